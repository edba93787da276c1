"""Bookkeeping writes: hit counts, and which plans each application used, by run (what
auto-prime loads at the next start). Both are batched by the local tier and written in
one short transaction that gives way to a busy store: never worth a stall.

An application is a name (``PLANCACHE_APP``, else the entry script). Each process run that
looks plans up records, per key and device, the order in which it first used them; the
next run of the same application primes the keys of the latest run, in that order. Rows
are read without a lock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..errors import StoreBusyError, StoreError
from .schema import BUSY_TIMEOUT_MS

if TYPE_CHECKING:
    from .store import Store

__all__ = ["RETENTION_SECONDS", "latest_run", "record", "record_counters", "record_hits", "record_judgements", "record_usage"]

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


def record(store: Store, write: Callable[[sqlite3.Connection], object], *, wait: bool, what: str) -> bool:
    """Run ``write`` in one bookkeeping transaction. ``wait=False``: False, writing nothing,
    when another process holds the write lock (not waiting up to the busy timeout; the caller
    keeps its batch for the next try). ``what`` names the bookkeeping in a failed write's error."""
    try:
        conn = store.connection()
        if not wait:
            conn.execute("PRAGMA busy_timeout = 0")
        try:
            with store.transaction() as tx:
                write(tx)
        finally:
            if not wait:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        return True
    except StoreBusyError:
        if wait:
            raise
        return False
    except sqlite3.Error as exc:
        raise StoreError(f"cannot record {what} in {store.path}: {exc}", path=str(store.path)) from exc


def record_hits(store: Store, hits: Mapping[str, tuple[int, float]], *, wait: bool = True) -> bool:
    """Add batched hit counts and last-used times: ``{key: (count, last_used)}``; an older
    time never moves ``last_used_at`` back (see ``record`` for ``wait``)."""
    rows = [(count, used, key) for key, (count, used) in hits.items()]
    sql = "UPDATE plans SET hit_count = hit_count + ?, last_used_at = max(last_used_at, ?) WHERE key = ?"
    return not rows or record(store, lambda tx: tx.executemany(sql, rows), wait=wait, what="hits")


def record_judgements(store: Store, judgements: Mapping[str, tuple[str, str]], *, wait: bool = True) -> bool:
    """Keep judgements in their rows: ``{key: (blob_sha256, text)}`` (``store.kept``); a row
    written again since, with another blob, is left alone (see ``record`` for ``wait``)."""
    rows = [(text, key, blob) for key, (blob, text) in judgements.items()]
    sql = "UPDATE plans SET judgement = ? WHERE key = ? AND blob_sha256 = ?"
    return not rows or record(store, lambda tx: tx.executemany(sql, rows), wait=wait, what="judgements")


def record_counters(store: Store, deltas: Mapping[str, int], *, wait: bool) -> bool:
    """Add ``deltas`` to the store's persistent counters (the remote tier's, by name); see
    ``record`` for ``wait``."""
    rows = [(name, int(by)) for name, by in deltas.items() if by]
    sql = "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value"
    return not rows or record(store, lambda tx: tx.executemany(sql, rows), wait=wait, what="counters")


def record_usage(store: Store, app: str, run: str, run_started: float, uses: Mapping[tuple[str, int], int], *,
                 wait: bool) -> bool:  # fmt: skip
    """Record that run ``run`` of ``app`` (started at ``run_started``) used ``uses``:
    ``{(key, device): order of first use}``; a row a later run took over is left alone (see
    ``record`` for ``wait``)."""
    if not uses:
        return True
    rows = [(app, key, device, run, run_started, seq) for (key, device), seq in uses.items()]

    def write(tx: sqlite3.Connection) -> None:
        tx.executemany(_UPSERT, rows)
        tx.execute("DELETE FROM app_plans WHERE app = ? AND run_started < ?", (app, run_started - RETENTION_SECONDS))

    return record(store, write, wait=wait, what=f"the plans {app!r} used")


def latest_run(store: Store, app: str) -> list[tuple[str, int]]:
    """``[(key, device)]`` the latest recorded run of ``app`` used, in the order it first
    used them; [] when ``app`` has no record."""
    try:
        rows = store.connection().execute(_LATEST, {"app": app}).fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the plans {app!r} used from {store.path}: {exc}", path=str(store.path)) from exc
    return [(str(r[0]), int(r[1])) for r in rows]
