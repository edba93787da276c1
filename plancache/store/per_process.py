"""State of one process, which a forked child must not inherit, declared once by its owner.

``fork()`` copies a process's memory but only the thread that forked. A child would inherit
the locks the parent's other threads held (nobody in the child releases them), the loads
and builds under way, loaded plans and cuDNN handles and streams of the parent's CUDA
context, pending hit counts the parent writes, and the parent's SQLite connections. Each
owner keeps such state in a ``PerProcess`` holder, whose ``get()`` returns the current
process's value, made by the owner's ``make`` at the first ``get`` of each process: nothing
is called at the fork, and no owner can be forgotten in a chain of hooks. A lock held for a
few operations off the hit path is one too (the breaker's, the fleet lock's holds, the
unstored plans', the cuDNN library's loading, the frontend integration's, a primer's
report): a thread of the parent may have been inside it at the fork. This module imports
nothing of the store (``store/__init__.py`` loads its names on first use): the start-up
hook's import of the frontend integration, in every process that sets
PLANCACHE_PATCH_CUDNN, brings it alone.

The current process is told by a count of forks that an ``os.register_at_fork`` hook bumps
in each child, not by ``os.getpid()``: glibc has not cached the pid since 2.25, so that is a
system call (0.3 to 0.4 us on a shared 2-core machine; a global reads in 0.02 us), and
``get`` is on the path of every hit.

What must happen at the fork itself keeps a hook of its own: ``connections`` holds every
SQLite call off across the fork (a copy of a mutex another thread holds would hang the
child); filelock closes a child's copies of the build-lock descriptors the parent holds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess", "forks"]

T = TypeVar("T")

#: How many forks lie between the first process and this one (bumped in each child).
_forks = 0
#: Taken to publish a value just made, so every thread of a process gets the same one; not
#: held while it is made: a slow make (one asks CUDA whether a device is usable) would hold
#: up every other holder's first ``get``, a lookup's included.
_publishing = threading.Lock()


def _in_child() -> None:
    global _forks, _publishing
    _forks += 1
    _publishing = threading.Lock()  # a thread of the parent may have held it at the fork


def forks() -> int:
    """How many forks lie between the first process and this one (an object records it where
    it is made, to tell later whether it is in that process)."""
    return _forks


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


class PerProcess(Generic[T]):
    """``make()``'s value for this process, made at the first ``get`` of each process (never
    the parent's value in a forked child)."""

    __slots__ = ("_forks", "_make", "_value")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._forks = -1  # made at the first get
        self._value: T

    def get(self) -> T:
        if self._forks == _forks:
            return self._value
        return self._made()

    def made_here(self, value: T) -> bool:
        """Whether ``value`` is this process's (made or set here): False in a forked child for
        its parent's, which a block of the forking thread took before the fork and ends in the
        child too. What it holds (a build lock, a fleet lock) is the parent's: the child must
        not release it."""
        return self._forks == _forks and self._value is value

    def set(self, value: T) -> None:
        """Make ``value`` this process's (a forked child's first ``get`` makes its own)."""
        with _publishing:
            self._value = value
            self._forks = _forks

    def _made(self) -> T:
        # Two threads of a process may both make a value at its first get (a make has no
        # effect beyond its value); the first one published is the one every thread gets.
        value = self._make()
        with _publishing:
            if self._forks != _forks:
                self._value = value  # then the count: a thread that sees the count sees this value
                self._forks = _forks
            return self._value
