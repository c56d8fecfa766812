"""Handing a shared region to another worker of the same host (issue 42:
one copy per host).

A worker that holds an object in a :class:`~dask_hoplite.worker.memfd_regions.SharedRegion`
serves it with a :class:`RegionServer`: a Unix-domain socket in the abstract
namespace, one per worker. A worker of the same host that needs the object
calls :func:`fetch_region` with the server's name and the object's token and
gets the region's descriptor (``SCM_RIGHTS``), not its bytes: it maps the
pages the host already holds.

- Abstract socket names belong to a network namespace, not to the file
  system, so a name reaches exactly the workers that share the server's
  network stack: the workers of one host, and on the emulated cluster (one
  namespace per host, one file system for all) those of one emulated host. A
  worker elsewhere gets :class:`~dask_hoplite.errors.HandoffFailed` and fetches over the network.
- Only a process of the server's own user is served (``SO_PEERCRED``): the
  socket has no file permissions to guard it.
- One record per message (``SOCK_SEQPACKET``, msgpack): a request is
  ``{"token": ...}``, a reply ``{"status": "OK", "nbytes": ..., "name": ...,
  "meta": ...}`` with the descriptor attached, or ``{"status": "missing"}``;
  while the region is not ready, ``{"status": "waiting"}`` every
  :data:`KEEPALIVE` seconds, so that a client can tell a server that is
  slow to answer from one that is stopped.
  ``meta`` is the region's :attr:`~dask_hoplite.worker.memfd_regions.SharedRegion.meta`
  (the object's layout, for a worker's store), set on the region received.

The server finds regions through the ``lookup`` callable it is given, which
may answer at once or later (a region still being received is handed out
once complete); it knows nothing of keys, stores or plugins.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from distributed.utils import wait_for

from dask_hoplite.errors import HandoffFailed
from dask_hoplite.worker.memfd_regions import SharedRegion

logger = logging.getLogger(__name__)

#: The largest request or reply header, in bytes.
MAX_MESSAGE = 64 * 1024

#: Seconds between the server's "waiting" messages while a region is not ready.
KEEPALIVE = 1.0

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _abstract(name: str) -> str:
    return "\0" + name


async def _when(loop: asyncio.AbstractEventLoop, sock: socket.socket, writing: bool) -> None:
    """Until ``sock`` is readable (or writable)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fileno = sock.fileno()
    if writing:
        loop.add_writer(fileno, wake)
    else:
        loop.add_reader(fileno, wake)
    try:
        await ready
    finally:
        if writing:
            loop.remove_writer(fileno)
        else:
            loop.remove_reader(fileno)


async def _recv(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]]:
    """One record and the descriptors sent with it."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
            return data, fds
        except BlockingIOError:
            await _when(loop, sock, writing=False)


async def _send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """One record, with ``fds`` attached."""
    loop = asyncio.get_running_loop()
    data = msgpack.packb(msg, use_bin_type=True)
    while True:
        try:
            socket.send_fds(sock, [data], fds)
            return
        except BlockingIOError:
            await _when(loop, sock, writing=True)


class RegionServer:
    """Serves this worker's shared regions to the workers of its host.

    ``lookup(token)`` returns (or returns an awaitable of) the region of the
    object named ``token``, or None when this worker holds no shared region
    for it. :attr:`name` is what
    the other workers of the host connect to (announced by the caller)."""

    def __init__(
        self,
        lookup: Callable[[Any], SharedRegion | None | Awaitable[SharedRegion | None]],
        name: str | None = None,
    ):
        self.lookup = lookup
        self.name = name or f"dask-hoplite-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        #: Regions handed out (a count for tests and metrics).
        self.handed = 0

    async def start(self) -> RegionServer:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(_abstract(self.name))
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept(sock))
        return self

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            task = asyncio.create_task(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setblocking(False)
            _, uid, _ = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if uid != os.getuid():
                logger.warning("refused a shared region to user %d on %s", uid, self.name)
                return
            try:
                while True:
                    data, fds = await _recv(conn, 0)
                    for fd in fds:  # a request carries none
                        os.close(fd)
                    if not data:
                        return
                    found = self.lookup(_unpack(data)["token"])
                    region = (
                        await self._waiting(conn, found) if inspect.isawaitable(found) else found
                    )
                    if region is None or region.closed:
                        await _send(conn, {"status": "missing"})
                        continue
                    # A copy of the descriptor: the region may close while
                    # the send waits for room, and its number be reused.
                    fd = os.dup(region.fd)
                    try:
                        await _send(
                            conn,
                            {
                                "status": "OK",
                                "nbytes": region.nbytes,
                                "name": region.name,
                                "meta": region.meta,
                            },
                            (fd,),
                        )
                    finally:
                        os.close(fd)
                    self.handed += 1
            except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                logger.debug("a region request on %s failed: %s", self.name, e)

    async def _waiting(
        self, conn: socket.socket, found: Awaitable[SharedRegion | None]
    ) -> SharedRegion | None:
        """What ``found`` gives, telling the client every :data:`KEEPALIVE`
        seconds that the answer is coming (a client gone cancels it)."""
        task = asyncio.ensure_future(found)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=KEEPALIVE)
                if done:
                    return task.result()
                await _send(conn, {"status": "waiting"})
        finally:
            task.cancel()

    def close_now(self) -> None:
        """Stop serving at once, from outside a coroutine (a plugin's
        teardown): the name is free again when this returns."""
        for t in (self._accepting, *self._serving):
            if t is not None:
                t.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def close(self) -> None:
        """:meth:`close_now`, then wait until the cancelled tasks are over."""
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        self.close_now()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def __aenter__(self) -> RegionServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def fetch_region(server: str, token: Any, timeout: float = 60.0) -> SharedRegion | None:
    """The shared region of ``token`` from the :class:`RegionServer` named
    ``server``, once it is ready there: None when that worker holds none.
    Raises :class:`~dask_hoplite.errors.HandoffFailed` when the server cannot
    be reached from here (it is on another host, say), says nothing for
    ``timeout`` seconds (stopped), or its answer is not a sealed region."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with sock:
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, _abstract(server))
            await _send(sock, {"token": token})
            while True:
                data, fds = await wait_for(_recv(sock, 1), timeout)
                if not data:
                    raise HandoffFailed(f"{server!r} closed the connection without an answer")
                try:
                    reply = _unpack(data)
                except (ValueError, msgpack.UnpackException) as e:
                    for fd in fds:
                        os.close(fd)
                    raise HandoffFailed(f"{server!r} answered garbage: {e}") from e
                if reply.get("status") != "waiting":
                    break
                for fd in fds:
                    os.close(fd)
        except asyncio.TimeoutError as e:
            raise HandoffFailed(f"{server!r} said nothing for {timeout} s") from e
        except OSError as e:
            raise HandoffFailed(f"no shared region from {server!r}: {e}") from e
        if reply.get("status") != "OK" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if reply.get("status") == "missing":
                return None
            raise HandoffFailed(f"{server!r} answered {reply!r} with {len(fds)} descriptor(s)")
        try:
            region = SharedRegion.from_fd(fds[0], reply.get("name", ""))
        except (OSError, ValueError) as e:
            raise HandoffFailed(f"{server!r} sent an unusable region: {e}") from e
        region.meta = reply.get("meta") or {}
        if region.nbytes != reply["nbytes"]:
            region.close()
            raise HandoffFailed(
                f"{server!r} sent a region of {region.nbytes} bytes, not {reply['nbytes']}"
            )
        return region


def _unpack(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False, use_list=False)
    if not isinstance(msg, dict):
        raise ValueError(f"a message must be a map, got {type(msg).__name__}")
    return msg
