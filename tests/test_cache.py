"""PlanCache end to end on the CPU test backend: misses, hits, damaged entries, read-only
and failing stores, eviction, and the builder decorator."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from graphs import EXAMPLES, ConvBiasRelu, assert_runs_correctly
from harness import end_if_stuck

import plancache.cache
import plancache.store.bookkeeping
import plancache.tiers.local
from plancache import BuildError, BuildOptions, InvalidGraphError, LockTimeoutError, PlanCache, PlanCacheError, Store, StoreError
from plancache.cache.builder import _signature
from plancache.cache.counters import NAMES as COUNTERS
from plancache.key import environment_id
from plancache.store import DB_NAME, maintenance
from plancache.testing import CpuTestBackend, plans

MakeCache = Callable[..., PlanCache]
Connect = Callable[[], sqlite3.Connection]
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN", "COMMIT", "CREATE", "DROP", "ALTER")


def build_and_close(make_cache: MakeCache, *specs: Any) -> list[Any]:
    """Store plans for ``specs`` with a first cache that is then closed."""
    first = make_cache()
    plans = [first.get(spec.graph()) for spec in specs]
    assert [p.source for p in plans] == ["built"] * len(specs)
    first.close()
    return plans


def damage_blob(connect: Connect, key: str) -> bytes:
    """Flip one bit in the middle of a stored blob, leaving its recorded checksum."""
    conn = connect()
    blob = bytes(conn.execute("SELECT blob FROM plans WHERE key = ?", (key,)).fetchone()[0])
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x01
    conn.execute("UPDATE plans SET blob = ? WHERE key = ?", (bytes(damaged), key))
    return blob


def file_state(directory: Path) -> dict[str, tuple[int, int]]:
    state = {}
    for suffix in ("", "-wal"):
        path = directory / (DB_NAME + suffix)
        if path.exists():
            st = path.stat()
            state[path.name] = (st.st_size, st.st_mtime_ns)
    return state


# ---------------------------------------------------------------------------- miss, hit


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_miss_then_hit_in_a_new_instance(name: str, make_cache: MakeCache) -> None:
    spec = EXAMPLES[name]
    first = make_cache()
    built = first.get(spec.graph())
    assert built.source == "built"
    assert (first.counters["misses"], first.counters["builds"], first.counters["hits"]) == (1, 1, 0)
    assert_runs_correctly(built, spec)
    first.close()

    backend = CpuTestBackend()
    second = make_cache(backend=backend)
    loaded = second.get(spec.graph())
    assert loaded.source == "loaded"
    assert (second.counters["misses"], second.counters["builds"], second.counters["hits"]) == (0, 0, 1)
    assert backend.loads == 1
    assert (loaded.key, loaded.engine, loaded.tensors, loaded.workspace_size) == (
        built.key, built.engine, built.tensors, built.workspace_size,
    )  # fmt: skip
    assert_runs_correctly(loaded, spec, seed=1)


def test_memory_hit_returns_the_same_plan(cache: PlanCache, backend: CpuTestBackend) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    plan = cache.get(spec.graph())
    assert cache.get(spec.graph()) is plan  # a new, equal graph object
    renamed = cache.get(dataclasses.replace(spec, prefix="other_").graph())
    assert renamed.native is plan.native and renamed.key == plan.key  # one loaded plan...
    assert set(renamed.names) == {f"other_{n}" for n in plan.names}  # ...under the caller's names
    assert cache.counters["memory_hits"] == 2
    assert cache.counters["misses"] == 1
    assert backend.loads == 1, "the miss's own load back from the blob; memory hits load nothing"


def test_hits_write_nothing_until_flush(make_cache: MakeCache, cache_dir: Path, db: Connect) -> None:
    specs = [ConvBiasRelu(n=n) for n in (1, 2, 3)]
    build_and_close(make_cache, *specs)
    second = make_cache()
    statements: list[str] = []
    second.store.connection().set_trace_callback(statements.append)
    before = file_state(cache_dir)
    assert DB_NAME in before
    for _ in range(40):
        plans = [second.get(spec.graph()) for spec in specs]
    assert [p.source for p in plans] == ["loaded"] * 3
    assert (second.counters["hits"], second.counters["memory_hits"]) == (3, 117)
    assert [s for s in statements if s.lstrip().upper().startswith(WRITES)] == []
    assert file_state(cache_dir) == before
    assert {r["hit_count"] for r in db().execute("SELECT hit_count FROM plans")} == {0}

    second.flush()
    assert any(s.lstrip().upper().startswith("UPDATE") for s in statements)
    # every lookup counts, from the store or from memory, so busy plans stay young for eviction
    assert sorted(r["hit_count"] for r in db().execute("SELECT hit_count FROM plans")) == [40, 40, 40]
    second.flush()  # nothing pending: nothing counted twice
    assert sorted(r["hit_count"] for r in db().execute("SELECT hit_count FROM plans")) == [40, 40, 40]


def test_hit_counts_are_written_by_a_background_thread(
    make_cache: MakeCache, db: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plancache.tiers.local, "HIT_FLUSH_SECONDS", 0.05)
    specs = [ConvBiasRelu(n=n) for n in range(1, 6)]
    build_and_close(make_cache, *specs)
    second = make_cache()
    for spec in specs:
        second.get(spec.graph())

    def counted() -> int:
        return sum(r[0] for r in db().execute("SELECT hit_count FROM plans"))

    deadline = time.monotonic() + 10
    while counted() < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counted() == 5  # written off the lookup path, without a flush() or close()


def test_a_hit_never_waits_for_another_process_holding_the_write_lock(
    make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune, import or prewarm elsewhere holds the write lock (here until all the lookups
    are done, 60 s at most): lookups, hit bookkeeping included, go on; the counts wait for
    their turn instead of the caller."""
    monkeypatch.setattr(plancache.tiers.local, "HIT_FLUSH_SECONDS", 0.05)
    specs = [ConvBiasRelu(n=n) for n in range(1, 4)]
    build_and_close(make_cache, *specs)
    second = make_cache()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import select, sqlite3, sys\n"
        f"c = sqlite3.connect({str(cache_dir / DB_NAME)!r}, isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
        "select.select([sys.stdin], [], [], 60); c.execute('COMMIT')\n"  # until the test closes stdin
    )], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        worst = 0.0
        for _ in range(20):  # counted, not timed: each lookup is a hit; the flusher runs every 0.05 s between
            for spec in specs:
                started = time.perf_counter()
                second.get(spec.graph())
                worst = max(worst, time.perf_counter() - started)
            time.sleep(0.05)
        # A hit that waited for the lock would wait until the holder commits (60 s) or the
        # store's busy timeout (30 s); the bound is far above a busy machine's scheduling
        # noise and far below that wait.
        assert worst < 3.0, f"a hit waited {worst * 1000:.0f} ms behind another process's write lock"
        assert holder.poll() is None, "the write lock was let go while the lookups ran"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=90)
        if holder.stdout is not None:
            holder.stdout.close()
    second.flush()  # once the lock is gone, nothing was lost
    conn = sqlite3.connect(cache_dir / DB_NAME)
    try:
        assert conn.execute("SELECT sum(hit_count) FROM plans").fetchone()[0] > 3
    finally:
        conn.close()


def test_close_never_waits_for_another_process_holding_the_write_lock(
    make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() writes what is pending without waiting: the Redis tier's counters waited
    out the store's whole busy timeout (30 s) behind another process's write."""
    cache = make_cache()
    cache.get(EXAMPLES["conv_bias_relu"].graph())
    monkeypatch.setattr(cache, "_remote_counter_deltas", lambda: {"remote_hits": 3})
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"c = sqlite3.connect({str(cache_dir / DB_NAME)!r}, isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.read(); c.execute('COMMIT')\n"
    )], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        cache.close()
        took = time.monotonic() - started
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        if holder.stdout is not None:
            holder.stdout.close()
    assert took < 5, f"close() waited {took:.1f} s for another process's write"


def test_flush_writes_the_counts_the_background_writer_has_in_hand(
    make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background writer takes the batch out, finds the store busy and puts it back; a
    flush() called meanwhile returns only once the counts are in the store."""
    monkeypatch.setattr(plancache.tiers.local, "HIT_FLUSH_SECONDS", 0.01)
    spec = EXAMPLES["conv_bias_relu"]
    build_and_close(make_cache, spec)
    in_hand = threading.Event()
    real = plancache.store.bookkeeping.record_hits

    def busy_once_in_the_background(store: Any, hits: Any, *, wait: bool = True) -> bool:
        if threading.current_thread().name == "plancache-hits" and not in_hand.is_set():
            in_hand.set()
            time.sleep(0.3)
            return False  # as a busy store answers a writer that does not wait
        return real(store, hits, wait=wait)

    monkeypatch.setattr(plancache.store.bookkeeping, "record_hits", busy_once_in_the_background)
    cache = make_cache()
    for _ in range(3):
        cache.get(spec.graph())
    assert in_hand.wait(5), "the background writer never ran"
    cache.flush()
    conn = sqlite3.connect(cache_dir / DB_NAME)
    try:
        assert conn.execute("SELECT sum(hit_count) FROM plans").fetchone()[0] == 3
    finally:
        conn.close()
    cache.close()


def test_a_store_hit_leaves_per_process_work_to_the_cache_opening(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The judging code's version (its source read and hashed) and the start of the
    hit-count writer are done on a thread as the cache opens: the first store hit starts
    no thread and reads no source."""
    spec = EXAMPLES["conv_bias_relu"]
    build_and_close(make_cache, spec)
    plancache.cache.judging.code_version.cache_clear()
    cache = make_cache()
    for thread in threading.enumerate():
        if thread.name == "plancache-prepare":
            thread.join(10)
    assert plancache.cache.judging.code_version.cache_info().currsize == 1
    started: list[str] = []
    real_start = threading.Thread.start

    def noted_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", noted_start)
    read: list[str] = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read.append(str(path)) or real_read(path))
    assert cache.get(spec.graph()).source == "loaded"
    assert started == [] and read == []
    cache.close()


def test_context_manager_flushes_on_exit(make_cache: MakeCache, db: Connect) -> None:
    spec = EXAMPLES["causal_sdpa"]
    build_and_close(make_cache, spec)
    with PlanCache(backend=CpuTestBackend()) as cache:
        assert cache.get(spec.graph()).source == "loaded"
    assert db().execute("SELECT hit_count FROM plans").fetchone()[0] == 1


def test_counters_and_stats(make_cache: MakeCache) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    first = make_cache()
    first.get(spec.graph())
    first.get(spec.graph())
    stats = first.stats()
    assert set(stats["process"]) == {*COUNTERS, "memory_plans", "memory_evicted", "native_fallbacks", "native_fallback_reasons"}
    assert stats["process"].pop("native_fallback_reasons") == {}
    assert stats["process"]["misses"] == 1 and stats["process"]["memory_hits"] == 1
    assert stats["process"]["memory_plans"] == 1
    assert all(v == 0 for k, v in stats["process"].items() if k not in ("misses", "builds", "memory_hits", "memory_plans"))
    assert stats["store"]["entries"] == 1
    assert stats["store"]["by_policy"] == {"topk": 1}


def test_stored_entry_records_how_the_plan_was_made(cache: PlanCache, backend: CpuTestBackend) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    plan = cache.get(spec.graph())
    entry = cache.store.get(plan.key)
    assert entry is not None and entry.checksum_ok()
    assert entry.label == "CONV_FPROP+POINTWISE(bias)+POINTWISE(relu)"
    assert entry.backend == "cpu-test"
    assert entry.policy == "topk"
    assert entry.environment == backend.environment()
    assert entry.env_id == environment_id(backend.environment())
    assert entry.options == BuildOptions().to_dict()
    assert entry.description == cache.key(spec.graph()).parts["graph"]
    assert entry.tensors == [t.to_dict() for t in plan.tensors]
    assert plan.engine is not None and entry.engine == plan.engine.to_dict()
    assert len(entry.candidates) == backend.candidate_count
    chosen = [c for c in entry.candidates if c["status"] == "chosen"]
    assert [c["index"] for c in chosen] == [plan.engine.engine_id]
    assert entry.timing["runs"] == cache.timing.runs
    json.dumps(entry.candidates)


def test_autotuning_is_deterministic_and_skips_unbuildable(make_cache: MakeCache, tmp_path: Path) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    winner = make_cache().get(spec.graph()).engine
    again = make_cache(directory=tmp_path / "other").get(spec.graph()).engine
    assert winner == again
    assert winner is not None and winner.engine_id is not None
    avoiding = make_cache(directory=tmp_path / "third", backend=CpuTestBackend(unbuildable=[winner.engine_id]))
    other = avoiding.get(spec.graph()).engine
    assert other is not None and other.engine_id != winner.engine_id


def test_options_per_call_make_another_entry(cache: PlanCache) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    default = cache.get(spec.graph())
    heuristic = cache.get(spec.graph(), options=BuildOptions(policy="heuristic"))
    assert heuristic is not default and heuristic.key != default.key
    entry = cache.store.get(heuristic.key)
    assert entry is not None and entry.policy == "heuristic"
    assert heuristic.engine is not None and heuristic.engine.engine_id == 0  # first buildable
    assert entry.candidates[0]["status"] == "chosen"
    assert len(cache.store.keys()) == 2


def test_recorders_see_every_lookup(cache: PlanCache) -> None:
    seen: list[tuple[Any, str]] = []
    cache.add_recorder(lambda graph, key: seen.append((graph, key.digest)))
    graphs = [EXAMPLES["conv_bias_relu"].graph() for _ in range(2)]
    plans = [cache.get(g) for g in graphs]
    assert [(g, p.key) for g, p in zip(graphs, plans)] == seen


def test_invalid_graph_and_build_error_store_nothing(make_cache: MakeCache) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    graph = spec.graph()
    graph.tensors["X"].uid_assigned = False  # as if set_uid() had never been called
    cache = make_cache()
    with pytest.raises(InvalidGraphError, match="'X' has no uid"):
        cache.get(graph)
    failing = make_cache(backend=CpuTestBackend(unbuildable=range(4)))
    with pytest.raises(BuildError, match="none of the 4 candidate plans"):
        failing.get(spec.graph())
    assert failing.counters["builds"] == 0
    assert failing.store.keys() == []


# ---------------------------------------------------------------------------- damaged entries


def test_corrupted_blob_is_quarantined_and_rebuilt_from_its_engine(
    make_cache: MakeCache, db: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    [original] = build_and_close(make_cache, spec)
    good_blob = damage_blob(db, original.key)

    backend = CpuTestBackend()
    second = make_cache(backend=backend)
    plan = second.get(spec.graph())
    assert plan.source == "rebuilt"
    assert plan.engine == original.engine  # no autotuning: the recorded engine
    # One load: the rebuilt plan's blob, loaded back before it was stored; the damaged blob never reached the library.
    assert backend.loads == 1
    counters = second.counters
    assert (counters["corrupt"], counters["rebuilds"], counters["misses"], counters["hits"]) == (1, 1, 0, 0)
    [quarantined] = second.store.quarantined()
    assert (quarantined["key"], quarantined["reason"]) == (original.key, "blob checksum mismatch")
    assert second.store.counters()["quarantined"] == 1
    assert "unusable" in caplog.text
    assert_runs_correctly(plan, spec)
    entry = second.store.get(original.key)
    assert entry is not None and entry.checksum_ok() and plancache.store.problem(entry) is None
    assert plans.decode(entry.blob)["engine"] == plans.decode(good_blob)["engine"]
    second.close()
    assert make_cache().get(spec.graph()).source == "loaded"


def test_backend_refusing_a_blob_is_quarantined_and_rebuilt(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EXAMPLES["causal_sdpa"]
    [original] = build_and_close(make_cache, spec)
    backend = CpuTestBackend()

    def refuse(blob: bytes, tensors: Any, device: Any = None) -> Any:
        raise RuntimeError("CUDNN_STATUS_BAD_PARAM: cannot deserialize")

    monkeypatch.setattr(backend, "load", refuse)
    second = make_cache(backend=backend)
    plan = second.get(spec.graph())
    assert plan.source == "rebuilt"
    assert plan.engine == original.engine
    [quarantined] = second.store.quarantined()
    assert quarantined["reason"].startswith("the backend refused the plan: RuntimeError")
    assert second.counters["corrupt"] == 1 and second.counters["rebuilds"] == 1
    assert_runs_correctly(plan, spec)


def test_a_load_that_fails_for_a_transient_reason_keeps_the_entry(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EXAMPLES["causal_sdpa"]
    [built] = build_and_close(make_cache, spec)
    with make_cache() as first:
        original = first.store.get(built.key)
    assert original is not None
    backend = CpuTestBackend()

    def invalidated(blob: bytes, tensors: Any, device: Any = None) -> Any:
        raise plancache.TransientLoadError("loading the plan failed for now: cudaErrorStreamCaptureInvalidated")

    monkeypatch.setattr(backend, "load", invalidated)
    second = make_cache(backend=backend)
    plan = second.get(spec.graph())
    assert plan.source == "unpersisted" and second.counters["load_failures"] >= 1  # tried again inside the flight
    assert second.counters["corrupt"] == 0 and second.store.quarantined() == []
    assert_runs_correctly(plan, spec)
    entry = second.store.get(original.key)
    assert entry is not None and entry.blob_sha256 == original.blob_sha256 and entry.created_at == original.created_at
    second.close()
    assert make_cache().get(spec.graph()).source == "loaded", "a later process loads the kept entry"


def test_damaged_entry_without_engine_is_autotuned_again(make_cache: MakeCache, db: Connect) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    [original] = build_and_close(make_cache, spec)
    damage_blob(db, original.key)
    db().execute("UPDATE plans SET engine_json = NULL")
    second = make_cache()
    plan = second.get(spec.graph())
    assert plan.source == "built"
    assert (second.counters["corrupt"], second.counters["rebuilds"], second.counters["misses"]) == (1, 0, 1)
    assert_runs_correctly(plan, spec)
    assert second.store.get(original.key) is not None


def test_failed_rebuild_falls_back_to_autotuning(make_cache: MakeCache, db: Connect, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    [original] = build_and_close(make_cache, spec)
    damage_blob(db, original.key)
    backend = CpuTestBackend()

    def no_rebuild(*args: Any) -> Any:
        raise RuntimeError("engine gone")

    monkeypatch.setattr(backend, "rebuild", no_rebuild)
    second = make_cache(backend=backend)
    plan = second.get(spec.graph())
    assert plan.source == "built"
    assert second.counters["corrupt"] == 1 and second.counters["rebuilds"] == 0
    assert_runs_correctly(plan, spec)


def test_entry_whose_environment_differs_is_not_served(make_cache: MakeCache, db: Connect) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    [original] = build_and_close(make_cache, spec)
    foreign = {**CpuTestBackend().environment(), "gpu_name": "Some other GPU"}
    db().execute("UPDATE plans SET environment_json = ? WHERE key = ?", (json.dumps(foreign), original.key))
    backend = CpuTestBackend()
    second = make_cache(backend=backend)
    plan = second.get(spec.graph())
    assert plan.source == "rebuilt"
    assert backend.loads == 1, "only the rebuilt plan, loaded back before it was stored: the foreign entry was not loaded"
    [quarantined] = second.store.quarantined()
    assert quarantined["reason"] == "environment differs from the key's"
    entry = second.store.get(original.key)
    assert entry is not None and entry.environment == backend.environment()


def test_another_environment_misses_and_keeps_both_entries(make_cache: MakeCache) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    [here] = build_and_close(make_cache, spec)
    other = make_cache(backend=CpuTestBackend(environment={"cudnn_backend_version": "91000"}))
    there = other.get(spec.graph())
    assert there.source == "built" and there.key != here.key
    assert len({e["env_id"] for e in maintenance.list_entries(other.store)}) == 2
    assert other.store.quarantined() == []


# ---------------------------------------------------------------------------- store trouble


def test_read_only_store_serves_hits_and_builds_misses_in_memory(make_cache: MakeCache, db: Connect) -> None:
    stored, unstored = EXAMPLES["conv_bias_relu"], EXAMPLES["matmul_bias_relu"]
    build_and_close(make_cache, stored)
    ro = make_cache(read_only=True)
    assert ro.store.read_only
    hit = ro.get(stored.graph())
    assert hit.source == "loaded"
    miss = ro.get(unstored.graph())
    assert miss.source == "built"
    assert ro.get(unstored.graph()) is miss
    assert (ro.counters["hits"], ro.counters["misses"], ro.counters["unpersisted"]) == (1, 1, 1)
    assert_runs_correctly(hit, stored)
    assert_runs_correctly(miss, unstored)
    ro.close()
    rows = db().execute("SELECT key, hit_count FROM plans").fetchall()
    assert [(r["key"], r["hit_count"]) for r in rows] == [(hit.key, 0)]  # nothing written at all


def test_read_only_store_with_a_damaged_entry_builds_in_memory(make_cache: MakeCache, db: Connect) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    [original] = build_and_close(make_cache, spec)
    damage_blob(db, original.key)
    ro = make_cache(read_only=True)
    plan = ro.get(spec.graph())
    assert plan.source == "built"
    assert ro.counters["corrupt"] == 1 and ro.counters["unpersisted"] == 1
    assert_runs_correctly(plan, spec)
    assert db().execute("SELECT count(*) FROM quarantine").fetchone()[0] == 0  # could not move it


def test_store_write_failure_still_returns_a_plan(
    cache: PlanCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def disk_full(self: Store, entry: Any, **kwargs: Any) -> None:
        raise StoreError("cannot store plan: database or disk is full", path=str(self.path))

    monkeypatch.setattr(Store, "put", disk_full)
    spec = EXAMPLES["causal_sdpa_float_scale"]
    plan = cache.get(spec.graph())
    assert plan.source == "built"
    assert cache.counters["unpersisted"] == 1 and cache.counters["store_errors"] == 1
    assert cache.store.keys() == []
    assert "could not store plan" in caplog.text
    assert_runs_correctly(plan, spec)
    assert cache.get(spec.graph()) is plan  # still served from memory


def test_store_read_failure_is_a_miss(cache: PlanCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Store, key: str, *args: Any) -> Any:
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(Store, "get", broken)  # the lookup path reads get
    plan = cache.get(EXAMPLES["conv_bias_relu"].graph())
    assert plan.source == "built"
    assert cache.counters["store_errors"] == 2  # before and after taking the build lock


# ---------------------------------------------------------------------------- eviction


def test_max_size_evicts_least_recently_used(make_cache: MakeCache, tmp_path: Path) -> None:
    specs = [ConvBiasRelu(n=n) for n in (1, 2, 3)]
    probe = make_cache(directory=tmp_path / "probe")
    for spec in specs:
        probe.get(spec.graph())
    by_key = {e["key"]: e["blob_size"] for e in maintenance.list_entries(probe.store)}
    sizes = [by_key[probe.key(spec.graph()).digest] for spec in specs]
    cache = make_cache(max_size=sizes[1] + sizes[2])
    keys = [cache.get(s.graph()).key for s in specs]
    assert cache.store.keys() == sorted(keys[1:])  # only the oldest went, not the whole batch
    assert cache.store.total_size() == sizes[1] + sizes[2]


def test_max_size_from_environment_or_argument(monkeypatch: pytest.MonkeyPatch, make_cache: MakeCache) -> None:
    monkeypatch.setenv("PLANCACHE_MAX_SIZE", "1M")
    assert make_cache().max_size == 1 << 20
    assert make_cache(max_size=5000).max_size == 5000  # the argument wins


# ---------------------------------------------------------------------------- builder


def test_builder_returns_the_same_plan_for_same_shaped_tensors(cache: PlanCache) -> None:
    calls: list[tuple[int, ...]] = []

    @cache.builder
    def conv_plan(x: torch.Tensor, w: torch.Tensor, *, padding: int = 1) -> Any:
        calls.append(tuple(x.shape))
        n, c, h, width = x.shape
        return ConvBiasRelu(n=n, c=c, h=h, w=width, k=w.shape[0], padding=padding).graph()

    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(4, 8, 3, 3).to(memory_format=torch.channels_last)
    plan = conv_plan(x, w)
    assert conv_plan(torch.zeros_like(x), torch.ones_like(w)) is plan
    assert calls == [(2, 8, 6, 6)]  # the graph was not even built again
    bigger = conv_plan(torch.randn(3, 8, 6, 6).to(memory_format=torch.channels_last), w)
    assert bigger is not plan and bigger.key != plan.key
    unpadded = conv_plan(x, w, padding=0)
    assert unpadded.key not in (plan.key, bigger.key)
    assert conv_plan(x, w, padding=0) is unpadded
    assert len(calls) == 3
    assert len(conv_plan.plans) == 3
    assert cache.counters["memory_hits"] == 2
    assert conv_plan.__name__ == "conv_plan"
    assert_runs_correctly(plan, ConvBiasRelu())


def test_builder_hits_count_in_the_store_as_lookups_do(make_cache: MakeCache, db: Connect) -> None:
    """The plan a program runs every step through a builder is the most used: its hit count
    and last use reach the store, so eviction under max_size keeps it."""
    cache = make_cache()
    conv_plan = cache.builder(lambda n: ConvBiasRelu(n=n).graph())
    plan = conv_plan(1)
    cache.get(ConvBiasRelu(n=2).graph())
    for _ in range(50):
        assert conv_plan(1) is plan
    cache.flush()
    assert db().execute("SELECT hit_count FROM plans WHERE key = ?", (plan.key,)).fetchone()[0] == 50
    cache.close()


def test_the_first_lookups_on_two_threads_never_see_a_device_half_set_up(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first lookup on a device records its environment and that environment's
    encoding; a lookup on another thread that finds the one must find the other (it raised
    KeyError into the program). The other thread's lookup is run at the worst moment: while
    the first is encoding."""
    cache = make_cache()
    spec = EXAMPLES["conv_bias_relu"]
    encode = plancache.cache.lookup.canonical_json
    interleaved: list[Any] = []

    def encode_while_another_lookup_runs(value: Any) -> str:
        if not interleaved:
            interleaved.append(None)  # once: the other lookup encodes too, when it sets up first
            interleaved[0] = cache.get(spec.graph())
        return encode(value)

    monkeypatch.setattr(plancache.cache.lookup, "canonical_json", encode_while_another_lookup_runs)
    plan = cache.get(spec.graph())
    assert interleaved and interleaved[0].key == plan.key


def test_builder_tells_layouts_and_dtypes_apart(cache: PlanCache) -> None:
    calls = []

    @cache.builder(options=BuildOptions(policy="heuristic"))
    def plan_for(x: torch.Tensor) -> Any:
        calls.append(x)
        return ConvBiasRelu(n=x.shape[0]).graph()

    x = torch.randn(2, 8, 6, 6)
    plan = plan_for(x)
    plan_for(x.to(memory_format=torch.channels_last))  # other strides
    plan_for(x.double())  # other dtype
    assert len(calls) == 3
    assert plan_for(x) is plan
    entry = cache.store.get(plan.key)
    assert entry is not None and entry.policy == "heuristic"


def test_signature_is_tensor_layout_and_argument_values() -> None:
    assert _signature((1,), {"a": 2, "b": 3}) == _signature((1,), {"b": 3, "a": 2})
    assert _signature((1,), {"a": 2}) != _signature((1,), {"a": 3})
    x = torch.zeros(2, 3)
    assert _signature((x,), {}) == _signature((torch.ones(2, 3),), {})
    assert _signature((x,), {}) != _signature((x.t().contiguous().t(),), {})


def test_signature_keeps_positional_and_keyword_arguments_apart_with_marker() -> None:
    assert _signature((("n", 1),), {}) != _signature((), {"n": 1})
    assert _signature((1,), {})[1] is False


def test_signature_keeps_a_dicts_order_and_a_plain_tuple_as_it_is() -> None:
    """A builder may build in a dict's order: two orders are two graphs. A tuple of plain
    values (strides, paddings) is its own description, and a list never equals a tuple."""
    assert _signature(({"relu": 1, "neg": 2},), {}) != _signature(({"neg": 2, "relu": 1},), {})
    assert _signature(((1, 2),), {})[0] == ((1, 2),)
    assert _signature(([1],), {}) != _signature((("list", 1),), {}) != _signature(((1,),), {})


def test_signature_describes_tensors_inside_tuples_lists_and_dicts_by_layout() -> None:
    """A tensor inside a tuple was part of the signature by identity: no later call matched,
    and the memo kept every such tensor alive; a list or dict argument raised TypeError
    (unhashable) into the program."""
    x, y = torch.zeros(2, 3), torch.ones(2, 3)
    assert _signature(((x, 1),), {}) == _signature(((y, 1),), {}) and _signature(((x, 1),), {})[1] is True
    assert _signature(([x],), {"d": {"a": x}}) == _signature(([y],), {"d": {"a": y}})
    assert _signature(([x],), {}) != _signature(((x,),), {})  # a list and a tuple stay apart
    assert _signature(((x,),), {}) != _signature(((x.t().contiguous().t(),),), {})
    assert _signature(([1, [2]],), {})[1] is False
    hash(_signature(([1, {"k": [2]}],), {"o": [3]}))


def test_builder_matches_tensors_passed_in_a_tuple_and_keeps_none_alive(cache: PlanCache) -> None:
    import gc
    import weakref

    @cache.builder
    def conv_plan(inputs: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, w = inputs
        return ConvBiasRelu(n=x.shape[0], c=x.shape[1], h=x.shape[2], w=x.shape[3], k=w.shape[0]).graph()

    alive = []
    for _ in range(3):
        x, w = torch.randn(2, 8, 6, 6), torch.randn(4, 8, 3, 3)
        conv_plan((x, w))
        alive.append(weakref.ref(x))
        del x, w
    gc.collect()
    assert len(conv_plan.plans) == 1 and cache.counters["memory_hits"] == 2
    assert not any(ref() is not None for ref in alive)


def test_builder_and_preload_refuse_once_the_cache_is_closed(make_cache: MakeCache) -> None:
    """A builder served remembered plans after close(), and preload reported nothing missing."""
    cache = make_cache()
    conv_plan = cache.builder(lambda n: ConvBiasRelu(n=n).graph())
    conv_plan(1)
    cache.close()
    for call in (lambda: conv_plan(1), lambda: conv_plan(2), cache.preload):
        with pytest.raises(PlanCacheError, match="is closed"):
            call()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_builders_clean_even_with_their_lock_held(make_cache: MakeCache) -> None:
    """A child forked while another thread was inside a builder call inherited the memo's
    lock held and hung at its first call; it also kept the parent's loaded plans."""
    cache = make_cache()
    conv_plan = cache.builder(lambda n: ConvBiasRelu(n=n).graph())
    parents = conv_plan(1)
    conv_plan.plans._entries.get().lock.acquire()  # as another thread inside a builder call at the fork
    try:
        pid = os.fork()
        if pid == 0:  # the child: a fresh memo, and a plan of its own; it never returns to pytest
            end_if_stuck()
            ok = False
            with contextlib.suppress(BaseException):
                ok = len(conv_plan.plans) == 0 and conv_plan(1) is not parents
            os._exit(0 if ok else 3)
    finally:
        conv_plan.plans._entries.get().lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert conv_plan(1) is parents


def test_a_build_inside_a_build_of_its_stripe_on_one_thread_does_not_wait_for_itself(tmp_path: Path) -> None:
    """A build that looks up and builds another key of its build-lock stripe on its own
    thread took a second FileLock of the file it held and waited for itself until
    lock_timeout. One FileLock per stripe and process is re-entrant per thread; another
    thread of the process still waits for the stripe."""
    from plancache.cache.flight import SingleFlight, lock_name

    outer = "a" * 64
    inner = next(k for k in (f"{i:064x}" for i in range(1, 10_000)) if lock_name(k) == lock_name(outer))
    waits: list[str] = []
    flight = SingleFlight(tmp_path / "locks", timeout=30.0, count=waits.append)
    other_thread: list[BaseException | None] = []

    def another_thread_of_the_stripe() -> None:
        try:
            with SingleFlight(tmp_path / "locks", timeout=0.5).hold(inner, "env"):
                other_thread.append(None)
        except LockTimeoutError as exc:
            other_thread.append(exc)

    started = time.monotonic()
    with flight.hold(outer, "env"), flight.hold(inner, "env"):
        nested = time.monotonic() - started
        thread = threading.Thread(target=another_thread_of_the_stripe)
        thread.start()
        thread.join(60)
    assert nested < 5.0 and waits == [], (nested, waits)  # the old code waited the 30 s out, then raised
    assert len(other_thread) == 1 and isinstance(other_thread[0], LockTimeoutError), "another thread waits for the stripe"
    with flight.hold(inner, "env"):  # released once the outer build is over, for everyone
        pass
    assert waits == []


def test_a_wait_for_another_thread_of_the_process_is_counted_and_logged(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A thread missing a key while another thread of its process builds a key of its stripe
    waits on the stripe's thread lock: counted in ``waits`` and logged, as a wait for
    another process is (it was neither)."""
    from plancache.cache.counters import Count
    from plancache.cache.flight import SingleFlight

    waits: list[Count] = []
    flight = SingleFlight(tmp_path / "locks", timeout=30.0, count=waits.append)
    holding, done = threading.Event(), threading.Event()

    def builder() -> None:
        with flight.hold("a" * 64, "env", "first"):
            holding.set()
            done.wait(30)

    thread = threading.Thread(target=builder)
    thread.start()
    assert holding.wait(30)
    threading.Timer(0.2, done.set).start()
    with caplog.at_level(logging.INFO, logger="plancache"), flight.hold("a" * 64, "env", "second"):
        pass
    thread.join(30)
    assert waits == [Count.WAITS]
    [line] = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert "another thread" in line and "a" * 12 in line and "(second)" in line


def test_a_build_inside_a_build_of_its_stripe_does_not_wait_for_a_thread_that_waits_for_the_stripe(tmp_path: Path) -> None:
    """One thread builds key A and, inside, key B of A's stripe; another thread missed B
    meanwhile. The locks were taken in two orders: the other thread held B's thread lock
    and waited for the stripe, which the first held while it waited for B's thread lock,
    both until lock_timeout. Every thread now takes the stripe's thread lock, then its file."""
    from plancache.cache.flight import SingleFlight, lock_name

    outer = "a" * 64
    inner = next(k for k in (f"{i:064x}" for i in range(1, 10_000)) if lock_name(k) == lock_name(outer))
    flight = SingleFlight(tmp_path / "locks", timeout=30.0)  # the other thread's wait: far past a busy machine's delays
    other: list[BaseException | None] = []

    def another_thread_missing_the_inner_key() -> None:
        try:
            with flight.hold(inner, "env"):
                other.append(None)
        except LockTimeoutError as exc:
            other.append(exc)

    thread = threading.Thread(target=another_thread_missing_the_inner_key)
    with flight.hold(outer, "env"):
        thread.start()
        time.sleep(0.3)  # the other thread waits, for B's build or for the stripe
        started = time.monotonic()
        with flight.hold(inner, "env"):
            nested = time.monotonic() - started
        assert other == [], "the other thread waits while the stripe is held"
    thread.join(60)
    assert nested < 5.0, f"the nested build waited {nested:.1f} s"  # the old code waited the 30 s out, then raised
    assert other == [None], other


def test_a_lookup_inside_a_build_does_not_wait_for_a_thread_that_waits_for_the_build_lock(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build of plan A looks up plan B of A's lock stripe; another thread missed B just
    before and waits for the stripe. The lookup inside the build waited for that thread's
    load of B, which waited for the build: both until lock_timeout. A thread holding a
    build lock now loads or builds B itself; the other thread then finds B in memory."""
    from plancache.cache import flight

    monkeypatch.setattr(flight, "_stripe_of", lambda key: 0)  # every key of one stripe
    monkeypatch.setattr(flight, "lock_name", lambda key: "build-000.lock")
    cache = make_cache(lock_timeout=10.0)
    outer, inner = ConvBiasRelu(n=1).graph(), ConvBiasRelu(n=2).graph()
    build = cache.lookup._repair_or_build
    outcomes: dict[str, str] = {}

    def another_thread_missing_the_inner_plan() -> None:
        try:
            outcomes["other"] = cache.get(inner).source
        except LockTimeoutError as exc:
            outcomes["other"] = repr(exc)

    other = threading.Thread(target=another_thread_missing_the_inner_plan)

    def building(graph: Any, *args: Any, **kwargs: Any) -> Any:
        if graph is outer:
            other.start()
            time.sleep(0.3)  # the other thread holds B's load and waits for the stripe
            outcomes["nested"] = cache.get(inner).source
        return build(graph, *args, **kwargs)

    monkeypatch.setattr(cache.lookup, "_repair_or_build", building)
    cache.get(outer)
    other.join(30)
    assert outcomes == {"nested": "built", "other": "built"}, outcomes
    assert cache.counters["builds"] == 2, "B was built once"


def test_a_lookup_inside_a_build_beside_another_threads_build_of_its_plan_builds_it_once(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with B in a stripe of its own: the other thread holds B's load and builds
    B; the lookup inside A's build does not wait for that load, so it waits for B's stripe.
    Once it has the stripe it must find B in memory: the plan is put there before the
    stripe is let go (it was put after, so the lookup could meet neither and build again)."""
    from plancache.cache import flight

    cache = make_cache(lock_timeout=10.0)
    outer, inner = ConvBiasRelu(n=1).graph(), ConvBiasRelu(n=2).graph()
    outer_key = cache.key(outer).digest
    monkeypatch.setattr(flight, "_stripe_of", lambda key: 0 if key == outer_key else 1)
    build, put = cache.lookup._repair_or_build, cache.lookup.memory.put
    inner_building, builds_of_inner, outcomes = threading.Event(), [], {}

    def other_thread_building_the_inner_plan() -> None:
        outcomes["other"] = cache.get(inner).source

    other = threading.Thread(target=other_thread_building_the_inner_plan)

    def building(graph: Any, *args: Any, **kwargs: Any) -> Any:
        if graph is outer:
            other.start()
            assert inner_building.wait(10)
            outcomes["nested"] = cache.get(inner).source
        else:
            builds_of_inner.append(threading.current_thread().name)
            inner_building.set()
            time.sleep(0.3)  # the lookup inside A's build reaches B's stripe and waits for it
        return build(graph, *args, **kwargs)

    def putting(slot: Any, plan: Any) -> None:
        if threading.current_thread() is other:
            time.sleep(0.5)  # a slow put: the stripe let go first would leave B in no tier
        put(slot, plan)

    monkeypatch.setattr(cache.lookup, "_repair_or_build", building)
    monkeypatch.setattr(cache.lookup.memory, "put", putting)
    cache.get(outer)
    other.join(30)
    assert builds_of_inner == [other.name], "B was built, or looked for below memory, once"
    assert outcomes == {"nested": "built", "other": "built"}, outcomes


def test_a_hit_executes_by_the_callers_tensor_names(make_cache: Any, tmp_path: Path) -> None:
    from plancache.workflows import templates

    params = {"b": 1, "m": 4, "n": 4, "k": 4, "dtype": "float32"}
    first = make_cache()
    first.get(templates.build("matmul_bias_act", **params))
    first.close()
    graph = templates.build("matmul_bias_act", **params)
    for t in graph.tensors.values():
        if not t.is_virtual:
            t.set_name("renamed_" + t.name)
    plan = make_cache().get(graph)
    assert plan.source == "loaded"
    tensors = templates.allocate("matmul_bias_act", device="cpu", **params)
    by_name = {name: tensors[t.uid] for name, t in graph.tensors.items() if not t.is_virtual}
    assert all(name.startswith("renamed_") for name in by_name)
    plan.execute(by_name)
    ref = templates.reference("matmul_bias_act", tensors, **params)
    assert torch.allclose(tensors[4].float(), ref, atol=1e-5)


def test_builder_with_an_explicit_key(make_cache: Any) -> None:
    from plancache.workflows import templates

    cache = make_cache()
    calls = []

    @cache.builder(key=lambda n: n)
    def conv(n: int) -> Any:
        calls.append(n)
        return templates.build("conv_bias_act", n=n, c=4, h=6, w=6, k=4, dtype="float32")

    first, again, other = conv(1), conv(1), conv(2)
    assert first is again and first is not other
    assert calls == [1, 2]


def _dynamic_conv(n: int) -> Any:
    from plancache.workflows import templates

    return templates.build("conv_bias_act", n=n, c=4, h=6, w=6, k=4, dtype="float32", dynamic=True)


def test_kernel_cache_is_shared_but_not_persisted_by_default(make_cache: Any) -> None:
    from plancache.key import environment_id
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend()
    cache = make_cache(backend=backend)
    cache.get(_dynamic_conv(1))
    assert backend.kernels, "dynamic builds use the shared kernel cache"
    assert cache.store.get_kernel_cache(environment_id(cache.environment)) is None


def test_kernel_cache_persisted_and_restored_when_asked(make_cache: Any) -> None:
    from plancache.key import environment_id
    from plancache.testing import CpuTestBackend

    first = make_cache(persist_kernel_cache=True)
    first.get(_dynamic_conv(1))
    assert first.store.get_kernel_cache(environment_id(first.environment)) is not None
    restored, fresh = CpuTestBackend(), CpuTestBackend(environment={"gpu_name": "another GPU"})
    same_env = make_cache(backend=restored, persist_kernel_cache=True)
    same_env.get(_dynamic_conv(2))
    assert same_env.counters["kernel_cache_restores"] == 1
    other_env = make_cache(backend=fresh, persist_kernel_cache=True)
    other_env.get(_dynamic_conv(3))
    assert other_env.counters["kernel_cache_restores"] == 0, "never a kernel cache of another environment"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_restores_the_kernel_cache_before_it_stores_its_own(make_cache: Any) -> None:
    """A forked child's backend starts with a fresh kernel cache (cuDNN's are per process).
    It took the parent's "restored" for its own, never restored the stored one, and stored
    its smaller kernel cache over it."""
    import json

    from plancache.key import environment_id
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend()
    cache = make_cache(backend=backend, persist_kernel_cache=True)
    cache.get(_dynamic_conv(1))
    env_id = environment_id(cache.environment)
    parents = set(backend.kernels)
    assert parents and set(json.loads(cache.store.get_kernel_cache(env_id)[0])) == parents
    pid = os.fork()
    if pid == 0:  # the child: it never returns to pytest
        code = 1
        try:
            end_if_stuck()
            backend.kernels = set()  # fresh, as cuDNN's kernel caches are in a child
            cache.lookup.kernel_cache.restore(env_id)  # before the child's first dynamic-shape build
            backend.kernels.add("a kernel of the child's")
            cache.lookup.kernel_cache.save(env_id)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    stored = set(json.loads(cache.store.get_kernel_cache(env_id)[0]))
    assert stored == parents | {"a kernel of the child's"}, f"the child stored {sorted(stored)}"


def test_kernel_cache_sharing_can_be_turned_off(make_cache: Any) -> None:
    from plancache import BuildOptions
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend()
    cache = make_cache(backend=backend, options=BuildOptions(kernel_cache=False))
    cache.get(_dynamic_conv(1))
    assert not backend.kernels


def test_the_cudnn_backend_shares_one_kernel_cache_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuDNN backend's kernel-cache bookkeeping, without a GPU: a stand-in for the
    frontend's kernel cache, and the current device set by the test."""
    import types

    from plancache.cudnn import backend as cudnn_backend

    class KernelCache:
        def __init__(self) -> None:
            self.text = ""

        def serialize(self) -> str:
            return self.text

        def deserialize(self, text: str) -> None:
            self.text = text

    device = [0]
    monkeypatch.setattr(cudnn_backend, "_cudnn", lambda: types.SimpleNamespace(create_kernel_cache=KernelCache))
    monkeypatch.setattr(cudnn_backend.CudnnBackend, "current_device", lambda self: device[0])
    backend = cudnn_backend.CudnnBackend()

    def graph(**kwargs: Any) -> Any:
        return types.SimpleNamespace(_cpp_graph_kwargs={"is_dynamic_shape_enabled": True, **kwargs})

    assert backend.kernel_cache_blob() is None, "none before its first use"
    assert not backend.attach_kernel_cache(types.SimpleNamespace(_cpp_graph_kwargs={"is_dynamic_shape_enabled": False}))
    first, second = graph(), graph()
    assert backend.attach_kernel_cache(first) and backend.attach_kernel_cache(second)
    assert first._cpp_graph_kwargs["kernel_cache"] is second._cpp_graph_kwargs["kernel_cache"]
    own = object()
    assert not backend.attach_kernel_cache(graph(kernel_cache=own)), "a cache the caller attached stays"
    backend.restore_kernel_cache(b"kernels of device 0")
    assert backend.kernel_cache_blob() == b"kernels of device 0"
    device[0] = 1
    assert backend.kernel_cache_blob() is None, "each device has its own"
    third = graph()
    assert backend.attach_kernel_cache(third)
    assert third._cpp_graph_kwargs["kernel_cache"] is not first._cpp_graph_kwargs["kernel_cache"]
    device[0] = 0
    if hasattr(os, "fork"):
        pid = os.fork()
        if pid == 0:  # the child: no torch work, no pytest; it only reports
            os._exit(0 if backend.kernel_cache_blob() is None else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a forked child starts without the parent's"
    assert backend.kernel_cache_blob() == b"kernels of device 0", "the parent keeps its own"


def test_hit_counts_are_kept_when_writing_them_fails(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch, db: Connect) -> None:
    from plancache.store import bookkeeping

    spec = EXAMPLES["conv_bias_relu"]
    build_and_close(make_cache, spec)
    cache = make_cache()
    cache.get(spec.graph())
    cache.get(spec.graph())
    real = bookkeeping.record_hits

    def locked(*args: Any, **kwargs: Any) -> bool:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(bookkeeping, "record_hits", locked)
    assert cache.local.flush(wait=False) is False
    monkeypatch.setattr(bookkeeping, "record_hits", real)
    cache.flush()
    assert db().execute("SELECT sum(hit_count) FROM plans").fetchone()[0] == 2
