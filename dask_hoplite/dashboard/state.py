"""What the ``/hoplite`` page shows, built from plain inputs (no I/O).

:func:`page_state` turns the directory's open transfers, the workers'
heartbeat reports (:mod:`dask_hoplite.worker.progress`), the collective log,
the network estimate and the counters into the columns the page's plots and
tables draw, and the JSON route serves as they are.

Edges: every stream into a worker that its heartbeat reported (with the bytes
so far), and every transfer the directory assigned that no report shows yet
(0 bytes so far). Each edge has a status the page colours it by:

* ``streaming``;
* ``stalled``: no progress for ``stall_after`` seconds or more;
* ``resumed``: the stream started past byte 0 (a receiver resuming from
  another sender, or a reduce node replacing a dead one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

#: Edge colours by status, and the palette's meaning on the page.
COLOURS = {"streaming": "#2b8cbe", "stalled": "#e31a1c", "resumed": "#ff7f00"}


def circle_layout(workers: list[str]) -> dict[str, tuple[float, float]]:
    """Workers evenly on the unit circle, in address order."""
    n = max(1, len(workers))
    return {
        w: (math.cos(2 * math.pi * i / n), math.sin(2 * math.pi * i / n))
        for i, w in enumerate(sorted(workers))
    }


def _status(stream: Mapping[str, Any], stall_after: float) -> str:
    if float(stream.get("stalled") or 0) >= stall_after:
        return "stalled"
    if int(stream.get("resumed_from") or 0) > 0:
        return "resumed"
    return "streaming"


def _columns(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, list[Any]]:
    """Rows as the columns a Bokeh data source takes."""
    return {n: [r[n] for r in rows] for n in names}


EDGE_COLUMNS = (
    "key", "kind", "sender", "receiver", "progress", "nbytes", "fraction", "stalled",
    "status", "colour", "width", "x0", "y0", "x1", "y1", "xa", "ya",
)  # fmt: skip
COLLECTIVE_COLUMNS = ("kind", "outcome", "inputs", "nbytes", "seconds", "bound", "ratio")


def edge_row(
    key: str,
    kind: str,
    sender: str,
    receiver: str,
    stream: Mapping[str, Any],
    pos: Mapping[str, tuple[float, float]],
    stall_after: float,
) -> dict[str, Any]:
    """One stream, sender to receiver, with its share sent and its status."""
    nbytes = int(stream.get("nbytes") or 0)
    progress = int(stream.get("progress") or 0)
    fraction = progress / nbytes if nbytes else 0.0
    status = _status(stream, stall_after)
    x0, y0 = pos.get(sender, (0.0, 0.0))
    x1, y1 = pos.get(receiver, (0.0, 0.0))
    return {
        "key": key,
        "kind": kind,
        "sender": sender,
        "receiver": receiver,
        "progress": progress,
        "nbytes": nbytes,
        "fraction": round(fraction, 4),
        "stalled": round(float(stream.get("stalled") or 0), 2),
        "status": status,
        "colour": COLOURS[status],
        "width": 2 + 6 * fraction,
        "x0": x0,
        "y0": y0,
        "x1": x1,
        "y1": y1,
        # Where the arrow head goes: short of the receiver's circle.
        "xa": x0 + 0.9 * (x1 - x0),
        "ya": y0 + 0.9 * (y1 - y0),
    }


def collective_row(c: Mapping[str, Any], bandwidth: float) -> dict[str, Any]:
    """One finished collective, its time as a ratio to S/B."""
    nbytes = int(c.get("nbytes") or 0)
    seconds = float(c.get("seconds") or 0)
    bound = nbytes / bandwidth if bandwidth > 0 else 0.0
    return {
        "kind": c.get("kind"),
        "outcome": c.get("outcome"),
        "inputs": int(c.get("inputs") or 0),
        "nbytes": nbytes,
        "seconds": round(seconds, 3),
        "bound": round(bound, 3),
        "ratio": round(seconds / bound, 2) if bound > 0 else None,
    }


def page_state(
    *,
    workers: Iterable[str],
    reports: Mapping[str, Mapping[str, Any]],
    transfers: Iterable[tuple[str, str, str]],
    collectives: Iterable[Mapping[str, Any]],
    bandwidth: float,
    counters: Mapping[str, float],
    stall_after: float,
) -> dict[str, Any]:
    """The page's data.

    ``reports``: worker address -> its heartbeat report (``streams``,
    ``stats``); ``transfers``: the directory's open (key, sender, receiver);
    ``collectives``: the latest finished ones (kind, outcome, inputs, nbytes,
    seconds); ``bandwidth``: bytes/s per host (S/B's B); ``counters``: the
    scheduler's own, to which every worker's stats are added."""
    addresses = sorted(set(workers))
    pos = circle_layout(addresses)
    edges, reported = [], set()
    for receiver, report in sorted(reports.items()):
        for s in report.get("streams") or ():
            key, sender = str(s.get("key")), str(s.get("sender"))
            reported.add((key, sender, receiver))
            kind = str(s.get("kind") or "object")
            edges.append(edge_row(key, kind, sender, receiver, s, pos, stall_after))
    for key, sender, receiver in transfers:
        if (str(key), sender, receiver) not in reported:  # assigned, not reported yet
            edges.append(edge_row(str(key), "object", sender, receiver, {}, pos, stall_after))

    totals: dict[str, float] = dict(counters)
    for report in reports.values():
        for name, v in (report.get("stats") or {}).items():
            totals[name] = totals.get(name, 0) + v

    return {
        "workers": {
            "address": addresses,
            "x": [pos[w][0] for w in addresses],
            "y": [pos[w][1] for w in addresses],
        },
        "edges": _columns(edges, EDGE_COLUMNS),
        "collectives": _columns(
            [collective_row(c, bandwidth) for c in collectives], COLLECTIVE_COLUMNS
        ),
        "counters": {"name": sorted(totals), "value": [totals[k] for k in sorted(totals)]},
        "bandwidth": bandwidth,
    }
