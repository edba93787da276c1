"""Issue #34, the Redis tier: its bounds hold for the whole operation, whatever Redis does.

A value larger than the cap is refused before it is read; a fleet lock that would outlive
``lock_ttl`` is stale; a server that drips its reply, or sends more than any value may be,
is cut off at the operation's deadline or the reply cap. Each a miss or a failure, never an
exception and never a wait of seconds.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from redis_fixtures import SECRET, LocalRedis, needs_server  # noqa: E402
from test_remote import ENV_ID, warnings_of  # noqa: E402

from plancache import PlanCache, Store  # noqa: E402  (after the importorskip above)
from plancache.config import ConfigError  # noqa: E402
from plancache.key import environment_id  # noqa: E402
from plancache.store import Entry  # noqa: E402
from plancache.testing import CpuTestBackend  # noqa: E402
from plancache.tiers.remote import RemoteTier, settings_from_env  # noqa: E402
from plancache.workflows import templates  # noqa: E402

KEY = "cd" * 32
MiB = 1 << 20


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    """A plan built on the CPU test backend, as a node would publish it (about 9 KiB)."""
    directory = tmp_path_factory.mktemp("built")
    with PlanCache(directory, backend=CpuTestBackend()) as cache:
        cache.get(templates.build("conv_bias_act", n=2, c=8, h=6, w=6, k=8, dtype="float32"))
    store = Store(directory)
    (key,) = store.keys()
    built = store.get(key)
    assert built is not None
    return built


def output_bytes(client: Any) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


# ---------------------------------------------------------------------------- a value over the cap


@needs_server
@pytest.mark.redis
def test_a_200_mib_value_is_refused_without_being_read(
    own_server: LocalRedis, make_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(own_server.url)
    raw = own_server.client()
    raw.setrange(tier.redis_key(KEY, ENV_ID), 200 * MiB - 1, b"x")  # made inside Redis: nothing sent
    before = output_bytes(raw)
    started = time.monotonic()
    assert tier.get(KEY, ENV_ID) is None
    elapsed = time.monotonic() - started
    sent = output_bytes(raw) - before
    assert sent < MiB, f"Redis sent {sent} bytes for a lookup of a 200 MiB value"
    assert elapsed < 1.0, f"the lookup took {elapsed:.2f} s"
    stats = tier.stats()
    assert stats["refused"] == 1 and stats["remote_hits"] == 0 and stats["errors"] == 0
    (warning,) = warnings_of(caplog)
    assert "PLANCACHE_REDIS_MAX_VALUE" in warning and str(200 * MiB) in warning
    raw.close()


@needs_server
@pytest.mark.redis
def test_the_cap_is_a_setting_and_bounds_what_is_published(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], entry: Entry, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry over the cap is not published, since every node would refuse it unread; one
    published under a larger cap is refused, unread, by a node with a smaller one. Too
    small a cap is a clear error."""
    small = make_tier(redis_server.url, max_value="4k")
    assert not small.put(entry) and small.stats()["errors"] == 1
    assert small.get(entry.key, entry.env_id) is None and small.stats()["remote_misses"] == 1, "nothing was stored"
    assert any("not publishing" in w and "PLANCACHE_REDIS_MAX_VALUE" in w for w in warnings_of(caplog))
    large = make_tier(redis_server.url)
    assert large.put(entry) and large.get(entry.key, entry.env_id) is not None
    assert small.get(entry.key, entry.env_id) is None and small.stats()["refused"] == 1
    settings = settings_from_env({"PLANCACHE_REDIS_URL": redis_server.url, "PLANCACHE_REDIS_SECRET": SECRET.decode(),
                                  "PLANCACHE_REDIS_MAX_VALUE": "8M"})  # fmt: skip
    assert settings is not None and settings["max_value"] == 8 * MiB
    with pytest.raises(ConfigError, match="max_value"):
        RemoteTier(redis_server.url, secret=SECRET, max_value=100)


# ---------------------------------------------------------------------------- stale locks


@needs_server
@pytest.mark.redis
@pytest.mark.parametrize("expiry", ["none", "a year"])
def test_a_lock_that_would_outlive_lock_ttl_is_taken_over(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], expiry: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(redis_server.url, lock_ttl=5)
    raw = redis_server.client()
    lock = tier.redis_key(KEY, ENV_ID) + ":lock"
    raw.set(lock, b"someone", ex=None if expiry == "none" else 365 * 86400)
    started = time.monotonic()
    with tier.lock(KEY, ENV_ID, wait=3.0) as mine:
        elapsed = time.monotonic() - started
        assert mine, "the miss goes on to build"
        assert elapsed < 1.0, f"waited {elapsed:.2f} s on a stale lock"
        assert 0 < raw.pttl(lock) <= 5000, "the lock is ours now, with our expiry"
    assert raw.get(lock) is None, "and released"
    assert any("took over the fleet lock" in w and "PLANCACHE_REDIS_LOCK_TTL" in w for w in warnings_of(caplog))
    raw.close()


@needs_server
@pytest.mark.redis
def test_a_miss_under_a_lock_with_no_expiry_builds_without_waiting_lock_timeout(
    redis_server: LocalRedis, make_tier: Callable[..., RemoteTier], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    graph = templates.build("conv_bias_act", n=3, c=8, h=6, w=6, k=8, dtype="float32")
    with PlanCache(tmp_path / "a", backend=CpuTestBackend(), remote=make_tier(redis_server.url), lock_timeout=10) as cache:
        key = cache.key(graph)
        raw = redis_server.client()
        raw.set(cache.remote.redis_key(key.digest, environment_id(key.parts["environment"])) + ":lock", b"stray")
        started = time.monotonic()
        plan = cache.get(graph)
        elapsed = time.monotonic() - started
        raw.close()
    assert plan.source == "built"
    assert elapsed < 5.0, f"the miss waited {elapsed:.1f} s on a lock that never expires (lock_timeout 10 s)"
    assert any("took over the fleet lock" in w for w in warnings_of(caplog))


@needs_server
@pytest.mark.redis
def test_a_live_lock_is_still_waited_for(redis_server: LocalRedis, make_tier: Callable[..., RemoteTier]) -> None:
    """The counterpart: a lock within lock_ttl is another node's build, not stale."""
    tier = make_tier(redis_server.url, lock_ttl=5)
    raw = redis_server.client()
    lock = tier.redis_key(KEY, ENV_ID) + ":lock"
    raw.set(lock, b"someone", px=4000)
    with tier.lock(KEY, ENV_ID, wait=0.3) as mine:
        assert not mine
    assert raw.get(lock) == b"someone"
    raw.close()


# ---------------------------------------------------------------------------- hostile servers


class HostileServer:
    """A TCP server on 127.0.0.1 that reads each command and answers with ``reply``: an
    iterator of chunks sent ``pause`` seconds apart, until the client hangs up or the test
    ends. ``closed`` is set once a client hung up; ``sent`` counts the bytes that left."""

    def __init__(self, reply: Callable[[], Iterator[bytes]], pause: float) -> None:
        self.reply = reply
        self.pause = pause
        self.closed = threading.Event()
        self.stop = threading.Event()
        self.sent = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.settimeout(0.05)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn = self.listener.accept()[0]
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(1 << 16)  # the command
            for chunk in self.reply():
                if self.stop.is_set() or self._hung_up(conn):
                    return
                try:
                    conn.sendall(chunk)
                except OSError:
                    self.closed.set()
                    return
                self.sent += len(chunk)
                time.sleep(self.pause)

    def _hung_up(self, conn: socket.socket) -> bool:
        if select.select([conn], [], [], 0)[0] and conn.recv(1 << 16) == b"":
            self.closed.set()
            return True
        return False

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


def endless(chunk: bytes, first: bytes = b"") -> Callable[[], Iterator[bytes]]:
    def reply() -> Iterator[bytes]:
        yield first
        while True:
            yield chunk

    return reply


@pytest.fixture
def dripping() -> Iterator[HostileServer]:
    """A simple-string reply that never ends, one byte every 0.2 s: each read of a socket
    timeout of 0.25 s gets a byte, so only a deadline for the whole call stops it."""
    server = HostileServer(endless(b"O", first=b"+"), pause=0.2)
    yield server
    server.close()


def call_in_thread(operation: Callable[[], Any], limit: float) -> tuple[bool, Any, float]:
    """(finished within ``limit``, its result or exception, seconds taken)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(operation())
        except BaseException as exc:  # asserted on below: nothing may come out of the tier
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit)
    return not thread.is_alive(), outcome[0] if outcome else None, time.monotonic() - started


def _lock(tier: RemoteTier) -> bool:
    with tier.lock(KEY, ENV_ID, wait=5.0) as mine:
        return mine


OPERATIONS: dict[str, tuple[Callable[[RemoteTier, Entry], Any], Any]] = {
    "get": (lambda tier, entry: tier.get(entry.key, entry.env_id), None),  # a miss
    "put": (lambda tier, entry: tier.put(entry), False),  # not published
    "lock": (lambda tier, entry: _lock(tier), True),  # no one to coordinate with: build locally
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_a_server_that_drips_its_reply_is_cut_off_at_the_deadline(
    dripping: HostileServer, make_tier: Callable[..., RemoteTier], entry: Entry, operation: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(dripping.url, timeout=0.25)
    run, failed = OPERATIONS[operation]
    finished, result, elapsed = call_in_thread(lambda: run(tier, entry), limit=5.0)
    assert finished, f"{operation} was still reading a dripped reply after {elapsed:.1f} s"
    assert not isinstance(result, BaseException), result
    assert result == failed
    assert elapsed < 0.5 + 0.5, f"{operation} took {elapsed:.2f} s; its deadline is 0.5 s (2 round trips of 0.25 s)"
    stats = tier.stats()
    assert stats["errors"] == 1 and not stats["available"], "the breaker was told, as for any failure"
    assert len([w for w in warnings_of(caplog) if "unreachable" in w]) == 1
    assert dripping.closed.wait(2.0), "the half-read connection was dropped, not kept for reuse"


def test_a_reply_larger_than_any_value_is_cut_off_unread(make_tier: Callable[..., RemoteTier]) -> None:
    """A hostile server that ignores the size check and streams a huge value as fast as it
    can: the lookup reads at most the cap (and framing), then drops the connection."""
    server = HostileServer(endless(b"\0" * MiB, first=b"$314572800\r\n"), pause=0)  # 300 MiB announced
    try:
        tier = make_tier(server.url, timeout=5)  # a cap of 16 MiB
        finished, result, _ = call_in_thread(lambda: tier.get(KEY, ENV_ID), limit=20.0)
        assert finished and result is None, (finished, result)
        assert server.closed.wait(5.0)
        assert server.sent < 64 * MiB, f"the server got {server.sent} bytes out before the lookup hung up"
        assert tier.stats()["errors"] == 1
    finally:
        server.close()


def test_a_reply_no_redis_sends_is_a_failure_never_an_exception(make_tier: Callable[..., RemoteTier]) -> None:
    """A list where a value or nothing is due: redis-py 8's own handshake raised
    AttributeError on it, out of the lookup."""
    server = HostileServer(endless(b"", first=b"*1\r\n$1\r\nx\r\n"), pause=0.05)
    try:
        tier = make_tier(server.url)
        finished, result, _ = call_in_thread(lambda: tier.get(KEY, ENV_ID), limit=5.0)
        assert finished and result is None, result
        stats = tier.stats()
        assert stats["remote_hits"] == 0 and stats["errors"] + stats["refused"] == 1
    finally:
        server.close()


def test_every_way_redis_py_reads_a_connection_is_bounded() -> None:
    """Where hiredis is installed redis-py's parser reads with recv_into and peeks with
    recv(1, MSG_PEEK): the first went around both bounds, and the second failed every call
    on a pooled connection (TypeError), so the tier backed off after each Redis restart."""
    from plancache.tiers.bounded import BoundedSocket, within

    ours, theirs = socket.socketpair()
    with ours, theirs:
        bounded, buffer = BoundedSocket(ours), bytearray(64)
        theirs.sendall(b"x" * 100)
        with within(5.0, max_bytes=10):
            assert bounded.recv(1, socket.MSG_PEEK) == b"x"
            assert bounded.recv_into(buffer) == 9 and buffer[:9] == b"x" * 9  # the peeked byte counted
            with pytest.raises(OSError, match="larger than"):
                bounded.recv_into(buffer)
        with within(0.3, max_bytes=MiB):
            assert bounded.recv_into(buffer) == 64 and bounded.recv(64) == b"x" * 27
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                bounded.recv_into(buffer)  # nothing more comes: the deadline ends the wait
            assert time.monotonic() - started < 1.0
