"""The SQLite store: opening, migrating, permissions, damaged and foreign databases, and
every read and write the cache relies on."""

from __future__ import annotations

import grp
import json
import os
import pickle
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plancache import CacheDirError, EntryNotFoundError, SchemaTooNewError, Store, StoreError
from plancache.config import ConfigError
from plancache.store import BUSY_TIMEOUT_MS, DB_NAME, Entry, bookkeeping, maintenance, migrations, schema, sha256
from plancache.store.schema import PAGE_SIZE

IS_ROOT = os.geteuid() == 0


def make_entry(key: str = "ab" * 32, *, blob: bytes = b"plan-bytes", last_used_at: float = 1000.0, **fields: Any) -> Entry:
    values: dict[str, Any] = {
        "key": key,
        "env_id": "0123456789abcdef",
        "label": "MATMUL+POINTWISE(relu)",
        "description": {"nodes": [{"type": "MATMUL"}], "tensors": {}},
        "environment": {"gpu_name": "CPU test device"},
        "options": {"policy": "topk", "top_k": 8},
        "tensors": [{"uid": 1, "name": "A", "dims": [2, 3], "strides": [3, 1], "dtype": None, "is_output": False}],
        "blob": blob,
        "blob_sha256": sha256(blob),
        "engine": {"engine_id": 3, "knobs": {"tile": 64}, "name": "e3"},
        "workspace_size": 1024,
        "policy": "topk",
        "candidates": [{"index": 0, "status": "chosen"}],
        "timing": {"runs": 7},
        "build_seconds": 0.5,
        "autotune_seconds": 0.25,
        "backend": "cpu-test",
        "created_at": 900.0,
        "last_used_at": last_used_at,
        "check": {"status": "agreed", "rule": 2, "compared": 2, "agreeing": 2, "rejected": []},
    }
    values.update(fields)
    entry = Entry(**values)
    if "meta_sha256" not in fields:
        entry.meta_sha256 = entry.meta_digest()  # as Store.put seals it
    return entry


def hexkey(prefix: str) -> str:
    return (prefix + "0" * 64)[:64]


# ---------------------------------------------------------------------------- opening


def test_fresh_store_is_migrated_in_wal_mode_with_a_busy_timeout(store: Store) -> None:
    conn = store.connection()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(migrations()) >= 1
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS > 0
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"plans", "quarantine", "kernel_caches", "counters"} <= tables
    assert store.read_only is False


def test_wal_mode_is_persistent(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    store.close()
    conn = db()  # a plain connection sees what the file says, not what the store set
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(migrations())


def test_a_new_store_has_large_pages_and_an_old_one_keeps_its_own(store: Store, db: Callable[[], sqlite3.Connection],
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A plan blob is read one page at a time: a store plancache creates has 16 KB pages; a
    store made with SQLite's default 4 KB pages (as plancache made them before) is used as
    it is, never rewritten."""
    store.close()
    assert db().execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE == 16384
    old = tmp_path / "old"
    monkeypatch.setattr(schema, "PAGE_SIZE", 4096)
    Store(old).close()
    monkeypatch.undo()
    again = Store(old)
    try:
        again.put(make_entry())
        assert again.get(make_entry().key) == make_entry()
        assert again.connection().execute("PRAGMA page_size").fetchone()[0] == 4096
    finally:
        again.close()


def test_migrations_are_numbered_from_one() -> None:
    steps = migrations()
    assert [n for n, _, _ in steps] == list(range(1, len(steps) + 1))
    assert steps[0][1] == "0001_initial.sql"
    assert "CREATE TABLE plans" in steps[0][2]


def test_reopening_does_not_migrate_again(store: Store) -> None:
    store.put(make_entry())
    store.close()
    again = Store()
    try:
        assert again.keys() == [make_entry().key]
    finally:
        again.close()


def test_default_directory_is_plancache_dir(store: Store, cache_dir: Path) -> None:
    assert store.directory == cache_dir
    assert store.path == cache_dir / DB_NAME
    assert store.path.is_file()


def test_created_directory_is_0700_and_database_0600(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b" / "cache"
    umask = os.umask(0o022)  # the usual one, which would leave the files readable by all
    try:
        s = Store(directory)
    finally:
        os.umask(umask)
    try:
        s.put(make_entry())  # creates -wal and -shm
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
        for suffix in ("-wal", "-shm"):
            side = Path(str(s.path) + suffix)
            if side.exists():
                assert stat.S_IMODE(side.stat().st_mode) == 0o600, suffix
    finally:
        s.close()


def test_garbage_database_is_moved_aside_and_replaced(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache_dir.mkdir(mode=0o700)
    garbage = b"this is not an SQLite database\n" * 200
    (cache_dir / DB_NAME).write_bytes(garbage)
    s = Store()
    try:
        aside = list(cache_dir.glob(f"{DB_NAME}.corrupt-*"))
        assert len(aside) == 1
        assert aside[0].read_bytes() == garbage  # kept for inspection, not overwritten
        assert "unreadable" in caplog.text
        assert s.keys() == []
        s.put(make_entry())
        assert s.get(make_entry().key) == make_entry()
        assert s.connection().execute("PRAGMA user_version").fetchone()[0] == len(migrations())
    finally:
        s.close()


def test_a_store_left_out_of_wal_mode_is_put_back_at_open(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    """Another tool's PRAGMA journal_mode=DELETE made readers wait on writers for good."""
    store.close()
    conn = db()
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    reopened = Store(store.directory)
    assert reopened.connection().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reopened.close()


def test_schema_newer_than_code_is_refused_and_left_untouched(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    store.put(make_entry())
    store.close()
    conn = db()
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    path = store.path
    before = path.read_bytes()
    listing = sorted(p.name for p in path.parent.iterdir())
    with pytest.raises(SchemaTooNewError) as info:
        Store()
    assert info.value.found == 99
    assert info.value.supported == len(migrations())
    assert info.value.path == str(path)
    assert isinstance(info.value, StoreError) and isinstance(info.value, OSError)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == listing  # nothing moved aside


def test_shared_directory_is_refused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    with pytest.raises(CacheDirError, match="writable by other users") as info:
        Store()
    assert info.value.path == str(cache_dir)
    assert not (cache_dir / DB_NAME).exists()
    cache_dir.chmod(0o770)  # group-writable is shared too
    with pytest.raises(CacheDirError):
        Store()
    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", "0")
    with pytest.raises(CacheDirError):
        Store()
    group = grp.getgrgid(cache_dir.stat().st_gid).gr_name  # the opt-in names the group that shares it
    with pytest.raises(CacheDirError, match="it is not setgid"):
        Store(allow_shared_dir=group)
    cache_dir.chmod(0o2770)  # setgid: what each member creates there is the group's
    Store(allow_shared_dir=group).close()
    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", group)
    s = Store()
    s.put(make_entry())
    s.close()
    assert stat.S_IMODE((cache_dir / DB_NAME).stat().st_mode) == 0o660  # the group's, as the directory is
    cache_dir.chmod(0o2777)  # writable by others: never shared
    with pytest.raises(CacheDirError, match="writable by other users"):
        Store()
    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", "1")  # a switch names no group
    with pytest.raises(ConfigError, match="name the group"):
        Store()


def test_directory_that_cannot_be_created_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "cache"
    with pytest.raises(CacheDirError) as info:
        Store(target)
    assert str(target) in str(info.value)
    assert info.value.path == str(target)
    with pytest.raises(CacheDirError, match="not a directory") as info:
        Store(blocker)
    assert info.value.path == str(blocker)


def test_read_only_store_serves_reads_and_refuses_writes(store: Store) -> None:
    store.put(make_entry())
    store.close()
    ro = Store(read_only=True)
    try:
        assert ro.read_only is True
        assert ro.get(make_entry().key) == make_entry()
        assert ro.stats()["read_only"] is True
        with pytest.raises(StoreError, match="read-only"):
            ro.put(make_entry(hexkey("cd")))
        with pytest.raises(StoreError, match="read-only"):
            bookkeeping.record_hits(ro, {make_entry().key: (1, 2000.0)})
    finally:
        ro.close()
    reopened = Store()
    try:
        assert reopened.keys() == [make_entry().key]
    finally:
        reopened.close()


def test_read_only_store_needs_a_database(cache_dir: Path) -> None:
    cache_dir.mkdir(mode=0o700)
    with pytest.raises(CacheDirError, match="holds no"):
        Store(read_only=True)
    assert not (cache_dir / DB_NAME).exists()


def test_read_only_directory_can_be_read(store: Store, cache_dir: Path) -> None:
    store.put(make_entry())
    store.close()
    before = store.path.read_bytes()
    cache_dir.chmod(0o500)
    try:
        # Root can write anywhere, so os.access cannot tell; ask for read-only explicitly.
        ro = Store(read_only=True if IS_ROOT else None)
        try:
            assert ro.read_only is True
            assert ro.get(make_entry().key) == make_entry()
            with pytest.raises(StoreError):
                ro.put(make_entry(hexkey("ef")))
        finally:
            ro.close()
        assert store.path.read_bytes() == before
        if not IS_ROOT:
            assert sorted(p.name for p in cache_dir.iterdir()) == [DB_NAME]  # no -wal, no -shm
    finally:
        cache_dir.chmod(0o700)


def test_read_only_store_sees_what_a_live_writer_committed(store: Store) -> None:
    # A fresh store keeps everything, its schema included, in the -wal until a checkpoint.
    store.put(make_entry())
    assert Path(str(store.path) + "-wal").stat().st_size > 0
    ro = Store(read_only=True)
    try:
        assert ro.get(make_entry().key) == make_entry()
        store.put(make_entry(hexkey("cd")))
        assert ro.keys() == sorted([make_entry().key, hexkey("cd")])
    finally:
        ro.close()


def test_odd_characters_in_the_directory_name(tmp_path: Path) -> None:
    directory = tmp_path / "odd #?% name"
    writer = Store(directory)
    writer.put(make_entry())
    writer.close()
    ro = Store(directory, read_only=True)
    try:
        assert ro.get(make_entry().key) == make_entry()
    finally:
        ro.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd #?% name"]


@pytest.mark.skipif(IS_ROOT, reason="root may write to a 0500 directory; auto-detection cannot be seen")
def test_read_only_directory_is_detected(store: Store, cache_dir: Path) -> None:
    store.put(make_entry())
    store.close()
    cache_dir.chmod(0o500)
    try:
        ro = Store()
        try:
            assert ro.read_only is True
            assert ro.get(make_entry().key) is not None
        finally:
            ro.close()
    finally:
        cache_dir.chmod(0o700)


def test_unwritable_directory_is_detected_through_os_access(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # The detection logic itself, runnable as root: pretend os.access denies writing.
    store.put(make_entry())
    store.close()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if mode & os.W_OK else real_access(path, mode))
    ro = Store()
    try:
        assert ro.read_only is True
        assert ro.get(make_entry().key) is not None
    finally:
        ro.close()


# ---------------------------------------------------------------------------- plans


def test_put_get_round_trip(store: Store) -> None:
    entry = make_entry(blob=bytes(range(256)) * 4)
    store.put(entry)
    got = store.get(entry.key)
    assert got == entry
    assert got is not None and got.checksum_ok()
    assert store.get(hexkey("ff")) is None
    replaced = make_entry(label="other", blob=b"x")
    store.put(replaced)  # same key: replaces
    assert store.get(entry.key) == replaced
    assert store.keys() == [entry.key]


def test_checksum_ok_detects_damage_and_empty_blobs() -> None:
    assert make_entry().checksum_ok()
    assert not make_entry(blob_sha256=sha256(b"other")).checksum_ok()
    assert not make_entry(blob=b"", blob_sha256=sha256(b"")).checksum_ok()


def test_a_key_is_named_by_a_unique_prefix_of_four_characters_or_more(store: Store) -> None:
    """``plancache rm 0`` removed whatever key began with 0: a prefix names a key only from
    four characters on, as git asks of an abbreviation."""
    keys = [hexkey("abc10"), hexkey("abc20"), hexkey("abd0"), hexkey("f000")]
    for k in keys:
        store.put(make_entry(k))
    assert store.key_named("abc1") == keys[0]
    assert store.key_named("ABC1") == keys[0]  # case-insensitive
    assert store.key_named(keys[2]) == keys[2]
    assert store.key_named("f000") == keys[3]
    for prefix, why in [("abc", "too short: give at least 4 characters"), ("f", "too short"), ("", "too short"),
                        ("abc0", "no entry with key 'abc0'"), ("zzzz", "no entry"), ("ab%c", "no entry"),  # never a LIKE pattern
                        ("0000", "no entry")]:  # fmt: skip
        with pytest.raises(EntryNotFoundError, match=why):
            store.key_named(prefix)
    store.put(make_entry(hexkey("abc11")))
    with pytest.raises(EntryNotFoundError, match="key prefix 'abc1' is ambiguous"):
        store.key_named("abc1")


def test_record_hits_adds_counts_in_one_transaction(store: Store) -> None:
    a, b = hexkey("a1"), hexkey("b2")
    store.put(make_entry(a, last_used_at=1000.0))
    store.put(make_entry(b, last_used_at=1000.0))
    statements: list[str] = []
    store.connection().set_trace_callback(statements.append)
    bookkeeping.record_hits(store, {a: (3, 2000.0), b: (1, 1500.0), hexkey("c3"): (5, 9999.0)})  # unknown key: ignored
    store.connection().set_trace_callback(None)
    assert sum(s.startswith("BEGIN") for s in statements) == 1
    assert sum(s.startswith("COMMIT") for s in statements) == 1
    rows = {r["key"]: r for r in maintenance.list_entries(store)}
    assert (rows[a]["hit_count"], rows[a]["last_used_at"]) == (3, 2000.0)
    assert (rows[b]["hit_count"], rows[b]["last_used_at"]) == (1, 1500.0)
    bookkeeping.record_hits(store, {a: (2, 1200.0)})  # an older time never moves last_used_at back
    entry = store.get(a)
    assert entry is not None and (entry.hit_count, entry.last_used_at) == (5, 2000.0)
    assert store.keys() == [a, b]


def test_record_no_hits_writes_nothing(store: Store) -> None:
    statements: list[str] = []
    store.connection().set_trace_callback(statements.append)
    bookkeeping.record_hits(store, {})
    store.connection().set_trace_callback(None)
    assert statements == []


def test_quarantine_moves_the_row(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    entry = make_entry(blob=b"damaged?")
    store.put(entry)
    store.put(make_entry(hexkey("cd")))
    assert store.quarantine(entry.key, "blob checksum mismatch") is True
    assert store.get(entry.key) is None
    assert store.keys() == [hexkey("cd")]
    [row] = store.quarantined()
    assert (row["key"], row["reason"], row["blob_size"]) == (entry.key, "blob checksum mismatch", len(b"damaged?"))
    assert store.counters() == {"quarantined": 1}
    assert store.quarantine(entry.key, "again") is False  # already gone
    assert store.quarantine(hexkey("ee"), "unknown") is False
    assert store.counters() == {"quarantined": 1}
    stored = db().execute("SELECT row_json, blob FROM quarantine").fetchone()
    meta = json.loads(stored["row_json"])
    assert meta["label"] == entry.label and "blob" not in meta
    assert bytes(stored["blob"]) == b"damaged?"
    assert store.stats()["quarantined"] == 1


def test_evict_to_deletes_least_recently_used_first(store: Store) -> None:
    blob = b"x" * 100
    for i, used in enumerate([4000.0, 1000.0, 3000.0, 2000.0]):
        store.put(make_entry(hexkey(f"{i}"), blob=blob, last_used_at=used))
    assert store.total_size() == 400
    assert store.evict_to(10_000) == 0
    assert store.evict_to(250) == 2  # only as many as needed, oldest first
    assert store.keys() == [hexkey("0"), hexkey("2")]
    bookkeeping.record_hits(store, {hexkey("2"): (1, 5000.0)})  # now 0 is least recently used
    assert store.evict_to(100) == 1
    assert store.keys() == [hexkey("2")]
    assert store.evict_to(0) == 1
    assert store.keys() == []
    assert store.total_size() == 0


def test_evict_to_many_entries_in_one_transaction(store: Store) -> None:
    for i in range(40):
        store.put(make_entry(f"{i:02x}".ljust(64, "0"), blob=b"y" * 10, last_used_at=float(i + 1)))
    assert store.total_size() == 400
    assert store.evict_to(55) == 35
    assert store.total_size() == 50
    assert store.keys() == [f"{i:02x}".ljust(64, "0") for i in range(35, 40)]


def test_delete_list_and_stats(store: Store) -> None:
    store.put(make_entry(hexkey("01"), last_used_at=10.0, blob=b"abc"))
    store.put(make_entry(hexkey("02"), last_used_at=20.0, blob=b"defg", env_id="fedcba9876543210", policy="heuristic"))
    listed = maintenance.list_entries(store)
    assert [e["key"] for e in listed] == [hexkey("02"), hexkey("01")]  # most recently used first
    assert "blob" not in listed[0]
    assert [e["key"] for e in maintenance.list_entries(store, env_id="fedcba9876543210")] == [hexkey("02")]
    stats = store.stats()
    assert (stats["entries"], stats["blob_bytes"], stats["environments"]) == (2, 7, 2)
    assert stats["by_policy"] == {"topk": 1, "heuristic": 1}
    assert stats["file_bytes"] > 0
    assert store.delete(hexkey("01")) is True
    assert store.delete(hexkey("01")) is False
    assert store.keys() == [hexkey("02")]


def test_counters_and_kernel_caches(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    bookkeeping.record_counters(store, {"rebuilds": 1}, wait=True)
    bookkeeping.record_counters(store, {"rebuilds": 2}, wait=True)
    assert store.counters() == {"rebuilds": 3}
    assert store.get_kernel_cache("env1") is None
    store.put_kernel_cache("env1", b"kernels", 7)
    assert store.get_kernel_cache("env1") == (b"kernels", 7)
    db().execute("UPDATE kernel_caches SET blob = ? WHERE env_id = 'env1'", (b"kernelz",))
    assert store.get_kernel_cache("env1") is None  # a damaged kernel cache is ignored


def test_verify_reports_checksum_mismatches(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    entry = make_entry()
    store.put(entry)
    assert maintenance.verify(store)["checksum"] == []
    db().execute("UPDATE plans SET blob = ? WHERE key = ?", (b"plan-bytez", entry.key))
    assert maintenance.verify(store)["checksum"] == [entry.key]


def test_connection_is_per_thread(store: Store) -> None:
    import threading

    seen: list[sqlite3.Connection] = []
    thread = threading.Thread(target=lambda: seen.append(store.connection()))
    thread.start()
    thread.join()
    assert seen[0] is not store.connection()
    assert store.connection() is store.connection()
    seen[0].close()


def test_store_errors_pickle_with_their_fields() -> None:
    error = CacheDirError("cannot create cache directory /x", path="/x")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is CacheDirError and copy.path == "/x" and str(copy) == str(error)
    too_new = pickle.loads(pickle.dumps(SchemaTooNewError("too new", path="/p", found=3, supported=1)))
    assert (too_new.found, too_new.supported) == (3, 1)


def test_writes_are_visible_to_another_connection_at_once(store: Store, db: Callable[[], sqlite3.Connection]) -> None:
    reader = db()
    store.put(make_entry())
    assert reader.execute("SELECT count(*) FROM plans").fetchone()[0] == 1
    store.put(make_entry(hexkey("cd")))
    assert reader.execute("SELECT count(*) FROM plans").fetchone()[0] == 2


def _schema_one_database(directory: Path) -> Path:
    """A database as plancache 0.1 with only migration 0001 wrote it, holding one row."""
    directory.mkdir(mode=0o700)
    path = directory / "plans.db"
    number, _name, sql = migrations()[0]
    assert number == 1
    conn = sqlite3.connect(path)
    conn.executescript(sql)
    conn.execute("PRAGMA user_version = 1")
    row = make_entry().row()
    del row["meta_sha256"], row["check_json"]  # schema 1 had no such columns
    conn.execute(f"INSERT INTO plans ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    conn.commit()
    conn.close()
    return path


def test_schema_one_database_is_migrated_and_its_rows_still_served(tmp_path: Path) -> None:
    _schema_one_database(tmp_path / "old")
    store = Store(tmp_path / "old")
    assert store.connection().execute("PRAGMA user_version").fetchone()[0] == len(migrations()) >= 2
    entry = store.get("ab" * 32)
    assert entry is not None and entry.meta_sha256 is None, "old rows keep NULL: nothing to compare"
    assert entry.checksum_ok()
    assert entry.check is None, "rows stored before candidates were compared are not marked checked"
    store.close()


def test_metadata_checksum_catches_an_altered_tensor_table(store: Store) -> None:

    entry = make_entry()
    store.put(entry)
    stored = store.get(entry.key)
    assert stored is not None and stored.meta_sha256 == stored.meta_digest()
    tensors = json.loads(store.connection().execute("SELECT tensors_json FROM plans").fetchone()[0])
    tensors[0]["dims"] = [2, 4]  # a flipped bit in a stored shape
    store.connection().execute("UPDATE plans SET tensors_json = ?", (json.dumps(tensors),))
    altered = store.get(entry.key)
    assert altered is not None and altered.checksum_ok(), "the blob itself is intact"
    assert altered.meta_sha256 != altered.meta_digest()


def test_an_entry_with_an_altered_output_shape_is_rebuilt(make_cache: Callable[..., Any], cache_dir: Path) -> None:
    from plancache.workflows import templates

    params = {"b": 1, "m": 4, "n": 4, "k": 4, "dtype": "float32"}
    key = make_cache().get(templates.build("matmul_bias_act", **params)).key
    conn = sqlite3.connect(cache_dir / DB_NAME)
    tensors = json.loads(conn.execute("SELECT tensors_json FROM plans").fetchone()[0])
    output = next(t for t in tensors if t["is_output"])
    output["dims"] = [1, 4, 5]  # outputs are not in the graph description: only the checksum sees this
    conn.execute("UPDATE plans SET tensors_json = ?", (json.dumps(tensors),))
    conn.commit()
    conn.close()
    cache = make_cache()
    plan = cache.get(templates.build("matmul_bias_act", **params))
    assert (plan.source, cache.counters["corrupt"]) == ("rebuilt", 1)
    assert plan.key == key and next(t for t in plan.tensors if t.is_output).dims == (1, 4, 4)


_EVICTING_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from test_store import make_entry
from plancache.store import Store
store = Store(sys.argv[1])
start_at = float(sys.argv[4])
while time.time() < start_at:
    time.sleep(0.001)
for i in range(10):
    store.put(make_entry(f"{sys.argv[2]}{i:02x}".ljust(64, "0"), blob=b"n" * 1000, last_used_at=5000.0 + i), max_bytes=15_000)
store.close()
"""


def test_two_processes_evicting_at_once_evict_only_what_the_cap_requires(cache_dir: Path) -> None:
    """Each process's eviction reads the total inside its own write transaction, so two
    writers never both delete for the same excess."""
    import subprocess
    import sys
    import time

    store = Store(cache_dir)
    for i in range(20):
        store.put(make_entry(f"{i:02x}".ljust(64, "0"), blob=b"o" * 1000, last_used_at=float(i + 1)))
    store.close()
    tests = str(Path(__file__).resolve().parent)
    start_at = str(time.time() + 1.0)
    writers = [
        subprocess.Popen([sys.executable, "-c", _EVICTING_WRITER, str(cache_dir), prefix, tests, start_at])
        for prefix in ("a", "b")
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    store = Store(cache_dir)
    try:
        total, kept = store.total_size(), store.keys()
        assert total == sum(len(store.get(k).blob) for k in kept)  # type: ignore[union-attr]
        assert 14_000 < total <= 15_000, f"{total} bytes left: the cap is 15,000 and every entry 1,000"
        assert len(kept) == 15
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_what_it_stores_after_its_parent_closes(tmp_path: Path) -> None:
    """A worker forked from a process that used the store stores plans after the parent has
    closed its own (or exited). The child inherited SQLite's record of the parent's file
    locks without the locks, so it held none: the parent's close, the last as far as the
    kernel could tell, checkpointed and deleted the WAL the child was writing to, and the
    child's plans were lost while every put reported success."""
    store = Store(tmp_path)
    store.put(make_entry(hexkey("a1")))
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            assert store.get(hexkey("a1")) is not None  # the child uses the store: its own connection
            os.write(from_child, b"1")
            os.read(to_child, 1)  # until the parent has closed its connection
            store.put(make_entry(hexkey("c3")))
            code = 0
        finally:
            os._exit(code)
    os.read(to_parent, 1)
    store.close()
    os.write(from_parent, b"2")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    fresh = Store(tmp_path)
    assert sorted(fresh.keys()) == sorted([hexkey("a1"), hexkey("c3")])
    assert fresh.connection().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    fresh.close()


def test_a_store_open_during_another_process_repair_writes_to_the_new_file(tmp_path: Path) -> None:
    """Another process finds the file damaged and moves it aside; a long-running process
    that had it open kept writing into the copy set aside, where no one looks, and never
    saw the plans stored in the new file."""
    first = Store(tmp_path)
    first.put(make_entry(hexkey("a1")))
    first.close()
    path = tmp_path / DB_NAME
    with sqlite3.connect(path) as conn:  # damage a page lookups never read: kernel_caches' root
        root, page = conn.execute(
            "SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master WHERE name = 'kernel_caches'"
        ).fetchone()
    conn.close()
    data = bytearray(path.read_bytes())
    data[(root - 1) * page : root * page] = b"\xff" * page
    path.write_bytes(bytes(data))
    running = Store(tmp_path)  # a process that has the store open, serving hits
    assert running.get(hexkey("a1")) is not None
    (tmp_path / (DB_NAME + ".damaged")).write_text("another process saw damage\n")
    repairing = Store(tmp_path)  # the next process to open repairs: the file is moved aside
    assert list(tmp_path.glob(DB_NAME + ".corrupt-*"))
    repairing.put(make_entry(hexkey("b2")))
    running.put(make_entry(hexkey("c3")))
    assert running.get(hexkey("b2")) is not None
    later = Store(tmp_path)
    # a1 is not salvaged: these hand-made entries' keys are not the hash of what they hold
    assert sorted(later.keys()) == sorted([hexkey("b2"), hexkey("c3")])
    for store in (running, repairing, later):
        store.close()
