#!/usr/bin/env python3
"""Latency of the Redis fleet tier: RemoteTier.get of one ~100 KB entry, many times.

Starts its own redis-server on 127.0.0.1 (no persistence) unless --url is given, publishes
one entry, then times ``get`` (GET + HMAC check + decode + checksum) and, for comparison,
a bare redis-py GET of the same value, and ``put``. Prints median and p99 in milliseconds.

    python scripts/bench_remote.py                 # needs redis-server on PATH
    python scripts/bench_remote.py --url redis://127.0.0.1:6379/0 --gets 2000
"""

from __future__ import annotations

import argparse
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

import redis

from plancache.store import Entry, sha256
from plancache.tiers.remote import RemoteTier

SECRET = b"bench-secret-0123456789abcdef-32"


@contextmanager
def local_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, killed on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH (Debian: apt-get install redis-server), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(250):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.kill()
            process.wait()


def entry_of_size(size: int) -> Entry:
    blob = (bytes(range(256)) * (size // 256 + 1))[:size]
    return Entry(
        key="ab" * 32, env_id="0123456789abcdef", label="CONV_FPROP", description={"nodes": [{"type": "CONV_FPROP"}]},
        environment={"gpu": "bench"}, options={}, tensors=[{"uid": 1}], blob=blob, blob_sha256=sha256(blob),
        engine={"id": 3}, workspace_size=0, policy="fastest", candidates=[], timing={}, build_seconds=1.0,
        autotune_seconds=1.0, backend="bench", check={"status": "agreed", "rule": 2, "compared": 2, "agreeing": 2, "rejected": []},
    )  # fmt: skip


def timed(fn: Callable[[], object], count: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def summary(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{name:<28} median {statistics.median(ordered):7.3f} ms   p99 {p99:7.3f} ms   (n={len(ordered)})"


def run(url: str, size: int, gets: int) -> None:
    tier = RemoteTier(url, secret=SECRET, namespace="bench")
    entry = entry_of_size(size)
    assert tier.put(entry), "publish failed"
    name = tier.redis_key(entry.key, entry.env_id)
    bare = redis.Redis.from_url(url)
    value = bare.get(name)
    assert value is not None
    results = [
        summary("RemoteTier.get (verified)", timed(lambda: tier.get(entry.key, entry.env_id), gets)),
        summary("bare redis-py GET", timed(lambda: bare.get(name), gets)),
        summary("RemoteTier.put (signed)", timed(lambda: tier.put(entry), max(50, gets // 5))),
    ]
    server = bare.info("server")["redis_version"]
    print(f"entry {len(value):,} bytes in Redis (blob {size:,}); redis-server {server}; redis-py {redis.__version__}; "
          f"Python {platform.python_version()}; {platform.processor() or platform.machine()}")  # fmt: skip
    print("\n".join(results))
    stats = tier.stats()
    assert stats["remote_hits"] >= gets and stats["refused"] == 0 and stats["errors"] == 0
    bare.delete(name)
    bare.close()
    tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis (default: start one on 127.0.0.1)")
    parser.add_argument("--size", type=int, default=100_000, help="blob bytes (default 100000)")
    parser.add_argument("--gets", type=int, default=500, help="timed gets (default 500)")
    args = parser.parse_args()
    if args.url:
        run(args.url, args.size, args.gets)
        return
    with local_redis() as url:
        run(url, args.size, args.gets)


if __name__ == "__main__":
    main()
