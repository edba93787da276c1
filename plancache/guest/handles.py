"""cuDNN handles by device, leased to one thread at a time for one launch.

cuDNN forbids two threads using one handle at once, and creating a handle inside a
CUDA-graph capture invalidates the capture. So handles live in a pool per device: a
launch leases one for the few microseconds it takes to enqueue; loading or preparing a
plan puts one in the pool, so a thread that first launches inside a capture leases an
existing handle instead of creating one. What a handle is, and how one is made, is the
backend's (``create``); no CUDA library is imported here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .block import known_captures

__all__ = ["Handles"]


class Handles:
    """cuDNN handles by device, leased to one thread at a time for one launch.

    ``take`` pops a free handle without a lock (``list.pop`` and ``list.append`` are
    atomic), because it runs on every launch; only when none is free does it lock, and
    then it creates one, except inside a CUDA-graph capture, where creating one would
    invalidate the capture: there it waits for a handle to come back (one exists once any
    plan of that device was loaded or prepared, and a lease lasts one enqueue). ``ensure``
    is called outside captures, when a plan is loaded or prepared."""

    def __init__(self, create: Callable[[int], Any], capturing: Callable[[], bool],
                 relaxed: Callable[[], AbstractContextManager[Any]]) -> None:  # fmt: skip
        self._create = create  # device -> a new handle (called in relaxed capture mode, on that device)
        self._capturing = capturing  # whether the calling thread's stream is capturing
        self._relaxed = relaxed  # the calling thread in relaxed capture mode for a block
        self._free: dict[int, list[Any]] = {}
        self._count: dict[int, int] = {}
        self._cond = threading.Condition()
        self._waiting = 0
        known_captures.watch(self._wake)

    def _wake(self) -> None:
        """A capture of plancache's ended: a thread waiting for a handle may now make one."""
        with self._cond:
            self._cond.notify_all()

    def ensure(self, device: int) -> None:
        with self._cond:
            if self._count.get(device, 0):
                return
        self.give(device, self.take(device))

    def take(self, device: int) -> Any:
        try:
            return self._free[device].pop()
        except (KeyError, IndexError):
            return self._take_slow(device)

    def give(self, device: int, handle: Any) -> None:
        self._free[device].append(handle)
        if self._waiting:  # read unlocked: a waiter counts itself before it looks at the list
            with self._cond:
                self._cond.notify()

    @contextlib.contextmanager
    def lease(self, device: int) -> Iterator[Any]:
        handle = self.take(device)
        try:
            yield handle
        finally:
            self.give(device, handle)

    def _take_slow(self, device: int) -> Any:
        with self._cond:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
            # Creating a handle is a cudaMalloc: inside this thread's capture it would
            # break the capture, and beside a capture plancache runs it is not done either.
            here = self._capturing()
            if here or known_captures.active:
                if here and not self._count.get(device, 0):
                    raise RuntimeError(
                        f"no cuDNN handle of device {device} exists, and creating one inside a CUDA-graph capture would "
                        "invalidate it: call plan.prepare() before capturing"
                    )
                self._waiting += 1
                try:
                    if not self._cond.wait_for(lambda: bool(free) or not (here or known_captures.active), timeout=30.0):
                        raise RuntimeError(
                            f"no cuDNN handle of device {device} came back within 30 s during a CUDA-graph capture"
                        )
                finally:
                    self._waiting -= 1
                if free:
                    return free.pop()
            self._count[device] = self._count.get(device, 0) + 1
        try:
            with self._relaxed():
                return self._create(device)
        except BaseException:
            with self._cond:
                self._count[device] -= 1
            raise
