"""One transfer's timeline per receiver, from the workers' ``hoplite.timelines``.

With ``hoplite.timelines`` on in the workers (``DASK_HOPLITE__TIMELINES=True``),
every worker records each large key it fetches. After a broadcast of ``key``::

    from benchmarks.timeline import collect, render
    print(render(collect(client, key), t0=start, rate=B))

prints one row per receiver: when it asked the directory (seconds after
``t0``), the sender it got (each one, if it resumed elsewhere or fetched byte
ranges), when its first and its last byte arrived, its mean throughput as a
fraction of the per-host bandwidth ``rate`` (bytes/s), whether its receiving
memory was freshly mapped (``fresh``: the kernel zeroes it as it is first
written) or recycled by the buffer pool, and its throughput over
time, one character per ``step`` seconds from ``t0`` (`` ▁▂▃▄▅▆▇█``: 0 to
``rate``, ``!`` above it). ``benchmarks/broadcast.py --timelines`` prints the
timelines of its slowest and its median warm repetition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Throughput glyphs, from nothing to the full rate.
BARS = " ▁▂▃▄▅▆▇█"

Event = tuple[float, str, dict[str, Any]]


def collect(client: Any, key: Any) -> dict[str, list[Event]]:
    """Every worker's timeline of ``key`` (workers that did not fetch it:
    none)."""
    from dask_hoplite.worker.timelines import timeline_of

    got: dict[str, list[Any]] = client.run(timeline_of, key)
    return {w: [(float(t), str(e), dict(d)) for t, e, d in ev] for w, ev in got.items() if ev}


@dataclass
class Row:
    """One receiver's fetch of the key."""

    worker: str
    asked: float
    senders: list[str]
    first_byte: float
    last_byte: float
    nbytes: int
    #: (time, bytes in hand), as sampled.
    samples: list[tuple[float, int]]
    #: Whether the receiving memory was freshly mapped (not recycled) during the fetch.
    fresh: bool = False

    def throughput(self, rate: float) -> float:
        span = self.last_byte - self.first_byte
        return self.nbytes / span / rate if span > 0 else math.inf


def rows(timelines: dict[str, list[Event]], t0: float) -> list[Row]:
    """The receivers' rows, times in seconds after ``t0``, by first byte."""
    out = []
    for w, events in timelines.items():
        asked = [t for t, e, _ in events if e == "asked"]
        senders = [d["sender"] for _, e, d in events if e == "answered" and d.get("sender")]
        samples = [(t - t0, int(d["n"])) for t, e, d in events if e == "bytes"]
        if not asked or not samples:
            continue
        start = samples[0][1]
        first = next((t for t, n in samples if n > start), samples[-1][0])
        end = max(n for _, n in samples)
        last = next(t for t, n in samples if n == end)
        mapped = [int(d.get("mapped", 0)) for _, e, d in events if e in ("stream", "streamed")]
        fresh = bool(mapped) and max(mapped) > min(mapped)
        out.append(Row(w, min(asked) - t0, senders, first, last, end - start, samples, fresh))
    return sorted(out, key=lambda r: r.first_byte)


def _spark(samples: list[tuple[float, int]], rate: float, step: float, width: int) -> str:
    """Throughput per ``step`` from 0, one glyph each, ``width`` glyphs."""
    chars = []
    for i in range(width):
        lo, hi = i * step, (i + 1) * step
        got = _at(samples, hi) - _at(samples, lo)
        frac = got / step / rate
        chars.append(
            "!" if frac > 1.05 else BARS[min(len(BARS) - 1, round(frac * (len(BARS) - 1)))]
        )
    return "".join(chars)


def _at(samples: list[tuple[float, int]], t: float) -> float:
    """Bytes in hand at ``t``, interpolated between samples."""
    if not samples or t <= samples[0][0]:
        return float(samples[0][1]) if samples else 0.0
    for (ta, na), (tb, nb) in zip(samples, samples[1:], strict=False):
        if ta <= t <= tb:
            return na + (nb - na) * ((t - ta) / (tb - ta) if tb > ta else 1.0)
    return float(samples[-1][1])


def render(
    timelines: dict[str, list[Event]],
    t0: float,
    rate: float,
    step: float = 0.1,
    names: dict[str, str] | None = None,
) -> str:
    """The timeline table (see the module's docstring); ``names`` shortens
    worker addresses (e.g. to host names)."""
    rs = rows(timelines, t0)
    if not rs:
        return "(no timelines: is hoplite.timelines on in the workers?)"
    name = (names or {}).get
    end = max(r.last_byte for r in rs)
    width = max(1, math.ceil(end / step))
    head = (
        f"{'receiver':<10} {'asked':>6} {'first':>6} {'last':>6} {'x B':>5} {'mem':>5}  sender(s)"
    )
    lines = [head + f"  | throughput per {step:g}s, 0 to B", "-" * (len(head) + 30)]
    for r in rs:
        senders = ",".join(name(s) or s for s in r.senders)
        lines.append(
            f"{name(r.worker) or r.worker:<10} {r.asked:6.2f} {r.first_byte:6.2f} "
            f"{r.last_byte:6.2f} {r.throughput(rate):5.2f} {'fresh' if r.fresh else 'reuse':>5}"
            f"  {senders:<12}"
            f"  |{_spark(r.samples, rate, step, width)}|"
        )
    return "\n".join(lines)
