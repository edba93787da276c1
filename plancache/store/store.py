"""The SQLite plan store: open, migrate, get, put, evict; nothing of GPUs. A row holds an
``entry.Entry``. ``Store`` keeps the connections and transactions; ``schema`` opens the
file, ``recovery`` handles damage, ``quarantine`` takes entries out of service, and
``maintenance`` runs ``verify`` and ``prune``.

Habits: WAL set once at creation; on every connection a busy timeout and
``synchronous=NORMAL``; one connection per thread, reopened after ``fork`` (``connections``
keeps them safe across it); writes in short ``BEGIN IMMEDIATE`` transactions; a lookup
never writes (the caller batches hit counts for ``bookkeeping.record_hits``). Every blob
carries a SHA-256 checked by ``Entry.checksum_ok`` before it reaches cuDNN.

Never put the store on a network filesystem (NFS, Lustre): SQLite's locking is not
reliable there. Use the Redis tier to share plans between machines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Concatenate, ParamSpec, TypedDict, TypeVar

from ..config import ALLOW_SHARED_DIR, CACHE_DIR
from ..errors import CacheDirError, DamagedEntryError, EntryNotFoundError, StoreBusyError, StoreError
from ..key import JSON
from . import quarantine, recovery, schema
from .connections import GATE, GatedConnection, connect
from .entry import INSERT_COLUMNS, INSERT_SQL, Entry, sha256, sound_use
from .files import check_trusted, create_file, harden
from .per_process import PerProcess
from .recovery import DB_NAME, Repaired, is_damage, is_locked, is_undecodable, lenient_text
from .schema import BUSY_TIMEOUT_MS, default_cache_dir

__all__ = ["MIN_KEY_PREFIX", "Stats", "Store"]

#: The fewest characters of a key that name it (``rm``, ``show``, ``export --key``).
MIN_KEY_PREFIX = 4
_READ_ALL = "SELECT * FROM plans WHERE key = ?"
#: A store hit's read: every column but the candidates' and the timing records, which a
#: hit never reads (text SQLite would otherwise turn into Python strings at every hit).
_HIT_COLUMNS = ", ".join([*(c for c in INSERT_COLUMNS if c not in ("candidates_json", "timing_json")), "judgement"])
_READ_HIT = f"SELECT {_HIT_COLUMNS} FROM plans WHERE key = ?"

log = logging.getLogger("plancache")

P = ParamSpec("P")
T = TypeVar("T")


def reads(method: Callable[Concatenate[Store, P], T]) -> Callable[Concatenate[Store, P], T]:
    """A read of the store: SQLite's errors become ``StoreError`` naming the file (one
    plancache error to catch, an ``OSError``)."""

    @functools.wraps(method)
    def read(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read plan store {self.path}: {exc}", path=str(self.path)) from exc

    return read


def _file_id(path: os.PathLike[str]) -> tuple[int, int] | None:
    """Which file ``path`` is now (device and inode); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _evict(tx: sqlite3.Connection, max_bytes: int, keep: str | None) -> int:
    """Inside a write transaction: delete least-recently-used plans (never ``keep``) until the
    total is at most ``max_bytes``, read inside it: two processes evicting at once each see
    the other's deletions."""
    total = int(tx.execute("SELECT value FROM totals WHERE name = 'plan_bytes'").fetchone()[0])
    excess = total - max_bytes
    if excess <= 0:
        return 0
    doomed = []
    # The blob's own length, never the stored blob_size: a number the database can compute is not trusted.
    for key, size in tx.execute("SELECT key, length(blob) FROM plans ORDER BY last_used_at ASC, key").fetchall():
        if excess <= 0:
            break
        if key == keep:
            continue
        doomed.append((key,))
        excess -= int(size)
    tx.executemany("DELETE FROM plans WHERE key = ?", doomed)
    return len(doomed)


class Stats(TypedDict):
    """``Store.stats()``: the store's totals (``plancache stats``)."""

    path: str
    read_only: bool
    file_bytes: int
    entries: int
    blob_bytes: int
    hits: int
    environments: int
    build_seconds: float
    by_policy: dict[str, int]
    quarantined: int
    unstored: list[dict[str, object]]  # key, label, why, reason, times, last_at: the plans built and not stored
    counters: dict[str, int]


class Store:
    """The SQLite database of one cache directory.

    ``Store(directory)`` creates the directory (mode 0700) and database (0600; 0660 in a
    directory shared with the ``allow_shared_dir`` group) if needed, applies pending
    migrations and moves an unreadable database file aside. A directory that cannot be
    written opens read-only: lookups work, writes raise ``StoreError``.
    A directory or file another user owns or can write, a link in place of a file, or a
    schema other than the migrations' is refused (``CacheDirError``) before anything is read;
    ``allow_shared_dir`` (``PLANCACHE_ALLOW_SHARED_DIR``) names the group whose members may
    share the directory. ``repair=False`` is for tools that report damage rather than mend it
    (the ``plancache`` command): the whole file is checked at open (``PRAGMA quick_check``) and
    damage is left, named by ``damage``; such a store may fail any read until ``repair``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        read_only: bool | None = None,
        allow_shared_dir: str | None = None,
        repair: bool = True,
    ) -> None:
        self.directory = CACHE_DIR.of(directory, "directory") or default_cache_dir()
        self.path = self.directory / DB_NAME
        group = ALLOW_SHARED_DIR.given_or_env(allow_shared_dir, "allow_shared_dir")
        self._local = PerProcess(threading.local)  # a forked child opens connections of its own
        self._closed = False
        #: What is wrong with the file, found at open and left there (``repair=False``); None when sound.
        self.damage: str | None = None
        self.modes, self._directory_writable, self._file_writable, self.read_only = schema.prepare_directory(
            self.directory, read_only, group
        )
        try:
            self._open_and_migrate(repair)
        except BaseException:
            self.close()  # a refused database (newer schema, locked) must not stay open
            raise

    # ------------------------------------------------------------------ opening

    def _open_and_migrate(self, repair: bool) -> None:
        """Open the file and migrate; damage found is repaired, or (not ``repair``) kept in ``damage``."""
        try:
            schema.migrate_when_free(self._migrate)
            damage = recovery.damage_at_open(self.connection, self.path, whole=not repair)
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc) or (self.read_only and repair):
                # Busy, full, I/O error: no sign of damage, and moving a healthy store aside
                # would lose every entry. A read-only one cannot be moved.
                raise StoreError(f"cannot open plan store {self.path}: {exc}", path=str(self.path)) from exc
            damage = str(exc)
        if damage is None:
            return
        if not repair:
            self.damage = damage
            return
        if self.read_only:  # cannot move it aside: damaged pages stay misses
            log.warning("plancache: read-only store %s is damaged (%s); unreadable entries are misses", self.path, damage)
            return
        self.repair(damage)

    def _migrate(self) -> None:
        schema.migrate(self.connection(), self.transaction, self.path, self.read_only)

    def connection(self) -> GatedConnection:
        """This thread's connection, opened on first use, after a fork, and when the file was
        replaced (another process's repair moved it aside: plans stored in the old file would
        be where no other process looks)."""
        local = self._local.get()
        conn: GatedConnection | None = getattr(local, "conn", None)
        if conn is not None:
            if _file_id(self.path) in (local.file_id, None):  # None: mid-repair, no file yet
                return conn
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            local.conn = None
        if self._closed:
            raise StoreError(f"plan store {self.path} is closed", path=str(self.path))
        if GATE.refusal is not None:
            raise StoreError(f"plan store {self.path} cannot be used: {GATE.refusal}", path=str(self.path))
        # SQLite follows a link to the database (the sqlite3 module cannot pass
        # SQLITE_OPEN_NOFOLLOW, and no URI parameter sets it), so the file is checked before and
        # after the open: a link, a file not the user's, or another file than the one checked is
        # refused (only someone who can write the directory could swap it, and the open refuses
        # such a directory).
        writing = not (self.read_only and not self._file_writable)
        if writing:
            create_file(self.path, self.modes)  # SQLite gives its -wal and -shm the same mode
        before = check_trusted(self.path, self.modes.group)
        if not writing:
            # mode=ro still reads the -wal, so it sees what live writers committed (a fresh
            # store keeps even its schema there until a checkpoint). Only a directory we cannot
            # write (a baked cache: no -shm can be made) needs immutable=1, which ignores the
            # -wal. Quoted: '?' or '#' would end the path in a URI.
            uri = f"file:{urllib.parse.quote(str(self.path))}?mode=ro"
            if not self._directory_writable:
                uri += "&immutable=1"
            conn = connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            conn = connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            after = check_trusted(self.path, self.modes.group)
            if before is not None and after is not None and (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
                raise CacheDirError(
                    f"plancache does not trust {self.path}: it was replaced while being opened", path=str(self.path)
                )
        except CacheDirError:
            conn.close()
            raise
        harden(conn)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        # Only with recursive triggers does INSERT OR REPLACE's delete of the row it replaces run
        # the trigger that keeps the size total (migration 0003) exact.
        conn.execute("PRAGMA recursive_triggers = ON")
        if self.read_only:
            # Read-only by choice, on a file this user could write: SQLite refuses every write,
            # and, unlike a mode=ro connection, the last one to close removes the -wal and -shm
            # it created (a command that writes nothing leaves nothing beside plans.db).
            conn.execute("PRAGMA query_only = ON")
        else:
            conn.execute("PRAGMA synchronous = NORMAL")
        local.conn = conn
        local.file_id = _file_id(self.path)
        return conn

    def close(self) -> None:
        """Close this thread's connection; later calls raise ``StoreError``. Other threads'
        connections close when their threads end."""
        self._close_connection()
        self._closed = True

    def _close_connection(self) -> None:
        conn = getattr(self._local.get(), "conn", None)
        if conn is not None:  # this process's: a forked child's copies are closed by the gate
            conn.close()
        self._local = PerProcess(threading.local)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction, taken with BEGIN IMMEDIATE so it never deadlocks."""
        if self.read_only:
            raise StoreError(f"plan store {self.path} is read-only", path=str(self.path))
        conn = self.connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if is_locked(exc):
                raise StoreBusyError(
                    f"plan store {self.path} stayed locked for {BUSY_TIMEOUT_MS} ms", path=str(self.path)
                ) from exc
            raise StoreError(f"cannot write plan store {self.path}: {exc}", path=str(self.path)) from exc
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            self.note_damage(exc)
            raise StoreError(f"cannot commit to plan store {self.path}: {exc}", path=str(self.path)) from exc

    def _write(self, sql: str, params: tuple[object, ...] = ()) -> int:
        try:
            with self.transaction() as tx:
                return tx.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write plan store {self.path}: {exc}", path=str(self.path)) from exc

    # ------------------------------------------------------------------ damage

    def note_damage(self, exc: BaseException) -> None:
        """After a read or write found the file damaged: a marker for the next open (``recovery.note_damage``)."""
        if not self.read_only:
            recovery.note_damage(self.path, self.modes, exc)

    def repair(self, reason: str, *, thorough: bool = False) -> Repaired:
        """Move a damaged database file aside (kept, never deleted), start a new one and copy
        into it every entry of the old file that still reads back intact.

        Serialized by a file lock and re-checked under it: of several processes that find the
        same damage, one moves the file. ``thorough``: ``integrity_check``, not ``quick_check``."""
        with recovery.repair_lock(self.path, self.modes):
            self._close_connection()
            still = recovery.quick_check(self.connection, full=thorough)
            if still is None:  # healthy after all, or another process replaced it meanwhile
                recovery.clear_marker(self.path)
                return {"moved_aside": None, "salvaged": 0}
            self._close_connection()
            why = f"{reason}; {still}" if still and still not in reason else reason
            aside, salvaged = recovery.start_over(self.path, why, migrate=self._migrate, transaction=self.transaction)
        if salvaged:
            log.warning("plancache: copied %d intact entries from %s into the new store", salvaged, aside)
        return {"moved_aside": str(aside), "salvaged": salvaged}

    def quarantine(self, key: str, reason: str, *, identity: tuple[str, float] | None = None) -> bool:
        """Move an entry out of service, keeping it (and its blob) for inspection.

        ``identity``: ``(blob_sha256, created_at)`` of the row that was judged; only that row
        is quarantined, so one another process has since replaced (rebuilt) stays in service."""
        where = "key = ?" if identity is None else "key = ? AND blob_sha256 = ? AND created_at = ?"
        return quarantine.move(self.transaction, self.path, where, (key, *(identity or ())), reason)

    def quarantine_rowid(self, rowid: int, reason: str) -> bool:
        """``quarantine`` for a row whose key itself may be damaged (found by ``verify``)."""
        return quarantine.move(self.transaction, self.path, "rowid = ?", (rowid,), reason)

    @reads
    def quarantined(self) -> list[dict[str, object]]:
        sql = "SELECT id, key, reason, quarantined_at, length(blob) AS blob_size FROM quarantine ORDER BY id"
        return [dict(r) for r in self.connection().execute(sql)]

    # ------------------------------------------------------------------ plans

    def get(self, key: str, known: Mapping[str, tuple[str, JSON]] | None = None, details: bool = True) -> Entry | None:
        """The entry stored under ``key``, or None; checks no checksum. A read that finds the file
        damaged leaves a marker for the next open, then raises. ``known``, ``details``: ``Entry.from_row``."""
        try:
            row = self.connection().one(_READ_ALL if details else _READ_HIT, (key,))
            return Entry.from_row(row, known, details) if row is not None else None
        except (ValueError, KeyError, TypeError, sqlite3.DatabaseError) as exc:
            # A field of the wrong type, range or depth (Entry.from_row), or one row's text damaged: not the file.
            if isinstance(exc, sqlite3.DatabaseError) and not is_undecodable(exc):
                self.note_damage(exc)
                raise StoreError(f"cannot read plan store {self.path}: {exc}", path=str(self.path)) from exc
            raise DamagedEntryError(
                f"entry {key[:12]} in {self.path} cannot be decoded: {str(exc)[:200]}", path=str(self.path), key=key
            ) from exc

    def put(self, entry: Entry, *, max_bytes: int | None = None) -> int:
        """Insert or replace an entry (sealed first: given a metadata checksum if it has none) in
        one short transaction, evicting least-recently-used others in it until the plans total
        at most ``max_bytes``, if given; returns how many were evicted. A plan that replaces
        another under its key (``tune``, a rebuild) keeps the key's hit count and last use:
        they tell which plans are hot, whatever plan serves."""
        if entry.meta_sha256 is None:
            entry.meta_sha256 = entry.meta_digest()
        row = entry.row()
        try:
            with self.transaction() as tx:
                used = tx.execute("SELECT hit_count, last_used_at FROM plans WHERE key = ?", (entry.key,)).fetchone()
                if used is not None and sound_use(used[0], used[1]):  # a damaged record of use is not carried over
                    row["hit_count"], row["last_used_at"] = used[0], used[1]
                tx.execute(INSERT_SQL, row)
                tx.execute("DELETE FROM unstored WHERE key = ?", (entry.key,))  # stored now: no longer one that cannot be
                return _evict(tx, max_bytes, keep=entry.key) if max_bytes is not None else 0
        except sqlite3.Error as exc:
            self.note_damage(exc)
            raise StoreError(f"cannot store plan {entry.key[:12]} in {self.path}: {exc}", path=str(self.path)) from exc

    def delete(self, key: str) -> bool:
        return self._write("DELETE FROM plans WHERE key = ?", (key,)) > 0

    def note_unstored(self, key: str, label: str, why: str, reason: str) -> None:
        """Record, for ``plancache stats``, that a process built the plan of ``key`` and did not
        store it (``why``: a ``cache.unstored.Why`` value)."""
        now = time.time()
        self._write(
            "INSERT INTO unstored (key, label, why, reason, times, first_at, last_at) VALUES (?, ?, ?, ?, 1, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET why = excluded.why, reason = excluded.reason, times = times + 1, "
            "last_at = excluded.last_at",
            (key, label, why, reason[:500], now, now),
        )

    @reads
    def key_named(self, prefix: str) -> str:
        """The one stored key that ``prefix`` (at least ``MIN_KEY_PREFIX`` hex digits, as git
        asks: ``rm 0`` must not remove whatever starts with 0) begins; else ``EntryNotFoundError``."""
        if len(prefix) < MIN_KEY_PREFIX:
            raise EntryNotFoundError(f"key prefix {prefix!r} is too short: give at least {MIN_KEY_PREFIX} characters of "
                                     "the key", key=prefix)  # fmt: skip
        low = prefix.lower()
        sql = "SELECT key FROM plans WHERE key >= ? AND key < ? ORDER BY key LIMIT 2"  # two tell ambiguity
        hexadecimal = all(c in "0123456789abcdef" for c in low)
        found: list[str] = [r[0] for r in self.connection().execute(sql, (low, low + "g"))] if hexadecimal else []
        if not found:
            raise EntryNotFoundError(f"no entry with key {prefix!r} in {self.path}", key=prefix)
        if len(found) > 1:
            raise EntryNotFoundError(f"key prefix {prefix!r} is ambiguous in {self.path}; give more characters", key=prefix)
        return found[0]

    @reads
    def keys(self) -> list[str]:
        return [r[0] for r in self.connection().execute("SELECT key FROM plans ORDER BY key")]

    @reads
    def counters(self) -> dict[str, int]:
        return {r[0]: r[1] for r in self.connection().execute("SELECT name, value FROM counters")}

    # ------------------------------------------------------------------ kernel caches

    @reads
    def get_kernel_cache(self, env_id: str) -> tuple[bytes, int | None] | None:
        sql = "SELECT blob, blob_sha256, revision FROM kernel_caches WHERE env_id = ?"
        row = self.connection().execute(sql, (env_id,)).fetchone()
        if row is None or sha256(bytes(row["blob"])) != row["blob_sha256"]:
            return None
        return bytes(row["blob"]), row["revision"]

    def put_kernel_cache(self, env_id: str, blob: bytes, revision: int | None) -> None:
        self._write(
            "INSERT OR REPLACE INTO kernel_caches (env_id, blob, blob_sha256, revision, updated_at) VALUES (?, ?, ?, ?, ?)",
            (env_id, blob, sha256(blob), revision, time.time()),
        )

    # ------------------------------------------------------------------ size, age, health

    @reads
    def total_size(self) -> int:
        """Bytes of plan blobs stored, as the database tracks them (one row, no scan)."""
        row = self.connection().execute("SELECT value FROM totals WHERE name = 'plan_bytes'").fetchone()
        return int(row[0]) if row is not None else 0

    def evict_to(self, max_bytes: int) -> int:
        """Delete least-recently-used entries, in one transaction, until the blobs total at most
        ``max_bytes``; returns how many."""
        try:
            with self.transaction() as tx:
                return _evict(tx, max_bytes, keep=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot evict from plan store {self.path}: {exc}", path=str(self.path)) from exc

    @reads
    def stats(self) -> Stats:
        conn = self.connection()
        entries, blob_bytes, hits, environments, build_seconds = conn.execute(
            "SELECT count(*), coalesce(sum(length(blob)), 0), coalesce(sum(hit_count), 0), count(DISTINCT env_id), "
            "coalesce(sum(build_seconds), 0) FROM plans"
        ).fetchone()
        quarantined = conn.execute("SELECT count(*) FROM quarantine").fetchone()[0]
        with lenient_text(conn):  # a row whose policy cannot be decoded fails only itself (`plancache stats` names it)
            by_policy: dict[str, int] = {}
            for policy, count in conn.execute("SELECT policy, count(*) FROM plans GROUP BY policy"):
                policy = policy if "\ufffd" not in str(policy) else "(undecodable)"
                by_policy[policy] = by_policy.get(policy, 0) + count
            sql = "SELECT key, label, why, reason, times, last_at FROM unstored ORDER BY last_at DESC"
            unstored: list[dict[str, object]] = [dict(r) for r in conn.execute(sql)]
        return {"path": str(self.path), "read_only": self.read_only, "file_bytes": self.path.stat().st_size if self.path.exists() else 0,
                "entries": entries, "blob_bytes": blob_bytes, "hits": hits, "environments": environments, "build_seconds": build_seconds,
                "by_policy": by_policy, "quarantined": quarantined, "unstored": unstored, "counters": self.counters()}  # fmt: skip
