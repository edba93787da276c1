"""Recovery of a damaged plan store: which SQLite errors mean damage, a marker left by a
process that met damage, and the repair that moves the file aside (kept, never deleted) and
copies every intact entry into a new one.

Only real damage (SQLITE_CORRUPT, SQLITE_NOTADB) moves a file aside. A full disk, an I/O
error, a read-only file or a busy lock say nothing about the file's contents: moving a
healthy store aside for them would lose every entry.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import StoreBusyError, StoreError
from .connections import connect
from .entry import INSERT_SQL, Entry, problem
from .files import Modes, create_file, file_lock, harden, open_regular

__all__ = ["Recovery", "is_damage", "is_locked", "is_undecodable", "lenient_text", "reads"]

T = TypeVar("T")

log = logging.getLogger("plancache")

DB_NAME = "plans.db"
REPAIR_LOCK_TIMEOUT_S = 30.0


def is_locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def is_damage(exc: BaseException) -> bool:
    """An error that says the file itself is damaged (not busy, full or read-only)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    name = getattr(exc, "sqlite_errorname", "")  # Python >= 3.11
    return name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or "malformed" in str(exc) or "not a database" in str(exc)


def is_undecodable(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "Could not decode" in str(exc)


@contextlib.contextmanager
def lenient_text(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Text columns decoded with replacement characters, so a damaged row can still be
    quarantined or reported instead of raising on every read."""
    old = conn.text_factory
    conn.text_factory = lambda b: b.decode("utf-8", "replace")
    try:
        yield conn
    finally:
        conn.text_factory = old


def reads(method: Callable[..., T]) -> Callable[..., T]:
    """A read of the store (a method of ``Store`` or one of its base classes): SQLite's own
    errors become ``StoreError`` naming the file, so callers catch one plancache error (and
    the builtin ``OSError`` it subclasses)."""

    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read plan store {self.path}: {exc}", path=str(self.path)) from exc

    return read


def _readable_entries(src: sqlite3.Connection) -> list[Entry]:
    """Every entry of a damaged file that still reads back whole. Rows are fetched one
    rowid at a time, so a bad page costs only the rows on it; the rowids come from a scan
    (until the first bad page) and from ``max(rowid)`` when that still reads."""
    src.execute("PRAGMA writable_schema = ON")  # reads a file shorter than its header says; mode=ro writes nothing
    rowids: set[int] = set()
    with contextlib.suppress(sqlite3.Error):
        for row in src.execute("SELECT rowid FROM plans"):
            rowids.add(int(row[0]))
    with contextlib.suppress(sqlite3.Error, TypeError):
        top = int(src.execute("SELECT max(rowid) FROM plans").fetchone()[0])
        rowids.update(range(max(1, top - 200_000), top + 1))  # bounded: rowids grow with every replace
    found = []
    for rowid in sorted(rowids):
        try:
            row = src.execute("SELECT * FROM plans WHERE rowid = ?", (rowid,)).fetchone()
            if row is not None:
                found.append(Entry.from_row(row))
        except (sqlite3.Error, ValueError, KeyError, TypeError):
            continue
    return found


def _drop_empty_sides(aside: Path) -> None:
    """Remove what opening the moved-aside file leaves beside it: its -shm (an index that
    SQLite rebuilds from the -wal whenever the file is opened) and an empty -wal. A -wal
    that holds transactions is part of the copy and stays. Nothing has the copy open."""
    with contextlib.suppress(OSError):
        Path(f"{aside}-shm").unlink()
    wal = Path(f"{aside}-wal")
    with contextlib.suppress(OSError):
        if wal.lstat().st_size == 0:
            wal.unlink()


class Recovery:
    """What a ``Store`` does about damage (a base class: the store's own methods open,
    migrate and close the file)."""

    path: Path
    read_only: bool
    modes: Modes

    if TYPE_CHECKING:  # provided by Store; declared for type checkers only (no stub may
        # shadow the real method in Store's method resolution order).
        def connection(self) -> sqlite3.Connection: ...
        def _close_connection(self) -> None: ...
        def _migrate(self) -> None: ...
        def transaction(self) -> Any: ...

    def _damage_at_open(self, *, whole: bool) -> str | None:
        """Damage that an earlier process left a marker for (``note_damage``), confirmed by
        ``PRAGMA quick_check``; None when healthy. quick_check reads every page (tens of ms
        per 1000 entries), so a cache runs it only after a marker; ``whole`` runs it anyway
        (a one-off command, which must see damage whatever pages it would read).

        A truncated file needs no check here: SQLite refuses a file shorter than its header
        says on the first read (``_migrate`` reads page 1). The header is never read with
        ``open()``: closing a second descriptor of the database file would drop this
        process's POSIX locks on it, and other processes could then corrupt it."""
        suspicion = self._marker_reason()
        if suspicion is None and not whole:
            return None
        problem = self._quick_check()
        if problem is None:
            self._clear_marker()  # a stale marker (if any): the file reads back whole
            return None
        return f"{suspicion}; {problem}" if suspicion else problem

    def _quick_check(self, *, full: bool = False) -> str | None:
        """The first problems ``PRAGMA quick_check`` (``integrity_check`` when ``full``)
        reports, or None when it says ok."""
        pragma = "integrity_check" if full else "quick_check"
        try:
            conn = self.connection()
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            rows = [r[0] for r in conn.execute(f"PRAGMA {pragma}(8)")]
        except sqlite3.DatabaseError as exc:
            if is_locked(exc):
                raise
            return f"{pragma} failed: {exc}"
        return None if rows == ["ok"] else "; ".join(rows[:3])

    @property
    def _marker(self) -> Path:
        return self.path.with_name(DB_NAME + ".damaged")

    def _marker_reason(self) -> str | None:
        try:
            fd, _ = open_regular(self._marker, os.O_RDONLY)
        except OSError:
            return None
        try:
            text = os.read(fd, 4096).decode("utf-8", "replace").strip()  # bounded: the reason is one line
        except OSError:
            return None
        finally:
            os.close(fd)
        return f"a process saw damage: {text[:200]}"

    def _clear_marker(self) -> None:
        with contextlib.suppress(OSError):
            self._marker.unlink()

    def note_damage(self, exc: BaseException) -> None:
        """Leave a marker after a read or write that found a damaged file, so the next open
        (or ``verify --fix``) checks it and moves it aside; this process keeps running on
        misses rather than replacing a file other processes have open."""
        if self.read_only or not is_damage(exc):
            return
        with contextlib.suppress(OSError):
            create_file(self._marker, self.modes)
            fd, _ = open_regular(self._marker, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {exc}\n".encode())
            finally:
                os.close(fd)

    def repair(self, reason: str, *, thorough: bool = False) -> dict[str, Any]:
        """Move a damaged database file aside (kept, never deleted), start a new one and
        copy into it every entry of the old file that still reads back intact.

        Serialized by a file lock and re-checked under it: of several processes that find
        the same damage, one moves the file and the others find the new store healthy.
        ``thorough`` re-checks with ``integrity_check`` instead of ``quick_check``.
        Returns ``{"moved_aside": path or None, "salvaged": n}``."""
        from filelock import Timeout  # only on damage

        lock = file_lock(self.path.with_name(DB_NAME + ".repair.lock"), self.modes)
        try:
            lock.acquire(timeout=REPAIR_LOCK_TIMEOUT_S)
        except Timeout as exc:
            raise StoreBusyError(
                f"another process kept repairing {self.path} for {REPAIR_LOCK_TIMEOUT_S:.0f} s", path=str(self.path)
            ) from exc
        try:
            self._close_connection()
            still = self._quick_check(full=thorough)
            if still is None:  # healthy after all, or another process replaced it meanwhile
                self._clear_marker()
                return {"moved_aside": None, "salvaged": 0}
            aside = self._move_aside(f"{reason}; {still}" if still and still not in reason else reason)
            self._clear_marker()
            self._migrate()
            salvaged = self._salvage(aside)
            _drop_empty_sides(aside)
        finally:
            lock.release()
        if salvaged:
            log.warning("plancache: copied %d intact entries from %s into the new store", salvaged, aside)
        return {"moved_aside": str(aside), "salvaged": salvaged}

    def _move_aside(self, reason: str) -> Path:
        self._close_connection()
        aside = self.path.with_name(f"{DB_NAME}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        log.warning("plancache: %s is unreadable (%s); moved it to %s and started a new store", self.path, reason, aside)
        os.replace(self.path, aside)
        for suffix in ("-wal", "-shm"):
            side = Path(str(self.path) + suffix)
            if side.exists():
                os.replace(side, Path(str(aside) + suffix))
        return aside

    def _salvage(self, aside: Path) -> int:
        """Copy the entries of a moved-aside file that read back whole, match their
        checksum and their key into this (new) store; 0 when nothing can be read."""
        try:
            src = connect(f"file:{urllib.parse.quote(str(aside))}?mode=ro", uri=True, isolation_level=None)
        except sqlite3.Error:
            return 0
        src.row_factory = sqlite3.Row
        try:
            harden(src)
            entries = [e for e in _readable_entries(src) if problem(e) is None]
        finally:
            src.close()
        for start in range(0, len(entries), 64):  # small transactions
            with self.transaction() as tx:
                tx.executemany(INSERT_SQL, [e.row() for e in entries[start : start + 64]])
        return len(entries)
