"""What happens to this worker's copy of a key when Dask's state of the key
changes here: dropped, kept for a resume, or completed from the value.

* Dask released the key here (typically: lost, being recomputed) while our
  copy was partial: keep the bytes for ``hoplite.resume-window``, so that the
  next fetch resumes from them; meanwhile the copy serves nobody.
* The key landed in memory here by another path (computed here, or fetched by
  Dask) while a partial copy of ours waited: complete the copy from the value
  without a copy, so the receivers streaming from it carry on; if the value is
  another object (a non-deterministic task recomputed), drop the copy and let
  its readers restart elsewhere.
* Otherwise the copy goes, and the directory is told (``hoplite-released``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dask.typing import Key

from dask_hoplite.core.store import BufferState, ObjectBuffer
from dask_hoplite.worker.context import WorkerContext

logger = logging.getLogger(__name__)


class PartialCopies:
    """Key lifecycle of this worker's buffers, driven by Dask's transitions.

    ``is_fetching(key)``: whether a hoplite fetch of ``key`` runs here now
    (its stream then decides, not the transition)."""

    def __init__(self, ctx: WorkerContext, is_fetching: Callable[[Key], bool]) -> None:
        self.ctx = ctx
        self.is_fetching = is_fetching
        #: Partial copies of released keys kept for a resume, with their expiry.
        self.kept: dict[Key, tuple[ObjectBuffer, asyncio.TimerHandle]] = {}

    def transition(self, key: Key, finish: str) -> None:
        """Dask moved ``key`` to state ``finish`` on this worker."""
        store = self.ctx.store
        if finish in ("released", "forgotten") and key in store:
            if self.is_fetching(key):
                # Our stream is still running (Dask cancelled the fetch, e.g.
                # because the key was lost and is being recomputed): let it
                # finish or resume; Dask releases the key again afterwards.
                return
            buf = store.get(key)
            if (
                buf is not None
                and buf.state is BufferState.RECEIVING
                and buf.progress > 0
                and self.ctx.config.resume_window > 0
            ):
                self._keep_for_resume(key, buf)
            else:
                self.forget(key)
                store.release(key)
            self.ctx.send({"op": "hoplite-released", "key": key})
        elif finish == "memory":
            self.forget(key)
            self._landed(key)

    def _landed(self, key: Key) -> None:
        """``key`` is in memory here: complete a waiting partial copy from it."""
        buf = self.ctx.store.get(key)
        if buf is None or buf.state is BufferState.COMPLETE:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            running = False
        else:
            running = True
        if (
            running
            and buf.state is BufferState.RECEIVING
            and not self.is_fetching(key)
            and key in self.ctx.worker.data
        ):
            # The key was computed here (a lost key recomputed) or came by
            # Dask's own path while a partial copy of ours waited to be
            # resumed: complete that copy from the value, so that the
            # receivers streaming from it carry on.
            self.ctx.spawn(self._adopt_local(key, buf))
        else:
            self.drop(key)

    async def _adopt_local(self, key: Key, buf: ObjectBuffer) -> None:
        """Complete the partial copy ``buf`` of ``key`` with the value in this
        worker's memory; if the value is another object (a non-deterministic
        task recomputed), drop the copy: its readers restart elsewhere."""
        ctx = self.ctx
        try:
            held = await ctx.serialize_held(key)
            if held is None:
                # Released meanwhile: the transition kept or dropped the copy.
                return
            header, frames = held
            if ctx.store.get(key) is not buf or buf.state is not BufferState.RECEIVING:
                return  # released or completed meanwhile
            buf.adopt(ObjectBuffer.from_frames(key, header, frames))
            ctx.count("partial-copies-adopted")
            logger.debug("%r: partial copy completed from the value computed here", key)
        except Exception as e:
            logger.info("%r: partial copy not completed from the local value (%s)", key, e)
            if ctx.store.get(key) is buf:
                self.drop(key)

    def drop(self, key: Key) -> None:
        """Drop our copy of ``key`` (its readers fail over) and tell the directory."""
        self.ctx.store.release(key)
        self.ctx.send({"op": "hoplite-released", "key": key})

    def _keep_for_resume(self, key: Key, buf: ObjectBuffer) -> None:
        """Keep the partial copy ``buf`` of a key Dask released here for
        ``hoplite.resume-window``: the key was typically lost and is being
        recomputed, and the next fetch of it resumes this buffer. Meanwhile
        it serves nobody: the receivers streaming from it give up at once
        (and keep their own bytes likewise), and the directory no longer
        lists it."""
        store = self.ctx.store
        buf.interrupt(KeyError(f"{key!r} was released on {self.ctx.address}"))
        kept = self.kept.get(key)
        if kept is not None:
            if kept[0] is buf:
                return  # already timed
            self.forget(key)

        def expire() -> None:
            if self.kept.get(key, (None,))[0] is buf:
                del self.kept[key]
            if (
                store.get(key) is buf
                and not self.is_fetching(key)
                and buf.state is not BufferState.COMPLETE
            ):
                logger.debug("dropping the partial copy of %r kept for a resume", key)
                store.release(key)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the worker's event loop: nothing to time it with
            store.release(key)
            return
        self.kept[key] = (buf, loop.call_later(self.ctx.config.resume_window, expire))
        self.ctx.count("partial-copies-kept")

    def forget(self, key: Key) -> None:
        """Stop timing the kept copy of ``key`` (the store no longer holds it)."""
        kept = self.kept.pop(key, None)
        if kept is not None:
            kept[1].cancel()

    def close(self) -> None:
        for _, handle in self.kept.values():
            handle.cancel()
        self.kept.clear()
