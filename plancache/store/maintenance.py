"""Offline maintenance of a plan store: ``verify`` (SQLite's integrity check, every row
judged by ``entry.problem``, kernel caches and, optionally, that blobs deserialize; with
``fix``, quarantine and repair), ``prune`` (entries of other environments, unused ones,
the quarantine) in short transactions, and the listing ``plancache ls`` prints.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import TypedDict, cast

from ..errors import EntryNotFoundError, StoreError
from .entry import Entry, problem, sha256
from .recovery import Repaired, is_locked, is_undecodable, lenient_text
from .store import Store

__all__ = ["UNDECODABLE_HINT", "Deserialized", "Fixed", "Listed", "PruneReport", "Pruned", "VerifyReport", "environment_named",
           "list_entries", "prune", "verify"]  # fmt: skip

# Sizes are the blobs' own lengths: the stored blob_size is a number the database can compute, so is not trusted.
_LISTED = ("key, env_id, label, length(blob) AS blob_size, workspace_size, policy, backend, build_seconds, autotune_seconds, created_at, "
           "last_used_at, hit_count")  # fmt: skip


class Listed(TypedDict):
    """One entry of ``list_entries``: its row's columns (as a validated ``Entry`` wrote them),
    the blob's size in place of the blob."""

    key: str
    env_id: str
    label: str
    blob_size: int
    workspace_size: int
    policy: str
    backend: str
    build_seconds: float
    autotune_seconds: float
    created_at: float
    last_used_at: float
    hit_count: int


class Pruned(TypedDict):
    """An entry ``prune`` removes (or would), and why."""

    key: str
    env_id: str
    label: str
    blob_size: int
    last_used_at: float
    reason: str


class PruneReport(TypedDict):
    """What ``prune`` removed (or, ``dry_run``, would)."""

    dry_run: bool
    removed: list[Pruned]
    bytes: int
    kernel_caches: list[str]
    quarantined: int


class Deserialized(TypedDict):
    """What ``verify`` loaded: the blobs of ``env_id`` checked, others skipped, and why each failure failed."""

    env_id: str | None
    checked: int
    skipped: int
    failed: dict[str, str]


class Fixed(TypedDict, total=False):
    """What ``verify(fix=True)`` did: a damaged file moved aside (``Store.repair``), entries
    quarantined, kernel caches removed."""

    moved_aside: str | None
    salvaged: int
    quarantined: list[str]
    kernel_caches_removed: list[str]


class VerifyReport(TypedDict):
    """What ``verify`` found (and, with ``fix``, did): ``problems`` has a line for each."""

    path: str
    entries: int
    integrity: list[str]
    checksum: list[str]  # keys whose blob fails its checksum
    foreign: dict[str, str]  # key -> why the entry cannot be served
    damaged: dict[int, str]  # rowid -> why the row cannot be decoded
    unreadable: list[str]
    kernel_caches: list[str]  # environment ids whose kernel cache fails its checksum
    deserialize: Deserialized | None
    fixed: Fixed
    problems: list[str]


#: What the read commands say of a row they skip.
UNDECODABLE_HINT = "`plancache verify --fix` quarantines it"


def list_entries(store: Store, env_id: str | None = None, *, undecodable: dict[str, str] | None = None) -> list[Listed]:
    """Summaries of every entry (no blob), most recently used first. A row whose text cannot
    be decoded (invalid UTF-8) is left out, and reported in ``undecodable`` if given (its key,
    with replacement characters -> which column): one damaged row fails no read command."""
    where, args = ("WHERE env_id = ?", (env_id,)) if env_id is not None else ("", ())
    sql = f"SELECT {_LISTED} FROM plans {where} ORDER BY last_used_at DESC, key"
    with lenient_text(store.connection(), bytes) as conn:  # each row decoded below: one bad row fails only itself
        cursor = conn.execute(sql, args)
        names = [column[0] for column in cursor.description]
        raw = cursor.fetchall()
    rows: list[Listed] = []
    for values in raw:
        row: dict[str, object] = {}
        bad = None
        for name, value in zip(names, values):
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError:
                    bad = bad or name
                    value = value.decode("utf-8", "replace")
            row[name] = value
        if bad is None:
            rows.append(cast(Listed, row))  # every column of _LISTED, decoded
        elif undecodable is not None:
            undecodable[str(row["key"])] = f"its {bad} column cannot be decoded"
    return rows


def environment_named(prefix: str, known: set[str], where: str) -> str:
    """The one environment id of ``known`` (those of the plans in ``where``) that ``prefix``
    begins, else ``EntryNotFoundError`` naming what there is: a typo must not silently
    export, list or import nothing."""
    found = sorted(env for env in known if env.startswith(prefix))
    if len(found) != 1:
        problem = "no environment" if not found else f"an ambiguous prefix ({', '.join(found)})"
        shown = f" (it has: {', '.join(sorted(known))})" if known and not found else ""
        raise EntryNotFoundError(f"environment {prefix!r} names {problem} of the plans in {where}{shown}", key=prefix)
    return found[0]


def prune(
    store: Store,
    *,
    env_ids_keep: set[str] | None = None,
    older_than_s: float | None = None,
    quarantined: bool = False,
    dry_run: bool = False,
    batch: int = 64,
) -> PruneReport:
    """Remove entries of environments not in ``env_ids_keep`` (and their kernel caches), those
    unused for over ``older_than_s`` seconds, and with ``quarantined`` every quarantined
    entry: ``batch`` rows per transaction, so other processes never wait long; an entry used
    meanwhile is kept. ``dry_run`` deletes nothing."""
    cutoff = time.time() - older_than_s if older_than_s is not None else None
    doomed: list[Pruned] = []
    rows = store.connection().execute("SELECT key, env_id, label, length(blob), last_used_at FROM plans ORDER BY key").fetchall()
    for key, env_id, label, blob_size, last_used_at in rows:
        if env_ids_keep is not None and env_id not in env_ids_keep:
            reason = "other environment"
        elif cutoff is not None and last_used_at < cutoff:
            reason = "unused since " + time.strftime("%Y-%m-%d", time.localtime(last_used_at))
        else:
            continue
        doomed.append({"key": key, "env_id": env_id, "label": label, "blob_size": blob_size, "last_used_at": last_used_at,
                       "reason": reason})  # fmt: skip
    report: PruneReport = {
        "dry_run": dry_run,
        "removed": doomed,
        "bytes": sum(r["blob_size"] for r in doomed),
        "kernel_caches": _stale_kernel_caches(store, env_ids_keep),
        "quarantined": store.connection().execute("SELECT count(*) FROM quarantine").fetchone()[0] if quarantined else 0,
    }
    if dry_run:
        return report
    try:
        for start in range(0, len(doomed), batch):
            with store.transaction() as tx:  # an entry used since it was listed is kept
                rows = [(r["key"], r["last_used_at"]) for r in doomed[start : start + batch]]
                tx.executemany("DELETE FROM plans WHERE key = ? AND last_used_at <= ?", rows)
        if report["kernel_caches"]:
            with store.transaction() as tx:
                tx.executemany("DELETE FROM kernel_caches WHERE env_id = ?", [(e,) for e in report["kernel_caches"]])
        while quarantined:
            with store.transaction() as tx:
                sql = "DELETE FROM quarantine WHERE id IN (SELECT id FROM quarantine ORDER BY id LIMIT ?)"
                if tx.execute(sql, (batch,)).rowcount == 0:
                    break
    except sqlite3.Error as exc:
        raise StoreError(f"cannot prune plan store {store.path}: {exc}", path=str(store.path)) from exc
    return report


def _stale_kernel_caches(store: Store, env_ids_keep: set[str] | None) -> list[str]:
    if env_ids_keep is None:
        return []
    rows = store.connection().execute("SELECT env_id FROM kernel_caches ORDER BY env_id")
    return [env_id for (env_id,) in rows if env_id not in env_ids_keep]


def verify(
    store: Store,
    *,
    fix: bool = False,
    load: Callable[[Entry], object] | None = None,
    env_id: str | None = None,
) -> VerifyReport:
    """Check everything: SQLite's integrity check, every row through ``entry.problem``,
    kernel-cache checksums and, given ``load``, that every blob of environment ``env_id``
    deserializes; ``report["problems"]`` lists them all. ``fix``: quarantine bad entries
    (kept, never served), drop bad kernel caches, and move a file that fails the integrity
    check aside (kept), its intact entries copied into a new one; the report says what was done."""
    report: VerifyReport = {"path": str(store.path), "entries": 0, "integrity": [], "checksum": [], "foreign": {}, "damaged": {},
                            "unreadable": [], "kernel_caches": [], "deserialize": None, "fixed": {}, "problems": []}  # fmt: skip
    try:
        report["integrity"] = [r[0] for r in store.connection().execute("PRAGMA integrity_check(100)") if r[0] != "ok"]
    except sqlite3.DatabaseError as exc:
        if is_locked(exc):
            raise StoreError(f"cannot verify plan store {store.path}: {exc}", path=str(store.path)) from exc
        report["integrity"] = [f"integrity_check failed: {exc}"]
    if report["integrity"] and fix:
        report["fixed"] = _repaired(store.repair("integrity check: " + "; ".join(report["integrity"][:3]), thorough=True))
    identities = _verify_rows(store, report, load, env_id)
    report["problems"] = _problems(report)
    if fix:
        report["fixed"].update(_fix_rows(store, report, identities))
    return report


def _verify_rows(store: Store, report: VerifyReport, load: Callable[[Entry], object] | None,
                 env_id: str | None) -> dict[str, tuple[str, float]]:  # fmt: skip
    """Fill the row-level parts of a verify report, one row at a time by rowid (a row whose key
    is damaged is still found, to be quarantined); returns each row's identity (blob checksum,
    creation time) by key."""
    checked: Deserialized = {"env_id": env_id, "checked": 0, "skipped": 0, "failed": {}}
    identities: dict[str, tuple[str, float]] = {}
    if load is not None:
        report["deserialize"] = checked
    try:
        conn = store.connection()  # a file that is no database fails even this
        rowids = [r[0] for r in conn.execute("SELECT rowid FROM plans ORDER BY rowid")]
    except sqlite3.DatabaseError as exc:
        report["unreadable"].append(f"listing entries failed: {exc}")
        return identities
    for rowid in rowids:
        entry = _verify_read(store, rowid, report)
        if entry is None:
            continue
        identities[entry.key] = (entry.blob_sha256, entry.created_at)
        report["entries"] += 1
        if not entry.checksum_ok():
            report["checksum"].append(entry.key)
        elif (found := problem(entry)) is not None:
            report["foreign"][entry.key] = found
        elif load is not None and env_id is not None and entry.env_id != env_id:
            checked["skipped"] += 1  # another environment's blob cannot load on this GPU
        elif load is not None:
            checked["checked"] += 1
            try:
                load(entry)
            except Exception as exc:  # the library refusing a blob is a finding, not a crash
                checked["failed"][entry.key] = f"deserialize failed: {type(exc).__name__}: {exc}"
    try:
        with lenient_text(conn):
            for row in conn.execute("SELECT env_id, blob, blob_sha256 FROM kernel_caches"):
                if sha256(bytes(row["blob"])) != row["blob_sha256"]:
                    report["kernel_caches"].append(row["env_id"])
    except sqlite3.DatabaseError as exc:
        report["unreadable"].append(f"listing kernel caches failed: {exc}")
    return identities


def _verify_read(store: Store, rowid: int, report: VerifyReport) -> Entry | None:
    """One row as an Entry; a row that cannot be decoded is recorded as damaged (it can
    be quarantined), one SQLite cannot read as unreadable (only moving the file helps)."""
    try:
        row = store.connection().execute("SELECT * FROM plans WHERE rowid = ?", (rowid,)).fetchone()
        return Entry.from_row(row) if row is not None else None
    except (ValueError, KeyError, TypeError, sqlite3.DatabaseError) as exc:
        if isinstance(exc, sqlite3.DatabaseError) and not is_undecodable(exc):
            report["unreadable"].append(f"row {rowid}: {exc}")
        else:
            report["damaged"][rowid] = f"cannot be decoded: {exc}"
    return None


def _fix_rows(store: Store, report: VerifyReport, identities: Mapping[str, tuple[str, float]]) -> Fixed:
    bad = {key: "blob checksum mismatch" for key in report["checksum"]}
    bad.update(report["foreign"])
    bad.update(report["deserialize"]["failed"] if report["deserialize"] else {})
    # Only the row that was judged: reading (and loading) every row takes a while, and a
    # live cache may meanwhile have quarantined a bad row itself and stored a healthy rebuild.
    quarantined = [
        key for key, reason in sorted(bad.items()) if store.quarantine(key, f"verify: {reason}", identity=identities[key])
    ]
    quarantined += [
        f"row {rowid}" for rowid, reason in report["damaged"].items() if store.quarantine_rowid(rowid, f"verify: {reason}")
    ]
    if report["kernel_caches"]:
        try:
            with store.transaction() as tx:
                tx.executemany("DELETE FROM kernel_caches WHERE env_id = ?", [(e,) for e in report["kernel_caches"]])
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write plan store {store.path}: {exc}", path=str(store.path)) from exc
    fixed: Fixed = {"quarantined": quarantined, "kernel_caches_removed": list(report["kernel_caches"])}
    if report["unreadable"] and not report["fixed"].get("moved_aside"):  # unreadable rows cannot be moved: the file is
        fixed.update(_repaired(store.repair("unreadable rows: " + "; ".join(report["unreadable"][:3]), thorough=True)))
    return fixed


def _repaired(repaired: Repaired) -> Fixed:
    return {"moved_aside": repaired["moved_aside"], "salvaged": repaired["salvaged"]}


def _problems(report: VerifyReport) -> list[str]:
    """One line per problem a verify report found."""
    lines = [f"integrity: {p}" for p in report["integrity"]]
    lines += [f"{key}: blob checksum mismatch" for key in report["checksum"]]
    lines += [f"{key}: {reason}" for key, reason in report["foreign"].items()]
    lines += [f"row {rowid}: {reason}" for rowid, reason in report["damaged"].items()]
    lines += [f"unreadable: {what}" for what in report["unreadable"]]
    lines += [f"kernel cache of {env}: checksum mismatch" for env in report["kernel_caches"]]
    lines += [f"{key}: {reason}" for key, reason in (report["deserialize"]["failed"] if report["deserialize"] else {}).items()]
    return lines
