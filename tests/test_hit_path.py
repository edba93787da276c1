"""A store hit does each piece of its work once: the blob decoded once (the judge reads its
graph, the load its record, from the same decoding), one guest block (the lookup's; the
load inside it opens none), and the judge's tensor table is the one the plan runs with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from graphs import ConvBiasRelu, assert_runs_correctly

from plancache import PlanCache
from plancache.formats import plan_blob
from plancache.store import Sound, Unsound, judged
from plancache.testing import CpuTestBackend

MakeCache = Callable[..., PlanCache]


def _counting(monkeypatch: pytest.MonkeyPatch, backend: CpuTestBackend) -> tuple[list[bytes], list[int]]:
    """Every blob decoded, and every guest block opened (the driver asked to be ready)."""
    decoded: list[bytes] = []
    ready: list[int] = []
    decode, driver_ready = plan_blob.decode, backend.driver.ready

    def counting_decode(data: bytes, *args: Any, **kwargs: Any) -> Any:
        decoded.append(bytes(data))
        return decode(data, *args, **kwargs)

    def counting_ready(device: int) -> None:
        ready.append(device)
        driver_ready(device)

    monkeypatch.setattr(plan_blob, "decode", counting_decode)
    monkeypatch.setattr(backend.driver, "ready", counting_ready)
    return decoded, ready


def test_a_store_hit_decodes_its_blob_once_and_opens_one_guest_block(make_cache: MakeCache,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    spec = ConvBiasRelu()
    stored = make_cache().get(spec.graph())
    backend = CpuTestBackend()
    cache = make_cache(backend=backend, auto_prime=False)
    cache.environment  # noqa: B018 - the environment is read once per process, not per hit
    decoded, ready = _counting(monkeypatch, backend)
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["hits"] == 1
    blob = cache.store.get(stored.key).blob
    assert decoded == [blob], "decoded once: by the judge, and the load read that decoding"
    assert ready == [0], "one guest block: the lookup's, with the load inside it"
    assert backend.native_fallbacks == {}, "loaded through the native path, which reads the record"
    assert_runs_correctly(plan, spec)


def test_a_load_outside_a_guest_block_opens_its_own(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ConvBiasRelu()
    stored = make_cache().get(spec.graph())
    backend = CpuTestBackend()
    entry = make_cache(backend=backend).store.get(stored.key)
    decoded, ready = _counting(monkeypatch, backend)
    verdict = judged(entry)
    assert isinstance(verdict, Sound)
    native = backend.load(verdict.blob, list(verdict.tensors), 0)
    assert native is not None and ready == [0] and decoded == [entry.blob]
    backend.load(entry.blob, list(verdict.tensors), 0)  # bytes: read again, in a block of its own
    assert ready == [0, 0] and decoded == [entry.blob, entry.blob]


def test_the_judge_hands_the_load_the_tensor_table_it_read(make_cache: MakeCache) -> None:
    spec = ConvBiasRelu()
    stored = make_cache().get(spec.graph())
    entry = make_cache().store.get(stored.key)
    verdict = judged(entry, entry.environment, entry.env_id)
    assert isinstance(verdict, Sound) and verdict.entry is entry
    assert [t.to_dict() for t in verdict.tensors] == entry.tensors
    true_id, entry.env_id = entry.env_id, "0" * 16  # what a row copied from another machine's store says
    refused = Unsound("env_id does not match the recorded environment")
    assert judged(entry, entry.environment) == refused
    assert judged(entry, entry.environment, true_id) == refused  # a lookup's own id of its environment, compared


def test_the_memory_tier_evicts_the_least_recently_used_plan_without_calling_back_into_python() -> None:
    from plancache.tiers.memory import LRU

    lru: LRU[str, object] = LRU(3)
    for name in "abc":
        lru.put(name, object())
    assert lru.get("a") is not None  # a used again: b is now the oldest
    lru.put("d", object())
    assert sorted(lru.keys()) == ["a", "c", "d"] and lru.evicted == 1
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    import sys

    full: LRU[int, int] = LRU(1000)
    for i in range(1000):
        full.put(i, i)
    sys.setprofile(count)
    try:
        full.put(1000, 1000)  # past the bound: the oldest (0) goes
    finally:
        sys.setprofile(None)
    assert 0 not in full and 1000 in full and calls < 10, calls  # the scan is C's, not a Python call per plan


def test_a_row_written_before_columns_were_canonical_is_decoded_and_served(make_cache: MakeCache, db: Any) -> None:
    """Stores written by earlier releases hold the graph, environment and options columns as
    ``json.dumps(sort_keys=True)`` wrote them (with spaces): not the key's texts, so a hit
    decodes them, judges them as before, and serves the plan."""
    import json

    spec = ConvBiasRelu()
    stored = make_cache().get(spec.graph())
    conn = db()
    row = conn.execute("SELECT graph_json, environment_json, options_json FROM plans WHERE key = ?", (stored.key,)).fetchone()
    spaced = {name: json.dumps(json.loads(row[name]), sort_keys=True) for name in row.keys()}  # noqa: SIM118
    assert all(spaced[name] != row[name] for name in spaced), "the columns are written canonically now"
    conn.execute("UPDATE plans SET graph_json = ?, environment_json = ?, options_json = ? WHERE key = ?",
                 (spaced["graph_json"], spaced["environment_json"], spaced["options_json"], stored.key))  # fmt: skip
    cache = make_cache(auto_prime=False)
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["corrupt"] == 0
    assert_runs_correctly(plan, spec)
    # Altered in its spaced form, the graph no longer hashes to the key: found as before.
    assert "[2, 8, 6, 6]" in spaced["graph_json"]
    conn.execute("UPDATE plans SET graph_json = replace(graph_json, '[2, 8, 6, 6]', '[2, 8, 6, 7]') WHERE key = ?",
                 (stored.key,))  # fmt: skip
    again = make_cache(auto_prime=False)
    assert again.get(spec.graph()).source in ("rebuilt", "built") and again.counters["corrupt"] == 1


def test_a_miss_decodes_the_blob_it_stores_once(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load back and the judge, before the plan is stored, read one decoding."""
    backend = CpuTestBackend()
    cache = make_cache(backend=backend, auto_prime=False)
    cache.environment  # noqa: B018 - read once per process
    decoded, _ = _counting(monkeypatch, backend)
    plan = cache.get(ConvBiasRelu().graph())
    assert plan.source == "built"
    assert decoded == [cache.store.get(plan.key).blob]


def test_a_store_hit_reads_no_candidates_or_timing_records_and_encodes_no_metadata(
        make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A hit's row read names only the columns it reads (not the candidates' and timing
    records, which SQLite would turn into strings at every hit), and its metadata checksum
    is checked on the row's own texts: nothing encoded again."""
    from plancache.store import Entry
    from plancache.store import entry as entry_module

    spec = ConvBiasRelu()
    make_cache().get(spec.graph())
    cache = make_cache(auto_prime=False)
    cache.environment  # noqa: B018 - read once per process
    statements: list[str] = []
    cache.store.connection().set_trace_callback(statements.append)

    def no_encoding(self: Entry) -> str:
        raise AssertionError("the metadata checksum was computed by encoding the entry again")

    monkeypatch.setattr(Entry, "meta_digest", no_encoding)
    encoded: list[Any] = []
    canonical = entry_module.canonical_json
    monkeypatch.setattr(entry_module, "canonical_json", lambda value: encoded.append(value) or canonical(value))
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["corrupt"] == 0
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT") and "FROM plans" in s]
    assert reads and all("candidates_json" not in s and "timing_json" not in s and "*" not in s for s in reads), reads
    assert encoded == [], "a hit encodes no column again"


def test_a_row_whose_metadata_texts_are_not_canonical_is_checked_on_its_decoding(make_cache: MakeCache, db: Any) -> None:
    """An older writer's tensor table with spaces: its checksum (over the canonical text)
    is checked on the decoded table, and the plan served; the same table altered is refused."""
    import json

    spec = ConvBiasRelu()
    stored = make_cache().get(spec.graph())
    conn = db()
    text = conn.execute("SELECT tensors_json FROM plans WHERE key = ?", (stored.key,)).fetchone()[0]
    spaced = json.dumps(json.loads(text), sort_keys=True)
    assert spaced != text
    conn.execute("UPDATE plans SET tensors_json = ? WHERE key = ?", (spaced, stored.key))
    cache = make_cache(auto_prime=False)
    assert cache.get(spec.graph()).source == "loaded" and cache.counters["corrupt"] == 0
    altered = spaced.replace('"is_output": false', '"is_output": true', 1)
    assert altered != spaced
    conn.execute("UPDATE plans SET tensors_json = ? WHERE key = ?", (altered, stored.key))
    again = make_cache(auto_prime=False)
    assert again.get(spec.graph()).source in ("rebuilt", "built") and again.counters["corrupt"] == 1


def test_json_columns_that_only_the_standard_library_reads_still_decode() -> None:
    """orjson reads the columns; what it refuses and ``json`` wrote (NaN, an integer past 64
    bits) is read by ``json`` as before, and text that is no JSON is still a ValueError."""
    from plancache.store import entry as entry_module

    assert entry_module.load_json('{"a": [1, 2]}', "x") == {"a": [1, 2]}
    value = entry_module.load_json('{"t": NaN, "n": 123456789012345678901234567890}', "timing_json")
    assert value["n"] == 123456789012345678901234567890 and value["t"] != value["t"]
    with pytest.raises(ValueError, match="nests deeper"):
        entry_module.load_json("[" * 100 + "]" * 100, "check_json")
    with pytest.raises(ValueError):
        entry_module.load_json("{not json", "engine_json")


def test_what_is_read_from_a_blob_is_read_once_errors_included() -> None:
    blob = plan_blob.PlanBlob(b"\x00\x01")
    calls: list[int] = []

    def reader(b: plan_blob.PlanBlob) -> int:
        calls.append(1)
        return len(b.data)

    def refusing(b: plan_blob.PlanBlob) -> int:
        calls.append(2)
        raise ValueError("not a plan")

    assert blob.read(reader) == 2 and blob.read(reader) == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="not a plan"):
            blob.read(refusing)
    assert calls == [1, 2]
