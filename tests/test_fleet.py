"""PlanCache with the Redis tier: two cache directories stand for two machines sharing one
real redis-server on 127.0.0.1 (see test_remote.py for the server fixtures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import LocalRedis

from plancache import PlanCache, Store
from plancache.key import environment_id
from plancache.testing import CpuTestBackend
from plancache.tiers import breaker
from plancache.tiers.remote import RemoteTier
from plancache.workflows import templates

SECRET = b"fleet-secret-0123456789abcdef-32"

pytestmark = pytest.mark.redis

PARAMS = {"n": 2, "c": 8, "h": 6, "w": 6, "k": 8, "dtype": "float32"}


def graph(**overrides: Any) -> Any:
    return templates.build("conv_bias_act", **{**PARAMS, **overrides})


@pytest.fixture
def machine(tmp_path: Path) -> Callable[..., PlanCache]:
    """``machine(name, url)``: a PlanCache in its own directory with its own tier."""
    namespace = f"fleet{time.monotonic_ns()}"
    caches: list[PlanCache] = []

    def make(name: str, url: str, **backend_options: Any) -> PlanCache:
        tier = RemoteTier(url, secret=SECRET, namespace=namespace, timeout=0.25)
        cache = PlanCache(tmp_path / name, backend=CpuTestBackend(**backend_options), remote=tier)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def test_a_plan_built_on_one_machine_is_a_hit_on_another(redis_server: LocalRedis, machine: Callable[..., PlanCache]) -> None:
    a, b = machine("a", redis_server.url), machine("b", redis_server.url)
    built = a.get(graph())
    loaded = b.get(graph())
    assert (built.source, loaded.source) == ("built", "loaded")
    assert b.counters["builds"] == 0
    assert b.remote.stats()["remote_hits"] == 1
    assert b.store.get(loaded.key) is not None, "read-through stores the plan locally"
    b.close()
    assert Store(b.directory).counters()["remote_hits"] == 1, "remote counters reach the store (plancache stats)"


def test_two_machines_missing_together_build_once(redis_server: LocalRedis, machine: Callable[..., PlanCache]) -> None:
    caches = [machine(name, redis_server.url, build_delay=0.05) for name in ("a", "b", "c")]
    sources: list[str] = []
    barrier = threading.Barrier(len(caches))

    def node(cache: PlanCache) -> None:
        barrier.wait()
        sources.append(cache.get(graph(n=3)).source)

    threads = [threading.Thread(target=node, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(sources) == ["built", "loaded", "loaded"]
    assert sum(c.counters["builds"] for c in caches) == 1


def test_a_tampered_remote_entry_is_refused_and_rebuilt(redis_server: LocalRedis, machine: Callable[..., PlanCache]) -> None:
    a, b = machine("a", redis_server.url), machine("b", redis_server.url)
    key = a.get(graph(n=4)).key
    client = redis_server.client()
    name = a.remote.redis_key(key, environment_id(a.environment))
    value = bytearray(client.get(name))
    value[-10] ^= 0x01
    client.set(name, bytes(value))
    plan = b.get(graph(n=4))
    assert plan.source == "built"
    assert b.remote.stats()["refused"] >= 1
    assert b.remote.stats()["remote_hits"] == 0
    c = machine("c", redis_server.url)
    assert c.get(graph(n=4)).source == "loaded", "the rebuilt plan replaced the tampered one"


def test_killed_server_leaves_local_operation_working(own_server: LocalRedis, machine: Callable[..., PlanCache],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Once the server is gone, one call finds out and starts the backoff; every later call
    of the lookups is skipped (counted, not timed: the backoff clock stands still here, so
    slow builds on a busy machine do not end the backoff), and each plan is built locally."""
    a = machine("a", own_server.url)
    a.get(graph(n=5))
    own_server.stop()
    monkeypatch.setattr(breaker, "_monotonic", lambda: 1000.0)
    before = a.remote.stats()
    started = time.monotonic()
    for n in range(6, 12):
        assert a.get(graph(n=n)).source == "built"
    assert a.get(graph(n=5)).source == "built"  # the in-memory plan: still served
    took = time.monotonic() - started
    after = a.remote.stats()
    assert after["errors"] - before["errors"] == 1, "one failed call to the dead server, not one per lookup"
    assert after["skipped"] - before["skipped"] >= 6, "the lookups after it skip Redis while it backs off"
    assert after["available"] is False
    assert took < 60.0  # a backstop far past seven CPU builds on a busy machine


def test_a_full_redis_costs_only_the_publish(own_server: LocalRedis, machine: Callable[..., PlanCache]) -> None:
    """Redis refuses every write (maxmemory reached, allkeys-lru or not): each machine builds
    without the fleet lock, keeps and serves its plan locally, and raises nothing."""
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.config_set("maxmemory", "1")  # below Redis's own overhead: nothing fits
    a = machine("a", own_server.url)
    started = time.monotonic()
    assert a.get(graph(n=13)).source == "built"
    assert time.monotonic() - started < 2.0
    stats = a.remote.stats()
    assert stats["publishes"] == 0 and stats["errors"] == 2 and stats["available"] is True  # the lock, the publish
    assert machine("a", own_server.url).get(graph(n=13)).source == "loaded", "kept in the local store"
    assert machine("b", own_server.url).get(graph(n=13)).source == "built"
