"""Guarantees 1 and 2 of docs/reliability.md with real processes: single-flight autotuning
across processes, locks of killed processes, SIGKILL at random points of writing and of
autotuning, and many readers with writers. The scenarios live in harness.py (shared with
scripts/stress_store.py, which runs them with larger counts)."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock
from graphs import ConvBiasRelu, assert_runs_correctly
from harness import (
    StoreModel,
    cache_victim,
    entry_for,
    processes,
    readers_writers,
    sigkill_builders,
    sigkill_writers,
    single_flight,
    start,
)

from plancache import LockTimeoutError, PlanCache, Store
from plancache.cache.flight import lock_name
from plancache.store import DB_NAME

pytestmark = pytest.mark.slow
MakeCache = Callable[..., PlanCache]


def lock_path(cache: PlanCache, graph: object) -> Path:
    return cache.directory / "locks" / lock_name(cache.key(graph).digest)


# ---------------------------------------------------------------------------- 1. single flight


def test_sixteen_processes_build_each_key_exactly_once(tmp_path: Path) -> None:
    # Each build takes 4 x 0.5 s, longer than the 1 s after which a waiter logs.
    report = single_flight(tmp_path, processes_n=16, keys=6, delay=0.5)
    assert report["violations"] == []
    assert (report["plans"], report["builds"]) == (16 * 6, 6)
    assert report["waits"] > 0 and report["wait_log_lines"] == report["waits"]  # one line per wait


def test_a_lock_left_by_a_killed_builder_blocks_no_one(tmp_path: Path, make_cache: MakeCache) -> None:
    directory, spec = tmp_path / "cache", ConvBiasRelu(n=3)
    journal, build_log = tmp_path / "victim", tmp_path / "builds.log"
    probe = make_cache(directory=directory)
    lock = FileLock(str(lock_path(probe, spec.graph())))
    with processes() as procs:
        victim = start(procs, cache_victim, str(directory), [3], 0.5, str(build_log), str(journal))
        deadline = time.monotonic() + 30
        while not _held(lock):  # the victim is autotuning inside its lock
            assert time.monotonic() < deadline and victim.is_alive(), "the victim never took the lock"
            time.sleep(0.01)
        victim.kill()
        victim.join(10)
    assert not build_log.exists()  # killed before storing anything
    started = time.monotonic()
    cache = make_cache(directory=directory, lock_timeout=20)
    plan = cache.get(spec.graph())
    # It never waited (waits 0): below the 20 s lock timeout, however busy the machine.
    assert time.monotonic() - started < 20
    assert plan.source == "built" and cache.counters["waits"] == 0
    assert_runs_correctly(plan, spec)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_build_does_not_keep_its_lock(tmp_path: Path, make_cache: MakeCache) -> None:
    """A worker forked while another thread builds inherits the lock's descriptor, and a
    flock lives as long as any copy: after the builder was killed mid-build, every later
    process waited out its lock_timeout while the worker lived, though nobody built."""
    import signal
    import subprocess
    import sys
    import textwrap

    directory, spec = tmp_path / "cache", ConvBiasRelu(n=3)
    probe = make_cache(directory=directory)
    lock = FileLock(str(lock_path(probe, spec.graph())))
    builder = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from graphs import ConvBiasRelu
        from plancache import PlanCache
        from plancache.testing import CpuTestBackend
        cache = PlanCache({str(directory)!r}, backend=CpuTestBackend(build_delay=5.0), auto_prime=False)
        threading.Thread(target=lambda: cache.get(ConvBiasRelu(n=3).graph()), daemon=True).start()
        time.sleep(1.0)  # the thread holds the key's lock and builds
        child = os.fork()
        if child == 0:  # a worker forked meanwhile (a DataLoader's, say), unrelated to plancache
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", builder], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    worker = int(process.stdout.readline())
    try:
        assert _held(lock)
        process.kill()  # the builder dies mid-build; its worker lives on
        process.wait(10)
        started = time.monotonic()
        plan = make_cache(directory=directory, lock_timeout=10).get(spec.graph())
        assert time.monotonic() - started < 5 and plan.source == "built"
    finally:
        os.kill(worker, signal.SIGKILL)
        process.stdout.close()


# ---------------------------------------------------------------------------- forks

_FORK_STORM = """
import dataclasses, json, logging, os, sys, threading, time
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)  # torch's CPU thread pool does not survive a fork; one thread makes none
from graphs import ConvBiasRelu
from plancache import PlanCache
from plancache.store import sha256
from plancache.testing import CpuTestBackend

directory, forks = {directory!r}, {forks}
cache = PlanCache(directory, backend=CpuTestBackend(), auto_prime=False)
known = ConvBiasRelu(n=1)
entry = cache.store.get(cache.get(known.graph()).key)
big = os.urandom(1 << 20)  # rows a reader spends long inside SQLite on
rows = [dataclasses.replace(entry, key=f"{{i:064x}}", blob=big, blob_sha256=sha256(big)) for i in range(1, 5)]
for row in rows:
    cache.store.put(row)
stop, built = threading.Event(), []

def hit(key):
    while not stop.is_set():
        assert cache.store.get(key) is not None

def miss():
    n = 100
    while not stop.is_set():
        n += 1
        built.append(cache.get(ConvBiasRelu(n=n).graph()).key)

threads = [threading.Thread(target=hit, args=(row.key,), daemon=True) for row in rows]
threads.append(threading.Thread(target=miss, daemon=True))
for thread in threads:
    thread.start()
children = []
for i in range(forks):
    time.sleep(0.02)
    read, write = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # a hit and a miss: both must come back, and soon
        warned = []
        logging.getLogger("plancache").addHandler(type("H", (logging.Handler,), {{"emit": lambda s, r: warned.append(r.getMessage())}})())
        hit_source = cache.get(known.graph()).source
        new = cache.get(ConvBiasRelu(n=1000 + i).graph())
        os.write(write, json.dumps([hit_source, new.source, new.key, warned]).encode())
        os._exit(0)
    os.close(write)
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() - started > 5:  # hung: ended, and reported as such
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    seconds = time.monotonic() - started
    children.append([seconds, *json.loads(os.read(read, 1 << 16) or b'[null, null, null, []]')])
    os.close(read)
stop.set()
for thread in threads:
    thread.join()
cache.close()
print(json.dumps({{"children": children, "built": built}}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forty_children_forked_while_threads_hit_and_miss_each_hit_and_miss_within_5_s(tmp_path: Path) -> None:
    """Four threads reading 1 MiB rows and one storing new plans while the process forks 40
    times. A child forked while a thread was inside SQLite closed a connection whose mutex
    that thread held, and hung forever; one forked inside a write transaction waited the
    busy timeout (30 s) out, then stored nothing. Each child must get its hit and its miss
    within 5 s, store its plan, and the parent lose nothing."""
    import json
    import sys
    import textwrap

    directory = tmp_path / "cache"
    script = textwrap.dedent(_FORK_STORM).format(tests=str(Path(__file__).parent), directory=str(directory), forks=40)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    late = [child for child in report["children"] if child[0] >= 5 or child[1] is None]
    assert not late, f"{len(late)} of 40 children hung or took 5 s or more: {late[:3]}"
    assert {(child[1], child[2]) for child in report["children"]} == {("loaded", "built")}
    assert [child[4] for child in report["children"] if child[4]] == []  # no warning: every child used the store
    store = Store(directory)
    try:
        kept = set(store.keys())
        assert set(report["built"]) <= kept and report["built"]  # nothing the parent stored is lost
        assert {child[3] for child in report["children"]} <= kept  # nor anything a child stored
        assert store.connection().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        store.close()


_FORK_INSIDE_A_WAIT = """
import dataclasses, json, logging, os, sqlite3, sys, threading, time
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from graphs import ConvBiasRelu
from plancache import PlanCache
from plancache.store import DB_NAME

directory = {directory!r}
from plancache.testing import CpuTestBackend
cache = PlanCache(directory, backend=CpuTestBackend(), auto_prime=False)
known = ConvBiasRelu(n=1)
entry = cache.store.get(cache.get(known.graph()).key)
holder = sqlite3.connect(os.path.join(directory, DB_NAME), isolation_level=None)
holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
row = dataclasses.replace(entry, key="f" * 64)
writer = threading.Thread(target=cache.store.put, args=(row,))  # waits for it, inside SQLite
writer.start()
time.sleep(0.5)
started = time.monotonic()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    warned = []
    logging.getLogger("plancache").addHandler(type("H", (logging.Handler,), {{"emit": lambda s, r: warned.append(r.getMessage())}})())
    sources = [cache.get(known.graph()).source, cache.get(ConvBiasRelu(n=2).graph()).source]
    os.write(write, json.dumps([sources, warned]).encode())
    os._exit(0)
forked = time.monotonic() - started
os.close(write)
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() - started > 10:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        break
    time.sleep(0.01)
child = json.loads(os.read(read, 1 << 16) or b"null")
seconds = time.monotonic() - started
holder.execute("ROLLBACK")
writer.join()
print(json.dumps({{"child": child, "seconds": seconds, "forked": forked, "stored": cache.store.get("f" * 64) is not None}}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_write_waits_inside_sqlite_builds_in_memory_with_one_warning(tmp_path: Path) -> None:
    """A thread waits inside SQLite for another writer's lock (up to the 30 s busy timeout),
    longer than a fork waits for it: the child cannot touch any connection it inherited.
    It must not hang or wait: it builds its plans in memory, says so once, and the parent's
    write goes through once the lock is free."""
    import json
    import sys
    import textwrap

    script = textwrap.dedent(_FORK_INSIDE_A_WAIT).format(tests=str(Path(__file__).parent), directory=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["child"] is not None and report["seconds"] < 5, report
    sources, warned = report["child"]
    assert sources == ["built", "built"]
    assert len(warned) == 1 and "forked while another thread was inside SQLite" in warned[0], warned
    assert report["stored"]  # the parent's write, once the other writer let go


def test_threads_waiting_for_one_key_each_wait_one_lock_timeout(tmp_path: Path, make_cache: MakeCache) -> None:
    """Another process holds the key's build lock. Four threads of this one look it up: the
    first waits at the lock, the others behind it in this process. Each gives up after
    lock_timeout; the k-th gave up after k times it, each starting its wait anew."""
    import threading

    directory, spec = tmp_path / "cache", ConvBiasRelu(n=3)
    cache = make_cache(directory=directory, lock_timeout=1.0)
    lock = FileLock(str(lock_path(cache, spec.graph())))  # another open file: held against this process too
    waited: list[float] = []

    def lookup() -> None:
        started = time.monotonic()
        with pytest.raises(LockTimeoutError):
            cache.get(spec.graph())
        waited.append(time.monotonic() - started)

    with lock:
        threads = [threading.Thread(target=lookup) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(waited) == 4 and max(waited) < 2.5, f"waits of {sorted(round(w, 1) for w in waited)} s"


def test_lock_timeout_is_a_number_of_seconds_above_zero_or_infinity(make_cache: MakeCache) -> None:
    import math

    from plancache.config import ConfigError

    for bad in (0, -1, math.nan, "ten", True, None):
        with pytest.raises(ConfigError, match=r"^PlanCache\(lock_timeout\)=.* is not a number of seconds above 0"):
            make_cache(lock_timeout=bad)
    assert make_cache(lock_timeout="10").lock_timeout == 10.0  # the text of a number, as every setting reads
    cache = make_cache(lock_timeout=math.inf)  # waits as long as a build takes
    assert cache.get(ConvBiasRelu(n=2).graph()).source == "built"


def _builder_holding_the_lock(directory: Path, build_delay: float) -> subprocess.Popen[str]:
    """A process whose lookup holds the build lock of ``ConvBiasRelu(n=3)`` while it builds
    for ``build_delay`` s; returned once the lock is held."""
    import sys
    import textwrap

    builder = textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from graphs import ConvBiasRelu
        from plancache import PlanCache
        from plancache.testing import CpuTestBackend
        cache = PlanCache({str(directory)!r}, backend=CpuTestBackend(build_delay={build_delay}), auto_prime=False)
        builder = threading.Thread(target=lambda: cache.get(ConvBiasRelu(n=3).graph()))
        builder.start()
        time.sleep(1.0)  # the thread holds the key's lock and builds
        print("holding", flush=True)
        # The main thread waits: were it to end, the interpreter's shutdown would begin while
        # the build imports torch, and that import fails then ("can't register atexit after
        # shutdown"; torch 2.14 reached concurrent.futures that late), releasing the lock early.
        builder.join()
    """)
    process = subprocess.Popen([sys.executable, "-c", builder], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "holding"
    return process


def test_a_stopped_lock_holder_holds_no_one_up(tmp_path: Path, make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A process stopped while it holds a key's build lock (Ctrl-Z, a debugger): its lock
    file stops being touched, and a waiter that finds it untouched for STALLED_AFTER_S
    builds the plan itself, with one warning, instead of waiting out lock_timeout and then
    raising into the program."""
    import signal

    from plancache.cache import flight

    monkeypatch.setattr(flight, "STALLED_AFTER_S", 4.0)
    directory, spec = tmp_path / "cache", ConvBiasRelu(n=3)
    holder = _builder_holding_the_lock(directory, build_delay=60.0)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="plancache"):
            plan = make_cache(directory=directory, lock_timeout=600).get(spec.graph())
        waited = time.monotonic() - started
        assert 3.0 <= waited < 15, waited  # the file's age, not the 600 s lock_timeout
        assert plan.source == "built"
        assert_runs_correctly(plan, spec)
        stalled = [r.getMessage() for r in caplog.records if "has not moved" in r.getMessage()]
        assert len(stalled) == 1 and f"process {holder.pid}" in stalled[0], stalled
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        os.kill(holder.pid, signal.SIGCONT)
        holder.wait(10)
        assert holder.stdout is not None
        holder.stdout.close()


def test_a_holder_that_builds_keeps_its_waiters_waiting(tmp_path: Path, make_cache: MakeCache,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A holder that runs touches its lock file every HEARTBEAT_S (2 s): a build longer than
    STALLED_AFTER_S is waited for, and its plan served from the store, never built twice."""
    from plancache.cache import flight

    monkeypatch.setattr(flight, "STALLED_AFTER_S", 4.0)
    directory, spec = tmp_path / "cache", ConvBiasRelu(n=3)
    holder = _builder_holding_the_lock(directory, build_delay=8.0)
    try:
        cache = make_cache(directory=directory, lock_timeout=600)
        plan = cache.get(spec.graph())
        assert plan.source == "loaded" and cache.counters["waits"] == 1
        assert_runs_correctly(plan, spec)
    finally:
        holder.kill()
        holder.wait(10)
        assert holder.stdout is not None
        holder.stdout.close()


def _held(lock: FileLock) -> bool:
    try:
        lock.acquire(timeout=0)
    except TimeoutError:
        return True
    lock.release()
    return False


def test_waiting_is_bounded_logged_and_names_the_key(make_cache: MakeCache, caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache(lock_timeout=1.5)
    graph = ConvBiasRelu(n=5).graph()
    with FileLock(str(lock_path(cache, graph))), caplog.at_level(logging.INFO, logger="plancache"):  # a builder that hangs
        started = time.monotonic()
        with pytest.raises(LockTimeoutError) as info:
            cache.get(graph)
    waited = time.monotonic() - started
    assert 1.4 < waited < 5
    assert info.value.key == cache.key(graph).digest and info.value.waited_s >= 1.4
    assert "still building or hung" in str(info.value)
    [line] = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert info.value.key[:12] in line and "CONV_FPROP" in line and ".lock" in line
    assert cache.counters["waits"] == 1


def test_a_lookup_never_takes_the_build_lock(make_cache: MakeCache) -> None:
    spec = ConvBiasRelu(n=6)
    first = make_cache()
    first.get(spec.graph())
    first.close()
    second = make_cache(lock_timeout=30.0)  # a lookup that took the lock would wait 30 s, then raise
    with FileLock(str(lock_path(second, spec.graph()))):  # another process is rebuilding it
        started = time.monotonic()
        plan = second.get(spec.graph())
        took = time.monotonic() - started
    assert plan.source == "loaded" and second.counters["waits"] == 0
    assert took < 5.0, f"the lookup took {took:.1f} s"  # far above a busy machine's delays, far below the wait


# ---------------------------------------------------------------------------- 2. crash safety


def test_sigkill_of_writers_at_random_points_loses_nothing(tmp_path: Path) -> None:
    report = sigkill_writers(tmp_path, iterations=30, writers=2, seed=3)
    assert report["violations"] == []
    assert report["entries_lost"] == 0
    assert report["integrity_checks_passed"] == 30
    assert report["sigkills"] == 60 and report["early_kills"] > 0
    assert report["operations"] > 1000 and report["operations_cut"] > 10  # kills landed inside operations
    assert report["entries_at_end"] > 0


def test_the_kill_checker_sees_a_lost_or_partial_entry(tmp_path: Path) -> None:
    # The checker above must be able to fail: drop one committed entry, cut another's blob.
    store = Store(tmp_path / "cache")
    entries = [entry_for(f"check-{i}", 4096) for i in range(3)]
    journal = tmp_path / "journal"
    journal.write_text("R\n" + "".join(f"B put {e.key}\nE put {e.key}\n" for e in entries))
    for entry in entries:
        store.put(entry)
    model = StoreModel(4096)
    model.apply(journal)
    assert model.check(store.path) == ([], 0)
    conn = sqlite3.connect(store.path, isolation_level=None)
    conn.execute("DELETE FROM plans WHERE key = ?", (entries[0].key,))
    conn.execute("UPDATE plans SET blob = substr(blob, 1, 100), blob_sha256 = ? WHERE key = ?", ("x", entries[1].key))
    conn.close()
    store.close()
    violations, lost = model.check(tmp_path / "cache" / DB_NAME)
    assert lost == 1
    assert any("gone" in v for v in violations) and any("partial" in v for v in violations)


def test_sigkill_during_autotune_and_store_lets_the_next_process_proceed(tmp_path: Path) -> None:
    report = sigkill_builders(tmp_path, iterations=5, keys=4, delay=0.05)
    assert report["violations"] == []
    assert report["sigkills"] >= 5
    assert report["final_plans"] == 2 * 5 * 4
    assert report["final_seconds"] < 30


# ---------------------------------------------------------------------------- many readers, two writers


def test_sixteen_readers_and_two_writers_never_see_database_is_locked(tmp_path: Path) -> None:
    report = readers_writers(tmp_path, readers=16, writers=2, reader_ops=150, writer_ops=300)
    assert report["violations"] == []
    assert (report["processes"], report["operations"]) == (18, 3000)
    assert report["errors"] == 0 and report["locked_errors"] == 0


def test_workers_leave_no_process_behind(tmp_path: Path) -> None:
    # processes() kills and reaps whatever is still running, even when the test fails.
    with pytest.raises(RuntimeError), processes() as procs:
        worker = start(procs, cache_victim, str(tmp_path / "c"), list(range(1, 50)), 1.0, os.devnull, str(tmp_path / "j"))
        raise RuntimeError("the test failed")
    assert not worker.is_alive() and worker.exitcode is not None
