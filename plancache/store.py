"""The SQLite plan store: open, migrate, get, put, evict. Knows nothing of GPUs. What a row
holds is ``entry.Entry``; ``Store.verify`` and ``Store.prune`` run in ``maintenance``.

Habits: WAL set once at creation; on every connection a busy timeout and
``synchronous=NORMAL``; one connection per thread, reopened after ``fork``; writes in short
``BEGIN IMMEDIATE`` transactions; a lookup never writes (hit counts are batched by the
caller and flushed with ``record_hits``). Every blob carries a SHA-256 checked by
``Entry.checksum_ok`` before it reaches cuDNN.

Never put the store on a network filesystem (NFS, Lustre): SQLite's locking is not
reliable there. Use the Redis tier to share plans between machines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .entry import Entry, StoredPlan, _meta_digest, entry_problem, sha256
from .errors import CacheDirError, DamagedEntryError, SchemaTooNewError, StoreBusyError, StoreError

__all__ = ["DB_NAME", "Entry", "Store", "StoredPlan", "default_cache_dir", "entry_problem", "migrations", "sha256"]

log = logging.getLogger("plancache")

DB_NAME = "plans.db"
BUSY_TIMEOUT_MS = 30_000
_LIST_COLUMNS = (
    "key, env_id, label, blob_size, workspace_size, policy, backend, build_seconds, "
    "autotune_seconds, created_at, last_used_at, hit_count"
)


def default_cache_dir() -> Path:
    """``$PLANCACHE_DIR`` if set, else the platform's per-user cache directory."""
    env = os.environ.get("PLANCACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported here: only needed when no directory is given

    return Path(platformdirs.user_cache_dir("plancache", appauthor=False))


def migrations() -> list[tuple[int, str, str]]:
    """The numbered migrations as ``(number, file name, sql)``, in order."""
    from importlib import resources  # only when opening a store

    try:
        folder: Any = resources.files("plancache.migrations")
        files = [f for f in folder.iterdir() if f.name.endswith(".sql")]
    except ModuleNotFoundError:  # running from a source tree that is not installed
        folder = Path(__file__).resolve().parent.parent / "migrations"
        files = sorted(folder.glob("*.sql"))
    found = []
    for f in files:
        number = int(f.name.split("_", 1)[0])
        found.append((number, f.name, f.read_text()))
    found.sort()
    numbers = [n for n, _, _ in found]
    if numbers != list(range(1, len(found) + 1)):
        raise StoreError(f"migrations are not numbered 1..N: {numbers}", path=str(folder))
    return found


def _statements(script: str) -> Iterator[str]:
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                yield buffer.strip()
            buffer = ""
    if buffer.strip() and not all(ln.strip().startswith("--") for ln in buffer.strip().splitlines()):
        raise StoreError(f"incomplete SQL statement in migration: {buffer.strip()[:80]!r}", path=None)


_SELECT_PLAN = (
    "SELECT key, environment_json, tensors_json, blob, blob_sha256, engine_json, workspace_size, meta_sha256 "
    "FROM plans WHERE key = ?"
)


_INSERT_COLUMNS = (
    "key", "env_id", "label", "graph_json", "environment_json", "options_json", "tensors_json",
    "blob", "blob_sha256", "blob_size", "engine_json", "workspace_size", "policy",
    "candidates_json", "timing_json", "build_seconds", "autotune_seconds", "backend",
    "created_at", "last_used_at", "hit_count", "meta_sha256",
)  # fmt: skip
_INSERT_SQL = (
    f"INSERT OR REPLACE INTO plans ({', '.join(_INSERT_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _INSERT_COLUMNS)})"
)


def _is_locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def _is_damage(exc: BaseException) -> bool:
    """An error that says the file itself is damaged (not busy, full or read-only)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    name = getattr(exc, "sqlite_errorname", "")  # Python >= 3.11
    return name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or "malformed" in str(exc) or "not a database" in str(exc)


def _is_undecodable(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "Could not decode" in str(exc)


@contextlib.contextmanager
def _lenient_text(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Text columns decoded with replacement characters, so a damaged row can still be
    quarantined or reported instead of raising on every read."""
    old = conn.text_factory
    conn.text_factory = lambda b: b.decode("utf-8", "replace")
    try:
        yield conn
    finally:
        conn.text_factory = old


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


def _check_private(directory: Path, allow_shared: bool) -> None:
    """Refuse a cache directory that other users can write: its blobs carry native code."""
    mode = directory.stat().st_mode
    if allow_shared or not (mode & (stat.S_IWGRP | stat.S_IWOTH)):
        return
    raise CacheDirError(
        f"cache directory {directory} is writable by other users (mode {stat.filemode(mode)}); "
        "plans hold native code, so plancache refuses it. Use a private directory, or set "
        "PLANCACHE_ALLOW_SHARED_DIR=1 if everyone who can write there is trusted",
        path=str(directory),
    )


class Store:
    """The SQLite database of one cache directory.

    ``Store(directory)`` creates the directory (mode 0700) and database (0600) if needed,
    applies pending migrations and moves an unreadable database file aside. A directory
    that cannot be written opens read-only: lookups work, writes raise ``StoreError``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        read_only: bool | None = None,
        allow_shared_dir: bool | None = None,
    ) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / DB_NAME
        if allow_shared_dir is None:
            allow_shared_dir = os.environ.get("PLANCACHE_ALLOW_SHARED_DIR", "") not in ("", "0")
        self._local = threading.local()
        self._prepare_directory(read_only, allow_shared_dir)
        try:
            self._open_and_migrate()
        except BaseException:
            self.close()  # a refused database (newer schema, locked) must not stay open
            raise

    # ------------------------------------------------------------------ opening

    def _prepare_directory(self, read_only: bool | None, allow_shared: bool) -> None:
        directory = self.directory
        if not directory.exists() and read_only is not True:
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise CacheDirError(
                    f"cannot create cache directory {directory}: {exc.strerror or exc}", path=str(directory)
                ) from exc
        if not directory.is_dir():
            raise CacheDirError(f"cache path {directory} is not a directory", path=str(directory))
        _check_private(directory, allow_shared)
        self._directory_writable = os.access(directory, os.W_OK)
        writable = self._directory_writable and (not self.path.exists() or os.access(self.path, os.W_OK))
        if read_only is None:
            read_only = not writable
        self.read_only = bool(read_only)
        if self.read_only and not self.path.exists():
            raise CacheDirError(f"read-only cache directory {directory} holds no {DB_NAME}", path=str(directory))

    def _open_and_migrate(self) -> None:
        try:
            self._migrate()
            damage = self._damage_at_open()
        except sqlite3.DatabaseError as exc:
            if self.read_only or _is_locked(exc):
                raise StoreError(f"cannot open plan store {self.path}: {exc}", path=str(self.path)) from exc
            damage = str(exc)
        if damage is None:
            return
        if self.read_only:  # cannot move it aside: damaged pages stay misses
            log.warning("plancache: read-only store %s is damaged (%s); unreadable entries are misses", self.path, damage)
            return
        self.repair(damage)

    def _damage_at_open(self) -> str | None:
        """Damage that an earlier process left a marker for (``note_damage``), confirmed by
        ``PRAGMA quick_check``; None when healthy. quick_check reads every page (tens of ms
        per 1000 entries), so it runs only after a marker, never on a plain open.

        A truncated file needs no check here: SQLite refuses a file shorter than its header
        says on the first read (``_migrate`` reads page 1). The header is never read with
        ``open()``: closing a second descriptor of the database file would drop this
        process's POSIX locks on it, and other processes could then corrupt it."""
        suspicion = self._marker_reason()
        if suspicion is None:
            return None
        problem = self._quick_check()
        if problem is None:
            self._clear_marker()  # a stale marker: the file reads back whole
            return None
        return f"{suspicion}; {problem}"

    def _quick_check(self, *, full: bool = False) -> str | None:
        """The first problems ``PRAGMA quick_check`` (``integrity_check`` when ``full``)
        reports, or None when it says ok."""
        pragma = "integrity_check" if full else "quick_check"
        try:
            conn = self.connection()
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            rows = [r[0] for r in conn.execute(f"PRAGMA {pragma}(8)")]
        except sqlite3.DatabaseError as exc:
            if _is_locked(exc):
                raise
            return f"{pragma} failed: {exc}"
        return None if rows == ["ok"] else "; ".join(rows[:3])

    @property
    def _marker(self) -> Path:
        return self.path.with_name(DB_NAME + ".damaged")

    def _marker_reason(self) -> str | None:
        try:
            text = self._marker.read_text().strip()
        except OSError:
            return None
        return f"a process saw damage: {text[:200]}"

    def _clear_marker(self) -> None:
        with contextlib.suppress(OSError):
            self._marker.unlink()

    def note_damage(self, exc: BaseException) -> None:
        """Leave a marker after a read or write that found a damaged file, so the next open
        (or ``verify --fix``) checks it and moves it aside; this process keeps running on
        misses rather than replacing a file other processes have open."""
        if self.read_only or not _is_damage(exc):
            return
        old_umask = os.umask(0o077)
        try:
            self._marker.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {exc}\n")
        except OSError:
            pass
        finally:
            os.umask(old_umask)

    def repair(self, reason: str, *, thorough: bool = False) -> dict[str, Any]:
        """Move a damaged database file aside (kept, never deleted), start a new one and
        copy into it every entry of the old file that still reads back intact.

        Serialized by a file lock and re-checked under it: of several processes that find
        the same damage, one moves the file and the others find the new store healthy.
        ``thorough`` re-checks with ``integrity_check`` instead of ``quick_check``.
        Returns ``{"moved_aside": path or None, "salvaged": n}``."""
        from filelock import FileLock  # only on damage

        with FileLock(str(self.path.with_name(DB_NAME + ".repair.lock")), mode=0o600, timeout=BUSY_TIMEOUT_MS / 1000):
            self.close()
            still = self._quick_check(full=thorough)
            if still is None:  # healthy after all, or another process replaced it meanwhile
                self._clear_marker()
                return {"moved_aside": None, "salvaged": 0}
            aside = self._move_aside(f"{reason}; {still}" if still and still not in reason else reason)
            self._clear_marker()
            self._migrate()
            salvaged = self._salvage(aside)
        if salvaged:
            log.warning("plancache: copied %d intact entries from %s into the new store", salvaged, aside)
        return {"moved_aside": str(aside), "salvaged": salvaged}

    def _move_aside(self, reason: str) -> Path:
        self.close()
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
            src = sqlite3.connect(f"file:{urllib.parse.quote(str(aside))}?mode=ro", uri=True, isolation_level=None)
        except sqlite3.Error:
            return 0
        src.row_factory = sqlite3.Row
        try:
            entries = [e for e in _readable_entries(src) if e.checksum_ok() and entry_problem(e) is None]
        finally:
            src.close()
        for start in range(0, len(entries), 64):  # small transactions
            with self.transaction() as tx:
                tx.executemany(_INSERT_SQL, [e.row() for e in entries[start : start + 64]])
        return len(entries)

    def _migrate(self) -> None:
        conn = self.connection()
        found = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads page 1: garbage fails here
        steps = migrations()
        latest = steps[-1][0]
        if found > latest:
            raise SchemaTooNewError(
                f"{self.path} has schema {found}, newer than this plancache supports ({latest}); "
                "upgrade plancache or point PLANCACHE_DIR elsewhere. The file was not changed",
                path=str(self.path),
                found=found,
                supported=latest,
            )
        if found == latest:
            return
        if self.read_only:
            raise StoreError(f"read-only store {self.path} has schema {found}, older than {latest}", path=str(self.path))
        if found == 0:
            conn.execute("PRAGMA journal_mode=WAL")
        with self.transaction() as tx:
            found = tx.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated
            for number, name, sql in steps:
                if number <= found:
                    continue
                for statement in _statements(sql):
                    tx.execute(statement)
                tx.execute(f"PRAGMA user_version = {int(number)}")
                log.debug("plancache: applied migration %s to %s", name, self.path)

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use and again after a fork."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.pid == os.getpid():
            return conn
        if self.read_only:
            # mode=ro still reads the -wal, so it sees what live writers have committed (a
            # fresh store keeps even its schema there until a checkpoint). Only a directory we
            # cannot write (a baked cache), where no -shm can be created, needs immutable=1,
            # which ignores the -wal. The path is quoted: '?' or '#' would end it in a URI.
            uri = f"file:{urllib.parse.quote(str(self.path))}?mode=ro"
            if not self._directory_writable:
                uri += "&immutable=1"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            old_umask = os.umask(0o077)  # database, -wal and -shm private to the user
            try:
                conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
            finally:
                os.umask(old_umask)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not self.read_only:
            conn.execute("PRAGMA synchronous = NORMAL")
        local.conn = conn
        local.pid = os.getpid()
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local = threading.local()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction, taken with BEGIN IMMEDIATE so it never deadlocks."""
        if self.read_only:
            raise StoreError(f"plan store {self.path} is read-only", path=str(self.path))
        conn = self.connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _is_locked(exc):
                raise StoreBusyError(f"plan store {self.path} stayed locked for {BUSY_TIMEOUT_MS} ms", path=str(self.path)) from exc
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

    def _write(self, sql: str, params: Any = ()) -> int:
        try:
            with self.transaction() as tx:
                return tx.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write plan store {self.path}: {exc}", path=str(self.path)) from exc

    # ------------------------------------------------------------------ plans

    def get(self, key: str) -> Entry | None:
        """The entry stored under ``key``, or None. Reads only; checks no checksum. A read
        that finds the file damaged leaves a marker for the next open, then raises."""
        try:
            row = self.connection().execute("SELECT * FROM plans WHERE key = ?", (key,)).fetchone()
            return Entry.from_row(row) if row is not None else None
        except (ValueError, KeyError, TypeError) as exc:  # a damaged JSON column
            raise DamagedEntryError(f"entry {key[:12]} in {self.path} cannot be decoded: {str(exc)[:200]}", path=str(self.path), key=key) from exc
        except sqlite3.DatabaseError as exc:
            if _is_undecodable(exc):  # one row's text is damaged, not the file
                raise DamagedEntryError(f"entry {key[:12]} in {self.path} cannot be decoded: {str(exc)[:200]}", path=str(self.path), key=key) from exc
            self.note_damage(exc)
            raise

    def get_plan(self, key: str) -> StoredPlan | None:
        """What a hit needs of the entry under ``key`` (see ``StoredPlan``), or None.
        Raises like ``get``; a schema-1 row comes back with ``meta_ok`` None."""
        try:
            row = self.connection().execute(_SELECT_PLAN, (key,)).fetchone()
            if row is None:
                return None
            tensors_json, engine_json, workspace = row["tensors_json"], row["engine_json"], int(row["workspace_size"])
            meta = row["meta_sha256"]
            return StoredPlan(
                key=row["key"],
                environment=json.loads(row["environment_json"]),
                tensors=json.loads(tensors_json),
                blob=bytes(row["blob"]),
                blob_sha256=row["blob_sha256"],
                engine=json.loads(engine_json) if engine_json else None,
                workspace_size=workspace,
                meta_ok=None if meta is None else meta == _meta_digest(tensors_json, engine_json, workspace),
            )
        except (ValueError, KeyError, TypeError) as exc:  # a damaged JSON column
            raise DamagedEntryError(f"entry {key[:12]} in {self.path} cannot be decoded: {str(exc)[:200]}", path=str(self.path), key=key) from exc
        except sqlite3.DatabaseError as exc:
            if _is_undecodable(exc):
                raise DamagedEntryError(f"entry {key[:12]} in {self.path} cannot be decoded: {str(exc)[:200]}", path=str(self.path), key=key) from exc
            self.note_damage(exc)
            raise

    def put(self, entry: Entry) -> None:
        """Insert or replace an entry in one short transaction. Seals it first: an entry
        without a metadata checksum gets one (``entry.meta_sha256``)."""
        if entry.meta_sha256 is None:
            entry.meta_sha256 = entry.meta_digest()
        try:
            with self.transaction() as tx:
                tx.execute(_INSERT_SQL, entry.row())
        except sqlite3.Error as exc:
            self.note_damage(exc)
            raise StoreError(f"cannot store plan {entry.key[:12]} in {self.path}: {exc}", path=str(self.path)) from exc

    def delete(self, key: str) -> bool:
        return self._write("DELETE FROM plans WHERE key = ?", (key,)) > 0

    def resolve(self, prefix: str) -> list[str]:
        """Full keys starting with ``prefix`` (at most two, enough to tell ambiguity)."""
        if not prefix or any(c not in "0123456789abcdef" for c in prefix.lower()):
            return []
        rows = self.connection().execute(
            "SELECT key FROM plans WHERE key >= ? AND key < ? ORDER BY key LIMIT 2", (prefix.lower(), prefix.lower() + "g")
        )
        return [r[0] for r in rows]

    def keys(self) -> list[str]:
        return [r[0] for r in self.connection().execute("SELECT key FROM plans ORDER BY key")]

    def list_entries(self, env_id: str | None = None) -> list[dict[str, Any]]:
        """Summaries of every entry (no blob), most recently used first."""
        sql = f"SELECT {_LIST_COLUMNS} FROM plans"
        params: tuple[Any, ...] = ()
        if env_id is not None:
            sql += " WHERE env_id = ?"
            params = (env_id,)
        rows = self.connection().execute(sql + " ORDER BY last_used_at DESC, key", params)
        return [dict(r) for r in rows]

    def record_hits(self, hits: Mapping[str, tuple[int, float]]) -> None:
        """Add batched hit counts and last-used times: ``{key: (count, last_used)}``."""
        if not hits:
            return
        try:
            with self.transaction() as tx:
                tx.executemany(
                    "UPDATE plans SET hit_count = hit_count + ?, last_used_at = max(last_used_at, ?) WHERE key = ?",
                    [(count, used, key) for key, (count, used) in hits.items()],
                )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record hits in {self.path}: {exc}", path=str(self.path)) from exc

    def quarantine(self, key: str, reason: str) -> bool:
        """Move an entry out of service, keeping it (and its blob) for inspection."""
        return self._quarantine_where("key = ?", key, reason)

    def quarantine_rowid(self, rowid: int, reason: str) -> bool:
        """``quarantine`` for a row whose key itself may be damaged (found by ``verify``)."""
        return self._quarantine_where("rowid = ?", rowid, reason)

    def _quarantine_where(self, where: str, value: str | int, reason: str) -> bool:
        try:
            with self.transaction() as tx, _lenient_text(tx):
                row = tx.execute(f"SELECT * FROM plans WHERE {where}", (value,)).fetchone()  # where: a constant
                if row is None:
                    return False
                meta = {k: row[k] for k in row.keys() if k != "blob"}  # noqa: SIM118 - iterating a Row gives values
                tx.execute(
                    "INSERT INTO quarantine (key, reason, quarantined_at, row_json, blob) VALUES (?, ?, ?, ?, ?)",
                    (row["key"], reason, time.time(), json.dumps(meta), row["blob"]),
                )
                tx.execute(f"DELETE FROM plans WHERE {where}", (value,))
                tx.execute(
                    "INSERT INTO counters (name, value) VALUES ('quarantined', 1) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + 1"
                )
                return True
        except sqlite3.Error as exc:
            raise StoreError(f"cannot quarantine {str(value)[:12]} in {self.path}: {exc}", path=str(self.path)) from exc

    def quarantined(self) -> list[dict[str, Any]]:
        rows = self.connection().execute(
            "SELECT id, key, reason, quarantined_at, length(blob) AS blob_size FROM quarantine ORDER BY id"
        )
        return [dict(r) for r in rows]

    def bump(self, name: str, by: int = 1) -> None:
        self.bump_many({name: by})

    def bump_many(self, deltas: Mapping[str, int]) -> None:
        """Add to several persistent counters in one transaction."""
        rows = [(name, int(by)) for name, by in deltas.items() if by]
        if not rows:
            return
        try:
            with self.transaction() as tx:
                tx.executemany(
                    "INSERT INTO counters (name, value) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                    rows,
                )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot update counters in {self.path}: {exc}", path=str(self.path)) from exc

    def counters(self) -> dict[str, int]:
        return {r[0]: r[1] for r in self.connection().execute("SELECT name, value FROM counters")}

    # ------------------------------------------------------------------ kernel caches

    def get_kernel_cache(self, env_id: str) -> tuple[bytes, int | None] | None:
        row = self.connection().execute(
            "SELECT blob, blob_sha256, revision FROM kernel_caches WHERE env_id = ?", (env_id,)
        ).fetchone()
        if row is None or sha256(bytes(row["blob"])) != row["blob_sha256"]:
            return None
        return bytes(row["blob"]), row["revision"]

    def put_kernel_cache(self, env_id: str, blob: bytes, revision: int | None) -> None:
        self._write(
            "INSERT OR REPLACE INTO kernel_caches (env_id, blob, blob_sha256, revision, updated_at) VALUES (?, ?, ?, ?, ?)",
            (env_id, blob, sha256(blob), revision, time.time()),
        )

    # ------------------------------------------------------------------ size, age, health

    def total_size(self) -> int:
        row = self.connection().execute("SELECT coalesce(sum(blob_size), 0) FROM plans").fetchone()
        return int(row[0])

    def evict_to(self, max_bytes: int, batch: int = 16) -> int:
        """Delete least-recently-used entries, a small batch per transaction, until the
        blobs total at most ``max_bytes``. Returns how many entries were deleted."""
        try:
            return self._evict_to(max_bytes, batch)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot evict from plan store {self.path}: {exc}", path=str(self.path)) from exc

    def _evict_to(self, max_bytes: int, batch: int) -> int:
        deleted = 0
        while (excess := self.total_size() - max_bytes) > 0:
            with self.transaction() as tx:
                rows = tx.execute(
                    "SELECT key, blob_size FROM plans ORDER BY last_used_at ASC, key LIMIT ?", (batch,)
                ).fetchall()
                if not rows:
                    break
                # Only as many of the batch as the excess needs: deleting the whole batch
                # would also drop recently used entries (even the one just stored).
                keys = []
                for key, size in rows:
                    if excess <= 0:
                        break
                    keys.append(key)
                    excess -= int(size)
                tx.executemany("DELETE FROM plans WHERE key = ?", [(k,) for k in keys])
                deleted += len(keys)
        return deleted

    def stats(self) -> dict[str, Any]:
        conn = self.connection()
        row = conn.execute(
            "SELECT count(*) AS entries, coalesce(sum(blob_size), 0) AS blob_bytes, "
            "coalesce(sum(hit_count), 0) AS hits, count(DISTINCT env_id) AS environments, "
            "coalesce(sum(build_seconds), 0) AS build_seconds FROM plans"
        ).fetchone()
        by_policy = {r[0]: r[1] for r in conn.execute("SELECT policy, count(*) FROM plans GROUP BY policy")}
        quarantined = conn.execute("SELECT count(*) FROM quarantine").fetchone()[0]
        return {
            "path": str(self.path),
            "read_only": self.read_only,
            "file_bytes": self.path.stat().st_size if self.path.exists() else 0,
            **dict(row),
            "by_policy": by_policy,
            "quarantined": quarantined,
            "counters": self.counters(),
        }

    def integrity_problems(self) -> list[str]:
        """SQLite's integrity check plus every blob's checksum; empty when healthy."""
        conn = self.connection()
        problems = [r[0] for r in conn.execute("PRAGMA integrity_check") if r[0] != "ok"]
        with _lenient_text(conn):  # a damaged text column is a checksum problem, not a crash
            for row in conn.execute("SELECT key, blob, blob_sha256 FROM plans"):
                if sha256(bytes(row["blob"])) != row["blob_sha256"]:
                    problems.append(f"checksum mismatch in entry {row['key']}")
        return problems

    # ------------------------------------------------------------------ prune, verify

    def prune(
        self,
        *,
        env_ids_keep: set[str] | None = None,
        older_than_s: float | None = None,
        quarantined: bool = False,
        dry_run: bool = False,
        batch: int = 64,
    ) -> dict[str, Any]:
        """Remove entries of environments not in ``env_ids_keep`` (and their kernel caches),
        entries unused for more than ``older_than_s`` seconds, and with ``quarantined`` every
        quarantined entry. Deletes ``batch`` rows per transaction, so lookups and builds
        of other processes never wait long; an entry used meanwhile is kept. ``dry_run``
        reports and deletes nothing."""
        from . import maintenance  # imported here: maintenance imports this module

        return maintenance.prune(
            self, env_ids_keep=env_ids_keep, older_than_s=older_than_s, quarantined=quarantined, dry_run=dry_run, batch=batch
        )

    def verify(
        self,
        *,
        fix: bool = False,
        load: Callable[[Entry], object] | None = None,
        env_id: str | None = None,
    ) -> dict[str, Any]:
        """Check everything: SQLite's integrity check, every blob's checksum, every row's
        key against what it records, kernel-cache checksums and, given ``load``, that every
        blob of environment ``env_id`` deserializes. ``report["problems"]`` lists them all.

        ``fix``: quarantine bad entries (kept, never served), drop bad kernel caches; a file
        that fails the integrity check is moved aside (kept) and its intact entries copied
        into a new one. Nothing is deleted silently: the report says what was done."""
        from . import maintenance  # imported here: maintenance imports this module

        return maintenance.verify(self, fix=fix, load=load, env_id=env_id)
