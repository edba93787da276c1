"""A throwaway redis-server on 127.0.0.1 for the tests that need a real one.

``redis_server`` (one per session), ``own_server`` (one per test, which it may kill) and
``make_tier`` (tiers in a namespace of the test, under ``SECRET``) are registered in
conftest.py. Without the ``redis-server`` binary these fixtures skip,
except in CI (``CI`` set), where .ci/run installs it and a missing binary is an error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from plancache.tiers.remote import RemoteTier

try:
    import redis
except ImportError:  # the redis package is in [test]; without it the Redis tests skip, the others run
    redis = None

REDIS_SERVER = shutil.which("redis-server")
if REDIS_SERVER is None and os.environ.get("CI"):
    # In CI a missing server is a broken set-up (.ci/run installs it), not a reason to skip.
    raise RuntimeError("CI is set but redis-server is not on PATH: .ci/run should have installed it")
NO_SERVER = "redis-server is not on PATH (Debian: apt-get install redis-server)"
NO_CLIENT = "the redis package is not installed (pip install 'redis>=5')"
needs_server = pytest.mark.skipif(REDIS_SERVER is None or redis is None, reason=NO_CLIENT if redis is None else NO_SERVER)


def require_server() -> None:
    """Skip the calling test or fixture, saying why, when no local Redis can be started."""
    if redis is None:
        pytest.skip(NO_CLIENT)
    if REDIS_SERVER is None:
        pytest.skip(NO_SERVER)


# ---------------------------------------------------------------------------- a local redis-server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A throwaway redis-server bound to 127.0.0.1 only, without persistence unless ``args``
    (extra redis-server options, which override the defaults) turn it on."""

    def __init__(self, directory: Path, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.directory = directory
        self.port = port
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        for _ in range(5):  # a port picked free can be taken before redis binds it
            port = self.port or free_port()
            if self._try_start(port):
                self.port = port
                return self
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _try_start(self, port: int) -> bool:
        # self.args last: a repeated redis-server option takes its last value.
        args = [str(REDIS_SERVER), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log"),
                *self.args]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                return False
            with contextlib.suppress(redis.RedisError), self.client(port) as client:
                if client.ping():
                    return True
            time.sleep(0.02)
        self.stop()
        return False

    def client(self, port: int | None = None) -> Any:
        return redis.Redis(host="127.0.0.1", port=port or self.port, socket_timeout=1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    require_server()
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[LocalRedis]:
    """A server of this test alone, which it may kill, restart or fill."""
    require_server()
    server = LocalRedis(tmp_path).start()
    yield server
    server.stop()


#: The fleet secret of the tests' tiers.
SECRET = b"fleet-secret-0123456789abcdef-32"


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RemoteTier]]:
    """Tiers in a namespace of this test, under ``SECRET`` unless told otherwise, closed at the end."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    tiers: list[RemoteTier] = []

    def make(url: str, **options: Any) -> RemoteTier:
        options.setdefault("secret", SECRET)
        options.setdefault("namespace", namespace)
        tier = RemoteTier(url, **options)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
