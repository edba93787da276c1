"""The memory tier: loaded plans of this process, least recently used evicted.

Bounded because a dynamic-shape server meets new shapes for as long as it runs: every plan
holds a loaded cuDNN graph (host and device memory). Workspaces are not plans' own: each
launching thread holds one per stream, as large as the largest plan it launched there needs
(``guest.guest_backend``), so the bound on plans bounds the process.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A thread-safe mapping that keeps its ``capacity`` most recently used values.

    A read takes no lock and moves nothing: it stamps the entry with the time of its use
    (a number from one counter, drawn atomically), on the path of every repeat lookup and
    builder call. Writes are serialized, and the one that overflows the capacity evicts
    the entry with the oldest stamp: a scan, paid only by a write past the bound (a plan
    loaded or built), made in C: each entry is ``[stamp, key, value]``, and stamps are
    unique, so the smallest list is the oldest entry and no comparison reaches its value."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: dict[K, list[Any]] = {}  # key -> [stamp of its last use, key, value]
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self.evicted = 0

    def get(self, key: K) -> V | None:
        entry = self._items.get(key)
        if entry is None:
            return None
        entry[0] = next(self._clock)
        value: V = entry[2]
        return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            items = self._items
            items[key] = [next(self._clock), key, value]
            while len(items) > self.capacity:
                del items[min(items.values())[1]]
                self.evicted += 1

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def after_fork(self) -> None:
        """A forked child gets a fresh lock (the parent's may have been held at fork)."""
        self._lock = threading.Lock()
