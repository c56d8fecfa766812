"""Plain TCP through a chain of emulated hosts: is a slow broadcast the code
or the network?

The same emulated cluster as the broadcast benchmark (one namespace per host,
``tc tbf`` at B on both directions of every NIC), no Dask and no hoplite: host
w0 sends S bytes to w1 over one TCP connection, and each host relays every
chunk to the next as it arrives (w1 -> w2 -> ... -> w{N-1}), as hoplite's
chain broadcast does. Each host records the bytes in hand every 50 ms; the
table gives every repetition's time as a ratio to S/B (p50, p90 and max of
the warm ones, beside the first), and the timelines of the first, the median
and the slowest repetition, one row per host (``benchmarks/timeline.py``).

``--fresh``: a new connection per hop for every repetition (every
repetition is a first one for TCP); default: the connections of the first
repetition are kept, as Dask's connection pool keeps them.

``--store fresh``: each host keeps the whole object, as a worker does,
received into freshly mapped memory in every repetition (the kernel zeroes
each page as the socket first writes it, as in a worker's first transfer of
a size); ``reuse``: into the same memory every time (a warm buffer pool);
``none`` (default): through one 1 MiB buffer.

``--loop``: repetitions back to back, as ``benchmarks/loop.py`` runs hoplite's:
the last host tells the first over a connection of its own the moment it has
the whole object, and the next repetition starts then (default: a pause of
0.5 s between repetitions, as the broadcast benchmark).

    sudo python benchmarks/tcp_chain.py --workers 9 --rate-mbit 1000 --size 256MiB --reps 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks import timeline  # noqa: E402
from benchmarks.broadcast import quantile  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402

PORT = 9100
CHUNK = 1 << 20
SAMPLE = 0.05


def _connect(addr: str, port: int = PORT) -> socket.socket:
    for _ in range(200):
        try:
            return socket.create_connection((addr, port))
        except OSError:
            time.sleep(0.05)
    raise ConnectionError(f"cannot reach {addr}:{PORT}")


def host_main(
    index: int,
    addrs: list[str],
    size: int,
    reps: int,
    fresh: bool,
    store: str = "none",
    loop: bool = False,
) -> None:
    """One host of the chain: receive from the one before (unless first),
    relay to the one after (unless last); print one JSON line per repetition:
    its wall start (the source's) and this host's (time, bytes) samples.
    With ``loop``, the last host tells the first when it has each repetition
    whole, and the first starts the next one then."""
    last_host = index == len(addrs) - 1
    back = None  # loop: the first host's end of the last host's connection
    if loop and index == 0:
        back_listener = socket.socket()
        back_listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        back_listener.bind((addrs[0], PORT + 1))
        back_listener.listen(1)
    elif loop and last_host:
        back = _connect(addrs[0], PORT + 1)
    listener = None
    if index > 0:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addrs[index], PORT))
        listener.listen(1)
    nxt = addrs[index + 1] if index + 1 < len(addrs) else None
    up = down = None
    buf = bytearray(CHUNK if store == "none" else size)
    payload = memoryview(bytearray(os.urandom(CHUNK)) * (size // CHUNK))
    for rep in range(reps + 1):
        if store == "fresh" and rep > 0:
            buf = bytearray(size)  # freshly mapped: zero pages until written
        if down is None and nxt is not None:
            down = _connect(nxt)
        if up is None and listener is not None:
            up, _ = listener.accept()
        samples: list[tuple[float, int]] = []
        got = 0
        last = 0.0
        if index == 0:
            assert down is not None
            if not loop or rep == 0:
                time.sleep(0.5)  # as the broadcast benchmark, between repetitions
            if loop and back is None:
                back, _ = back_listener.accept()
            start = time.time()
            down.sendall(str(start).encode().ljust(64))
            for lo in range(0, size, CHUNK):
                down.sendall(payload[lo : lo + CHUNK])
            samples = [(start, 0), (time.time(), size)]
        else:
            assert up is not None
            head = b""
            while len(head) < 64:
                head += up.recv(64 - len(head))
            start = float(head.decode())
            if down is not None:
                down.sendall(head)
            whole = memoryview(buf)
            while got < size:
                view = whole if store == "none" else whole[got:]
                n = up.recv_into(view, min(CHUNK, size - got))
                if n == 0:
                    raise ConnectionError("upstream closed")
                if down is not None:
                    down.sendall(view[:n])
                got += n
                now = time.time()
                if now - last >= SAMPLE or got == size:
                    samples.append((now, got))
                    last = now
            if back is not None:
                back.sendall(b"1")  # the last host has it whole
        if index == 0 and back is not None:
            if not back.recv(1):
                raise ConnectionError("the last host closed its connection")
        print(json.dumps({"rep": rep, "start": start, "samples": samples}), flush=True)
        if fresh:
            for s in (up, down):
                if s is not None:
                    s.close()
            up = down = None
    sys.stdout.flush()


def run(
    workers: int,
    rate_mbit: float,
    size: int,
    reps: int,
    fresh: bool,
    store: str,
    loop: bool = False,
    out_path: str | None = None,
) -> int:
    with EmulatedCluster(workers, rate_mbit=rate_mbit) as ec:
        roles = [f"w{i}" for i in range(workers)]
        addrs = [ec.hosts[r].address for r in roles]
        procs = []
        for i in reversed(range(workers)):  # listeners first
            argv = (
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--host-index",
                    str(i),
                    "--addrs",
                    *addrs,
                    "--size",
                    str(size),
                    "--reps",
                    str(reps),
                    "--store",
                    store,
                ]
                + (["--fresh"] if fresh else [])
                + (["--loop"] if loop else [])
            )
            procs.append(
                (
                    roles[i],
                    subprocess.Popen(
                        [*ec.exec_prefix(roles[i]), *argv], stdout=subprocess.PIPE, text=True
                    ),
                )
            )
        out = {
            role: [json.loads(line) for line in p.communicate()[0].splitlines()]
            for role, p in procs
        }
        bound = size / ec.rate_bytes_per_s
    times = []
    for rep in range(reps + 1):
        start = out["w0"][rep]["start"]
        end = max(o[rep]["samples"][-1][0] for o in out.values())
        times.append(end - start)
    warm = times[1:]
    print(
        f"plain TCP chain: {workers} hosts, {format_bytes(size)}, {rate_mbit:g} Mbit/s, "
        f"S/B {bound:.3f} s, {'a new connection per repetition' if fresh else 'connections kept'}, "
        f"store {store}"
    )
    print(
        f"first {times[0] / bound:.2f}  p50 {quantile(warm, 0.5) / bound:.2f}  "
        f"p90 {quantile(warm, 0.9) / bound:.2f}  max {quantile(warm, 1.0) / bound:.2f}  (x S/B)"
    )
    print("every repetition:", " ".join(f"{t / bound:.2f}" for t in times))
    if out_path:
        with open(out_path + ".json", "w") as f:
            json.dump({"size": size, "rate_mbit": rate_mbit, "bound": bound, "times": times}, f)
    order = sorted(range(1, reps + 1), key=lambda i: times[i])
    for label, rep in (("first", 0), ("median", order[len(order) // 2]), ("slowest", order[-1])):
        tl = {
            role: [(t, "bytes", {"n": n}) for t, n in o[rep]["samples"]]
            + [
                (o[rep]["start"], "asked", {}),
                (o[rep]["start"], "answered", {"sender": f"w{i - 1}"}),
            ]
            for i, (role, o) in enumerate(sorted(out.items(), key=lambda kv: int(kv[0][1:])))
            if role != "w0"
        }
        print(f"\n# rep {rep} ({label}): {times[rep] / bound:.2f} x S/B")
        print(timeline.render(tl, out["w0"][rep]["start"], ec.rate_bytes_per_s))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=9)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--store", choices=("none", "fresh", "reuse"), default="none")
    p.add_argument("--loop", action="store_true", help="repetitions back to back")
    p.add_argument("--out", help="write every repetition's seconds to OUT.json")
    p.add_argument("--host-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addrs", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = (
        parse_bytes(args.size)
        if isinstance(args.size, str) and not args.size.isdigit()
        else int(args.size)
    )
    if args.host_index is not None:
        host_main(args.host_index, args.addrs, size, args.reps, args.fresh, args.store, args.loop)
        return 0
    return run(
        args.workers, args.rate_mbit, size, args.reps, args.fresh, args.store, args.loop, args.out
    )


if __name__ == "__main__":
    sys.exit(main())
