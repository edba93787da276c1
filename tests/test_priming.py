"""Auto-prime on the CPU test backend: which plans a run used is recorded per application
and device, the next start of that application loads exactly those in the background, a
lookup of a plan being primed waits for it instead of loading it twice, and priming never
holds up a lookup it does not serve."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plancache import PlanCache
from plancache.cache.priming import app_name
from plancache.formats.plan_blob import PlanBlob
from plancache.store import bookkeeping
from plancache.testing import CpuTestBackend
from plancache.workflows import templates

MakeCache = Callable[..., PlanCache]


def conv(n: int) -> Any:
    return templates.build("conv_bias_act", n=n, c=4, h=6, w=6, k=4, dtype="float32")


class SlowLoads(CpuTestBackend):
    """Loads of the keys in ``slow`` take ``delay`` seconds (as kernel loading does on a
    GPU); others are immediate. Records the keys in the order their loads start."""

    def __init__(self, delay: float = 0.0, slow: set[str] | None = None, gate: threading.Event | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.delay = delay
        self.slow = slow
        self.gate = gate  # when given, a slow load lasts until it is set (30 s at most), not ``delay``
        self.loaded: list[str] = []
        self.lock = threading.Lock()

    def load(self, blob: bytes, tensors: Any, device: int | None = None) -> Any:
        digest = self._digest_of(blob)
        with self.lock:  # in the order loads start: the primer's threads finish in any order
            self.loaded.append(digest)
        native = super().load(blob, tensors, device)
        if self.slow is None or digest in self.slow:
            if self.gate is not None:
                self.gate.wait(30)
            else:
                time.sleep(self.delay)
        return native

    keys_by_blob: dict[bytes, str] = {}

    def _digest_of(self, blob: PlanBlob | bytes) -> str:
        return self.keys_by_blob.get(PlanBlob.of(blob).data, "?")


def fill(make_cache: MakeCache, app: str, batches: list[int], device: int = 0, devices: int = 1) -> list[str]:
    """One run of ``app`` that looks up conv(n) for each n, in order, on ``device``."""
    backend = CpuTestBackend(devices=devices)
    backend.use_device(device)
    cache = make_cache(backend=backend, auto_prime=False, app=app)
    keys = [cache.get(conv(n)).key for n in batches]
    cache.close()  # writes what the run used
    return keys


def remember_blobs(cache_dir: Path) -> None:
    with sqlite3.connect(cache_dir / "plans.db") as conn:
        SlowLoads.keys_by_blob = {bytes(blob): key for key, blob in conn.execute("SELECT key, blob FROM plans")}


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; a deadline far past any busy machine's delay."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.005)


def primed(cache: PlanCache) -> dict[str, Any]:
    assert cache.primer is not None, "auto-prime did not start"
    cache.primer.join(timeout=30)
    assert not cache.primer.is_alive()
    return cache.primer.report


# ---------------------------------------------------------------------------- bookkeeping


def test_a_run_records_the_plans_it_used_in_order_of_first_use(make_cache: MakeCache, cache_dir: Path) -> None:
    keys = fill(make_cache, "app", [3, 1, 2, 1, 3])
    with sqlite3.connect(cache_dir / "plans.db") as conn:
        rows = conn.execute("SELECT key, device, seq FROM app_plans WHERE app = 'app' ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == keys[:3] and {r[1] for r in rows} == {0}


def test_the_next_start_primes_exactly_the_latest_runs_plans_in_order(make_cache: MakeCache, cache_dir: Path) -> None:
    fill(make_cache, "app", [1, 2, 3])
    latest = fill(make_cache, "app", [4, 2])  # the latest run used conv(4), then conv(2)
    fill(make_cache, "other app", [5])
    remember_blobs(cache_dir)
    backend = SlowLoads()
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    report = primed(cache)
    # the latest run's plans, handed out in the order it first used them to the primer's
    # threads (which then load side by side)
    assert sorted(backend.loaded) == sorted(latest) and len(backend.loaded) == len(latest)
    assert (report["primed"], report["loaded"], report["skipped"]) == (2, 0, {})
    assert cache.counters["primed"] == 2 and cache.counters["hits"] == 0
    for n in (4, 2):
        assert cache.get(conv(n)).source == "loaded"
    assert cache.counters["memory_hits"] == 2 and len(backend.loaded) == 2, "lookups of primed plans load nothing"
    cache.get(conv(1))  # not primed: a store hit as usual
    assert cache.counters["hits"] == 1


def test_the_first_plan_of_each_family_is_primed_first(make_cache: MakeCache, cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A family's first finalize loads its kernels (tens of milliseconds on a GPU, the others
    well under one): the primer begins each family's first load before the rest, so that the
    families' loads overlap rather than keep every thread waiting on one family at a time."""
    from graphs import MatmulBiasRelu

    from plancache.cache import priming

    def matmul(m: int) -> Any:
        return MatmulBiasRelu(m=m).graph()

    cache = make_cache(auto_prime=False, app="app")
    used = [cache.get(g).key for g in (conv(1), conv(2), matmul(8), conv(3), matmul(16))]
    cache.close()
    remember_blobs(cache_dir)
    monkeypatch.setattr(priming, "THREADS", 1)  # one thread: the loads start in the order handed out
    backend = SlowLoads()
    assert primed(make_cache(backend=backend, auto_prime=True, app="app"))["primed"] == 5
    assert backend.loaded == [used[0], used[2], used[1], used[3], used[4]], "conv(1) and matmul(8) first, the rest in order"


def test_the_switch_turns_priming_off_and_use_is_still_recorded(make_cache: MakeCache, cache_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    fill(make_cache, "app", [1])
    monkeypatch.setenv("PLANCACHE_AUTO_PRIME", "0")
    backend = CpuTestBackend()
    cache = make_cache(backend=backend, app="app")
    assert cache.primer is None
    cache.get(conv(2))
    cache.close()
    assert backend.loads == 1, "the miss's own load back: nothing was primed"
    monkeypatch.setenv("PLANCACHE_AUTO_PRIME", "1")
    backend = CpuTestBackend()
    report = primed(make_cache(backend=backend, app="app"))
    assert report["primed"] == 1 and backend.loads == 1, "the run with priming off recorded conv(2)"


def test_the_application_is_the_entry_script_and_the_local_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import __main__

    script = tmp_path / "train.py"
    monkeypatch.delenv("PLANCACHE_APP", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(__main__, "__file__", str(script), raising=False)
    assert app_name() == str(script.resolve())
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert app_name() == f"{script.resolve()}#rank3", "each local rank primes the plans of its own device"
    monkeypatch.setenv("PLANCACHE_APP", "server")
    assert app_name() == "server#rank3"


def test_plans_are_primed_on_the_device_they_were_used_on(make_cache: MakeCache) -> None:
    key = fill(make_cache, "app", [1], device=1, devices=2)[0]
    backend = CpuTestBackend(devices=2)
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    assert primed(cache)["primed"] == 1
    assert (key, 1) in cache.memory and (key, 0) not in cache.memory
    backend.use_device(1)
    assert cache.get(conv(1)).device == 1 and cache.counters["memory_hits"] == 1


def test_a_device_that_is_gone_is_skipped(make_cache: MakeCache) -> None:
    key = fill(make_cache, "app", [1], device=1, devices=2)[0]
    report = primed(make_cache(backend=CpuTestBackend(devices=1), auto_prime=True, app="app"))
    assert report["primed"] == 0 and report["skipped"] == {key: "no device 1 here"}


def test_the_primer_sets_up_no_device_the_program_has_not_used(make_cache: MakeCache) -> None:
    """A run on device 1, then a process that has only used device 0 so far: nothing is
    loaded on device 1 (that would create a context there) until the program uses it."""
    key = fill(make_cache, "app", [1], device=1, devices=2)[0]
    backend = CpuTestBackend(devices=2, in_use=[0])
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    time.sleep(0.2)
    assert cache.primer is not None and cache.primer.is_alive(), "waits for the program"
    assert backend.loads == 0 and not backend.device_in_use(1)
    backend.use_device(1)  # the program's own first work on device 1
    report = primed(cache)
    assert report["primed"] == 1 and (key, 1) in cache.memory


def test_the_primer_opens_the_libraries_before_the_device_and_makes_its_handle_before_any_finalize(
        make_cache: MakeCache) -> None:  # fmt: skip
    """Before the program has set its device up, the primer opens what a first load opens
    (no CUDA call); once it has, it makes the device's cuDNN handle as a stage of its own
    (it waits for the program's work on the legacy stream), before the first finalize."""
    fill(make_cache, "app", [1, 2, 3], device=1, devices=2)
    backend = CpuTestBackend(devices=2, in_use=[0])
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    time.sleep(0.2)
    assert backend.driver.libraries_opened == 1, "opened while the program has no device yet"
    assert backend.loads == 0 and backend.touched == [] and backend.driver.simulated.handles_created == 0
    backend.use_device(1)  # the program's own first work on device 1
    assert primed(cache)["primed"] == 3
    assert cache.primer is not None
    timeline = cache.primer.timeline()
    opened, ready, (made, handle_done) = timeline["libraries"], timeline["device_ready"]["1"], timeline["handle"]["1"]
    first_finalize = min(plan["finalize"][0] for plan in timeline["plans"])
    assert opened[1] <= ready <= made <= handle_done <= first_finalize
    assert backend.driver.libraries_opened == 1


def test_a_primer_with_nothing_to_prime_opens_nothing(make_cache: MakeCache) -> None:
    backend = CpuTestBackend()
    primed(make_cache(backend=backend, auto_prime=True, app="nothing-used-yet"))
    assert backend.driver.libraries_opened == 0


def test_a_device_the_program_never_uses_is_given_up(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    import plancache.cache.priming

    key = fill(make_cache, "app", [1], device=1, devices=2)[0]
    monkeypatch.setattr(plancache.cache.priming, "DEVICE_WAIT_S", 0.2)
    backend = CpuTestBackend(devices=2, in_use=[0])
    report = primed(make_cache(backend=backend, auto_prime=True, app="app"))
    assert report["primed"] == 0 and "device 1 was not used by this process" in report["skipped"][key]
    assert backend.loads == 0 and not backend.device_in_use(1)


def test_a_busy_store_keeps_the_record_for_the_next_write(make_cache: MakeCache, cache_dir: Path) -> None:
    cache = make_cache(auto_prime=False, app="app")
    key = cache.get(conv(1)).key
    blocker = sqlite3.connect(cache_dir / "plans.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    assert cache.local.flush(wait=False) is False, "gives way to the other writer at once"
    blocker.execute("COMMIT")
    assert cache.local.flush(wait=False) is True
    assert bookkeeping.latest_run(cache.store, "app") == [(key, 0)]


def test_runs_older_than_the_retention_are_dropped(cache: PlanCache) -> None:
    now = time.time()
    bookkeeping.record_usage(cache.store, "app", "old", now - bookkeeping.RETENTION_SECONDS - 10, {("k-old", 0): 1}, wait=True)
    bookkeeping.record_usage(cache.store, "app", "new", now, {("k-new", 0): 1}, wait=True)
    rows = cache.store.connection().execute("SELECT key FROM app_plans").fetchall()
    assert [r[0] for r in rows] == ["k-new"]


def test_a_row_a_later_run_took_over_is_not_taken_back(cache: PlanCache) -> None:
    """Two runs of one application flush in any order: the later run's record stands."""
    bookkeeping.record_usage(cache.store, "app", "later", 200.0, {("k", 0): 1}, wait=True)
    bookkeeping.record_usage(cache.store, "app", "earlier", 100.0, {("k", 0): 5, ("j", 0): 1}, wait=True)
    assert bookkeeping.latest_run(cache.store, "app") == [("k", 0)]


# ---------------------------------------------------------------------------- lookups and the primer


def test_a_lookup_of_a_plan_being_primed_waits_for_it_instead_of_loading_it_twice(make_cache: MakeCache,
                                                                                   cache_dir: Path) -> None:  # fmt: skip
    keys = fill(make_cache, "app", [1, 2])
    remember_blobs(cache_dir)
    backend = SlowLoads(delay=0.4)
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    deadline = time.monotonic() + 5
    while not backend.loaded and not cache.lookup.loads._busy and time.monotonic() < deadline:
        time.sleep(0.005)  # until the primer has claimed its first plan
    plan = cache.get(conv(1))
    primed(cache)
    assert plan.key == keys[0]
    assert backend.loaded.count(keys[0]) == 1, "loaded once, by the primer; the lookup waited for it"
    assert cache.counters["hits"] == 0 and cache.counters["memory_hits"] == 0


def test_priming_never_holds_up_a_lookup_it_does_not_serve(make_cache: MakeCache, cache_dir: Path) -> None:
    primed_keys = fill(make_cache, "app", [1, 2, 3])
    other = fill(make_cache, "another app", [4])[0]
    remember_blobs(cache_dir)
    gate = threading.Event()  # the primer's loads last until the lookup is done (30 s at most)
    backend = SlowLoads(slow=set(primed_keys), gate=gate)
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    try:
        wait_for(lambda: backend.loaded, "the primer inside its first (slow) load")
        started = time.perf_counter()
        plan = cache.get(conv(4))
        took = time.perf_counter() - started
    finally:
        gate.set()
    # Held up by the primer, the lookup would wait until the gate opens (30 s); the bound
    # is far above a busy machine's scheduling noise and far below that wait.
    assert plan.key == other and took < 3.0, f"a lookup the primer does not serve took {took:.3f} s"
    report = primed(cache)
    assert report["primed"] == 3


def test_the_primer_goes_on_while_a_lookup_loads_a_plan_it_has_not_reached(make_cache: MakeCache, cache_dir: Path) -> None:
    """The first step asks for its last plan first: the lookup loads it at once on the
    caller's thread, and the primer's loads of the others go on beside it, not after it."""
    keys = fill(make_cache, "app", [1, 2, 3, 4])
    remember_blobs(cache_dir)

    class TheLookupsLoadEndsAfterAPrimersStarts(SlowLoads):
        """The lookup's load lasts until the primer has started one of its own (30 s at
        most): the primer's loads going on beside it, not after it, is then no race."""

        def load(self, blob: bytes, tensors: Any, device: int | None = None) -> Any:
            if self._digest_of(blob) != keys[3]:
                return super().load(blob, tensors, device)
            with self.lock:
                self.loaded.append(keys[3])
            native = CpuTestBackend.load(self, blob, tensors, device)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: any(k != keys[3] for k in self.loaded), "a load of the primer's")
            return native

    backend = TheLookupsLoadEndsAfterAPrimersStarts(delay=0.4)
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    plan = cache.get(conv(4))  # the primer reaches it last
    asked_back = time.perf_counter()
    report = primed(cache)
    assert plan.key == keys[3] and report["primed"] == 3 and report["loaded"] == 1
    timeline = cache.primer.timeline()
    since = cache.primer.opened
    started = [since + p["finalize"][0] for p in timeline["plans"] if p["outcome"] == "primed"]
    assert min(started) < asked_back, "the primer loaded nothing while the lookup was loading its plan"
    assert next(p for p in timeline["plans"] if p["key"] == keys[3][:12])["asked"] is not None


def test_the_primer_gives_way_while_a_lookup_builds(make_cache: MakeCache, cache_dir: Path) -> None:
    """A miss holds its claim while it autotunes; the primer starts no load meanwhile."""
    fill(make_cache, "app", [1, 2])
    backend = SlowLoads(build_delay=0.1)  # 4 candidates: ~0.4 s of building
    cache = make_cache(backend=backend, auto_prime=False, app="app")
    builder = threading.Thread(target=cache.get, args=(conv(7),))
    builder.start()
    deadline = time.monotonic() + 5
    while not cache.lookup.loads._builds and time.monotonic() < deadline:
        time.sleep(0.005)
    from plancache.cache.priming import Primer

    primer = Primer(cache.lookup)
    primer.start()
    time.sleep(0.15)
    assert backend.loaded == [], "no load started while the lookup was building"
    builder.join(timeout=10)
    primer.join(timeout=10)
    assert primer.report["primed"] == 2


def test_closing_the_cache_stops_the_primer_between_plans(make_cache: MakeCache, cache_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from plancache.cache import priming

    monkeypatch.setattr(priming, "THREADS", 2)  # fewer threads than plans: some are left to stop before
    fill(make_cache, "app", [1, 2, 3, 4])
    remember_blobs(cache_dir)
    gate = threading.Event()  # each load lasts until the test lets it end
    backend = SlowLoads(gate=gate)
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    assert cache.primer is not None
    wait_for(lambda: len(backend.loaded) == 2, "both primer threads inside a load")
    closing = threading.Thread(target=cache.close)  # close() waits for the loads under way
    closing.start()
    try:
        wait_for(cache.primer.stopping.is_set, "close() to stop the primer")
    finally:
        gate.set()
        closing.join(timeout=30)
    assert not closing.is_alive()
    report = primed(cache)
    # the loads under way at close() (one per primer thread) finish; none starts after it
    assert report["primed"] <= 2 and len(backend.loaded) == 2, backend.loaded


def test_closing_the_cache_while_a_lookup_builds_stops_the_primer_at_once(make_cache: MakeCache, cache_dir: Path) -> None:
    """The primer waits for lookups to finish before it loads; a miss may autotune for
    minutes, and close() must not wait for it, nor the primer go on after close()."""
    fill(make_cache, "app", [1, 2])
    backend = SlowLoads(build_delay=2.0, candidates=2)  # ~4 s of building: twice what close() may take
    cache = make_cache(backend=backend, auto_prime=False, app="app")
    builder = threading.Thread(target=cache.get, args=(conv(7),), daemon=True)
    builder.start()
    deadline = time.monotonic() + 5
    while not cache.lookup.loads._builds and time.monotonic() < deadline:
        time.sleep(0.005)
    from plancache.cache.priming import Primer

    cache.primer = Primer(cache.lookup)  # what auto-prime starts
    cache.primer.start()
    time.sleep(0.1)
    started = time.monotonic()
    cache.close()
    took = time.monotonic() - started
    assert not cache.primer.is_alive() and took < 2.0, f"close() waited {took:.1f} s for a lookup's build"
    assert backend.loaded == [] and set(cache.primer.report["skipped"].values()) == {"stopped"}
    builder.join(timeout=30)  # its build ends with a warning (the store is closed): not in a later test's log


def test_a_failure_on_a_primer_helper_thread_stays_in_plancache(make_cache: MakeCache, cache_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Priming never raises, on any of its threads: a program's threading.excepthook (some
    frameworks abort the process there) never sees plancache's failure."""
    fill(make_cache, "app", [1, 2, 3, 4])
    escaped: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.thread.name if args.thread else "?"))

    class SlowLoad(CpuTestBackend):
        def load(self, blob: bytes, tensors: Any, device: int | None = None) -> Any:
            native = super().load(blob, tensors, device)
            time.sleep(0.3)  # as kernels load on a GPU: both primer threads are in a load
            return native

    backend = SlowLoad()
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    time.sleep(0.1)
    with contextlib.suppress(Exception):
        backend.cuda.poison("an illegal memory access")  # the program's own kernel faults meanwhile
    primed(cache)
    time.sleep(0.1)
    assert escaped == []
    cache.close()


@pytest.mark.parametrize("kept", [False, True], ids=["judged", "kept"])
def test_the_primer_judges_its_plans_and_reads_their_records_before_the_device_is_ready(
        make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, kept: bool) -> None:  # fmt: skip
    """Ahead of the program's device, each plan is judged (all but its environment) and its
    load's record read, from the blob or from the judgement kept in its row; once the device
    is ready, a primed plan is neither judged nor read again: its finalize is what is left."""
    from plancache.cache import judging
    from plancache.formats import plan_blob

    fill(make_cache, "app", [1, 2, 3], device=1, devices=2)
    if not kept:  # rows of an older plancache, or of other code
        with sqlite3.connect(cache_dir / "plans.db") as conn:
            conn.execute("UPDATE plans SET judgement = NULL")
    judgings: list[Any] = []
    decoded: list[bytes] = []
    judged, decode = judging.judged, plan_blob.decode
    monkeypatch.setattr(judging, "judged", lambda *a, **k: judgings.append(a) or judged(*a, **k))
    monkeypatch.setattr(plan_blob, "decode", lambda data, *a, **k: decoded.append(bytes(data)) or decode(data, *a, **k))
    backend = CpuTestBackend(devices=2, in_use=[0])
    cache = make_cache(backend=backend, auto_prime=True, app="app")
    assert cache.primer is not None
    deadline = time.monotonic() + 10
    while len(cache.primer._entries) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(judgings) == 3 and backend.loads == 0, "judged ahead while the program has no device yet"
    assert len(decoded) == (0 if kept else 3), "each blob decoded once, or none where its judgement was kept"
    backend.use_device(1)  # the program's own first work on device 1
    assert primed(cache)["primed"] == 3
    assert len(judgings) == 3 and len(decoded) == (0 if kept else 3), "nothing judged or read again once the device was ready"


def test_a_plan_judged_ahead_is_still_held_to_the_devices_environment(make_cache: MakeCache) -> None:
    """Judged ahead without the device, a plan stored for another GPU is still not primed."""
    stored = make_cache(backend=CpuTestBackend(environment={"gpu_name": "one GPU"}), auto_prime=False, app="app")
    key = stored.get(conv(1)).key
    stored.close()
    cache = make_cache(backend=CpuTestBackend(environment={"gpu_name": "another GPU"}), auto_prime=True, app="app")
    report = primed(cache)
    assert report["primed"] == 0 and report["skipped"] == {key: "environment differs from the key's"}
    assert cache.get(conv(1)).source == "built", "its own environment's key: a miss, the other GPU's entry left alone"
