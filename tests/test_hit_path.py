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
