"""The memory tier: loaded plans of this process, least recently used evicted.

Bounded because a dynamic-shape server meets new shapes for as long as it runs: every plan
holds a loaded cuDNN graph (host and device memory). Workspaces are not held at all (they
are allocated per launch), so the bound on plans bounds the process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A thread-safe mapping that keeps its ``capacity`` most recently used values."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
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
