"""Where plans are found, fastest first, behind one small interface.

* ``memory.MemoryTier``: loaded, ready ``Plan`` objects of this process, LRU-bounded.
* ``local.LocalTier``: the SQLite store of this machine.
* ``remote.RemoteTier``: the Redis store of a fleet.

The stored tiers speak ``Entry``: ``get(key, env_id) -> Entry | None`` (a miss, or a
failure they logged and counted) and ``put(entry) -> bool`` (False: not stored, logged).
Neither raises for the store's own troubles: a cache that cannot store still serves plans.
"""

from __future__ import annotations

from typing import Protocol

from ..store import Entry


class StoredTier(Protocol):
    """A tier that keeps entries (local SQLite, Redis)."""

    def get(self, key: str, env_id: str) -> Entry | None: ...

    def put(self, entry: Entry) -> bool: ...


__all__ = ["StoredTier"]
