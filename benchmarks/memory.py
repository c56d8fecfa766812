"""Memory after many broadcasts: does everything hoplite holds go away when
Dask releases the keys?

Runs N broadcasts of an S-byte array from one worker to all others (one
consumer task per worker) on a LocalCluster of worker processes, releasing each
key afterwards, and prints the RSS of every worker and of the scheduler's
process, the directory's entry count and the workers' hoplite buffers: at the
start (after one warm-up broadcast), at the peak, and at the end (after idle
pooled memory had time to be trimmed).

    python benchmarks/memory.py --broadcasts 200 --size 50MB --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dask  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from dask.utils import format_bytes, parse_bytes  # noqa: E402
from distributed import Client, LocalCluster, wait  # noqa: E402

from dask_hoplite import Hoplite  # noqa: E402


def _rss(dask_worker=None) -> int:
    return psutil.Process().memory_info().rss


def _hoplite_buffers(dask_worker) -> int:
    p = dask_worker.plugins["hoplite-worker"]
    return len(p.store) + len(p.parts.receiver.fetching)


def _received(dask_worker) -> int:
    return dask_worker.plugins["hoplite-worker"].stats.get("keys-received", 0)


def make(n: int, seed: int) -> np.ndarray:
    return np.full(n, seed % 256, dtype=np.uint8)


def check(x: np.ndarray, seed: int) -> bool:
    return bool(x[0] == seed % 256 and x[-1] == seed % 256)


async def snapshot(c: Client, scheduler, plugin: bool) -> dict:
    info = await c.scheduler.hoplite_info() if plugin else {"objects": 0, "transfers": 0}
    return {
        "workers_rss": await c.run(_rss),
        "scheduler_rss": _rss(),
        "directory_entries": info["objects"],
        "active_transfers": info["transfers"],
        "buffers": sum((await c.run(_hoplite_buffers)).values()) if plugin else 0,
        "tasks": len(scheduler.tasks),
    }


async def run(
    broadcasts: int, size: int, n_workers: int, idle: float = 1.0, plugin: bool = True
) -> dict:
    with dask.config.set({"hoplite.buffer-pool-idle": f"{idle}s"}):
        async with (
            LocalCluster(
                n_workers=n_workers,
                threads_per_worker=1,
                processes=True,
                asynchronous=True,
                dashboard_address=":0",
                memory_limit=0,
            ) as cluster,
            Client(cluster, asynchronous=True) as c,
        ):
            if plugin:
                await c.register_plugin(Hoplite())
            workers = sorted(cluster.scheduler.workers)

            async def one(i: int) -> None:
                x = c.submit(make, size, i, workers=[workers[0]], pure=False)
                await wait(x)
                oks = await c.gather(
                    [c.submit(check, x, i, workers=[w], pure=False) for w in workers[1:]]
                )
                assert all(oks)

            async def settle() -> None:
                for _ in range(600):
                    snap = await snapshot(c, cluster.scheduler, plugin)
                    if not (snap["tasks"] or snap["buffers"] or snap["directory_entries"]):
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(idle + 2.5)  # let idle pooled memory be trimmed

            fresh = await c.run(_rss)  # before any broadcast
            await one(-1)
            await settle()
            start = await snapshot(c, cluster.scheduler, plugin)
            received0 = sum((await c.run(_received)).values()) if plugin else 0
            peak_rss: dict[str, int] = {}
            t0 = time.perf_counter()
            for i in range(broadcasts):
                await one(i)
                if i % 20 == 0:
                    for a, r in (await c.run(_rss)).items():
                        peak_rss[a] = max(peak_rss.get(a, 0), r)
            elapsed = time.perf_counter() - t0
            received = (sum((await c.run(_received)).values()) if plugin else 0) - received0
            await settle()
            end = await snapshot(c, cluster.scheduler, plugin)
            return {
                "fresh_workers_rss": fresh,
                "start": start,
                "end": end,
                "peak_workers_rss": peak_rss,
                "elapsed": elapsed,
                "received": received,
            }


def report(r: dict, size: int) -> None:
    s, e = r["start"], r["end"]
    print(f"{'process':<28}{'start':>12}{'peak':>12}{'end':>12}{'end-start':>12}")
    for a in sorted(s["workers_rss"]):
        print(
            f"worker {a:<21}{format_bytes(s['workers_rss'][a]):>12}"
            f"{format_bytes(r['peak_workers_rss'].get(a, 0)):>12}"
            f"{format_bytes(e['workers_rss'][a]):>12}"
            f"{(e['workers_rss'][a] - s['workers_rss'][a]) / 2**20:>10.1f}MiB"
        )
    print(
        f"{'scheduler (+client)':<28}{format_bytes(s['scheduler_rss']):>12}{'':>12}"
        f"{format_bytes(e['scheduler_rss']):>12}"
        f"{(e['scheduler_rss'] - s['scheduler_rss']) / 2**20:>10.1f}MiB"
    )
    for k in ("directory_entries", "active_transfers", "buffers", "tasks"):
        print(f"{k:<28}{s[k]:>12}{'':>12}{e[k]:>12}")
    print(f"keys received through hoplite: {r['received']} in {r['elapsed']:.1f}s")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--broadcasts", type=int, default=200)
    p.add_argument("--size", default="50MB")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--compare", action="store_true", help="also run without the plugin")
    args = p.parse_args()
    size = parse_bytes(args.size)
    print(
        f"{args.broadcasts} broadcasts of {format_bytes(size)} to {args.workers - 1} workers,"
        " each key released afterwards\n"
    )
    print("with dask-hoplite:")
    report(asyncio.run(run(args.broadcasts, size, args.workers)), size)
    if args.compare:
        print("\nDask alone (same workload, for the scheduler's own growth):")
        report(asyncio.run(run(args.broadcasts, size, args.workers, plugin=False)), size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
