"""Where plans are found, fastest first: ``memory`` (loaded plans of this process,
LRU-bounded), ``local`` (this machine's SQLite store) and ``remote`` (a fleet's Redis).

The stored tiers speak ``Entry`` and never raise for the store's own troubles: a miss, or a
failure they logged and counted, is None; a put that did not store is False. A cache that
cannot store still serves plans.
"""
