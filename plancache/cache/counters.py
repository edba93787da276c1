"""The counters of one cache: one object that every part of a lookup counts in.

``PlanCache.stats()["process"]`` shows them. ``count`` takes a lock: ``d[name] += 1`` from
two threads at once can lose one of the two (a read, an add and a write are three steps
for the interpreter), and a lookup's counters are bumped from the program's threads, the
primer's and the background writer's.
"""

from __future__ import annotations

import threading

from ..config import StrEnum
from ..store.per_process import PerProcess

__all__ = ["NAMES", "Count", "Counters"]


class Count(StrEnum):
    """Every counter, in the order ``stats`` lists them."""

    MEMORY_HITS = "memory_hits"
    HITS = "hits"
    MISSES = "misses"
    BUILDS = "builds"
    REBUILDS = "rebuilds"
    CORRUPT = "corrupt"
    STORE_ERRORS = "store_errors"
    WAITS = "waits"
    UNPERSISTED = "unpersisted"
    KERNEL_CACHE_RESTORES = "kernel_cache_restores"
    PRIMED = "primed"
    NO_MAJORITY = "no_majority"
    RECHECKS = "rechecks"
    LOAD_FAILURES = "load_failures"
    UNLOADABLE = "unloadable"
    JUDGE_DISAGREEMENTS = "judge_disagreements"


NAMES = tuple(c.value for c in Count)


class Counters(dict[str, int]):
    """``{name: count}`` of ``NAMES``; read it as a dict, bump it with ``count``."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(NAMES, 0))
        # Per process: a lock another thread held at a fork would stay held in the child.
        self._lock = PerProcess(threading.Lock)

    def count(self, name: Count, n: int = 1) -> None:
        """Add ``n`` to ``name``."""
        with self._lock.get():
            self[name] += n
