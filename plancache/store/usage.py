"""Which plans each application used, by run: what auto-prime loads at the next start.

An application is a name (``PLANCACHE_APP``, else the entry script). Each process run that
looks plans up records, per key and device, the order in which it first used them; the
next run of the same application primes the keys of the latest run, in that order. Rows
are bookkeeping: written in one short transaction that gives way to a busy store, read
without a lock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from ..errors import StoreBusyError, StoreError

__all__ = ["RETENTION_SECONDS", "latest_run", "record_usage"]

#: Rows of runs older than this (relative to the run being recorded) are dropped: an
#: application that stopped using a plan a month ago does not need it primed.
RETENTION_SECONDS = 30 * 86400.0

_UPSERT = """
INSERT INTO app_plans (app, key, device, run, run_started, seq) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (app, key, device) DO UPDATE SET
    run = excluded.run, run_started = excluded.run_started, seq = excluded.seq
WHERE excluded.run_started >= app_plans.run_started
"""
_LATEST = """
SELECT key, device FROM app_plans
WHERE app = :app AND run = (SELECT run FROM app_plans WHERE app = :app ORDER BY run_started DESC, run DESC LIMIT 1)
ORDER BY seq
"""


def record_usage(store: Any, app: str, run: str, run_started: float, uses: Mapping[tuple[str, int], int], *,
                 wait: bool) -> bool:  # fmt: skip
    """Record that run ``run`` of ``app`` (started at ``run_started``) used ``uses``:
    ``{(key, device): order of first use}``. A row a later run already took over is left
    alone. ``wait=False``: False, writing nothing, when the store is busy."""
    if not uses:
        return True
    rows = [(app, key, device, run, run_started, seq) for (key, device), seq in uses.items()]
    try:
        with store.bookkeeping(wait=wait) as tx:
            tx.executemany(_UPSERT, rows)
            tx.execute("DELETE FROM app_plans WHERE app = ? AND run_started < ?", (app, run_started - RETENTION_SECONDS))
        return True
    except StoreBusyError:
        if wait:
            raise
        return False
    except sqlite3.Error as exc:
        raise StoreError(f"cannot record the plans {app!r} used in {store.path}: {exc}", path=str(store.path)) from exc


def latest_run(store: Any, app: str) -> list[tuple[str, int]]:
    """``[(key, device)]`` the latest recorded run of ``app`` used, in the order it first
    used them; [] when ``app`` has no record."""
    try:
        rows = store.connection().execute(_LATEST, {"app": app}).fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the plans {app!r} used from {store.path}: {exc}", path=str(store.path)) from exc
    return [(str(r[0]), int(r[1])) for r in rows]
