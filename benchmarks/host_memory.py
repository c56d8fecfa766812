"""One large key needed by every worker of one machine: how much memory the
machine spends on it, and how long until every task that needs it has run
(issue 42, one copy per host: the first acceptance item's scenario).

A ``LocalCluster`` of W worker processes on this machine. Each repetition
makes an S-byte array on the first worker, then runs one task that reads it
on each of the other W - 1 workers, and reports:

* the machine's used memory (``MemTotal - MemAvailable``, ``/proc/meminfo``)
  from the moment the array exists: its peak until every task has run
  (sampled every ``--interval``: Dask frees a worker's copy as soon as its
  task is done, so the end alone would miss copies), at the end, and a
  moment later;
* the same for the sum of the workers' PSS (each shared page counted once
  over the processes that map it) and of their RSS (what Dask's memory
  manager and the nanny read: a shared page counts in every process);
* the workers' peak PSS over their PSS before the
  cluster's first array: what the machine holds for the array, source
  included, where the growth above misses memory kept from an earlier
  repetition (hoplite's buffer pool keeps received regions for reuse);
* the time from the tasks' submission until the last has run.

Then the keys are released and the workers' memory given time to return.
The first repetition is reported apart (cold); the rest as p50, p90 and max.
Methods: ``dask`` (no plugin) and ``hoplite`` (the plugin registered), each
on a fresh cluster, in turn.

    python benchmarks/host_memory.py --workers 4 --size 1GiB --reps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from dask.utils import format_bytes, parse_bytes  # noqa: E402
from distributed import Client, LocalCluster, wait  # noqa: E402

from benchmarks.broadcast import quantile  # noqa: E402

METHODS = ("dask", "hoplite")


def used_memory() -> int:
    """The machine's used memory: MemTotal - MemAvailable, in bytes."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def process_memory(pids: list[int]) -> tuple[int, int]:
    """The sum of the PSS and of the RSS of ``pids``, in bytes."""
    pss = rss = 0
    for pid in pids:
        m = psutil.Process(pid).memory_full_info()
        pss += m.pss
        rss += m.rss
    return pss, rss


def make(nbytes: int, seed: int) -> np.ndarray:
    return np.full(nbytes // 8, float(seed), dtype="f8")


def read(x: np.ndarray) -> float:
    """A task that needs all of ``x`` (its sum, read once)."""
    return float(x.sum())


class PeakSampler(threading.Thread):
    """The peaks of the machine's used memory and of the sum of ``pids``'
    PSS and RSS, sampled every ``interval`` seconds until :meth:`stop`.

    A sample reads each worker's ``smaps_rollup``, which walks its page
    tables under its memory map's lock: about 2 ms per worker of 2 GiB on
    the 2-core VM. Every 20 ms, that is a third of a core taken from four
    such workers; every 0.2 s, a few percent."""

    def __init__(self, pids: list[int], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.interval = interval
        self.used = self.pss = self.rss = 0
        self._done = threading.Event()

    def sample(self) -> None:
        used, (pss, rss) = used_memory(), process_memory(self.pids)
        self.used, self.pss, self.rss = max(self.used, used), max(self.pss, pss), max(self.rss, rss)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> PeakSampler:
        self._done.set()
        self.join()
        self.sample()
        return self


@dataclass
class Repetition:
    seconds: float
    #: Growth from the moment the array exists on the first worker, in bytes:
    #: the peak until the last task has run, at that moment, and ``settle``
    #: seconds later.
    used_peak: int
    pss_peak: int
    rss_peak: int
    used: int
    pss: int
    rss: int
    used_later: int
    pss_later: int
    rss_later: int
    ok: bool
    #: The workers' peak PSS until the last task has run, over their PSS
    #: before the cluster's first array.
    pss_held: int = 0


@dataclass
class Result:
    method: str
    workers: int
    size: int
    reps: list[Repetition] = field(default_factory=list)

    def summary(self, attr: str) -> tuple[float, float, float, float]:
        """cold, p50, p90, max of ``attr`` over the warm repetitions."""
        warm = [float(getattr(r, attr)) for r in self.reps[1:]]
        first = float(getattr(self.reps[0], attr)) if self.reps else float("nan")
        return first, quantile(warm, 0.5), quantile(warm, 0.9), max(warm, default=float("nan"))


def run(
    method: str, workers: int, size: int, reps: int, settle: float, interval: float = 0.2
) -> Result:
    out = Result(method, workers, size)
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit=0,
        ) as cluster,
        Client(cluster) as c,
    ):
        if method == "hoplite":
            import dask_hoplite as dh

            c.register_plugin(dh.Hoplite())
        ws = sorted(c.scheduler_info()["workers"])
        pids = list(c.run(os.getpid).values())
        pss_start, _ = process_memory(pids)
        for i in range(reps + 1):
            x = c.submit(make, size, i, workers=[ws[0]], pure=False)
            wait(x)
            time.sleep(0.2)
            used0, (pss0, rss0) = used_memory(), process_memory(pids)
            sampler = PeakSampler(pids, interval)
            sampler.start()
            t0 = time.perf_counter()
            tasks = [c.submit(read, x, workers=[w], pure=False) for w in ws[1:]]
            wait(tasks)
            seconds = time.perf_counter() - t0
            used1, (pss1, rss1) = used_memory(), process_memory(pids)
            peak = sampler.stop()
            time.sleep(settle)
            used2, (pss2, rss2) = used_memory(), process_memory(pids)
            ok = all(v == float(i) * (size // 8) for v in c.gather(tasks))
            out.reps.append(
                Repetition(
                    seconds,
                    peak.used - used0,
                    peak.pss - pss0,
                    peak.rss - rss0,
                    used1 - used0,
                    pss1 - pss0,
                    rss1 - rss0,
                    used2 - used0,
                    pss2 - pss0,
                    rss2 - rss0,
                    ok,
                    peak.pss - pss_start,
                )
            )
            r = out.reps[-1]
            print(
                f"  {method} {'cold' if i == 0 else f'rep {i}'}: {seconds:.2f}s, peak growth: used "
                f"{r.used_peak / size:.2f} S, PSS {r.pss_peak / size:.2f} S, RSS "
                f"{r.rss_peak / size:.2f} S; at the end: PSS {r.pss / size:.2f} S; "
                f"{settle:g}s later: used {r.used_later / size:.2f} S, "
                f"PSS {r.pss_later / size:.2f} S; PSS over the start {r.pss_held / size:.2f} S ok {ok}",
                flush=True,
            )
            del x, tasks
            time.sleep(settle)
    return out


def print_table(results: list[Result]) -> None:
    print(f"{'method':8} {'what':22} {'cold':>7} {'p50':>7} {'p90':>7} {'max':>7}  (memory in S)")
    for r in results:
        for attr, label, scale in (
            ("seconds", "time s", 1.0),
            ("used_peak", "used growth, peak", r.size),
            ("pss_peak", "PSS growth, peak", r.size),
            ("rss_peak", "RSS growth, peak", r.size),
            ("pss", "PSS growth, end", r.size),
            ("used_later", "used growth, later", r.size),
            ("pss_later", "PSS growth, later", r.size),
            ("pss_held", "PSS over the start", r.size),
        ):
            cold, p50, p90, top = (v / scale for v in r.summary(attr))
            print(f"{r.method:8} {label:22} {cold:7.2f} {p50:7.2f} {p90:7.2f} {top:7.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--reps", type=int, default=10, help="warm repetitions after the cold one")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument(
        "--settle", type=float, default=2.0, help="seconds before the later figures, and after"
    )
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", help="result file name (default host-memory-w<workers>-<size>)")
    args = ap.parse_args(argv)
    size = parse_bytes(args.size)
    results = [
        run(m, args.workers, size, args.reps, args.settle, args.interval) for m in args.methods
    ]
    print()
    print(f"LocalCluster, {args.workers} worker processes, S={format_bytes(size)}")
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    name = args.name or f"host-memory-w{args.workers}-{args.size}"
    path = os.path.join(args.out, name + ".json")
    with open(path, "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    print(f"wrote {path}")
    return 0 if all(rep.ok for r in results for rep in r.reps) else 1


if __name__ == "__main__":
    sys.exit(main())
