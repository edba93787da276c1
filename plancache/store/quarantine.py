"""Quarantine: entries taken out of service and kept, row and blob, for inspection.

A lookup that judges an entry unsound quarantines that row only (matched by its checksum
and creation time), inside the key's single flight; ``maintenance.verify(fix=True)``
quarantines what it finds (by rowid where the key is damaged); ``maintenance.prune`` can
empty the quarantine. Each move is one short write transaction, counted as ``quarantined``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from ..errors import StoreError
from .connections import Transaction
from .recovery import lenient_text

__all__ = ["move"]


def move(transaction: Transaction, path: Path, where: str, values: tuple[object, ...], reason: str) -> bool:
    """Move the row ``where`` (a constant, with ``values``) matches out of service, kept for inspection, in one ``transaction``."""
    try:
        with transaction() as tx, lenient_text(tx):
            row = tx.execute(f"SELECT rowid AS row_id, * FROM plans WHERE {where}", values).fetchone()  # where: a constant
            if row is None:
                return False
            meta = {k: row[k] for k in row.keys() if k not in ("blob", "row_id")}  # noqa: SIM118 - iterating a Row gives values
            tx.execute(
                "INSERT INTO quarantine (key, reason, quarantined_at, row_json, blob) VALUES (?, ?, ?, ?, ?)",
                (row["key"], reason, time.time(), json.dumps(meta), row["blob"]),
            )
            tx.execute("DELETE FROM plans WHERE rowid = ?", (row["row_id"],))
            tx.execute(
                "INSERT INTO counters (name, value) VALUES ('quarantined', 1) ON CONFLICT(name) DO UPDATE SET value = value + 1"
            )
            return True
    except sqlite3.Error as exc:
        raise StoreError(f"cannot quarantine {str(values[0])[:12]} in {path}: {exc}", path=str(path)) from exc
