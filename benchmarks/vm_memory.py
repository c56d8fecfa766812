"""Freed memory kept in the VM while an emulated cluster runs, as a real host
keeps it (see :class:`KeptFreedMemory`).

The benchmarks' VM returns memory that its kernel has had free for a moment to
the hypervisor ("free page reporting", through the virtio balloon): on the
2-core VM of ``docs/benchmark-log.md``, 1.77 TB reported over its life by
2026-12-07. Touching such memory again makes the hypervisor back it anew, and
the guest's page zeroing then crawls: faulting in 1 GiB that was freed just
before ran at 5-9 GiB/s, the same 1 GiB after 5-10 s idle at 0.3-0.45 GiB/s
(``numpy.ones`` of 1 GiB, back to back and after a pause).

A real host keeps its freed memory, and its zeroing runs at the fast rate
whatever the pause. On the VM the slow rate lands on whatever first touches
memory after a pause: a grid search's fits copying out of X (``X[train]``,
``X[test]``: 4 GiB of fresh arrays per search) took three times the kernel
CPU after X's transfers than in a search started right after the previous
one, which made any comparison between the two a comparison of pauses.

So while an emulated cluster runs, this turns reporting off: the kernel's
``page_reporting_order`` is set above the largest block the buddy allocator
makes, so no free block qualifies, and the old value is restored on exit (a
run killed before its teardown leaves reporting off; the next run then puts
the kernel's default back when it ends).
Where the knob does not exist (no balloon driver, another kernel) or cannot
be written (not root, a kernel that bounds the value), nothing changes and
:attr:`KeptFreedMemory.why` says so. ``HOPLITE_BENCH_VM_PAGE_REPORTING=keep``
leaves the VM's reporting on, to compare with runs made before 2026-12-07.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

#: The kernel's free page reporting threshold: free blocks of this buddy
#: order and above are reported to the hypervisor.
KNOB = "/sys/module/page_reporting/parameters/page_reporting_order"
#: Above the largest buddy order of x86-64 Linux (10): no block qualifies.
NEVER = 11
#: The kernel's default threshold (pageblock order: 2 MiB blocks on x86-64),
#: restored when the knob is found at ``NEVER``, which a run killed before
#: its teardown leaves behind.
DEFAULT_ORDER = 9
#: Set to ``keep`` to leave the VM's reporting as it is.
ENV = "HOPLITE_BENCH_VM_PAGE_REPORTING"

#: Per knob, the value before the first holder turned reporting off, and the
#: holders still active: clusters may overlap, and only the last one to stop
#: restores the value the first one found.
_HELD: dict[str, tuple[str, int]] = {}


class KeptFreedMemory:
    """While active, the VM keeps freed memory (a context manager; see the
    module's docstring). ``active`` says whether reporting was turned off,
    ``why`` why not."""

    def __init__(self, knob: str = KNOB, never: int = NEVER) -> None:
        self.knob = knob
        self.never = never
        self.active = False
        self.why = ""

    def __enter__(self) -> KeptFreedMemory:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Turn the VM's reporting off, unless it is off already or cannot
        be (then ``why`` says why)."""
        if self.active:
            return
        if os.environ.get(ENV, "").lower() == "keep":
            self.why = f"{ENV}=keep: the VM's free page reporting left on"
            return
        if not os.path.exists(self.knob):
            self.why = f"no free page reporting here ({self.knob} does not exist)"
            return
        held = _HELD.get(self.knob)
        if held is not None:
            _HELD[self.knob] = (held[0], held[1] + 1)
            self.active = True
            return
        try:
            with open(self.knob) as f:
                saved = f.read().strip()
            if saved == str(self.never):
                logger.warning(
                    "%s was left at %s by a run that did not restore it; restoring %d on exit",
                    self.knob,
                    saved,
                    DEFAULT_ORDER,
                )
                saved = str(DEFAULT_ORDER)
            with open(self.knob, "w") as f:
                f.write(str(self.never))
            with open(self.knob) as f:
                now = f.read().strip()
        except OSError as e:
            self.why = f"free page reporting left on: {self.knob}: {e.strerror or e}"
            logger.warning("%s", self.why)
            return
        if now != str(self.never):
            self.why = (
                f"free page reporting left on: {self.knob} reads {now} after writing {self.never}"
            )
            logger.warning("%s", self.why)
            self._write(saved)
            return
        _HELD[self.knob] = (saved, 1)
        self.active = True
        logger.info(
            "the VM's free page reporting is off while the cluster runs (was order %s)", saved
        )

    def stop(self) -> None:
        """Give up this holder's part; the last one restores the VM's
        reporting as it was (idempotent)."""
        if not self.active:
            return
        self.active = False
        saved, holders = _HELD[self.knob]
        if holders > 1:
            _HELD[self.knob] = (saved, holders - 1)
            return
        del _HELD[self.knob]
        self._write(saved)

    def _write(self, value: str) -> None:
        try:
            with open(self.knob, "w") as f:
                f.write(value)
        except OSError as e:
            logger.warning("could not restore %s to %s: %s", self.knob, value, e)
