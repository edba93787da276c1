"""Recovery of a damaged plan store: which SQLite errors mean damage, a marker left by a
process that met damage, and the repair that moves the file aside (kept) and copies every
intact entry into a new one. Only real damage (SQLITE_CORRUPT, SQLITE_NOTADB) moves a file:
a full disk, an I/O error, a read-only file or a busy lock say nothing of its contents, and
moving a healthy store aside would lose every entry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypedDict

from ..errors import StoreBusyError
from .connections import Transaction, connect
from .entry import INSERT_SQL, Entry, problem
from .files import Modes, create_file, file_lock, harden, open_regular

__all__ = ["Repaired", "clear_marker", "damage_at_open", "is_damage", "is_locked", "is_undecodable", "lenient_text",
           "marker_reason", "note_damage", "quick_check", "repair_lock", "start_over"]  # fmt: skip

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
def lenient_text(conn: sqlite3.Connection, factory: Callable[[bytes], object] = lambda b: b.decode("utf-8", "replace")
                 ) -> Iterator[sqlite3.Connection]:  # fmt: skip
    """Text columns decoded with replacement characters (or by ``factory``): a damaged row can
    be quarantined or reported instead of failing every read."""
    old = conn.text_factory
    conn.text_factory = factory
    try:
        yield conn
    finally:
        conn.text_factory = old


def _readable_entries(src: sqlite3.Connection) -> list[Entry]:
    """Every entry of a damaged file that still reads back whole, one rowid at a time (a bad
    page costs only its rows); the rowids come from a scan (up to the first bad page) and
    from ``max(rowid)`` when that still reads."""
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
    """Remove what opening the moved-aside file (which nothing has open) left beside it: its
    -shm (SQLite rebuilds it from the -wal) and an empty -wal; a -wal holding transactions stays."""
    with contextlib.suppress(OSError):
        Path(f"{aside}-shm").unlink()
    wal = Path(f"{aside}-wal")
    with contextlib.suppress(OSError):
        if wal.lstat().st_size == 0:
            wal.unlink()


def _marker(path: Path) -> Path:
    return path.with_name(DB_NAME + ".damaged")


def marker_reason(path: Path) -> str | None:
    """Why a process left a damage marker beside the database ``path`` (``note_damage``), or None."""
    try:
        fd, _ = open_regular(_marker(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace").strip()  # bounded: the reason is one line
    except OSError:
        return None
    finally:
        os.close(fd)
    return f"a process saw damage: {text[:200]}"


def clear_marker(path: Path) -> None:
    with contextlib.suppress(OSError):
        _marker(path).unlink()


def note_damage(path: Path, modes: Modes, exc: BaseException) -> None:
    """Leave a marker beside the database ``path`` after a read or write found it damaged, for the next open (or
    ``verify --fix``) to check and move it aside: a process runs on misses, never replacing a file others have open."""
    if not is_damage(exc):
        return
    with contextlib.suppress(OSError):
        create_file(_marker(path), modes)
        fd, _ = open_regular(_marker(path), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {exc}\n".encode())
        finally:
            os.close(fd)


def quick_check(connection: Callable[[], sqlite3.Connection], *, full: bool = False) -> str | None:
    """The first problems ``PRAGMA quick_check`` (``integrity_check`` when ``full``) reports
    on the database ``connection`` opens, or None."""
    pragma = "integrity_check" if full else "quick_check"
    try:
        conn = connection()
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        rows = [r[0] for r in conn.execute(f"PRAGMA {pragma}(8)")]
    except sqlite3.DatabaseError as exc:
        if is_locked(exc):
            raise
        return f"{pragma} failed: {exc}"
    return None if rows == ["ok"] else "; ".join(rows[:3])


def damage_at_open(connection: Callable[[], sqlite3.Connection], path: Path, *, whole: bool) -> str | None:
    """Damage an earlier process left a marker for (``note_damage``), confirmed by ``PRAGMA
    quick_check``; None when healthy. quick_check reads every page (tens of ms per 1000
    entries), so a cache runs it only after a marker; ``whole`` runs it anyway (a one-off
    command must see damage whatever pages it reads). A truncated file needs no check:
    SQLite refuses it on the first read (``schema.migrate`` reads page 1). The header is
    never read with ``open()``: closing a second descriptor of the database file would drop
    this process's POSIX locks on it, and other processes could then corrupt it."""
    suspicion = marker_reason(path)
    if suspicion is None and not whole:
        return None
    problem = quick_check(connection)
    if problem is None:
        clear_marker(path)  # a stale marker (if any): the file reads back whole
        return None
    return f"{suspicion}; {problem}" if suspicion else problem


class Repaired(TypedDict):
    """What ``Store.repair`` did: where the file went (None: healthy after all), how many entries it copied."""

    moved_aside: str | None
    salvaged: int


@contextlib.contextmanager
def repair_lock(path: Path, modes: Modes) -> Iterator[None]:
    """Held while the database ``path`` is repaired: of the processes that find its damage, one repairs it."""
    from filelock import Timeout  # only on damage

    lock = file_lock(path.with_name(DB_NAME + ".repair.lock"), modes)
    try:
        lock.acquire(timeout=REPAIR_LOCK_TIMEOUT_S)
    except Timeout as exc:
        raise StoreBusyError(f"another process kept repairing {path} for {REPAIR_LOCK_TIMEOUT_S:.0f} s", path=str(path)) from exc
    try:
        yield
    finally:
        lock.release()


def start_over(path: Path, reason: str, *, migrate: Callable[[], None], transaction: Transaction) -> tuple[Path, int]:
    """Move the damaged database ``path`` aside (kept; this process must hold it closed), start a new
    one (``migrate``) and copy its intact entries in (``transaction``): the moved file, and how many."""
    aside = path.with_name(f"{DB_NAME}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    log.warning("plancache: %s is unreadable (%s); moved it to %s and started a new store", path, reason, aside)
    os.replace(path, aside)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    clear_marker(path)
    migrate()
    salvaged = _salvage(aside, transaction)
    _drop_empty_sides(aside)
    return aside, salvaged


def _salvage(aside: Path, transaction: Transaction) -> int:
    """Copy the entries of a moved-aside file that read back whole and ``problem`` passes
    into the new store (``transaction``'s); how many (0 when nothing can be read)."""
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
        with transaction() as tx:
            tx.executemany(INSERT_SQL, [e.row() for e in entries[start : start + 64]])
    return len(entries)
