"""Plans being loaded or built in this process: one thread per key and device does it.

A lookup and the primer (or two lookups on two threads) that want the same plan at once
must not deserialize it twice: the second waits for the first and takes its plan from
the memory tier. This is the in-process step before the key's single flight
(``flight.py``), which also spans processes and machines but is taken only on a miss.
A lookup nested in a build, on a thread that holds a build lock, does not wait for
another thread's load: that thread may be waiting for the build lock (a stripe of two
keys), so the nested lookup loads or builds the plan itself, and the other thread finds
it in memory once it holds the lock.

The primer also gives way to builds through it: it starts a load only while no lookup
is autotuning, whose timings its host work would disturb. It does not give way to loads:
a lookup of a plan the primer has not reached loads it at once on the caller's thread
while the primer goes on with the others (a native load holds no GIL, and two loads of
different plans wait for nothing of each other's).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from ..errors import LockTimeoutError
from ..runtime.plan import Plan
from .flight import holds_a_build_lock

__all__ = ["Loads"]

Slot = tuple[str, int]  # (key, device)


class _Memory(Protocol):
    def get(self, key: Slot) -> Plan | None: ...


class Loads:
    """Who is loading which ``(key, device)`` now, and how many lookups are at it: in one
    process (``Lookup`` holds one per process: a forked child's loads are its own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Who loads what: the loading thread, and the event a waiting thread waits on, made
        #: by the first thread that waits (None until one does: most loads are nobody else's
        #: wait, and an Event is a Condition and a lock to make).
        self._busy: dict[Slot, tuple[int, threading.Event | None]] = {}
        self._builds = 0  # lookups autotuning now

    @contextlib.contextmanager
    def claim(self, slot: Slot, memory: _Memory, deadline: float = math.inf) -> Iterator[Plan | None]:
        """For a lookup: yields the plan when another thread put it in ``memory`` (waiting
        for one that is loading it), else None, and then this thread loads or builds it
        while later claims of ``slot`` wait. Waiting past ``deadline`` (``time.monotonic``)
        raises ``LockTimeoutError``."""
        plan, mine = self._wait_or_take(slot, memory, deadline)
        if plan is not None or not mine:  # not mine: loaded or built here beside another thread's load
            yield plan
            return
        try:
            yield None
        finally:
            self._release(slot)

    def _wait_or_take(self, slot: Slot, memory: _Memory, deadline: float) -> tuple[Plan | None, bool]:
        """(the plan, False) once another thread has put it in ``memory``; (None, True) once
        this thread holds ``slot`` (nobody else loading it, and it is not in memory); (None,
        False) when another thread loads it and this one holds a build lock."""
        started = time.monotonic()
        while True:
            with self._cond:
                if slot not in self._busy:
                    plan = memory.get(slot)  # finished while this lookup was on its way here
                    if plan is None:
                        self._busy[slot] = (threading.get_ident(), None)
                    return plan, plan is None
                loader, event = self._busy[slot]
                if loader != threading.get_ident() and holds_a_build_lock():
                    return None, False
                if event is None:
                    event = threading.Event()
                    self._busy[slot] = (loader, event)
            # The other thread always sets it, whatever happened to its load or build.
            if not event.wait(None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())):
                waited = time.monotonic() - started
                raise LockTimeoutError(f"waited {waited:.0f} s for another thread to load or build plan {slot[0][:12]}",
                                       key=slot[0], waited_s=waited)  # fmt: skip
            plan = memory.get(slot)
            if plan is not None:
                return plan, False
            # Its load failed: this thread tries, as the lookup it is.

    @contextlib.contextmanager
    def try_claim(self, slot: Slot, memory: _Memory) -> Iterator[bool]:
        """For the primer: yields True when this thread now loads ``slot``; False when it
        is in ``memory`` or another thread is loading it (never waits)."""
        with self._cond:
            if slot in self._busy or memory.get(slot) is not None:
                mine = False
            else:
                self._busy[slot] = (threading.get_ident(), None)
                mine = True
        if not mine:
            yield False
            return
        try:
            yield True
        finally:
            self._release(slot)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """A lookup autotuning for the block: the primer waits (``wait_until_no_build``)."""
        self._count_build(1)
        try:
            yield
        finally:
            self._count_build(-1)

    def _count_build(self, change: int) -> None:
        with self._cond:
            self._builds += change
            self._cond.notify_all()  # a waiter re-checks that no build runs

    def wait_until_no_build(self, timeout: float | None = None) -> bool:
        """Wait until no lookup is autotuning; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._builds == 0, timeout=timeout)

    def _release(self, slot: Slot) -> None:
        with self._cond:
            _, event = self._busy.pop(slot)
        if event is not None:  # set outside the lock: a waiter it wakes takes the lock at once
            event.set()
