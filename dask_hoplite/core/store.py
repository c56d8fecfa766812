"""The block store: per key, the serialised bytes of an object and how many of
them are valid (its *progress*), with waiters woken as blocks land.

Pure bookkeeping, no event loop: a waiter is a plain callable that the buffer
calls when its threshold is reached or the buffer fails; the worker plugin
passes ``future.set_result``-style callbacks. A buffer is either

* a *source* buffer: the frames Dask's serialisation produced for an object in
  ``worker.data`` (zero-copy views of a numpy array), complete from the start;
* a *receiving* buffer: one contiguous allocation that blocks are written into
  in order, readable up to its progress while it fills (this is what lets a
  relay forward blocks before the whole object arrived).

The object's byte layout (:class:`Layout`) is the concatenation of its frames;
a block never spans two frames, so every block is one contiguous view.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.typing import Key

from dask_hoplite.core.buffer_pool import BufferPool
from dask_hoplite.core.byte_ranges import range_bounds
from dask_hoplite.errors import BufferStateError, LayoutChanged


class BufferState(enum.Enum):
    PENDING = "pending"  # announced, layout not known yet
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


#: Bytes hashed at each end of an object for its identity.
IDENTITY_BYTES = 64 * 1024


def content_identity(frames: Sequence[memoryview]) -> str:
    """Identity of an object's bytes: a digest of its length, its frame sizes
    and its first and last ``IDENTITY_BYTES``. Cheap (at most 128 KiB hashed
    whatever the size), computed once where the object is serialised, and
    carried along with the layout by every relay. Two copies of one object
    agree; a recomputation that produced other bytes differs with
    overwhelming probability unless it differs only in the middle."""
    h = hashlib.blake2b(digest_size=16)
    lengths = [f.nbytes for f in frames]
    h.update(repr(lengths).encode())
    head: list[memoryview] = []
    budget = IDENTITY_BYTES
    for f in frames:
        if budget <= 0:
            break
        head.append(f[:budget])
        budget -= min(budget, f.nbytes)
    tail: list[memoryview] = []
    budget = IDENTITY_BYTES
    for f in reversed(frames):
        if budget <= 0:
            break
        tail.append(f[max(0, f.nbytes - budget) :])
        budget -= min(budget, f.nbytes)
    for part in head:
        h.update(part)
    h.update(b"|")
    for part in reversed(tail):
        h.update(part)
    return h.hexdigest()


@dataclass(frozen=True)
class Layout:
    """Serialisation header, frame sizes and content identity of one object."""

    header: dict[str, Any]
    lengths: tuple[int, ...]
    identity: str = ""

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def frame_bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.lengths:
            out.append((start, start + n))
            start += n
        return out

    def frame_end(self, offset: int) -> int:
        """End of the frame that contains byte ``offset``."""
        for start, stop in self.frame_bounds():
            if start <= offset < stop:
                return stop
        raise ValueError(f"offset {offset} is outside the object (size {self.nbytes})")

    def block_end(self, offset: int, block_bytes: int) -> int:
        """End of the block starting at ``offset``: at most ``block_bytes`` long
        and never past the end of the frame that contains ``offset``."""
        return min(self.frame_end(offset), offset + block_bytes)

    def to_msg(self) -> dict[str, Any]:
        return {"header": self.header, "lengths": list(self.lengths), "identity": self.identity}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Layout:
        header, lengths = msg.get("header"), msg.get("lengths")
        if not isinstance(header, dict) or not isinstance(lengths, (list, tuple)):
            raise ValueError("malformed layout: needs a header dict and a list of lengths")
        if not all(isinstance(n, int) and n >= 0 for n in lengths):
            raise ValueError(f"malformed layout: frame lengths must be ints >= 0: {lengths!r}")
        identity = msg.get("identity") or ""
        if not isinstance(identity, str):
            raise ValueError(f"malformed layout: identity must be a string, got {identity!r}")
        return cls(header, tuple(lengths), identity)


Waiter = Callable[["ObjectBuffer"], None]


#: Used by buffers that are not given a pool of their own (no reuse).
_NO_POOL = BufferPool(0)


def as_byte_view(frame: Any) -> memoryview:
    """A flat, C-contiguous byte view of a serialisation frame (copying only
    when the frame is not contiguous)."""
    mv = memoryview(frame)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class ObjectBuffer:
    """Serialised bytes of one object and their progress."""

    def __init__(self, key: Key, pool: BufferPool | None = None) -> None:
        self.key = key
        self.pool = pool or _NO_POOL
        self.state = BufferState.PENDING
        self.layout: Layout | None = None
        #: Bytes received. Without ranges they are [0, progress); with
        #: ranges (:meth:`split`) the ones of each range are [lo, pos).
        self.progress = 0
        #: With ranges: how many, and each range's [lo, hi) and position.
        self.parts = 1
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._pos: list[int] = []
        self.error: BaseException | None = None
        #: Set while the buffer serves nobody (kept for a resume of its own
        #: receiving, see :meth:`interrupt`).
        self.interrupted: BaseException | None = None
        self._frames: list[memoryview] = []
        self._array: np.ndarray | None = None
        self._waiters: list[tuple[int, Waiter]] = []
        #: Per reader's address, the byte before which a sender may have
        #: handed this buffer's bytes to its socket
        #: (:func:`dask_hoplite.worker.streams.send_stream` raises it).
        self.served: dict[str, int] = {}

    # -------------------------------------------------------------- creation

    @classmethod
    def from_frames(cls, key: Key, header: dict[str, Any], frames: Sequence[Any]) -> ObjectBuffer:
        """A complete source buffer over existing frames (no copy)."""
        buf = cls(key)
        views = [as_byte_view(f) for f in frames]
        buf.layout = Layout(header, tuple(v.nbytes for v in views), content_identity(views))
        buf._frames = views
        buf.progress = buf.layout.nbytes
        buf.state = BufferState.COMPLETE
        return buf

    def allocate(self, layout: Layout, memory: np.ndarray | None = None) -> None:
        """Receiving side: the sender told us the layout; allocate once (from
        the pool, or ``memory``: a flat uint8 array of exactly the layout's
        size that the caller owns, e.g. a slice of a larger result)."""
        if self.layout is not None:
            if self.layout != layout:
                raise LayoutChanged(
                    f"{self.key!r} changed between senders (frames {self.layout.lengths}, "
                    f"identity {self.layout.identity or '?'} != {layout.lengths}, "
                    f"{layout.identity or '?'})"
                )
            return
        if memory is not None and (memory.dtype != np.uint8 or memory.shape != (layout.nbytes,)):
            raise ValueError(
                f"memory for {self.key!r} must be {layout.nbytes} uint8 bytes, "
                f"got {memory.dtype} of shape {memory.shape}"
            )
        self.layout = layout
        self._array = self.pool.allocate(layout.nbytes) if memory is None else memory
        mv = memoryview(self._array)  # type: ignore[arg-type]
        self._frames = [mv[a:b] for a, b in layout.frame_bounds()]
        self.state = BufferState.RECEIVING
        self._make_ranges()
        if layout.nbytes == 0:
            self._complete()
        else:
            self._wake()  # waiters for the layout itself (threshold 0)

    def split(self, parts: int) -> None:
        """Receive this buffer in ``parts`` byte ranges
        (:func:`~dask_hoplite.core.byte_ranges.range_bounds`), each filled in
        order and served as it fills, independently of the others; bytes
        already received count in their ranges. Once per buffer."""
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        if self.parts != 1 and self.parts != parts:
            raise BufferStateError(f"buffer of {self.key!r} is in {self.parts} ranges already")
        if parts == 1 or self.state is BufferState.COMPLETE:
            return
        self.parts = parts
        if self.layout is not None:
            self._make_ranges()

    def _make_ranges(self) -> None:
        if self.parts == 1 or self._lo or self.layout is None:
            return
        n, done = self.layout.nbytes, self.progress
        bounds = [range_bounds(n, j, self.parts) for j in range(self.parts)]
        self._lo = [lo for lo, _ in bounds]
        self._hi = [hi for _, hi in bounds]
        self._pos = [min(max(done, lo), hi) for lo, hi in bounds]

    def range_of(self, offset: int) -> int:
        """The range that byte ``offset`` is in (the last one for the end)."""
        return max(0, bisect.bisect_right(self._lo, offset) - 1)

    def available(self, start: int) -> int:
        """The end of the bytes received from ``start`` on without a gap
        (``start`` itself or less: none)."""
        if not self._lo:
            return self.progress
        if self.state is BufferState.COMPLETE:
            return self.nbytes
        return self._pos[self.range_of(start)]

    # -------------------------------------------------------------- writing

    def write(self, offset: int, data: Any) -> int:
        """Write a block received at ``offset``; returns the new progress.

        Blocks arrive in order; a block may overlap bytes we already have (a
        resumed stream) but must not leave a gap.
        """
        if self.state is not BufferState.RECEIVING or self._array is None:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not receiving")
        mv = as_byte_view(data)
        end = offset + mv.nbytes
        limit = self._hi[self.range_of(offset)] if self._lo else self._array.size
        if offset < 0 or offset > self.available(offset) or end > limit:
            raise ValueError(
                f"block [{offset}, {end}) of {self.key!r} does not continue progress "
                f"{self.progress} within size {self._array.size}"
            )
        self._array[offset:end] = np.frombuffer(mv, dtype=np.uint8)
        return self.advance(max(end, self.available(offset)))

    def writable_view(self, start: int, stop: int) -> memoryview:
        """Receiving side: the bytes [start, stop) to be filled in place (a
        socket reads straight into them); call :meth:`advance` once they are."""
        if self.state is not BufferState.RECEIVING or self._array is None:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not receiving")
        limit = self._hi[self.range_of(start)] if self._lo else self._array.size
        if not 0 <= start <= self.available(start) or not start <= stop <= limit:
            raise ValueError(f"[{start}, {stop}) does not continue progress {self.progress}")
        return memoryview(self._array)[start:stop]  # type: ignore[arg-type]

    def start_at(self, offset: int) -> None:
        """Receiving side of a replacement reduce node: its reader already
        has bytes [0, offset) from the node it replaces, and streams from
        ``offset``; those bytes are skipped here, never written or read."""
        if offset:
            self.advance(offset)

    def adopt(self, source: ObjectBuffer) -> None:
        """Complete this partial copy with the bytes of ``source``, a complete
        copy of the same object made here (the task was recomputed on this
        worker while its bytes were still arriving): readers carry on from the
        byte they reached, now reading ``source``'s frames (no copy); the
        bytes received so far go back to the pool when no reader holds them.
        Raises :class:`LayoutChanged` if ``source`` is another object."""
        if self.state is not BufferState.RECEIVING or self.layout is None:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not receiving")
        # Same frame sizes and content identity; the headers are not compared:
        # ours came over the wire (msgpack turns tuples into lists).
        if (
            source.state is not BufferState.COMPLETE
            or source.layout is None
            or not self.layout.identity
            or (source.layout.lengths, source.layout.identity)
            != (self.layout.lengths, self.layout.identity)
        ):
            raise LayoutChanged(
                f"{self.key!r} was recomputed here as another object "
                f"(identity {source.layout.identity if source.layout else '?'} != "
                f"{self.layout.identity or '?'})"
            )
        self._frames = list(source._frames)
        self._array = None
        self.progress = self.layout.nbytes
        self._complete()

    def serving(self, reader: str, end: int) -> None:
        """A sender is about to hand bytes up to ``end`` to ``reader``."""
        if end > self.served.get(reader, 0):
            self.served[reader] = end

    def served_to(self, ignore: str | None = None) -> int:
        """The end of the bytes handed to any reader but ``ignore`` (a dead
        one, whose bytes reach nobody)."""
        return max((n for r, n in self.served.items() if r != ignore), default=0)

    def swap_bytes(self, array: np.ndarray) -> None:
        """Serve the bytes of ``array`` (a byte array of this buffer's size)
        from now on, a complete buffer's readers carrying on from the byte
        they reached. For a reduce node whose stream changes from a byte no
        live reader has taken yet (:meth:`served_to`); the caller copies the
        bytes before it into ``array``."""
        if self.state is not BufferState.COMPLETE or self.layout is None:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not complete")
        if array.dtype != np.uint8 or array.size != self.layout.nbytes:
            raise ValueError(f"{self.key!r} has {self.layout.nbytes} bytes, not {array.nbytes}")
        mv = memoryview(array)  # type: ignore[arg-type]
        self._frames = [mv[a:b] for a, b in self.layout.frame_bounds()]
        self._array = array

    def advance(self, end: int) -> int:
        """Bytes up to ``end`` were written in place; wake readers. Returns
        the new position (of ``end``'s range, with ranges)."""
        if self.state is not BufferState.RECEIVING or self._array is None:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not receiving")
        if self._lo:
            return self._advance_range(end)
        if not self.progress <= end <= self._array.size:
            raise ValueError(f"cannot advance {self.key!r} from {self.progress} to {end}")
        if end > self.progress:
            self.progress = end
            if end == self._array.size:
                self._complete()
            else:
                self._wake()
        return self.progress

    def _advance_range(self, end: int) -> int:
        j = self.range_of(end - 1) if end > 0 else 0
        if not self._pos[j] <= end <= self._hi[j]:
            raise ValueError(
                f"cannot advance range {j} of {self.key!r} from {self._pos[j]} to {end}"
            )
        if end > self._pos[j]:
            self.progress += end - self._pos[j]
            self._pos[j] = end
            if self.progress == self.nbytes:
                self._complete()
            else:
                self._wake()
        return end

    def fail(self, error: BaseException) -> None:
        if self.state is BufferState.COMPLETE:
            return
        self.state = BufferState.FAILED
        self.error = error
        waiters, self._waiters = self._waiters, []
        for _, cb in waiters:
            cb(self)

    def interrupt(self, error: BaseException) -> None:
        """Stop serving readers, but keep the bytes: every waiter is woken
        and sees :attr:`interrupted` (so a relay's receivers give up on it at
        once instead of waiting for progress that may not come), until
        :meth:`resume` is called when this buffer's own receiving resumes."""
        if self.state is not BufferState.RECEIVING:
            return
        self.interrupted = error
        waiters, self._waiters = self._waiters, []
        for _, cb in waiters:
            cb(self)

    def resume(self) -> None:
        """This buffer receives again: readers may wait for its progress."""
        self.interrupted = None

    def _complete(self) -> None:
        self.state = BufferState.COMPLETE
        self.interrupted = None
        self._wake()

    # -------------------------------------------------------------- reading

    def when(self, threshold: int, callback: Waiter) -> None:
        """Call ``callback(self)`` once byte ``threshold`` is received (:meth:`available`
        beyond it; or the layout is known, for threshold 0 on an empty
        object), or the buffer completes or fails. Fires at once if that
        already holds."""
        if self._satisfied(threshold):
            callback(self)
        else:
            self._waiters.append((threshold, callback))

    def _satisfied(self, threshold: int) -> bool:
        if self.state in (BufferState.COMPLETE, BufferState.FAILED):
            return True
        if self.interrupted is not None:
            return True
        if self.layout is None:
            return False
        return self.available(threshold) > threshold or (threshold == 0 and self.layout.nbytes == 0)

    def _wake(self) -> None:
        keep: list[tuple[int, Waiter]] = []
        fire: list[tuple[int, Waiter]] = []
        for threshold, cb in self._waiters:
            (fire if self._satisfied(threshold) else keep).append((threshold, cb))
        self._waiters = keep
        for _, cb in fire:
            cb(self)

    def view(self, start: int, stop: int) -> memoryview:
        """Bytes [start, stop), which must lie within one frame and be valid."""
        if self.layout is None or stop > self.available(start) or start > stop:
            raise ValueError(f"bytes [{start}, {stop}) of {self.key!r} are not available")
        for (a, b), frame in zip(self.layout.frame_bounds(), self._frames, strict=True):
            if a <= start < b or (start == stop == a):
                if stop > b:
                    raise ValueError(f"[{start}, {stop}) spans frames")
                return frame[start - a : stop - a]
        raise ValueError(f"bytes [{start}, {stop}) of {self.key!r} are outside the object")

    def frames(self) -> list[memoryview]:
        if self.state is not BufferState.COMPLETE:
            raise BufferStateError(f"buffer of {self.key!r} is {self.state.value}, not complete")
        return list(self._frames)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes if self.layout is not None else 0

    @property
    def memory(self) -> np.ndarray | None:
        """The byte array this buffer's bytes are in, as allocated (or
        swapped in); None for a source buffer and for one that adopted the
        frames of another."""
        return self._array

    def __repr__(self) -> str:
        return (
            f"<ObjectBuffer {self.key!r} {self.state.value} {self.progress}/"
            f"{self.nbytes if self.layout else '?'}>"
        )


class BlockStore:
    """The buffers of one worker, by key."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self.buffers: dict[Key, ObjectBuffer] = {}
        self.pool = pool or _NO_POOL

    def get(self, key: Key) -> ObjectBuffer | None:
        return self.buffers.get(key)

    def announce(self, key: Key) -> ObjectBuffer:
        """Create the receiving buffer for ``key`` before asking for a sender,
        so that peers assigned to stream from us find it at once."""
        buf = self.buffers.get(key)
        if buf is None or buf.state is BufferState.FAILED:
            buf = self.buffers[key] = ObjectBuffer(key, self.pool)
        return buf

    def add_source(self, key: Key, header: dict[str, Any], frames: Sequence[Any]) -> ObjectBuffer:
        buf = self.buffers.get(key)
        if buf is not None and buf.state is not BufferState.FAILED:
            return buf
        buf = self.buffers[key] = ObjectBuffer.from_frames(key, header, frames)
        return buf

    def release(self, key: Key) -> ObjectBuffer | None:
        """Forget ``key``; readers that still hold the buffer keep it alive
        until they finish, then the memory goes."""
        buf = self.buffers.pop(key, None)
        if buf is not None and buf.state is not BufferState.COMPLETE:
            buf.fail(KeyError(f"{key!r} was released on this worker"))
        return buf

    def discard_if(self, key: Key, buf: ObjectBuffer) -> None:
        if self.buffers.get(key) is buf:
            del self.buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def __len__(self) -> int:
        return len(self.buffers)

    def __contains__(self, key: object) -> bool:
        return key in self.buffers
