"""Quarantine: entries taken out of service and kept, row and blob, for inspection.

A lookup that judges an entry unsound quarantines that row only (matched by its recorded
checksum and creation time), inside the key's single flight; ``maintenance.verify`` with
``fix`` quarantines what it finds, by rowid where the key itself is damaged, and
``maintenance.prune(quarantined=True)`` empties the quarantine. Each move is one short
write transaction, counted as ``quarantined``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from .recovery import lenient_text, reads

__all__ = ["Quarantine"]


class Quarantine:
    """How a ``Store`` takes entries out of service (a base class: the store's own methods
    provide the connection and the write transactions)."""

    path: Path

    if TYPE_CHECKING:  # provided by Store; declared for type checkers only (no stub may
        # shadow the real method in Store's method resolution order).
        def connection(self) -> sqlite3.Connection: ...
        def transaction(self) -> Any: ...

    def quarantine(self, key: str, reason: str, *, identity: tuple[str, float] | None = None) -> bool:
        """Move an entry out of service, keeping it (and its blob) for inspection.

        ``identity``: ``(blob_sha256, created_at)`` of the row that was judged; only that
        row is quarantined, so one that another process has since replaced (rebuilt
        healthy) stays in service."""
        if identity is None:
            return self._quarantine_where("key = ?", (key,), reason)
        return self._quarantine_where("key = ? AND blob_sha256 = ? AND created_at = ?", (key, *identity), reason)

    def quarantine_rowid(self, rowid: int, reason: str) -> bool:
        """``quarantine`` for a row whose key itself may be damaged (found by ``verify``)."""
        return self._quarantine_where("rowid = ?", (rowid,), reason)

    def _quarantine_where(self, where: str, values: tuple[Any, ...], reason: str) -> bool:
        try:
            with self.transaction() as tx, lenient_text(tx):
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
                    "INSERT INTO counters (name, value) VALUES ('quarantined', 1) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + 1"
                )
                return True
        except sqlite3.Error as exc:
            raise StoreError(f"cannot quarantine {str(values[0])[:12]} in {self.path}: {exc}", path=str(self.path)) from exc

    @reads
    def quarantined(self) -> list[dict[str, Any]]:
        rows = self.connection().execute(
            "SELECT id, key, reason, quarantined_at, length(blob) AS blob_size FROM quarantine ORDER BY id"
        )
        return [dict(r) for r in rows]
