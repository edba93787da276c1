"""The Redis fleet tier against a real redis-server on 127.0.0.1, started by these tests.

Tests marked ``redis`` need the ``redis-server`` binary (Debian package redis-server) and
are skipped without it; the rest (configuration, a hung server, backoff) need no server.
Nothing here contacts any address but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from harness import graph_blob  # noqa: E402
from redis_fixtures import SECRET, LocalRedis, free_port, needs_server  # noqa: E402

from plancache.config import ConfigError  # noqa: E402  (after the importorskip above)
from plancache.key import KEY_FORMAT, BuildOptions, canonical_json, environment_id  # noqa: E402
from plancache.store import Entry, Store, sha256  # noqa: E402
from plancache.store.codec import encode_entry  # noqa: E402
from plancache.tiers import breaker, remote  # noqa: E402
from plancache.tiers.remote import RemoteTier, sign_value  # noqa: E402

OTHER_SECRET = b"another-secret-0123456789abcdef!"
ENVIRONMENT = {"gpu_name": "test GPU", "cudnn_backend_version": "test"}
ENV_ID = environment_id(ENVIRONMENT)
LOG = "plancache.remote"


@pytest.fixture
def raw(redis_server: LocalRedis) -> Iterator[Any]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoff clock, moved by the test: ``fake_clock[0] += 5``."""
    now = [1000.0]
    monkeypatch.setattr(breaker, "_monotonic", lambda: now[0])
    return now


def make_entry(key: str = "ab" * 32, env_id: str = ENV_ID, size: int = 4096) -> Entry:
    """A servable entry (its key and environment id re-derive from what it records, as
    ``store.entry.problem`` requires); ``key`` seeds its description, so distinct seeds give
    distinct keys. ``env_id`` other than ``ENV_ID`` makes an entry of another environment."""
    environment = ENVIRONMENT if env_id == ENV_ID else {**ENVIRONMENT, "gpu_name": env_id}
    description = {"nodes": [{"type": "CONV_FPROP"}], "tensors": {}, "seed": key}
    blob = graph_blob(description, (bytes(range(256)) * (size // 512 + 1))[: size // 2])  # about size bytes, hex-encoded
    options = BuildOptions().to_dict()
    digest = hashlib.sha256(canonical_json({"format": KEY_FORMAT, "graph": description, "environment": environment,
                                            "options": options}).encode()).hexdigest()  # fmt: skip
    return Entry(
        key=digest, env_id=environment_id(environment), label="CONV_FPROP", description=description,
        environment=environment, options=options, tensors=[], blob=blob, blob_sha256=sha256(blob),
        engine={"engine_id": 3, "knobs": {}, "name": "e3"}, workspace_size=0, policy="topk",
        candidates=[{"index": 0, "ms": 0.1}], timing={"runs": 3}, build_seconds=1.5, autotune_seconds=1.0,
        backend="cpu-test", created_at=1_700_000_000.0, last_used_at=1_700_000_100.0, hit_count=7,
        check={"status": "agreed", "rule": 2, "compared": 2, "agreeing": 2, "rejected": []},
    )  # fmt: skip


def same_plan(a: Entry, b: Entry) -> bool:
    """Equal but for the per-node usage fields and the metadata checksum the store adds."""
    usage = {"hit_count", "last_used_at", "meta_sha256"}
    return {k: v for k, v in {**a.header(), "blob": a.blob}.items() if k not in usage} == {
        k: v for k, v in {**b.header(), "blob": b.blob}.items() if k not in usage
    }


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------- sharing


@needs_server
@pytest.mark.redis
def test_round_trip(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    tier = make_tier(redis_server.url)
    entry = make_entry()
    assert tier.get(entry.key, ENV_ID) is None
    assert tier.put(entry)
    got = tier.get(entry.key, ENV_ID)
    assert got is not None and same_plan(got, entry)
    assert got.hit_count == 0 and got.last_used_at > entry.last_used_at  # usage is per node
    stats = tier.stats()
    assert {k: stats[k] for k in breaker.RemoteCount} == {
        "remote_hits": 1, "remote_misses": 1, "publishes": 1, "refused": 0, "errors": 0, "lock_waits": 0, "skipped": 0,
    }  # fmt: skip
    assert stats["available"] is True and stats["key_id"] == tier.key_id


@needs_server
@pytest.mark.redis
def test_two_machines_share_a_plan(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], tmp_path: Path) -> None:
    """Two cache directories stand for two machines: A autotunes, B reads through."""
    store_a, store_b = Store(tmp_path / "machine-a"), Store(tmp_path / "machine-b")
    tier_a, tier_b = make_tier(redis_server.url), make_tier(redis_server.url)
    entry = make_entry(size=100_000)
    store_a.put(entry)  # write-through: local first, then the fleet
    assert tier_a.put(entry)

    assert store_b.get(entry.key) is None
    fetched = tier_b.get(entry.key, ENV_ID)
    assert fetched is not None
    store_b.put(fetched)  # read-through: a remote hit is stored locally
    local = store_b.get(entry.key)
    assert local is not None and local.checksum_ok() and same_plan(local, entry)
    assert tier_b.stats()["remote_hits"] == 1
    store_a.close()
    store_b.close()


@needs_server
@pytest.mark.redis
def test_namespaces_and_environments_are_separate(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    tier = make_tier(redis_server.url)
    other_namespace = make_tier(redis_server.url, namespace=f"{tier.namespace}x")
    entry = make_entry()
    assert tier.put(entry)
    assert tier.redis_key(entry.key, ENV_ID) == f"{tier.namespace}:v{remote.FORMAT}:{ENV_ID}:{entry.key}"
    assert other_namespace.get(entry.key, ENV_ID) is None
    assert tier.get(entry.key, "fedcba9876543210") is None


# ---------------------------------------------------------------------------- refusals


def _flip_byte(value: bytes) -> bytes:
    middle = len(value) - 100  # inside the blob
    return value[:middle] + bytes([value[middle] ^ 0x01]) + value[middle + 1 :]


def _unsigned(value: bytes) -> bytes:
    return encode_entry(make_entry())  # a well-formed entry without a signature


@needs_server
@pytest.mark.redis
@pytest.mark.parametrize("tamper", [_flip_byte, _unsigned], ids=["flipped-byte", "unsigned"])
def test_tampered_entry_is_refused(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any, tamper: Callable[[bytes], bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    tier = make_tier(redis_server.url)
    entry = make_entry()
    assert tier.put(entry)
    name = tier.redis_key(entry.key, ENV_ID)
    raw.set(name, tamper(raw.get(name)))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert tier.get(entry.key, ENV_ID) is None
        assert tier.get(entry.key, ENV_ID) is None
    assert tier.stats()["refused"] == 2 and tier.stats()["remote_hits"] == 0
    assert len(warnings_of(caplog)) == 1 and "refused" in warnings_of(caplog)[0]


@needs_server
@pytest.mark.redis
def test_validly_signed_entry_under_another_key_is_refused(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any
) -> None:
    """A signed value copied to another key must not serve that key."""
    tier = make_tier(redis_server.url)
    entry = make_entry()
    assert tier.put(entry)
    raw.set(tier.redis_key("cd" * 32, ENV_ID), raw.get(tier.redis_key(entry.key, ENV_ID)))
    assert tier.get("cd" * 32, ENV_ID) is None
    assert tier.stats()["refused"] == 1


@needs_server
@pytest.mark.redis
def test_a_value_copied_into_another_namespace_sharing_the_secret_is_refused(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any
) -> None:
    """Two namespaces (staging, prod) under one secret: a value published in one and copied,
    byte for byte, to the same plan's name in the other is refused there, since the
    signature covers the name it was stored under."""
    staging = make_tier(redis_server.url, namespace="staging")
    prod = make_tier(redis_server.url, namespace="prod")
    entry = make_entry()
    assert staging.put(entry)
    raw.set(prod.redis_key(entry.key, ENV_ID), raw.get(staging.redis_key(entry.key, ENV_ID)))
    assert prod.get(entry.key, ENV_ID) is None
    assert prod.stats()["refused"] == 1 and prod.stats()["remote_hits"] == 0
    assert staging.get(entry.key, ENV_ID) is not None  # where it was published, it serves


@needs_server
@pytest.mark.redis
def test_signed_but_undecodable_is_refused(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    tier = make_tier(redis_server.url)
    raw.set(tier.redis_key("ef" * 32, ENV_ID), sign_value(b"not an entry at all", SECRET, tier.redis_key("ef" * 32, ENV_ID)))
    assert tier.get("ef" * 32, ENV_ID) is None
    assert tier.stats()["refused"] == 1


@needs_server
@pytest.mark.redis
def test_wrong_secret_is_refused(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = make_tier(redis_server.url), make_tier(redis_server.url, secret=OTHER_SECRET)
    assert ours.key_id != theirs.key_id
    entry = make_entry()
    assert theirs.put(entry)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert ours.get(entry.key, ENV_ID) is None
    assert ours.stats()["refused"] == 1
    assert "another secret" in warnings_of(caplog)[0]


def test_damaged_local_entry_is_not_published() -> None:
    tier = RemoteTier("redis://127.0.0.1:1/0", secret=SECRET)  # never contacted
    entry = make_entry()
    entry.blob = entry.blob[:-1]
    assert tier.put(entry) is False
    assert tier.stats()["errors"] == 1 and tier.stats()["skipped"] == 0
    tier.close()


# ---------------------------------------------------------------------------- single flight


@needs_server
@pytest.mark.redis
def test_single_flight_across_two_nodes(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    """Two nodes miss the same key at once: exactly one builds, the other waits and loads it."""
    nodes = {"a": make_tier(redis_server.url), "b": make_tier(redis_server.url)}
    entry = make_entry()
    start = threading.Barrier(2)
    builds: list[str] = []
    outcome: dict[str, str] = {}

    def node(name: str) -> None:
        tier = nodes[name]
        start.wait()
        assert tier.get(entry.key, ENV_ID) is None
        with tier.lock(entry.key, ENV_ID, wait=5) as mine:
            if mine:
                time.sleep(0.3)  # autotuning
                builds.append(name)
                assert tier.put(entry)  # published before the lock is released
                outcome[name] = "built"
            else:
                outcome[name] = "loaded" if tier.get(entry.key, ENV_ID) is not None else "missing"

    threads = [threading.Thread(target=node, args=(name,)) for name in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(builds) == 1
    assert sorted(outcome.values()) == ["built", "loaded"]
    assert sum(t.stats()["lock_waits"] for t in nodes.values()) == 1
    waiter = nodes["b" if builds == ["a"] else "a"]
    assert waiter.stats()["remote_hits"] == 1


def _process_node(url: str, namespace: str, directory: str, start: Any, results: Any) -> None:
    """One machine in its own process: its own cache directory, its own connection."""
    store = Store(directory)
    tier = RemoteTier(url, secret=SECRET, namespace=namespace)
    entry = make_entry()
    start.wait(10)
    outcome = "hit"
    if tier.get(entry.key, ENV_ID) is None:
        with tier.lock(entry.key, ENV_ID, wait=10) as mine:
            fetched = None if mine else tier.get(entry.key, ENV_ID)
            if fetched is not None:
                store.put(fetched)
                outcome = "loaded"
            else:
                time.sleep(0.3)  # autotuning
                store.put(entry)
                tier.put(entry)
                outcome = "built"
    results.put((outcome, store.get(entry.key) is not None))
    tier.close()
    store.close()


@needs_server
@pytest.mark.redis
def test_single_flight_across_two_processes(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], tmp_path: Path
) -> None:
    context = multiprocessing.get_context("spawn")  # like separate machines: nothing inherited
    start, results = context.Barrier(2), context.Queue()
    namespace = make_tier(redis_server.url).namespace
    workers = [
        context.Process(target=_process_node, args=(redis_server.url, namespace, str(tmp_path / m), start, results))
        for m in ("machine-a", "machine-b")
    ]
    for w in workers:
        w.start()
    outcomes = sorted(results.get(timeout=20) for _ in workers)
    for w in workers:
        w.join(10)
    results.close()
    results.join_thread()
    assert outcomes == [("built", True), ("loaded", True)]


@needs_server
@pytest.mark.redis
def test_lock_is_released_only_by_its_owner(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    slow = make_tier(redis_server.url, lock_ttl=0.3)
    other = make_tier(redis_server.url, lock_ttl=5)
    key = "12" * 32
    lock_name = slow.redis_key(key, ENV_ID) + ":lock"
    with contextlib.ExitStack() as stack:
        first = slow.lock(key, ENV_ID, wait=0)
        assert first.__enter__() is True
        raw.delete(lock_name)  # the slow node's lock expired (say its renewals could not reach Redis)
        second = stack.enter_context(other.lock(key, ENV_ID, wait=1))
        assert second is True
        token = raw.get(lock_name)
        time.sleep(0.5)  # the slow node keeps building: its renewals must not extend the other's lock
        assert raw.pttl(lock_name) > 4000
        first.__exit__(None, None, None)  # must not release the other node's lock
        assert raw.get(lock_name) == token
    assert raw.exists(lock_name) == 0


@needs_server
@pytest.mark.redis
def test_dead_nodes_lock_expires(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    tier = make_tier(redis_server.url)
    key = "34" * 32
    raw.set(tier.redis_key(key, ENV_ID) + ":lock", "token-of-a-node-that-died", px=300)
    started = time.monotonic()
    with tier.lock(key, ENV_ID, wait=5) as mine:
        assert mine is True
    assert 0.2 < time.monotonic() - started < 2
    assert tier.stats()["lock_waits"] == 1


@needs_server
@pytest.mark.redis
def test_lock_wait_runs_out(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    tier = make_tier(redis_server.url)
    key = "56" * 32
    raw.set(tier.redis_key(key, ENV_ID) + ":lock", "busy", px=10_000)
    started = time.monotonic()
    with tier.lock(key, ENV_ID, wait=0.2) as mine:
        assert mine is False  # the caller re-checks get(), then builds anyway
    assert time.monotonic() - started < 1


@needs_server
@pytest.mark.redis
def test_lock_sees_an_entry_already_published(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    tier = make_tier(redis_server.url)
    entry = make_entry()
    assert tier.put(entry)
    with tier.lock(entry.key, ENV_ID, wait=5) as mine:
        assert mine is False
    assert tier.stats()["lock_waits"] == 0


# ---------------------------------------------------------------------------- outages


@needs_server
@pytest.mark.redis
def test_server_killed_mid_run(
    own_server: LocalRedis, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture,
    fake_clock: list[float],
) -> None:  # fmt: skip
    tier = make_tier(own_server.url)
    entry = make_entry()
    assert tier.put(entry) and tier.get(entry.key, ENV_ID) is not None
    own_server.stop()
    with caplog.at_level(logging.INFO, logger=LOG):
        started = time.monotonic()
        for _ in range(50):
            assert tier.get(entry.key, ENV_ID) is None
            assert tier.put(entry) is False
        with tier.lock(entry.key, ENV_ID, wait=5) as mine:
            assert mine is True  # nobody to coordinate with: build locally
        assert time.monotonic() - started < 1
        assert len(warnings_of(caplog)) == 1 and "unreachable" in warnings_of(caplog)[0]
        stats = tier.stats()
        assert stats["errors"] == 1 and stats["skipped"] == 100 and stats["available"] is False

        own_server.start()  # back on the same port
        fake_clock[0] += 1.0  # first backoff window over
        assert tier.get(entry.key, ENV_ID) is None  # a fresh server: a miss, not an error
        assert tier.stats()["remote_misses"] == 1 and tier.available
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_backoff_skips_calls_while_down(
    make_tier: Callable[..., RemoteTier], fake_clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(f"redis://127.0.0.1:{free_port()}/0", backoff_max=4)  # nothing listens there
    attempts = []
    with caplog.at_level(logging.WARNING, logger=LOG):
        for step in range(32):  # 16 fake seconds in half-second steps
            before = tier.stats()["errors"]
            tier.get("ab" * 32, ENV_ID)
            if tier.stats()["errors"] > before:
                attempts.append(step / 2)
            fake_clock[0] += 0.5
    assert attempts == [0, 1, 3, 7, 11, 15]  # waits of 1, 2, 4, then backoff_max
    assert tier.stats()["skipped"] == 32 - len(attempts)
    assert len(warnings_of(caplog)) == 1


def test_an_outage_of_days_still_costs_nothing_but_misses(make_tier: Callable[..., RemoteTier], fake_clock: list[float]) -> None:
    """Each failed attempt doubles the wait up to backoff_max; an outage long enough for
    more than a thousand attempts must not overflow the doubling (it raised OverflowError
    from every later get, put and lock)."""
    tier = make_tier(f"redis://127.0.0.1:{free_port()}/0", backoff_max=60, max_stall=3600)
    for _ in range(1100):
        assert tier.get("ab" * 32, ENV_ID) is None
        fake_clock[0] += 61
    assert tier.stats()["errors"] == 1100
    with tier.lock("ab" * 32, ENV_ID, wait=0) as mine:
        assert mine is True


@needs_server
@pytest.mark.redis
def test_options_in_the_url_cannot_turn_blobs_into_text(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    """redis-py lets a URL's query override keyword arguments; ?decode_responses=true made
    every remote hit raise UnicodeDecodeError out of a lookup."""
    writer = make_tier(redis_server.url)
    entry = make_entry()
    assert writer.put(entry)
    reader = make_tier(redis_server.url + "?decode_responses=true&socket_timeout=30", namespace=writer.namespace)
    found = reader.get(entry.key, ENV_ID)
    assert found is not None and same_plan(found, entry)
    assert reader._client.connection_pool.connection_kwargs["socket_timeout"] == reader.timeout


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw-1@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://127.0.0.1:6379/0?password=pw-1", "redis://127.0.0.1:6379/0?password=***"),
        ("unix:///run/redis.sock?db=0&password=pw-1", "unix:///run/redis.sock?db=0&password=***"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ],
)
def test_a_password_never_reaches_logs_or_stats(url: str, shown: str, make_tier: Callable[..., RemoteTier]) -> None:
    tier = make_tier(url)
    assert tier.stats()["url"] == shown and "pw-1" not in repr(tier)


@pytest.fixture
def hung_server() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: a hung Redis."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def test_hung_server_costs_one_timeout(
    hung_server: str, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(hung_server, timeout=0.1)
    with caplog.at_level(logging.WARNING, logger=LOG):
        started = time.monotonic()
        for _ in range(20):
            assert tier.get("ab" * 32, ENV_ID) is None
            assert tier.put(make_entry()) is False
        elapsed = time.monotonic() - started
    assert 0.09 < elapsed < 0.5
    assert tier.stats()["errors"] == 1 and len(warnings_of(caplog)) == 1


def test_max_stall_switches_the_tier_off(
    hung_server: str, make_tier: Callable[..., RemoteTier], fake_clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(hung_server, timeout=0.1, max_stall=0.15)
    with caplog.at_level(logging.WARNING, logger=LOG):
        for _ in range(10):
            tier.get("ab" * 32, ENV_ID)
            fake_clock[0] += 100  # every backoff window over: only the stall budget stops calls
    assert tier.stats()["available"] is False
    assert tier.stats()["errors"] == 2  # 2 x 0.1 s reached max_stall; the rest skipped
    assert len(warnings_of(caplog)) == 2 and "switched off" in warnings_of(caplog)[1]


@needs_server
@pytest.mark.redis
def test_full_redis_rejects_publish_but_serves_reads(
    own_server: LocalRedis, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(own_server.url)
    stored, new = make_entry(), make_entry(key="78" * 32)
    assert tier.put(stored)
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")  # every write now fails with OOM
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert tier.put(new) is False
        assert tier.put(new) is False
    assert tier.get(stored.key, ENV_ID) is not None  # reads still work: no backoff
    assert tier.available and tier.stats()["errors"] == 2
    assert len(warnings_of(caplog)) == 1 and "rejected" in warnings_of(caplog)[0]


# ---------------------------------------------------------------------------- lock renewal, release, bounds


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[LocalRedis]:
    """A server with an append-only file: a lock it holds survives a restart."""
    server = LocalRedis(tmp_path, args=["--appendonly", "yes", "--appendfsync", "always"]).start()
    yield server
    server.stop()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A tiny TCP server on 127.0.0.1 that accepts connections and never answers: a hung Redis."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # a timeout: look at `stop` again
                held.append(listener.accept()[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    thread.join(5)
    for connection in held:
        connection.close()
    listener.close()


@needs_server
@pytest.mark.redis
def test_lock_is_renewed_while_its_holder_builds(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any
) -> None:
    holder, other = make_tier(redis_server.url, lock_ttl=1), make_tier(redis_server.url)
    key = "9a" * 32
    lock_name = holder.redis_key(key, ENV_ID) + ":lock"
    with holder.lock(key, ENV_ID, wait=0) as mine:
        assert mine is True
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < 3:  # autotuning for three times the lock's expiry
            with other.lock(key, ENV_ID, wait=0) as theirs:
                assert theirs is False, f"another node took the lock {elapsed:.1f} s into the build"
            assert 0 < raw.pttl(lock_name) <= 1000
            time.sleep(0.1)
    assert raw.exists(lock_name) == 0  # released as the block ends
    time.sleep(0.5)
    assert raw.exists(lock_name) == 0  # and no renewal brings it back
    with other.lock(key, ENV_ID, wait=0) as theirs:
        assert theirs is True


@needs_server
@pytest.mark.redis
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("how", ["block-ends", "block-raises", "tier-closed"])
def test_a_child_forked_inside_the_block_leaves_its_parents_lock_alone(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any, how: str
) -> None:
    """A process forks while its thread holds the fleet lock (a build that starts a worker,
    say): the child's copy of the with-block ends there too, but the lock is the parent's,
    which still builds. The child neither releases nor renews it, and another node keeps
    waiting until the parent's block ends."""
    holder, other = make_tier(redis_server.url, lock_ttl=5), make_tier(redis_server.url)
    key = "9c" * 32
    lock_name = holder.redis_key(key, ENV_ID) + ":lock"
    block = holder.lock(key, ENV_ID, wait=0)
    assert block.__enter__() is True
    token = raw.get(lock_name)
    pid = os.fork()
    if pid == 0:  # the child: it never returns to pytest
        code = 1
        try:
            signal.alarm(20)
            if how == "block-raises":
                block.__exit__(RuntimeError, RuntimeError("the child's build failed"), None)
            else:
                block.__exit__(None, None, None)
            if how == "tier-closed":
                holder.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert raw.get(lock_name) == token, "the child released its parent's lock"
    with other.lock(key, ENV_ID, wait=0) as theirs:
        assert theirs is False, "another node took the lock while the parent still builds"
    block.__exit__(None, None, None)
    assert raw.exists(lock_name) == 0, "the parent releases its own lock as its block ends"


def _dying_holder(url: str, namespace: str, key: str, ready: Any) -> None:
    """A node that takes the lock and builds until it is killed."""
    tier = RemoteTier(url, secret=SECRET, namespace=namespace, lock_ttl=1)
    with tier.lock(key, ENV_ID, wait=0) as mine:
        ready.put(mine)
        time.sleep(60)


@needs_server
@pytest.mark.redis
def test_a_dead_holders_lock_lasts_one_expiry(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    """Renewal keeps a live holder's lock; when the holder dies, waiters wait one expiry at most."""
    waiter = make_tier(redis_server.url)
    key = "9b" * 32
    context = multiprocessing.get_context("spawn")  # another machine: nothing shared but Redis
    ready = context.Queue()
    holder = context.Process(target=_dying_holder, args=(redis_server.url, waiter.namespace, key, ready), daemon=True)
    holder.start()
    try:
        assert ready.get(timeout=15) is True
        time.sleep(1.5)  # past the lock's 1 s expiry: the holder's renewals keep it
        with waiter.lock(key, ENV_ID, wait=0) as mine:
            assert mine is False
        holder.kill()
        holder.join(5)
        started = time.monotonic()
        with waiter.lock(key, ENV_ID, wait=10) as mine:
            waited = time.monotonic() - started
            assert mine is True
        assert waited < 1.5  # at most one expiry (1 s) plus a poll
    finally:
        holder.kill()
        holder.join(5)
        ready.close()
        ready.join_thread()


@needs_server
@pytest.mark.redis
@pytest.mark.parametrize("trouble", ["down-at-release", "restarted-before-release", "hung-at-release"])
def test_a_failed_publish_never_strands_the_lock(
    aof_server: LocalRedis, make_tier: Callable[..., RemoteTier], trouble: str
) -> None:
    """Redis restarts (or hangs) mid-build: the holder's publish fails and it backs off, but its
    lock, kept in the append-only file, must still be released, or the next node to need the
    plan waits its whole lock timeout on a healthy Redis."""
    holder, other = make_tier(aof_server.url, timeout=0.1), make_tier(aof_server.url)
    entry = make_entry()
    assert aof_server.process is not None
    pid = aof_server.process.pid
    with holder.lock(entry.key, ENV_ID, wait=0) as mine:
        assert mine is True
        if trouble == "hung-at-release":
            os.kill(pid, signal.SIGSTOP)
        else:
            aof_server.stop()
        assert holder.put(entry) is False and not holder.available  # the holder backs off
        if trouble == "restarted-before-release":
            aof_server.start()
        leaving = time.monotonic()
    left_after = time.monotonic() - leaving
    if trouble == "hung-at-release":
        os.kill(pid, signal.SIGCONT)
    elif trouble == "down-at-release":
        aof_server.start()  # same port, same append-only file: the lock is back
    started = time.monotonic()
    with other.lock(entry.key, ENV_ID, wait=10) as theirs:
        waited = time.monotonic() - started
    assert left_after < 0.5, "leaving the block waits one Redis attempt at most"
    assert waited < 3, f"the next node waited {waited:.1f} s for a stranded lock"
    if trouble != "hung-at-release":  # a hung Redis runs the timed-out publish once it resumes
        assert theirs is True
    lock_name = holder.redis_key(entry.key, ENV_ID) + ":lock"
    with aof_server.client() as admin:
        deadline = time.monotonic() + 3
        while admin.exists(lock_name) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.exists(lock_name) == 0, "the holder's lock outlived its release"


@needs_server
@pytest.mark.redis
def test_a_take_whose_reply_was_lost_leaves_no_lock(own_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    """The take reaches a Redis that stalls: the node times out, builds locally, and Redis then
    runs the take and sets the lock. Nobody holds it, so the node releases it by its token once
    Redis answers; otherwise every other node would wait on it until it expires."""
    node, other = make_tier(own_server.url, timeout=0.1), make_tier(own_server.url)
    entry = make_entry()
    with node.lock(make_entry("cd" * 32).key, ENV_ID, wait=0):  # a connection open, the take's script loaded
        pass
    assert own_server.process is not None
    os.kill(own_server.process.pid, signal.SIGSTOP)
    try:
        with node.lock(entry.key, ENV_ID, wait=0) as mine:
            assert mine is True  # Redis did not answer: build locally
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
    lock_name = node.redis_key(entry.key, ENV_ID) + ":lock"
    started = time.monotonic()
    with other.lock(entry.key, ENV_ID, wait=10) as theirs:
        waited = time.monotonic() - started
    assert theirs is True and waited < 3, f"the next node waited {waited:.1f} s on a lock nobody held"
    with own_server.client() as admin:
        assert admin.exists(lock_name) == 0


@pytest.mark.parametrize("wait", [0.0, 1.0])
@pytest.mark.parametrize("state", ["healthy", "hung", "down", "hangs-while-waiting"])
def test_lock_wait_is_bounded(
    state: str, wait: float, request: pytest.FixtureRequest, make_tier: Callable[..., RemoteTier]
) -> None:
    """lock(wait=W) returns within W plus one Redis attempt, whatever Redis does."""
    timeout = 0.1
    held: contextlib.AbstractContextManager[bool] | None = None
    if state in ("healthy", "hangs-while-waiting"):
        server: LocalRedis = request.getfixturevalue("own_server")  # skips without redis-server
        url = server.url
        held = make_tier(url).lock("9d" * 32, ENV_ID, wait=0)  # referenced: held for the whole test
        assert held.__enter__() is True
    else:
        url = request.getfixturevalue("silent_server") if state == "hung" else f"redis://127.0.0.1:{free_port()}/0"
    tier = make_tier(url, timeout=timeout)
    hang: threading.Timer | None = None
    if state == "hangs-while-waiting":
        assert server.process is not None
        hang = threading.Timer(0.3, os.kill, args=(server.process.pid, signal.SIGSTOP))
        hang.start()
    try:
        started = time.monotonic()
        with tier.lock("9d" * 32, ENV_ID, wait=wait) as mine:
            elapsed = time.monotonic() - started
    finally:
        if hang is not None:
            hang.join()
            os.kill(server.process.pid, signal.SIGCONT)
        if held is not None:
            held.__exit__(None, None, None)
    assert elapsed < wait + 2 * timeout + 0.1
    expected = {"healthy": False, "hung": True, "down": True, "hangs-while-waiting": wait > 0.3}[state]
    assert mine is expected  # True: nobody to coordinate with, build locally
    if state == "healthy":
        assert elapsed >= wait


@needs_server
@pytest.mark.redis
@pytest.mark.parametrize(("maxmemory", "size"), [("1mb", 2_000_000), ("8mb", 10_000_000)])
def test_redis_smaller_than_a_plan(
    maxmemory: str, size: int, tmp_path: Path, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    """allkeys-lru does refuse writes: a value larger than what eviction can free (8mb), or
    every write once Redis's own overhead exceeds maxmemory (1mb). The tier reports it once,
    says "build locally" for a refused lock, and keeps working."""
    server = LocalRedis(tmp_path, args=["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]).start()
    try:
        tier = make_tier(server.url)
        big = make_entry(size=size)
        with caplog.at_level(logging.WARNING, logger=LOG):
            started = time.monotonic()
            assert tier.put(big) is False
            assert tier.put(big) is False
            with tier.lock("9e" * 32, ENV_ID, wait=5) as mine:
                assert mine is True  # taken, or refused: either way this node builds, at once
            elapsed = time.monotonic() - started
        assert elapsed < 1
        stats = tier.stats()
        assert stats["available"] is True and stats["publishes"] == 0 and stats["skipped"] == 0
        assert stats["errors"] >= 2
        published = [m for m in warnings_of(caplog) if "publish" in m]
        assert len(published) == 1 and "full" in published[0] and "local store" in published[0]
        if maxmemory == "8mb":  # once Redis has dropped the refused value, smaller plans fit again
            deadline = time.monotonic() + 3
            while not tier.put(make_entry(size=100_000)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tier.stats()["publishes"] == 1
    finally:
        server.stop()


@needs_server
@pytest.mark.redis
def test_full_redis_refuses_the_lock_but_not_its_renewal_or_release(
    own_server: LocalRedis, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    """A full Redis (here noeviction) refuses the lock script: a waiter builds locally at once,
    without the fleet lock; the holder's renewal and release still go through."""
    holder, waiter = make_tier(own_server.url, lock_ttl=0.6), make_tier(own_server.url)
    key = "9f" * 32
    lock_name = holder.redis_key(key, ENV_ID) + ":lock"
    admin = own_server.client()
    with holder.lock(key, ENV_ID, wait=0) as mine:
        assert mine is True
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")  # every write that needs memory fails with OOM
        with caplog.at_level(logging.WARNING, logger=LOG):
            started = time.monotonic()
            with waiter.lock(key, ENV_ID, wait=5) as theirs:
                assert theirs is True  # no exception, no wait: build without the fleet lock
            assert time.monotonic() - started < 0.5
        assert not waiter._locks._holds.get().listed(), "a refused take set no lock: nothing to release"
        assert any("without the fleet lock" in m for m in warnings_of(caplog))
        time.sleep(1.0)  # past the 0.6 s expiry: renewed all the same
        assert admin.exists(lock_name) == 1
    assert admin.exists(lock_name) == 0
    assert waiter.available and holder.available
    admin.close()


# ---------------------------------------------------------------------------- TTL


@needs_server
@pytest.mark.redis
def test_ttl_applied(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    entry = make_entry()
    expiring = make_tier(redis_server.url, ttl=100)
    assert expiring.put(entry)
    assert 90 < raw.ttl(expiring.redis_key(entry.key, ENV_ID)) <= 100

    lasting = make_tier(redis_server.url, namespace=f"{expiring.namespace}b", lock_ttl=30)
    assert lasting.put(entry)
    assert raw.ttl(lasting.redis_key(entry.key, ENV_ID)) == -1  # no TTL: kept until evicted
    with lasting.lock(entry.key + "0", ENV_ID, wait=0) as mine:
        assert mine
        assert 25_000 < raw.pttl(lasting.redis_key(entry.key + "0", ENV_ID) + ":lock") <= 30_000


@needs_server
@pytest.mark.redis
def test_ttl_expiry_is_a_miss(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], raw: Any) -> None:
    tier = make_tier(redis_server.url, ttl=1)
    entry = make_entry()
    assert tier.put(entry)
    raw.pexpire(tier.redis_key(entry.key, ENV_ID), 1)  # do not wait a whole second
    time.sleep(0.01)
    assert tier.get(entry.key, ENV_ID) is None and tier.stats()["remote_misses"] == 1


# ---------------------------------------------------------------------------- configuration


def test_from_env_without_url_is_none() -> None:
    assert RemoteTier.from_env({}) is None
    assert RemoteTier.from_env({"PLANCACHE_REDIS_SECRET": "x" * 32}) is None


def test_from_env_refuses_to_run_without_a_secret() -> None:
    with pytest.raises(ConfigError) as info:
        RemoteTier.from_env({"PLANCACHE_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert "PLANCACHE_REDIS_SECRET" in str(info.value) and "PLANCACHE_REDIS_SECRET_FILE" in str(info.value)


def test_from_env_reads_the_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    url = "redis://:hunter2@127.0.0.1:1/0"
    tier = RemoteTier.from_env({"PLANCACHE_REDIS_URL": url, "PLANCACHE_REDIS_SECRET_FILE": str(path),
                                "PLANCACHE_REDIS_TTL": "3600", "PLANCACHE_REDIS_TIMEOUT": "0.1",
                                "PLANCACHE_REDIS_NAMESPACE": "fleet1", "PLANCACHE_REDIS_LOCK_TTL": "120"})  # fmt: skip
    direct = RemoteTier(url, secret=SECRET)
    assert tier is not None
    assert tier.key_id == direct.key_id  # the trailing newline is not part of the secret
    assert (tier.ttl, tier.timeout, tier.namespace, tier.lock_ttl) == (3600, 0.1, "fleet1", 120)
    assert direct.lock_ttl == 60  # renewed while held: a dead holder's lock lasts a minute
    assert "hunter2" not in tier.url and "hunter2" not in repr(tier) and "hunter2" not in str(tier.stats())
    tier.close()
    direct.close()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PLANCACHE_REDIS_SECRET": "s" * 32, "PLANCACHE_REDIS_SECRET_FILE": "/x"}, "both set"),
        ({"PLANCACHE_REDIS_SECRET_FILE": "/nonexistent/secret"}, "/nonexistent/secret"),
        ({"PLANCACHE_REDIS_SECRET": "short"}, "at least 16"),
        ({"PLANCACHE_REDIS_SECRET": "s" * 32, "PLANCACHE_REDIS_TIMEOUT": "soon"}, "PLANCACHE_REDIS_TIMEOUT"),
    ],
)
def test_from_env_errors_are_clear(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RemoteTier.from_env({"PLANCACHE_REDIS_URL": "redis://127.0.0.1:1/0", **env})


def test_bad_url_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"^url is not a Redis URL"):
        RemoteTier("http://127.0.0.1:1", secret=SECRET)
    with pytest.raises(ConfigError, match=r"^url is not a Redis URL \(its host or port cannot be read"):
        RemoteTier("redis://127.0.0.1:port/0", secret=SECRET)
