"""The ``hoplite`` section of ``dask.config``.

Defaults live in ``hoplite.yaml`` beside this module (every key is commented
there) and are merged with :func:`dask.config.update_defaults` on import, so the
user's own settings and ``DASK_HOPLITE__*`` environment variables win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "hoplite.yaml")

with open(_DEFAULTS_PATH) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


#: The values of ``hoplite.reduce.repair``.
REDUCE_REPAIRS = ("auto", "replace", "spread")


def resolve_repair(setting: str, in_parts: bool) -> str:
    """The repair (``"replace"`` or ``"spread"``) a running tree uses under
    ``hoplite.reduce.repair`` ``setting``; ``in_parts``: the tree is one
    segment's of a reduce in parts. ``auto`` spreads there (split trees fill
    every NIC, so a replacement node would double its worker's load) and
    replaces in one tree. The benchmarks resolve their settings here too."""
    if setting != "auto":
        return setting
    return "spread" if in_parts else "replace"


def _get(key: str) -> Any:
    """``hoplite.<key>`` from dask.config, falling back to the shipped default
    (a test harness or an application may reset dask.config wholesale)."""
    default: Any = _defaults["hoplite"]
    for part in key.split("."):
        default = default[part]
    return dask.config.get(f"hoplite.{key}", default=default)


def _parts(name: str) -> int | None:
    """A ``parts`` setting: "auto" (None) or a positive int."""
    if _auto(name):
        return None
    value = _get(name)
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"hoplite.{name} must be 'auto' or a positive int, got {value!r}")
    return int(text)


def _auto(key: str) -> bool:
    value = _get(key)
    return value is None or (isinstance(value, str) and value.strip().lower() == "auto")


def _bytes(key: str) -> int:
    value = _get(key)
    n = parse_bytes(value) if isinstance(value, str) else int(value)
    if n < 0:
        raise ValueError(f"hoplite.{key} must be >= 0, got {value!r}")
    return n


def _count(key: str) -> int:
    value = int(_get(key))
    if value < 0:
        raise ValueError(f"hoplite.{key} must be >= 0, got {value!r}")
    return value


def _seconds(key: str) -> float:
    value = parse_timedelta(_get(key), default="seconds")
    if value is None or value <= 0:
        raise ValueError(f"hoplite.{key} must be a positive duration")
    return float(value)


@dataclass(frozen=True)
class HopliteConfig:
    """A validated snapshot of the ``hoplite`` config section."""

    min_bytes: int
    measure_unsized: bool
    block_bytes: int
    min_block_bytes: int
    min_blocks: int
    window_bytes: int
    stall_timeout: float
    max_resumes: int
    resume_window: float
    fanout: int
    queue_timeout: float
    protect_streams: bool
    keep_while_needed: bool
    prompt_stealing: bool
    stealing_delay: float
    buffer_pool_bytes: int
    buffer_pool_idle: float
    buffer_pool_spare: bool  # a spare region per size in a burst (core/buffer_pool.py)
    prefault: bool
    #: Workers of one host map one received copy of a large key
    #: (``hoplite.host-sharing``, :mod:`dask_hoplite.worker.host_sharing`).
    host_sharing: bool
    timelines: bool
    timeline_interval: float
    buffer_pool_reserve: int | None  # None: "auto" (core/buffer_pool.auto_reserve)
    buffer_pool_reserve_regions: int
    reduce_bandwidth: float | None  # bytes per second; None: measured
    reduce_latency: float | None  # seconds per hop; None: measured
    segment_min_bytes: int
    array_reductions: bool
    array_max_inputs: int
    bag_reductions: bool
    broadcast_parts: int | None  # None: "auto" (no cut; the directory may split into ranges)
    broadcast_ranges: int | None  # None: "auto" (core/shape_choice.py)
    plan_wait: float
    pipeline_fill: float  # share of S/B a chain's pipeline fill may cost (core/block_size.py)
    #: A relay below this share of its sender's rate is rerouted (0: off;
    #: core/relay_rates.py), judged over ``slow_relay_window`` seconds of
    #: progress reports sent every ``slow_relay_interval`` seconds, its
    #: sender at least ``slow_relay_min_lag`` bytes ahead.
    slow_relay_ratio: float
    slow_relay_window: float
    slow_relay_interval: float
    slow_relay_min_lag: int
    reduce_parts: int | None  # None: "auto" (core/shape_choice.py)
    #: How a running reduce tree repairs a dead node: "replace", "spread", or
    #: "auto" (spread in a reduce in parts, replace in one tree):
    #: :meth:`repair_for`.
    reduce_repair: str = "auto"

    @classmethod
    def from_dask_config(cls) -> HopliteConfig:
        fanout = int(_get("broadcast.fanout"))
        if fanout < 1:
            raise ValueError(f"hoplite.broadcast.fanout must be >= 1, got {fanout}")
        block = _bytes("block-bytes")
        min_block = _bytes("min-block-bytes")
        if not 0 < min_block <= block:
            raise ValueError(
                "hoplite.min-block-bytes must be positive and at most hoplite.block-bytes "
                f"(got {min_block} and {block})"
            )
        min_blocks = int(_get("min-blocks"))
        if min_blocks < 1:
            raise ValueError(f"hoplite.min-blocks must be >= 1, got {min_blocks}")
        window = _bytes("window-bytes")
        if window < block:
            raise ValueError(
                f"hoplite.window-bytes ({window}) must be at least hoplite.block-bytes ({block})"
            )
        parts = _parts("broadcast.parts")
        ranges = _parts("broadcast.ranges")
        reduce_parts = _parts("reduce.parts")
        repair = str(_get("reduce.repair"))
        if repair not in REDUCE_REPAIRS:
            raise ValueError(
                f"hoplite.reduce.repair must be 'auto', 'replace' or 'spread', got {repair!r}"
            )
        fill = float(_get("broadcast.pipeline-fill"))
        if not 0 < fill <= 1:
            raise ValueError(f"hoplite.broadcast.pipeline-fill must be in (0, 1], got {fill}")
        slow_ratio = float(_get("broadcast.slow-relay.ratio"))
        if not 0 <= slow_ratio < 1:
            raise ValueError(
                f"hoplite.broadcast.slow-relay.ratio must be in [0, 1), got {slow_ratio}"
            )
        slow_window = _seconds("broadcast.slow-relay.window")
        slow_interval = _seconds("broadcast.slow-relay.report-interval")
        if not 0 < slow_interval <= slow_window:
            raise ValueError(
                "hoplite.broadcast.slow-relay.report-interval must be positive and at most "
                f"its window (got {slow_interval} and {slow_window})"
            )
        max_inputs = int(_get("array.max-inputs"))
        if max_inputs < 2:
            raise ValueError(f"hoplite.array.max-inputs must be >= 2, got {max_inputs}")
        return cls(
            min_bytes=_bytes("min-bytes"),
            measure_unsized=bool(_get("measure-unsized")),
            block_bytes=block,
            min_block_bytes=min_block,
            min_blocks=min_blocks,
            window_bytes=window,
            stall_timeout=_seconds("stall-timeout"),
            max_resumes=_count("resume-attempts"),
            resume_window=_seconds("resume-window"),
            fanout=fanout,
            queue_timeout=_seconds("directory.queue-timeout"),
            protect_streams=bool(_get("amm.protect-streams")),
            keep_while_needed=bool(_get("amm.keep-while-needed")),
            prompt_stealing=bool(_get("stealing.prompt")),
            stealing_delay=_seconds("stealing.delay"),
            buffer_pool_bytes=_bytes("buffer-pool-bytes"),
            buffer_pool_idle=_seconds("buffer-pool-idle"),
            buffer_pool_spare=bool(_get("buffer-pool-spare")),
            prefault=bool(_get("prefault")),
            host_sharing=bool(_get("host-sharing")),
            timelines=bool(_get("timelines")),
            timeline_interval=_seconds("timeline-interval"),
            buffer_pool_reserve=None
            if _auto("buffer-pool-reserve")
            else _bytes("buffer-pool-reserve"),
            buffer_pool_reserve_regions=_count("buffer-pool-reserve-regions"),
            reduce_bandwidth=None
            if _auto("reduce.bandwidth")
            else float(_bytes("reduce.bandwidth")),
            reduce_latency=None if _auto("reduce.latency") else _seconds("reduce.latency"),
            segment_min_bytes=_bytes("reduce.allreduce-segment-min-bytes"),
            array_reductions=bool(_get("array.reductions")),
            array_max_inputs=max_inputs,
            bag_reductions=bool(_get("bag.reductions")),
            broadcast_parts=parts,
            broadcast_ranges=ranges,
            plan_wait=_seconds("broadcast.plan-wait"),
            pipeline_fill=fill,
            slow_relay_ratio=slow_ratio,
            slow_relay_window=slow_window,
            slow_relay_interval=slow_interval,
            slow_relay_min_lag=_bytes("broadcast.slow-relay.min-lag"),
            reduce_parts=reduce_parts,
            reduce_repair=repair,
        )

    def repair_for(self, in_parts: bool) -> str:
        """How a running tree repairs its dead nodes: :func:`resolve_repair`
        of this configuration's ``hoplite.reduce.repair``."""
        return resolve_repair(self.reduce_repair, in_parts)

    def block_size_for(self, nbytes: int, fitted: object = None) -> int:
        """Block size for an object of ``nbytes``: the block the directory
        ``fitted`` to the stream's chain (:mod:`~dask_hoplite.core.block_size`)
        if it gave one, else at least ``min_blocks`` blocks; either clamped to
        [min_block_bytes, block_bytes] (this process's settings)."""
        if isinstance(fitted, int) and not isinstance(fitted, bool) and fitted > 0:
            return max(self.min_block_bytes, min(self.block_bytes, fitted))
        return max(self.min_block_bytes, min(self.block_bytes, -(-nbytes // self.min_blocks)))
