"""One copy per host, the ground floor (issue 42): memfd regions that the
workers of one host map instead of copying, handed over a Unix socket.

Every test here crosses a real process boundary where the claim is about
other processes: a child Python process plays the second worker of the host."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
from distributed.utils_test import gen_test
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.errors import HandoffFailed
from dask_hoplite.worker import memfd_regions, region_handoff
from dask_hoplite.worker.memfd_regions import SharedRegion
from dask_hoplite.worker.region_handoff import RegionServer, fetch_region

pytestmark = pytest.mark.skipif(
    not memfd_regions.available(), reason="no memfd with F_SEAL_FUTURE_WRITE here"
)

# The second worker of the host: fetches the region of TOKEN from SERVER,
# prints what it saw, writes into its copy, prints again, then waits for a
# line on stdin (so the parent can look at it, or kill it, while it maps the
# region).
PEER = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    from dask_hoplite.errors import HandoffFailed
    from dask_hoplite.worker.region_handoff import fetch_region

    server, token = sys.argv[1:3]

    async def main():
        try:
            region = await fetch_region(server, token)
        except HandoffFailed as e:
            print(json.dumps({"failed": str(e)}), flush=True)
            return
        if region is None:
            print(json.dumps({"missing": True}), flush=True)
            return
        x = np.frombuffer(region.private(), dtype="f8")
        seen = float(x.sum())
        x[:] = -1.0  # a task writing into its input
        out = {"nbytes": region.nbytes, "sum": seen, "after": float(x.sum())}
        try:
            region.writable
        except ValueError:
            out["writable"] = False
        import mmap, os
        try:
            mmap.mmap(region.fd, region.nbytes, mmap.MAP_SHARED, mmap.PROT_WRITE | mmap.PROT_READ)
            out["shared_write"] = "allowed"
        except PermissionError:
            out["shared_write"] = "refused"
        try:
            os.pwrite(region.fd, b"z", 0)
            out["pwrite"] = "allowed"
        except PermissionError:
            out["pwrite"] = "refused"
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
        region.close()

    asyncio.run(main())
    """
)


def _peer(server: str, token: str, prefix: list[str] | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [*(prefix or []), sys.executable, "-c", PEER, server, token],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


async def _answer(p: subprocess.Popen) -> dict:
    line = await asyncio.to_thread(p.stdout.readline)
    assert line, p.stderr.read()
    return json.loads(line)


def _filled(n: int, name: str = "x") -> SharedRegion:
    region = SharedRegion.create(n * 8, name)
    np.frombuffer(region.writable, dtype="f8")[:] = np.arange(n, dtype="f8")
    region.seal()
    return region


def _holders(name: str) -> list[str]:
    """Every process (pid and how) that still holds memfd ``name``: a
    descriptor or a mapping. Empty means the kernel has freed its pages."""
    out = []
    tag = f"/memfd:{name} "
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(tag):
                    out.append(f"{pid} fd {fd}")
            with open(f"/proc/{pid}/maps") as f:
                out += [f"{pid} map" for line in f if tag.strip() in line]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def test_a_task_writing_into_its_input_changes_only_its_own_copy():
    """Two private views (two tasks) of one sealed region: a write into one
    is seen by neither the other nor the region, and the arrays are
    writable as Dask's are."""
    with _filled(1024) as region:
        a = np.frombuffer(region.private(), dtype="f8")
        b = np.frombuffer(region.private(), dtype="f8")
        assert a.flags.writeable
        a[:10] = 7.0
        assert b[:10].tolist() == list(range(10))
        assert np.frombuffer(region.writable, dtype="f8")[:10].tolist() == list(range(10))


def test_a_region_not_sealed_is_refused_by_its_receiver():
    region = SharedRegion.create(4096, "unsealed")
    try:
        with pytest.raises(ValueError, match="not sealed"):
            SharedRegion.from_fd(os.dup(region.fd), "unsealed")
    finally:
        region.close()


def test_the_writer_keeps_writing_after_it_sealed():
    """Sealing at completion must not break the writer's own mapping, from
    which streams to other hosts still read."""
    region = SharedRegion.create(4096, "writer")
    view = region.writable
    region.seal()
    assert region.sealed
    view[:3] = b"abc"
    assert bytes(region.private()[:3]) == b"abc"
    del view
    region.close()


@gen_test(timeout=60)
async def test_another_worker_of_the_host_maps_the_region_and_cannot_change_it():
    """The second worker gets the region's descriptor, reads the object
    right, writes into its own copy only, and can change the region neither
    through a shared mapping nor through the descriptor."""
    n = 1 << 18
    region = _filled(n, "handed")
    async with RegionServer({"x": region}.get) as server:
        p = _peer(server.name, "x")
        try:
            got = await _answer(p)
            assert got["nbytes"] == n * 8
            assert got["sum"] == n * (n - 1) / 2
            assert got["after"] == -n
            assert got["writable"] is False
            assert got["shared_write"] == "refused" and got["pwrite"] == "refused"
            # the writer's bytes are as they were
            assert np.frombuffer(region.writable, dtype="f8")[-1] == n - 1
            assert server.handed == 1
        finally:
            p.communicate("done\n", timeout=30)
        assert p.returncode == 0, p.stderr
    region.close()


@gen_test(timeout=60)
async def test_a_token_the_worker_does_not_hold_is_answered_missing():
    async with RegionServer({}.get) as server:
        assert await fetch_region(server.name, "nothing") is None


@gen_test(timeout=60)
async def test_a_server_that_is_gone_fails_the_handoff_not_the_caller():
    server = await RegionServer({}.get).start()
    name = server.name
    await server.close()
    with pytest.raises(HandoffFailed, match=name):
        await fetch_region(name, "x")


@gen_test(timeout=60)
async def test_a_killed_peer_and_a_released_region_leave_nothing_behind():
    """SIGKILL the second worker while it maps the region, then let go of
    it here: no process holds the memfd any more, so its pages are free, and
    nothing was ever in /dev/shm."""
    name = f"leak-check-{os.getpid()}"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    region = _filled(1 << 16, name)
    async with RegionServer({"x": region}.get) as server:
        p = _peer(server.name, "x")
        await _answer(p)
        assert any(h.startswith(f"{p.pid} ") for h in _holders(name))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    region.close()
    assert _holders(name) == []
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
@gen_test(timeout=60)
async def test_a_worker_in_another_network_namespace_cannot_reach_the_server():
    """Abstract socket names are per network namespace: a worker of another
    (emulated) host fails the handoff and fetches over the network instead."""
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    region = _filled(1024, "other-host")
    async with RegionServer({"x": region}.get) as server:
        p = _peer(server.name, "x", prefix=["unshare", "-n"])
        try:
            got = await _answer(p)
        finally:
            p.communicate("", timeout=30)
        assert "failed" in got and server.name in got["failed"], got
        assert server.handed == 0
    region.close()


# A client of another user, standard library only (that user may read
# neither this checkout nor its virtualenv): prints the reply's size and the
# descriptors that came with it.
RAW_PEER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect("\\0" + sys.argv[1])
    try:
        s.send(bytes.fromhex(sys.argv[2]))
        data, fds, _, _ = socket.recv_fds(s, 65536, 1)
    except OSError:  # the server hung up first
        data, fds = b"", []
    print(len(data), len(fds), flush=True)
    """
)


@gen_test(timeout=60)
async def test_a_process_of_another_user_is_refused():
    """The socket has no file permissions; the server checks the peer's user
    and closes the connection without handing anything."""
    python = "/usr/bin/python3"
    if os.getuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root and a system python to run a process as another user")
    region = _filled(1024, "other-user")
    async with RegionServer({"x": region}.get) as server:
        request = msgpack.packb({"token": "x"}).hex()
        argv = [python, "-c", RAW_PEER, server.name, request]
        mine = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
        assert mine.stdout.split() != ["0", "0"], mine  # the check can fail: this user is served
        assert mine.stdout.split()[1] == "1", mine
        theirs = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, user=65534, group=65534
        )
        assert theirs.returncode == 0, theirs.stderr
        assert theirs.stdout.split() == ["0", "0"], theirs
        assert server.handed == 1
    region.close()


@gen_test(timeout=60)
async def test_a_region_still_being_received_is_handed_once_ready(monkeypatch):
    """The server answers a request for a region not ready yet when it is,
    saying "waiting" meanwhile: the client waits longer than its timeout as
    long as those keep coming."""
    monkeypatch.setattr(region_handoff, "KEEPALIVE", 0.05)
    region = _filled(1024, "later")
    ready = asyncio.Event()

    async def lookup(token):
        await ready.wait()
        return region if token == "x" else None

    async with RegionServer(lookup) as server:
        asyncio.get_running_loop().call_later(0.6, ready.set)
        got = await fetch_region(server.name, "x", timeout=0.2)
        assert got is not None and got.nbytes == region.nbytes
        assert np.frombuffer(got.private(), dtype="f8")[-1] == 1023
        got.close()
    region.close()


@gen_test(timeout=60)
async def test_a_server_that_stops_answering_fails_the_handoff_after_the_timeout():
    """A server that accepts and then says nothing (its process stopped, say):
    the client gives up after ``timeout`` instead of hanging."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    name = f"dask-hoplite-test-silent-{os.getpid()}"
    sock.bind("\0" + name)
    sock.listen(1)
    try:
        with pytest.raises(HandoffFailed, match="said nothing"):
            await fetch_region(name, "x", timeout=0.3)
    finally:
        sock.close()


@given(
    sizes=st.lists(st.integers(0, 300), max_size=6),
    threads=st.integers(1, 5),
)
@settings(max_examples=50, deadline=None)
def test_copy_frames_lays_the_frames_end_to_end_whatever_the_threads(sizes, threads):
    """However the frames fall across the threads' stretches (pieces of any
    size allowed here), the region holds the frames end to end."""
    rng = np.random.default_rng(sum(sizes) + threads)
    frames = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    dest = bytearray(sum(sizes))
    original = memfd_regions._MIN_PIECE
    memfd_regions._MIN_PIECE = 1
    try:
        memfd_regions.copy_frames(memoryview(dest), frames, threads)
    finally:
        memfd_regions._MIN_PIECE = original
    assert bytes(dest) == b"".join(bytes(f) for f in frames)


def test_copy_frames_refuses_a_region_of_another_size():
    with pytest.raises(ValueError, match="5 bytes of frames for a region of 4"):
        memfd_regions.copy_frames(memoryview(bytearray(4)), [memoryview(b"hello")])
