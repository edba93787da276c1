"""Guarantees 3 to 6 of docs/reliability.md in one process: damaged and stale entries and
files, newer schemas, read-only and full disks, prune and verify (store and CLI), SQL that
never carries values, private files. Multi-process guarantees: test_concurrency.py."""

from __future__ import annotations

import ast
import json
import logging
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from graphs import ConvBiasRelu, MatmulBiasRelu, assert_runs_correctly
from harness import entry_for

import plancache
from plancache import EntryNotFoundError, PlanCache, SchemaTooNewError, Store
from plancache.cli import cli
from plancache.key import environment_id
from plancache.store import DB_NAME, maintenance, schema
from plancache.testing import CpuTestBackend

MakeCache = Callable[..., PlanCache]
Connect = Callable[[], sqlite3.Connection]
SPECS = [ConvBiasRelu(n=n) for n in (1, 2, 3)]
BACKEND = "plancache.testing:CpuTestBackend"


def stored(make_cache: MakeCache, specs: list[Any] = SPECS) -> list[str]:
    """Build and store ``specs`` with a cache that is then closed (no connection stays
    open: the tests below rewrite the file's bytes, which must never happen under SQLite)."""
    cache = make_cache()
    keys = [cache.get(spec.graph()).key for spec in specs]
    cache.close()
    return keys


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "plancache" and r.levelno >= logging.WARNING]


def aside_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"{DB_NAME}.corrupt-*") if not p.name.endswith(("-wal", "-shm")))


def all_served(cache: PlanCache, specs: list[Any] = SPECS) -> list[str]:
    """Every spec gets a plan that runs correctly; returns where each came from."""
    sources = []
    for spec in specs:
        plan = cache.get(spec.graph())
        assert_runs_correctly(plan, spec)
        sources.append(plan.source)
    return sources


# ---------------------------------------------------------------------------- 3. damaged entries


def test_a_flipped_byte_in_the_file_is_a_checksum_miss_rebuilt_from_its_engine(
    make_cache: MakeCache, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = stored(make_cache)
    store = Store()
    blob = store.get(keys[1]).blob  # type: ignore[union-attr]
    store.close()
    path = cache_dir / DB_NAME
    data = bytearray(path.read_bytes())
    at = _unique_offset(bytes(data), blob)
    data[at] ^= 0x20
    path.write_bytes(bytes(data))

    cache = make_cache()
    assert all_served(cache) == ["loaded", "rebuilt", "loaded"]
    assert (cache.counters["corrupt"], cache.counters["rebuilds"], cache.counters["builds"]) == (1, 1, 0)
    [q] = cache.store.quarantined()
    assert (q["key"], q["reason"]) == (keys[1], "blob checksum mismatch")
    assert "unusable" in " ".join(warnings_of(caplog))
    assert maintenance.verify(cache.store)["problems"] == []  # the rebuilt entry is whole again


def _unique_offset(data: bytes, blob: bytes) -> int:
    """An offset inside ``blob`` as the file stores it (a window found exactly once)."""
    for start in range(len(blob) // 2, len(blob) - 32, 16):
        window = blob[start : start + 32]
        if data.count(window) == 1:
            return data.index(window) + 16
    raise AssertionError("the blob is not stored contiguously anywhere")


@pytest.mark.parametrize(
    ("damage", "reason", "source"),
    [
        ("UPDATE plans SET tensors_json = replace(tensors_json, '[3,8,6,6]', '[3,8,6,7]')", "metadata checksum", "rebuilt"),
        ("UPDATE plans SET tensors_json = substr(tensors_json, 1, 20)", "cannot be decoded", "built"),
        ("UPDATE plans SET tensors_json = CAST(X'5bff' AS TEXT)", "cannot be decoded", "built"),
    ],
    ids=["altered-tensor-table", "truncated-json", "invalid-utf8"],
)
def test_damaged_metadata_is_quarantined_and_never_served(
    make_cache: MakeCache, db: Connect, damage: str, reason: str, source: str
) -> None:
    keys = stored(make_cache)
    db().execute(damage + " WHERE key = ?", (keys[2],))
    cache = make_cache()
    assert all_served(cache) == ["loaded", "loaded", source]
    [q] = cache.store.quarantined()
    assert q["key"] == keys[2] and reason in q["reason"]
    assert q["blob_size"] > 0  # kept for inspection, blob and all
    assert cache.counters["corrupt"] == 1


def test_a_description_altered_on_disk_is_found_by_every_reader(make_cache: MakeCache, db: Connect) -> None:
    # One check judges every stored entry (store.entry.problem): verify re-derives each key
    # from its row, and so does a hit, which then rebuilds the entry from its engine.
    keys = stored(make_cache)
    db().execute("UPDATE plans SET graph_json = replace(graph_json, '[3,8,6,6]', '[3,8,6,7]') WHERE key = ?", (keys[2],))
    report = maintenance.verify(Store(), fix=False)
    assert "key does not match" in report["foreign"][keys[2]]
    cache = make_cache()
    assert all_served(cache) == ["loaded", "loaded", "rebuilt"]
    assert maintenance.verify(cache.store)["problems"] == []


def test_an_entry_cudnn_refuses_after_an_upgrade_is_rebuilt_without_autotuning(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = stored(make_cache)
    backend = CpuTestBackend()

    def refuse(blob: bytes, tensors: Any, device: Any = None) -> Any:
        raise RuntimeError("CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH")

    monkeypatch.setattr(backend, "load", refuse)
    cache = make_cache(backend=backend)
    assert all_served(cache) == ["rebuilt"] * 3
    assert (cache.counters["builds"], cache.counters["rebuilds"]) == (0, 3)  # engine ids and knobs, no autotune
    assert sorted(q["key"] for q in cache.store.quarantined()) == sorted(keys)


# ---------------------------------------------------------------------------- 3. damaged files


def _truncate(path: Path) -> None:
    # Past the pages of the first rows: each blob of the test backend (about 4.9 KB, a frontend
    # graph with its attributes) spans more than one 4 KiB page.
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 7 // 10])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _zero_index_root(path: Path) -> None:
    """Zero the root page of the key index: the file opens, every lookup is malformed."""
    conn = sqlite3.connect(path)
    root, page_size = conn.execute("SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master "
                                   "WHERE name = 'sqlite_autoindex_plans_1'").fetchone()  # fmt: skip
    conn.close()
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size : root * page_size] = bytes(page_size)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _garbage], ids=["truncated", "garbage"])
def test_a_damaged_file_is_moved_aside_with_a_clear_message_and_plans_still_come(
    make_cache: MakeCache, cache_dir: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]
) -> None:
    specs = [ConvBiasRelu(n=n) for n in range(1, 13)]
    stored(make_cache, specs)
    path = cache_dir / DB_NAME
    damage(path)
    damaged = path.read_bytes()

    cache = make_cache()
    [aside] = aside_files(cache_dir)
    assert aside.read_bytes() == damaged  # kept as it was: nothing deleted
    [message] = [w for w in warnings_of(caplog) if "moved it to" in w]
    assert str(aside) in message and "started a new store" in message
    sources = all_served(cache, specs)
    assert sources.count("loaded") + sources.count("built") == len(specs)
    if damage is _truncate:  # the entries on the pages that remain were copied over
        assert sources.count("loaded") >= 1
    assert maintenance.verify(cache.store)["problems"] == []


def test_a_damaged_page_is_a_miss_now_and_the_file_is_set_aside_at_the_next_open(
    make_cache: MakeCache, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stored(make_cache)
    _zero_index_root(cache_dir / DB_NAME)
    first = make_cache()  # opens fine: the damage is found by the first lookup
    assert aside_files(cache_dir) == []
    assert all_served(first) == ["built"] * 3
    assert first.counters["store_errors"] >= 3 and first.counters["unpersisted"] == 3
    assert (cache_dir / f"{DB_NAME}.damaged").exists()
    first.close()

    second = make_cache()
    [aside] = aside_files(cache_dir)
    assert any(str(aside) in w for w in warnings_of(caplog))
    assert all_served(second) == ["loaded"] * 3  # every row was still readable by rowid: copied
    assert not (cache_dir / f"{DB_NAME}.damaged").exists()
    assert maintenance.verify(second.store)["problems"] == []


def test_a_stale_damage_marker_costs_one_check_and_changes_nothing(make_cache: MakeCache, cache_dir: Path) -> None:
    stored(make_cache)
    (cache_dir / f"{DB_NAME}.damaged").write_text("a transient error")
    cache = make_cache()
    assert aside_files(cache_dir) == [] and not (cache_dir / f"{DB_NAME}.damaged").exists()
    assert all_served(cache) == ["loaded"] * 3


def test_a_newer_schema_never_fails_the_program_and_the_file_is_untouched(
    make_cache: MakeCache, cache_dir: Path, db: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    stored(make_cache)
    conn = db()
    conn.execute("PRAGMA user_version = 42")
    conn.close()
    before = {p.name: p.read_bytes() for p in cache_dir.iterdir() if p.is_file()}
    with caplog.at_level(logging.WARNING, logger="plancache"):
        cache = PlanCache(backend=CpuTestBackend(), auto_prime=False)  # another venv upgraded the shared store
        plan = cache.get(SPECS[0].graph())
        cache.get(SPECS[1].graph())
    assert plan.source == "built" and cache.store is None and cache.counters["unpersisted"] == 2
    notes = [r.getMessage() for r in caplog.records if "not storing plans" in r.getMessage()]
    assert len(notes) == 1 and "newer than this plancache supports" in notes[0] and "upgrade plancache" in notes[0]
    cache.close()
    with pytest.raises(SchemaTooNewError, match="newer than this plancache supports") as info:
        plancache.Store(cache_dir)
    assert info.value.found == 42
    result = CliRunner().invoke(cli, ["stats"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "schema 42" in result.output
    assert {p.name: p.read_bytes() for p in cache_dir.iterdir() if p.is_file()} == before


# ---------------------------------------------------------------------------- 4. read-only and full disks


def test_a_read_only_cache_serves_hits_builds_misses_in_memory_and_warns_once(
    make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored(make_cache, SPECS[:1])
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache_dir.rglob("*")}
    cache_dir.chmod(0o500)  # baked into an image; root ignores modes, so os.access says it too
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode & os.W_OK else real_access(p, mode))
    try:
        cache = make_cache()
        assert cache.store.read_only
        assert all_served(cache) == ["loaded", "built", "built"]
        assert all_served(cache) == ["loaded", "built", "built"]  # from memory the second time
        assert (cache.counters["builds"], cache.counters["unpersisted"]) == (2, 2)
        cache.close()
    finally:
        cache_dir.chmod(0o700)
    assert len(warnings_of(caplog)) == 1 and "read-only" in warnings_of(caplog)[0]
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache_dir.rglob("*")} == before


def _fill_disk(cache: PlanCache) -> None:
    """A real SQLITE_FULL: no page may be added to the database any more."""
    conn = cache.store.connection()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    assert conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0] == pages


def test_a_full_disk_still_gives_working_plans_one_warning_and_an_intact_store(
    make_cache: MakeCache, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = stored(make_cache)
    cache = make_cache(max_size=1 << 30)
    _fill_disk(cache)
    new = [MatmulBiasRelu(), ConvBiasRelu(n=7)]
    assert all_served(cache, new) == ["built", "built"]
    assert all_served(cache, new + SPECS) == ["built", "built", "loaded", "loaded", "loaded"]
    assert (cache.counters["store_errors"], cache.counters["unpersisted"]) == (2, 2)
    [warning] = warnings_of(caplog)
    assert "could not store plan" in warning and "full" in warning
    cache.close()
    store = Store()
    assert store.keys() == sorted(keys)  # earlier entries intact, nothing half-written
    assert maintenance.verify(store)["problems"] == []
    store.close()


def test_a_full_disk_while_quarantining_a_damaged_entry_still_gives_a_plan(
    make_cache: MakeCache, db: Connect, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store of 4 KB pages (as plancache made them before): the quarantined row overflows
    # its table's one page, so the full disk refuses it (16 KB pages would hold it).
    monkeypatch.setattr(schema, "PAGE_SIZE", 4096)
    keys = stored(make_cache)
    db().execute("UPDATE plans SET blob = zeroblob(length(blob)) WHERE key = ?", (keys[0],))
    cache = make_cache()
    _fill_disk(cache)
    assert all_served(cache) == ["rebuilt", "loaded", "loaded"]
    unusable, no_room = warnings_of(caplog)
    assert "unusable" in unusable and "could not quarantine" in no_room and "database or disk is full" in no_room
    # The quarantine row needed new pages and failed; the rebuilt plan replaced the damaged
    # row in its own pages. Either way the store stays whole.
    assert maintenance.verify(cache.store)["problems"] == [] and cache.store.quarantined() == []


def test_no_lock_file_still_gives_a_stored_plan(make_cache: MakeCache, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache()
    (cache_dir / "locks").write_text("not a directory")
    assert all_served(cache, SPECS[:2]) == ["built", "built"]
    assert len(cache.store.keys()) == 2
    assert [w for w in warnings_of(caplog) if "build lock" in w] == [warnings_of(caplog)[0]]


# ---------------------------------------------------------------------------- 5. prune and verify


@pytest.fixture
def two_environments(make_cache: MakeCache, db: Connect) -> Iterator[dict[str, Any]]:
    """Entries of this environment (one old, one quarantined) and of another one."""
    here = make_cache()
    keys = [here.get(spec.graph()).key for spec in SPECS]
    here.store.quarantine(keys[2], "test")
    here.store.put_kernel_cache(environment_id(here.environment), b"k", None)
    here.close()
    other = make_cache(backend=CpuTestBackend(environment={"cudnn_backend_version": "90100"}))
    foreign = other.get(SPECS[0].graph()).key
    other.store.put_kernel_cache(environment_id(other.environment), b"k", None)
    other.close()
    db().execute("UPDATE plans SET last_used_at = 1000 WHERE key = ?", (keys[1],))
    yield {"keys": keys, "foreign": foreign, "env_id": environment_id(CpuTestBackend().environment())}


def test_prune_removes_other_environments_old_and_quarantined_entries_in_small_batches(
    two_environments: dict[str, Any], cache_dir: Path
) -> None:
    keys, env_id = two_environments["keys"], two_environments["env_id"]
    store = Store()
    dry = maintenance.prune(store, env_ids_keep={env_id}, older_than_s=86400, quarantined=True, dry_run=True)
    assert sorted(r["key"] for r in dry["removed"]) == sorted([two_environments["foreign"], keys[1]])
    assert len(store.keys()) == 3 and len(store.quarantined()) == 1  # a dry run changes nothing
    statements: list[str] = []
    store.connection().set_trace_callback(statements.append)
    report = maintenance.prune(store, env_ids_keep={env_id}, older_than_s=86400, quarantined=True, batch=1)
    assert {r["reason"] for r in report["removed"]} == {"other environment", "unused since 1970-01-01"}
    assert store.keys() == [keys[0]]
    assert store.quarantined() == [] and report["quarantined"] == 1
    assert report["kernel_caches"] == [e for e in report["kernel_caches"] if e != env_id] and len(report["kernel_caches"]) == 1
    assert store.get_kernel_cache(env_id) is not None
    assert statements.count("BEGIN IMMEDIATE") >= 4  # one entry per transaction with batch=1
    store.close()


def test_verify_finds_every_kind_of_problem_and_fix_quarantines_without_deleting(make_cache: MakeCache, db: Connect) -> None:
    keys = stored(make_cache)
    conn = db()
    conn.execute("UPDATE plans SET blob = zeroblob(length(blob)) WHERE key = ?", (keys[0],))  # checksum
    conn.execute("UPDATE plans SET env_id = 'elsewhere' WHERE key = ?", (keys[1],))  # foreign
    conn.execute("UPDATE plans SET timing_json = CAST(X'ff' AS TEXT) WHERE key = ?", (keys[2],))  # undecodable
    conn.execute("INSERT INTO kernel_caches VALUES ('env', x'00', 'nope', NULL, 0)")
    store = Store()
    report = maintenance.verify(store)
    assert report["checksum"] == [keys[0]] and list(report["foreign"]) == [keys[1]]
    assert len(report["damaged"]) == 1 and report["kernel_caches"] == ["env"]
    assert len(report["problems"]) == 4 and report["integrity"] == []
    assert len(store.keys()) == 3  # verify alone changes nothing
    fixed = maintenance.verify(store, fix=True)["fixed"]
    assert sorted(fixed["quarantined"][:2]) == sorted(keys[:2]) and len(fixed["quarantined"]) == 3
    assert fixed["kernel_caches_removed"] == ["env"] and fixed.get("moved_aside") is None
    assert store.keys() == [] and len(store.quarantined()) == 3  # kept for inspection
    assert maintenance.verify(store)["problems"] == []
    store.close()


def test_verify_fix_never_quarantines_what_a_live_cache_rebuilt_meanwhile(make_cache: MakeCache, db: Connect) -> None:
    """verify reads (and loads) every row before it fixes; a live cache that meets the
    damaged row meanwhile quarantines it and stores a healthy rebuild, which verify's fix
    took out of service again (it quarantined by key alone)."""
    keys = stored(make_cache)
    victim = sorted(keys)[0]
    db().execute("UPDATE plans SET blob = zeroblob(length(blob)) WHERE key = ?", (victim,))
    live = make_cache()
    rebuilt: list[Any] = []

    def load_while_a_live_cache_rebuilds(entry: Any) -> None:
        if not rebuilt:  # the first sound row verify loads: meanwhile, the live lookup
            rebuilt.append(live.get(SPECS[keys.index(victim)].graph()))

    store = Store()
    report = maintenance.verify(store, fix=True, load=load_while_a_live_cache_rebuilds)
    assert rebuilt and rebuilt[0].source == "rebuilt" and live.counters["corrupt"] == 1
    assert report["fixed"]["quarantined"] == []  # the row it judged was gone already
    assert store.get(victim) is not None and len(store.quarantined()) == 1
    live.close()
    store.close()


def test_verify_fix_sets_a_damaged_file_aside_and_keeps_every_readable_entry(make_cache: MakeCache, cache_dir: Path) -> None:
    keys = stored(make_cache)
    _zero_index_root(cache_dir / DB_NAME)
    damaged = (cache_dir / DB_NAME).read_bytes()
    store = Store()
    report = maintenance.verify(store)
    assert report["integrity"] and report["problems"]
    assert aside_files(cache_dir) == []  # without --fix the file is only read
    fixed = maintenance.verify(store, fix=True)["fixed"]
    [aside] = aside_files(cache_dir)
    assert fixed["moved_aside"] == str(aside) and fixed["salvaged"] == 3
    assert aside.read_bytes() == damaged
    assert store.keys() == sorted(keys) and maintenance.verify(store)["problems"] == []
    store.close()


def test_verify_deserializes_this_environments_blobs(two_environments: dict[str, Any]) -> None:
    keys, env_id = two_environments["keys"], two_environments["env_id"]
    backend = CpuTestBackend()
    seen: list[str] = []

    def load(entry: Any) -> None:
        seen.append(entry.key)
        if entry.key == keys[1]:
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM")
        backend.load(entry.blob, [])

    store = Store()
    report = maintenance.verify(store, load=load, env_id=env_id)
    assert report["deserialize"] == {"env_id": env_id, "checked": 2, "skipped": 1,
                                     "failed": {keys[1]: "deserialize failed: RuntimeError: CUDNN_STATUS_BAD_PARAM"}}  # fmt: skip
    assert sorted(seen) == sorted(keys[:2])
    assert maintenance.verify(store, fix=True, load=load, env_id=env_id)["fixed"]["quarantined"] == [keys[1]]
    store.close()


# ---------------------------------------------------------------------------- CLI: verify, prune, rm


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def test_cli_verify_exit_codes_json_and_fix(make_cache: MakeCache, db: Connect) -> None:
    keys = stored(make_cache)
    ok = invoke("verify")
    assert ok.exit_code == 0 and ok.output.endswith("ok\n")
    db().execute("UPDATE plans SET blob = x'00' WHERE key = ?", (keys[0],))
    found = invoke("verify", "--json")
    assert found.exit_code == 3
    assert json.loads(found.output)["problems"] == [f"{keys[0]}: blob checksum mismatch"]
    fixed = invoke("verify", "--fix")
    assert fixed.exit_code == 3 and f"fixed: quarantined {keys[0]}" in fixed.output
    assert invoke("verify").exit_code == 0


def test_cli_verify_deserialize_uses_the_chosen_backend_or_says_it_needs_a_gpu(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored(make_cache)
    no_gpu = invoke("verify", "--deserialize")
    assert no_gpu.exit_code == 1
    assert no_gpu.output.count("\n") == 1 and "verify --deserialize needs this machine's GPU" in no_gpu.output
    monkeypatch.setenv("PLANCACHE_BACKEND", BACKEND)
    result = invoke("verify", "--deserialize", "--json")
    assert result.exit_code == 0
    assert json.loads(result.output)["deserialize"]["checked"] == 3


def test_cli_prune(two_environments: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    keys = two_environments["keys"]
    assert invoke("prune").exit_code == 2  # nothing asked
    no_gpu = invoke("prune", "--other-environments")
    assert no_gpu.exit_code == 1 and "GPU" in no_gpu.output
    dry = invoke("prune", "--older-than", "30", "--dry-run")
    assert dry.exit_code == 0 and f"would remove {keys[1][:12]}" in dry.output
    monkeypatch.setenv("PLANCACHE_BACKEND", BACKEND)
    result = invoke("prune", "--other-environments", "--older-than", "30", "--quarantined", "--json")
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert sorted(r["key"] for r in report["removed"]) == sorted([keys[1], two_environments["foreign"]])
    assert report["quarantined"] == 1 and not report["dry_run"]
    store = Store()
    assert store.keys() == [keys[0]] and store.quarantined() == []
    store.close()


def test_cli_rm(make_cache: MakeCache) -> None:
    keys = stored(make_cache)
    result = invoke("rm", keys[0][:10], "--json")
    assert result.exit_code == 0 and json.loads(result.output) == {"removed": [keys[0]]}
    missing = invoke("rm", keys[0][:10])
    assert missing.exit_code == 1 and "no entry" in missing.output
    store = Store()
    assert store.keys() == sorted(keys[1:])
    store.close()


# ---------------------------------------------------------------------------- 6. security


def test_values_never_become_sql(store: Store) -> None:
    hostile = "x'); DROP TABLE plans; --"
    entry = entry_for(hostile, 1024)
    entry.label = hostile
    store.put(entry)
    with pytest.raises(EntryNotFoundError, match="no entry"):
        store.key_named("'; DROP TABLE plans; --")
    assert maintenance.prune(store, env_ids_keep={hostile, entry.env_id}, older_than_s=None, quarantined=False)["removed"] == []
    store.quarantine(entry.key, hostile)
    assert store.quarantined()[0]["reason"] == hostile
    assert invoke("rm", hostile).exit_code == 1
    assert store.connection().execute("SELECT count(*) FROM quarantine").fetchone()[0] == 1  # tables intact


def test_sql_text_is_built_only_from_constants() -> None:
    # Every SQL string the store and the cache run is a literal, a module constant or an
    # f-string of these few known, non-value parts; values always go in as parameters.
    allowed = {"BUSY_TIMEOUT_MS", "PAGE_SIZE", "int(number)", "pragma", "where"}
    source_dir = Path(plancache.__file__).parent
    sources = (
        "store/store.py",
        "store/schema.py",
        "store/recovery.py",
        "store/maintenance.py",
        "store/quarantine.py",
        "cache/cache.py",
        "tiers/local.py",
    )
    for name in sources:
        tree = ast.parse((source_dir / name).read_text())
        for call in ast.walk(tree):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in ("execute", "executemany")
            ):
                sql = call.args[0]
                if isinstance(sql, ast.JoinedStr):
                    parts = {ast.unparse(v.value) for v in sql.values if isinstance(v, ast.FormattedValue)}
                    assert parts <= allowed, f"{name}:{call.lineno}: SQL built from {parts - allowed}"
                else:
                    assert isinstance(sql, (ast.Constant, ast.Name, ast.BinOp)), f"{name}:{call.lineno}"


def test_lock_and_marker_files_are_private(make_cache: MakeCache, cache_dir: Path) -> None:
    stored(make_cache, SPECS[:1])
    store = Store()
    store.note_damage(sqlite3.DatabaseError("database disk image is malformed"))
    store.close()
    Store().close()  # checks the marker, finds the file healthy, removes the marker
    assert stat.S_IMODE((cache_dir / "locks").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.lstat().st_mode) for p in (cache_dir / "locks").iterdir()} == {0o600}  # the build's, kept
    store = Store()
    store.note_damage(sqlite3.DatabaseError("database disk image is malformed"))
    assert stat.S_IMODE((cache_dir / f"{DB_NAME}.damaged").stat().st_mode) == 0o600
    store.close()
