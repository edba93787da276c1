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

from ..store.per_process import PerProcess

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entries:
    """An LRU's entries and lock in one process (see ``LRU``)."""

    __slots__ = ("clock", "evicted", "items", "lock")

    def __init__(self) -> None:
        self.items: dict[Any, list[Any]] = {}  # key -> [stamp of its last use, key, value]
        self.clock = itertools.count()
        self.lock = threading.Lock()
        self.evicted = 0


class LRU(Generic[K, V]):
    """A thread-safe mapping that keeps its ``capacity`` most recently used values.

    A read (on the path of every repeat lookup and builder call) takes no lock and moves
    nothing: it stamps the entry from one counter, drawn atomically. Writes are serialized,
    and the one past the capacity evicts the oldest stamp by a scan, paid only by a write
    past the bound (a plan loaded or built) and made in C: each entry is
    ``[stamp, key, value]`` with unique stamps, so the smallest list is the oldest and no
    comparison reaches its value. A forked child starts empty (the parent's plans belong to
    the parent's CUDA context), with a lock of its own (a thread of the parent may have
    held the parent's at the fork)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._entries = PerProcess(_Entries)

    @property
    def evicted(self) -> int:
        """Entries this process evicted."""
        return self._entries.get().evicted

    def get(self, key: K) -> V | None:
        entries = self._entries.get()
        entry = entries.items.get(key)
        if entry is None:
            return None
        entry[0] = next(entries.clock)
        value: V = entry[2]
        return value

    def put(self, key: K, value: V) -> None:
        entries = self._entries.get()
        with entries.lock:
            items = entries.items
            items[key] = [next(entries.clock), key, value]
            while len(items) > self.capacity:
                del items[min(items.values())[1]]
                entries.evicted += 1

    def keys(self) -> list[K]:
        entries = self._entries.get()
        with entries.lock:
            return list(entries.items)

    def clear(self) -> None:
        entries = self._entries.get()
        with entries.lock:
            entries.items.clear()

    def __len__(self) -> int:
        return len(self._entries.get().items)

    def __contains__(self, key: object) -> bool:
        return key in self._entries.get().items
