"""Opening a plan store: the cache directory (created private, refused unless only its owner,
or the shared group it names, can have written it and its files), the database file and its
numbered migrations (``migrations/NNNN_*.sql``, each applied with its ``PRAGMA user_version``
in one transaction; a newer schema, or one the migrations did not make, is refused).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..config import CACHE_DIR
from ..errors import CacheDirError, SchemaTooNewError, StoreBusyError, StoreError
from .connections import Transaction, connect
from .files import Modes, check_trusted, modes_of
from .recovery import DB_NAME, is_locked

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["BUSY_TIMEOUT_MS", "Access", "check_private", "default_cache_dir", "migrate", "migrate_when_free", "migrations",
           "prepare_directory"]  # fmt: skip

log = logging.getLogger("plancache")

#: The page size of a store plancache creates. A plan blob (2-120 KB) lies on overflow
#: pages, read one system call each: a store hit reading an 80 KB blob spent 58 us in
#: SQLite on 4 KB pages (its default) and 37 us on 16 KB ones (CPU, 300 rows read once in
#: a fresh process, the file in the OS page cache). A store made earlier keeps its pages.
PAGE_SIZE = 16384

BUSY_TIMEOUT_MS = 30_000


def default_cache_dir() -> Path:
    """``$PLANCACHE_DIR`` if set, else the platform's per-user cache directory; ``CacheDirError``
    when that is in a home directory that does not exist (``HOME`` a placeholder, as services
    and containers set it): plancache makes its own directory, never a home directory."""
    named = CACHE_DIR.from_env()
    if named is not None:
        return named
    import platformdirs  # imported here: only needed when no directory is given

    path = Path(platformdirs.user_cache_dir("plancache", appauthor=False))
    try:
        home = Path.home()
    except RuntimeError:  # no home directory at all: nothing of one to create
        return path
    if home in path.parents and not home.is_dir():
        raise CacheDirError(f"the default cache directory {path} is in the home directory {home}, which does not exist: "
                            f"set {CACHE_DIR.name}, or pass a directory", path=str(path))  # fmt: skip
    return path


def migrations() -> list[tuple[int, str, str]]:
    """The numbered migrations as ``(number, file name, sql)``, in order."""
    from importlib import resources  # only when opening a store

    try:
        folder: Traversable = resources.files("plancache.migrations")
        files = [f for f in folder.iterdir() if f.name.endswith(".sql")]
    except ModuleNotFoundError:  # running from a source tree that is not installed
        folder = Path(__file__).resolve().parents[2] / "migrations"
        files = list(Path(folder).glob("*.sql"))
    found = sorted((int(f.name.split("_", 1)[0]), f.name, f.read_text()) for f in files)
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


def check_private(directory: Path, group: str | None) -> os.stat_result | None:
    """Refuse a cache directory that anyone but its owner (or ``group``'s members) could have
    written: its blobs carry native code. Its status (None: it went away meanwhile)."""
    if not directory.is_dir():
        raise CacheDirError(f"cache path {directory} is not a directory", path=str(directory))
    return check_trusted(directory, group, follow=True)


#: Tables SQLite makes itself (AUTOINCREMENT's counters, ANALYZE's statistics): never run, never foreign.
_SQLITE_OWN = frozenset({"sqlite_sequence", "sqlite_stat1", "sqlite_stat4"})


def _schema_of(conn: sqlite3.Connection) -> frozenset[tuple[object, ...]]:
    rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    return frozenset(tuple(r) for r in rows if not (r[0] == "table" and r[1] in _SQLITE_OWN))


def _version_and_schema(conn: sqlite3.Connection) -> tuple[int, frozenset[tuple[object, ...]]]:
    """The schema version and the schema, read in one snapshot: another process may commit
    a migration between two reads outside a transaction."""
    conn.execute("BEGIN")
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0], _schema_of(conn)
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")  # it only read


@functools.cache
def _made_by_migrations() -> dict[int, frozenset[tuple[object, ...]]]:
    """The schema (``sqlite_master``'s rows) of each version as the migrations alone make it,
    applied once per process to a database in memory."""
    conn = connect(":memory:", isolation_level=None)
    try:
        made = {0: _schema_of(conn)}
        for number, _name, sql in migrations():
            for statement in _statements(sql):
                conn.execute(statement)
            made[number] = _schema_of(conn)
    finally:
        conn.close()
    return made


class Access(NamedTuple):
    """What ``prepare_directory`` found a cache directory to allow."""

    modes: Modes  # how plancache makes files in the directory, and the shared group whose members' files it trusts
    directory_writable: bool
    file_writable: bool
    read_only: bool  # as asked, else whether the database file cannot be written


def prepare_directory(directory: Path, read_only: bool | None, group: str | None) -> Access:
    """Create the cache ``directory`` (unless ``read_only``) and refuse it, or a database
    file in it, unless trusted (``check_private``)."""
    if not directory.exists() and read_only is not True:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheDirError(f"cannot create cache directory {directory}: {exc.strerror or exc}", path=str(directory)) from exc
    status = check_private(directory, group)
    for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):  # a -wal or -shm not made yet is no risk
        check_trusted(directory / name, group)
    modes = modes_of(directory, status, group)
    path = directory / DB_NAME
    directory_writable = os.access(directory, os.W_OK)
    writable = directory_writable and (not path.exists() or os.access(path, os.W_OK))
    read_only = not writable if read_only is None else read_only
    if read_only and not path.exists():
        raise CacheDirError(f"read-only cache directory {directory} holds no {DB_NAME}", path=str(directory))
    return Access(modes, directory_writable, writable, bool(read_only))


def _check_schema(path: Path, found: frozenset[tuple[object, ...]], version: int) -> None:
    """Refuse a database whose schema (``found``) is not what migrations 1..``version`` made: a
    trigger, view, table or index someone added could rewrite what is read or stored."""
    made = _made_by_migrations().get(version, frozenset())
    if found == made:
        return
    foreign = [f"{kind} {name}" for kind, name, _, _ in sorted(found - made, key=str)]
    missing = [f"{kind} {name}" for kind, name, _, _ in sorted(made - found, key=str)]
    what = "; ".join(([f"holds {', '.join(foreign)} that no migration made"] if foreign else [])
                     + ([f"lacks or alters {', '.join(missing)}"] if missing else []))  # fmt: skip
    raise CacheDirError(
        f"plancache does not trust {path}: its schema (version {version}) {what}; nothing was read or changed. "
        "Move the file aside, or use another cache directory (--dir, PLANCACHE_DIR)",
        path=str(path),
    )


def migrate_when_free(migrate: Callable[[], None]) -> None:
    """``migrate``, retried up to the busy timeout while other processes hold the database
    (many processes opening a new store at once all want to create it)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    pause = 0.01
    while True:
        try:
            migrate()
            return
        except (sqlite3.OperationalError, StoreBusyError) as exc:
            cause = exc.__cause__ if isinstance(exc, StoreBusyError) else exc
            if not (isinstance(exc, StoreBusyError) or is_locked(cause or exc)) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


def migrate(conn: sqlite3.Connection, transaction: Transaction, path: Path, read_only: bool) -> None:
    """Apply the pending migrations to the database ``path`` (``conn``, this thread's
    connection, and ``transaction``, its write transaction); refuse a newer or foreign schema."""
    found, schema = _version_and_schema(conn)  # reads page 1: garbage fails here
    steps = migrations()
    latest = steps[-1][0]
    if found > latest:
        raise SchemaTooNewError(
            f"{path} has schema {found}, newer than this plancache supports ({latest}); "
            "upgrade plancache or use another cache directory (--dir, PLANCACHE_DIR). The file was not changed",
            path=str(path),
            found=found,
            supported=latest,
        )
    _check_schema(path, schema, found)  # before anything is migrated
    if found == latest:
        if not read_only and conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            # Another tool left it in a rollback journal, where a reader waits on a writer:
            # back to WAL, which the hit path's promise rests on (busy: next open).
            with contextlib.suppress(sqlite3.OperationalError):
                conn.execute("PRAGMA journal_mode=WAL")
        return
    if read_only:
        raise StoreError(f"read-only store {path} has schema {found}, older than {latest}", path=str(path))
    if found == 0:
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # a new file only: before WAL and the first table
        conn.execute("PRAGMA journal_mode=WAL")
    with transaction() as tx:
        found = tx.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated
        for number, name, sql in steps:
            if number <= found:
                continue
            for statement in _statements(sql):
                tx.execute(statement)
            tx.execute(f"PRAGMA user_version = {int(number)}")
            log.debug("plancache: applied migration %s to %s", name, path)
