"""The `hoplite` config namespace: defaults, overrides, validation."""

from __future__ import annotations

import dask
import pytest

import dask_hoplite  # noqa: F401  (loads the defaults)
from dask_hoplite.config import HopliteConfig


def test_defaults_are_loaded_and_documented():
    cfg = HopliteConfig.from_dask_config()
    assert cfg.min_bytes == 2**20
    assert cfg.fanout == 1
    assert cfg.window_bytes >= cfg.block_bytes
    import os

    text = open(os.path.join(os.path.dirname(dask_hoplite.__file__), "hoplite.yaml")).read()
    for key in [
        "min-bytes",
        "measure-unsized",
        "block-bytes",
        "min-block-bytes",
        "min-blocks",
        "window-bytes",
        "stall-timeout",
        "fanout",
        "queue-timeout",
        "protect-streams",
        "keep-while-needed",
        "buffer-pool-bytes",
        "bandwidth",
        "latency",
        "reductions",
        "max-inputs",
        "resume-attempts",
        "allreduce-segment-min-bytes",
        "repair",
    ]:
        # every key has a comment right above it
        lines = text.splitlines()
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(key + ":"))
        assert lines[i - 1].strip().startswith("#"), key


def test_environment_override(monkeypatch):
    monkeypatch.setenv("DASK_HOPLITE__MIN_BYTES", "4 MiB")
    dask.config.refresh()
    try:
        assert HopliteConfig.from_dask_config().min_bytes == 4 * 2**20
    finally:
        monkeypatch.delenv("DASK_HOPLITE__MIN_BYTES")
        dask.config.refresh()
    assert HopliteConfig.from_dask_config().min_bytes == 2**20


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"hoplite.broadcast.fanout": 0}, "fanout must be >= 1"),
        ({"hoplite.min-block-bytes": "2 MiB"}, "min-block-bytes"),
        ({"hoplite.window-bytes": "1 KiB"}, "window-bytes"),
        ({"hoplite.stall-timeout": "0s"}, "stall-timeout"),
        ({"hoplite.min-blocks": 0}, "min-blocks"),
        ({"hoplite.array.max-inputs": 1}, "max-inputs"),
        ({"hoplite.reduce.latency": "0s"}, "reduce.latency"),
        ({"hoplite.reduce.repair": "rebuild"}, "'auto', 'replace' or 'spread', got 'rebuild'"),
        ({"hoplite.broadcast.slow-relay.ratio": 1}, r"slow-relay.ratio must be in \[0, 1\)"),
        ({"hoplite.broadcast.slow-relay.report-interval": "1s"}, "at most its window"),
    ],
)
def test_bad_settings_are_named(setting, match):
    with dask.config.set(setting):
        with pytest.raises(ValueError, match=match):
            HopliteConfig.from_dask_config()


def test_a_reduce_in_parts_spreads_dead_nodes_by_default_and_one_tree_replaces_them():
    cfg = HopliteConfig.from_dask_config()
    assert cfg.reduce_repair == "auto"
    assert cfg.repair_for(in_parts=True) == "spread"
    assert cfg.repair_for(in_parts=False) == "replace"
    for chosen in ("replace", "spread"):  # a setting other than auto is kept
        with dask.config.set({"hoplite.reduce.repair": chosen}):
            cfg = HopliteConfig.from_dask_config()
        assert {cfg.repair_for(in_parts=p) for p in (True, False)} == {chosen}


def test_block_size_scales_with_the_object():
    cfg = HopliteConfig.from_dask_config()
    assert cfg.block_size_for(0) == cfg.min_block_bytes
    assert cfg.block_size_for(2**20) == max(cfg.min_block_bytes, 2**20 // cfg.min_blocks)
    assert cfg.block_size_for(2**30) == cfg.block_bytes


def test_network_model_is_measured_unless_set():
    cfg = HopliteConfig.from_dask_config()
    assert cfg.reduce_bandwidth is None and cfg.reduce_latency is None  # "auto"
    with dask.config.set({"hoplite.reduce.bandwidth": "10 GB", "hoplite.reduce.latency": "5us"}):
        cfg = HopliteConfig.from_dask_config()
    assert cfg.reduce_bandwidth == 10e9 and cfg.reduce_latency == pytest.approx(5e-6)
