"""Where plans are found, fastest first, behind one small interface.

* ``memory.MemoryTier``: loaded, ready ``Plan`` objects of this process, LRU-bounded.
* ``local.LocalTier``: the SQLite store of this machine.
* ``remote.RemoteTier``: the Redis store of a fleet.

The stored tiers speak ``Entry``: ``get(key, env_id) -> Entry | None`` (a miss, or a
failure they logged and counted) and ``put(entry) -> bool`` (False: not stored, logged).
Neither raises for the store's own troubles: a cache that cannot store still serves plans.
"""
