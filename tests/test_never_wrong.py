"""Never a wrong plan: names, scratch memory, devices, alignment, data types, forks, and the
cache's repair paths. Each test fails on a cache that gets its class of bug wrong, because
the CPU test backend behaves like cuDNN where these bugs live (one-shot planning, scratch
in the workspace, devices that differ, alignment that matters)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cudnn
import pytest
import torch
from graphs import EXAMPLES, ConvBiasRelu, MatmulBiasRelu
from harness import end_if_stuck

from plancache import ExecutionError, PlanCache, PlanCacheError, Store, TensorMismatchError, TensorSpec
from plancache.guest.tensors import TORCH_DTYPES
from plancache.runtime.plan import Plan
from plancache.store import sha256
from plancache.testing import CpuTestBackend

MakeCache = Callable[..., PlanCache]


def subtraction(lhs_name: str, rhs_name: str, lhs_uid: int = 1, rhs_uid: int = 2) -> Any:
    """out = (uid 1) - (uid 2), the inputs named as the caller likes."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    a = g.tensor(name=lhs_name, dim=[1, 4], stride=[4, 1], uid=lhs_uid, data_type=cudnn.data_type.FLOAT)
    b = g.tensor(name=rhs_name, dim=[1, 4], stride=[4, 1], uid=rhs_uid, data_type=cudnn.data_type.FLOAT)
    out = g.sub(a=a, b=b) if hasattr(g, "sub") else g.subtract(a, b)
    out.set_output(True).set_uid(3).set_name("out").set_data_type(cudnn.data_type.FLOAT)
    return g


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("path", ["memory", "preload", "store"])
def test_a_plan_speaks_the_names_of_the_graph_it_was_asked_for(make_cache: MakeCache, path: str) -> None:
    first = make_cache()
    first.get(subtraction("lhs", "rhs"))  # uid 1 is "lhs"
    cache = first
    if path != "memory":
        first.close()
        cache = make_cache()
        if path == "preload":
            assert cache.preload()["loaded"]
    plan = cache.get(subtraction("rhs", "lhs"))  # the same graph, but uid 1 is now "rhs"
    seven, zero, out = torch.full((1, 4), 7.0), torch.zeros(1, 4), torch.zeros(1, 4)
    plan.execute({"rhs": seven, "lhs": zero, "out": out})  # uid 1 = 7, uid 2 = 0
    assert torch.equal(out, torch.full((1, 4), 7.0)), "names were bound through another graph's table"


def test_names_of_an_earlier_caller_are_refused(make_cache: MakeCache) -> None:
    cache = make_cache()
    cache.get(subtraction("lhs", "rhs"))
    plan = cache.get(subtraction("a", "b"))
    with pytest.raises(TensorMismatchError, match="'lhs' is not a tensor of this plan"):
        plan.execute({"lhs": torch.zeros(1, 4), "b": torch.zeros(1, 4), "out": torch.zeros(1, 4)})


# ---------------------------------------------------------------------------- scratch


def test_concurrent_launches_of_one_plan_never_share_scratch(cache: PlanCache) -> None:
    spec = MatmulBiasRelu(m=32, k=32, n=32)
    plan = cache.get(spec.graph())
    wrong: list[int] = []
    barrier = threading.Barrier(4)

    def launch(seed: int) -> None:
        barrier.wait()
        for i in range(40):
            pack = spec.tensors(seed=seed * 1000 + i)
            plan.execute(pack)
            if not torch.allclose(pack[spec.uids[-1]], spec.reference(pack), atol=1e-4, rtol=1e-4):
                wrong.append(i)

    threads = [threading.Thread(target=launch, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [], f"{len(wrong)} of 160 concurrent launches gave wrong results"


def test_a_workspace_is_reused_by_one_thread_on_one_stream_and_by_nothing_else(make_cache: MakeCache) -> None:
    """A thread's launches on one stream run in the order it queued them, so they share a
    workspace; another stream, another thread or a CUDA-graph capture gets one of its own."""
    backend = CpuTestBackend()
    allocated: list[tuple[int, int]] = []
    make = backend.driver.workspace_getter()

    def recording(size: int, device: int) -> Any:
        allocated.append((size, backend.cuda.current_stream()))
        return make(size, device)

    backend.driver.workspace_getter = lambda: recording  # type: ignore[method-assign]
    cache = make_cache(backend=backend)
    spec = MatmulBiasRelu(m=32, k=32, n=32)
    plan = cache.get(spec.graph())
    assert plan.workspace_size > 0, "the test needs a plan with a workspace"
    allocated.clear()  # the miss's candidates had workspaces of their own
    pack = spec.tensors(seed=0)
    for _ in range(3):
        plan.execute(pack)
    assert len(allocated) == 1, "one thread's launches on one stream share its workspace"
    other = backend.cuda.new_stream(blocking=False)
    with backend.cuda.stream(other):
        plan.execute(pack)
        plan.execute(pack)
    assert len(allocated) == 2 and allocated[1][1] == other, "another stream gets its own"
    thread = threading.Thread(target=plan.execute, args=(pack,))
    thread.start()
    thread.join()
    assert len(allocated) == 3, "another thread gets its own, even on the same stream"
    captured = backend.cuda.new_stream(blocking=False)
    with backend.cuda.stream(captured):
        backend.cuda.begin_capture(captured)
        plan.execute(pack)
        plan.execute(pack)
        backend.cuda.end_capture(captured)
    assert len(allocated) == 5, "inside a capture, each launch takes one from the capture's pool"
    plan.execute(pack)
    assert len(allocated) == 5 and torch.allclose(pack[spec.uids[-1]], spec.reference(pack), atol=1e-4, rtol=1e-4)


def test_memory_holds_a_bounded_number_of_plans(make_cache: MakeCache) -> None:
    cache = make_cache(max_plans=3)
    plans = [cache.get(ConvBiasRelu(n=n).graph()) for n in range(1, 7)]
    assert len(cache.memory) == 3 and cache.stats()["process"]["memory_evicted"] == 3
    assert cache.get(ConvBiasRelu(n=1).graph()).source == "loaded"  # evicted from memory, still stored
    assert all(p.native is not None for p in plans)


def test_memory_plans_bound_comes_from_the_environment(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_MEMORY_PLANS", "2")
    assert make_cache().memory.capacity == 2
    monkeypatch.setenv("PLANCACHE_MEMORY_PLANS", "0")
    with pytest.raises(ValueError, match="PLANCACHE_MEMORY_PLANS"):
        make_cache()


# ---------------------------------------------------------------------------- devices


def two_devices() -> CpuTestBackend:
    return CpuTestBackend(devices=[{}, {"gpu_name": "CPU test device, smaller", "sm_count": 66}])


def test_each_device_is_keyed_and_stored_under_its_own_environment(make_cache: MakeCache) -> None:
    backend = two_devices()
    cache = make_cache(backend=backend)  # created while device 0 is current
    spec = EXAMPLES["conv_bias_relu"]
    on_zero = cache.get(spec.graph())
    backend.use_device(1)
    on_one = cache.get(spec.graph())
    assert on_one.key != on_zero.key and on_one.device == 1 and on_zero.device == 0
    assert cache.key(spec.graph()).parts["environment"]["sm_count"] == 66
    entry = cache.store.get(on_one.key)
    assert entry is not None and entry.environment["gpu_name"] == "CPU test device, smaller"
    assert on_one.source == "built"  # device 0's plan was not served for device 1


def test_a_plan_launches_on_its_own_device_whatever_is_current(make_cache: MakeCache) -> None:
    backend = two_devices()
    cache = make_cache(backend=backend)
    spec = EXAMPLES["conv_bias_relu"]
    backend.use_device(1)
    plan = cache.get(spec.graph())
    backend.use_device(0)
    pack = spec.tensors(seed=1)
    plan.execute(pack)  # the backend refuses a launch on another device than the plan's
    torch.testing.assert_close(pack[spec.uids[-1]], spec.reference(pack))


def test_threads_on_two_devices_get_plans_of_their_own_device(make_cache: MakeCache) -> None:
    backend = two_devices()
    cache = make_cache(backend=backend)
    seen: dict[int, Plan] = {}

    def worker(device: int) -> None:
        backend.use_device(device)
        seen[device] = cache.get(EXAMPLES["causal_sdpa"].graph())

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (seen[0].device, seen[1].device) == (0, 1) and seen[0].key != seen[1].key


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_uses_no_state_of_its_parent(make_cache: MakeCache) -> None:
    cache = make_cache()
    spec = EXAMPLES["conv_bias_relu"]
    cache.get(spec.graph())
    pid = os.fork()
    if pid == 0:  # the child: a fresh memory tier, its own store connection and locks
        code = 1
        try:
            # No torch computation here: torch's CPU thread pool does not survive a fork.
            plan = cache.get(spec.graph())
            code = 0 if (plan.source == "loaded" and len(cache.memory) == 1) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_graph_is_being_recorded_records_its_own(make_cache: MakeCache, tmp_path: Path) -> None:
    """Another thread of the parent is inside the recorder (writing the manifest) at the
    fork; that thread is not in the child, whose lookups of new graphs must not wait for it."""
    from plancache.cache.recording import record_to

    other = make_cache()
    other.get(EXAMPLES["causal_sdpa"].graph())  # stored: the child loads it (no torch work after a fork)
    other.close()
    recorder = record_to(tmp_path / "recorded.json")
    cache = make_cache()
    cache.add_recorder(recorder)
    cache.get(EXAMPLES["conv_bias_relu"].graph())
    with recorder._lock:  # type: ignore[attr-defined]  # as a recording thread holds it
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                end_if_stuck()  # a child that waits forever is ended, and the test fails
                plan = cache.get(EXAMPLES["causal_sdpa"].graph())
                code = 0 if plan.source == "loaded" else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Condition)
#: The CPU test backend's simulated CUDA and cuDNN: the machine, not the process's state.
_MACHINE = ("plancache.testing.device", "plancache.testing.library")


def _locks_of(*roots: Any) -> list[Any]:
    """Every lock and condition reachable from ``roots`` through the attributes of
    plancache's objects (and the containers and per-process values they hold)."""
    from plancache.store.per_process import PerProcess

    seen: set[int] = set()
    found: list[Any] = []
    todo = list(roots)
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, _LOCKS):
            found.append(value)
        elif type(value) is PerProcess:
            todo.append(value.get())
        elif type(value).__module__.startswith("plancache") and type(value).__module__ not in _MACHINE:
            names = list(getattr(value, "__dict__", {})) + [n for c in type(value).__mro__ for n in getattr(c, "__slots__", ())]
            todo.extend(getattr(value, n, None) for n in names)
        elif isinstance(value, (list, tuple, set, frozenset)):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
    return found


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_no_per_process_state_survives_into_a_forked_child(make_cache: MakeCache, tmp_path: Path) -> None:
    """Every piece of state a process keeps for itself (``store.per_process``: the memory
    tier, builder memos, loads, counters' and recorders' locks, build locks, pending hit
    counts, handles, streams, store connections) is made anew in a forked child: none of
    the parent's values is served there, and no lock the parent's threads held at the fork
    (all held here) stops the child's lookups, builder calls or build locks."""
    import gc

    from plancache.cache.recording import record_to
    from plancache.store.per_process import PerProcess

    other = make_cache()
    other.get(EXAMPLES["causal_sdpa"].graph())  # stored: the child loads it (no torch work after a fork)
    other.close()
    cache = make_cache()
    cache.add_recorder(record_to(tmp_path / "recorded.json"))
    sdpa = cache.builder(lambda: EXAMPLES["causal_sdpa"].graph())
    parents_plan = sdpa()
    cache.get(EXAMPLES["conv_bias_relu"].graph())  # built here: its flight, build lock, loads and hit counts
    with cache.flight.hold("f" * 64, "env"):  # the flight's per-process state made, as by a build
        pass
    holders = [o for o in gc.get_objects() if type(o) is PerProcess]  # type(): isinstance would ask every object
    parents = [h.get() for h in holders]
    # As threads of the parent would hold them at the fork: every lock of the cache's.
    held = [lock for lock in _locks_of(cache, sdpa.plans) if lock.acquire(blocking=False)]  # type: ignore[attr-defined]
    assert len(holders) >= 10 and len(held) >= 10, (len(holders), len(held))
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                end_if_stuck()  # a child that waits for a lock of the parent's is ended, and the test fails
                kept = [type(p).__name__ for h, p in zip(holders, parents, strict=True) if h.get() is p and p is not None]
                fresh = len(cache.memory) == 0 and len(sdpa.plans) == 0  # type: ignore[attr-defined]
                plan = cache.get(EXAMPLES["conv_bias_relu"].graph())
                memo = sdpa()
                with cache.flight.hold("f" * 64, "env"):
                    pass
                cache.flush()
                ok = not kept and fresh and plan.source == "loaded" and memo is not parents_plan and memo.source == "loaded"
                code = 0 if ok else 2
            finally:
                os._exit(code)
    finally:
        for lock in held:
            lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child kept state of its parent's, or waited for its locks"


def test_a_slow_first_make_holds_up_no_other_per_process_value() -> None:
    """One holder's first value may take long to make (the cuDNN driver asks CUDA whether a
    device is usable); meanwhile another thread's first ``get`` of any other holder (a
    lookup's memory tier, say) goes on, and two threads of one holder get one value."""
    from plancache.store.per_process import PerProcess

    making, release = threading.Event(), threading.Event()

    def make() -> bool:
        making.set()
        return release.wait(30)

    slow = PerProcess(make)
    got: list[bool] = []
    asking = threading.Thread(target=lambda: got.append(slow.get()))
    asking.start()
    try:
        assert making.wait(30), "the thread never began the slow make"
        started = time.monotonic()
        other = PerProcess(threading.Lock)
        first = other.get()
        waited = time.monotonic() - started
    finally:
        release.set()
        asking.join()
    # Waiting for the slow make would take until it is released (30 s); the bound is far
    # above a busy machine's scheduling noise.
    assert waited < 3.0, f"a first get waited {waited:.1f} s for another holder's make"
    assert other.get() is first and got == [True] and slow.get() is True


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_judge_held_its_forms_lock_still_judges() -> None:
    """The judge's forms (kept per key across lookups) are a module's; a thread of the
    parent holding their lock at the fork must not stop the child's first judgement."""
    from plancache.key import describe
    from plancache.store import judge

    description = describe(EXAMPLES["conv_bias_relu"].graph())
    with judge._FORMS_LOCK.get():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                end_if_stuck()  # a child that waits for the parent's lock is ended, and the test fails
                code = 0 if judge.form_of("e" * 64, description).nodes else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child waited for the lock its parent held at the fork"


def _a_plain_lock(owner: Any) -> Any:
    from plancache.store.per_process import PerProcess

    return owner.get() if isinstance(owner, PerProcess) else owner


def _short_held_locks(cache: PlanCache, tmp_path: Path) -> dict[str, tuple[Any, Callable[[], object]]]:
    """Per lock: the lock, as a thread of the parent would hold it at the fork, and what of
    the child takes it."""
    import types

    import redis

    from plancache.cache.priming import Primer
    from plancache.cudnn import library
    from plancache.guest.block import known_captures
    from plancache.integrations import frontend
    from plancache.store.per_process import PerProcess
    from plancache.tiers.breaker import Breaker
    from plancache.tiers.fleet_lock import FleetLock

    breaker = Breaker(redis, "redis://test", backoff_max=1.0, max_stall=1.0, deadline=1.0, max_reply=1 << 20)
    fleet = FleetLock(types.SimpleNamespace(register_script=lambda script: None), breaker.script_call, lock_ttl=30.0,
                      count=breaker.count, warn_once=breaker.warn_once)  # fmt: skip
    unstored = cache.lookup.unstored
    primer = Primer(cache.lookup, [])  # as one prewarm.prime returned: the child asks for its timeline
    (tmp_path / "maps").write_text("")

    def libraries() -> object:
        with pytest.raises(OSError):
            library.library()
        return library.libcuda(), library.open_beside(maps=str(tmp_path / "maps"))

    class Pool:
        def wake(self) -> None:
            pass

    pool = Pool()
    cached = frontend.graph_cache(key_fn=lambda n: n)(lambda n: n * 2)  # a cudnn.graph_cache decorator's lock
    [cached_guard] = [cell.cell_contents for cell in cached.__closure__ or ()
                      if isinstance(cell.cell_contents, (PerProcess, type(threading.Lock())))]  # fmt: skip

    def captures() -> None:
        known_captures.watch(pool.wake)
        assert known_captures.active == 0, "the parent's capture counted in the child"

    return {
        "unstored": (unstored._lock, lambda: (unstored.report(), unstored.why("e" * 64))),
        "breaker counters": (breaker._counter_lock, lambda: breaker.count("errors")),
        "breaker state": (breaker._state_lock, lambda: breaker.available),
        "fleet lock holds": (fleet._holds.get()._lock, fleet.close),
        "known captures": (known_captures._captures.get().lock, captures),
        "cudnn opened": (library._opened_lock, libraries),
        "libcuda": (library._libcuda_lock, libraries),
        "cudnn library": (library._lock, libraries),
        "frontend": (frontend._lock, lambda: frontend.use(None)),  # held while the process-wide cache is made
        "primer": (primer._lock, primer.timeline),
        "graph_cache": (cached_guard, lambda: cached(3)),
    }


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize(
    "which", ["unstored", "breaker counters", "breaker state", "fleet lock holds", "known captures", "cudnn opened",
              "libcuda", "cudnn library", "frontend", "primer", "graph_cache"]
)  # fmt: skip
def test_a_child_forked_while_a_thread_held_a_short_held_lock_does_not_wait_for_it(which: str, cache: PlanCache,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    """Locks held only for a few operations (the unstored plans', the Redis tier's breaker's
    and fleet lock's, the captures plancache runs, the cuDNN and CUDA libraries' loading,
    the frontend integration's and its graph_cache decorators', a primer's report) were
    still held in a child forked while a thread of the parent was inside one: they are per process, so the child's first use
    does not wait for a lock nobody releases (nor counts a capture of the parent's as its own)."""
    import contextlib

    from plancache.guest.block import known_captures

    owner, use = _short_held_locks(cache, tmp_path)[which]
    lock = _a_plain_lock(owner)
    with known_captures.running() if which == "known captures" else contextlib.nullcontext(), lock:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                end_if_stuck()  # a child that waits for the parent's lock is ended, and the test fails
                use()
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child waited for the {which} lock its parent held at the fork"


# ---------------------------------------------------------------------------- launch checks


def test_a_misaligned_tensor_is_refused_before_launch(cache: PlanCache) -> None:
    spec = MatmulBiasRelu()
    plan = cache.get(spec.graph())
    pack = spec.tensors(seed=3)
    a = pack[spec.uids[0]]
    storage = torch.empty(a.numel() + 8, dtype=a.dtype)
    shifted = storage[1 : 1 + a.numel()].view(a.shape)  # 4 bytes off a 16-byte boundary
    shifted.copy_(a)
    pack[spec.uids[0]] = shifted
    with pytest.raises(TensorMismatchError, match="16-byte alignment"):
        plan.execute(pack)


def test_every_frontend_data_type_has_a_dtype_check() -> None:
    members = [m for m in dir(cudnn.data_type) if m.isupper() and m != "NOT_SET"]
    assert sorted(f"data_type.{m}" for m in members) == sorted(TORCH_DTYPES)


@pytest.mark.parametrize("cudnn_type", ["data_type.FP8_E8M0", "data_type.FP8_E5M3", "data_type.INT4", "data_type.FP4_E2M1"])
def test_exotic_data_types_are_checked(cudnn_type: str) -> None:
    spec = TensorSpec(uid=1, name="x", dims=(4, 8), strides=(8, 1), dtype=cudnn_type, is_output=False)
    plan = Plan(key="k" * 64, backend=CpuTestBackend(), native=None, tensors=[spec], workspace_size=0,
                engine=None, source="built", device=0)  # fmt: skip
    with pytest.raises(TensorMismatchError, match="dtype"):
        plan.check({1: torch.zeros(4, 8, dtype=torch.float32)})
    packed = cudnn_type in ("data_type.INT4", "data_type.FP4_E2M1")
    storage = getattr(torch, TORCH_DTYPES[cudnn_type][-1])
    plan.check({1: torch.zeros(4, 4 if packed else 8, dtype=torch.uint8).view(storage)})  # 4-bit: two values a byte


def test_execute_of_none_is_a_mismatch_error(cache: PlanCache) -> None:
    plan = cache.get(EXAMPLES["conv_bias_relu"].graph())
    with pytest.raises(TensorMismatchError, match="mapping"):
        plan.execute(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- repair paths


def test_a_failed_rebuild_leaves_the_callers_graph_unplanned_for_autotuning(
    make_cache: MakeCache, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = EXAMPLES["matmul_bias_relu"]
    first = make_cache()
    first.get(spec.graph())
    first.close()
    db().execute("UPDATE plans SET blob = CAST('garbage' AS BLOB)")
    backend = CpuTestBackend()

    def rebuild_fails(graph: Any, engine: Any, options: Any) -> Any:
        backend._plan_once(graph)  # planned, as cuDNN plans it, then the build fails
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(backend, "rebuild", rebuild_fails)
    plan = make_cache(backend=backend).get(spec.graph())
    assert plan.source == "built"  # autotuned on the caller's graph, still unplanned


def test_a_candidate_that_fails_to_launch_in_the_first_pass_is_only_dropped(make_cache: MakeCache) -> None:
    cache = make_cache(backend=CpuTestBackend(candidates=4, unlaunchable=[1]))
    plan = cache.get(EXAMPLES["conv_bias_relu"].graph())
    entry = cache.store.get(plan.key)
    assert entry is not None
    statuses = {c["index"]: c["status"] for c in entry.candidates}
    assert statuses[1] == "failed" and "chosen" in statuses.values()


def test_quarantine_takes_only_the_row_that_was_judged(make_cache: MakeCache) -> None:
    cache = make_cache()
    plan = cache.get(EXAMPLES["conv_bias_relu"].graph())
    store: Store = cache.store
    judged = store.get(plan.key)
    assert judged is not None
    # Another process rebuilds the entry meanwhile: a new row under the same key.
    judged.created_at += 1.0
    judged.blob = judged.blob + b" "
    judged.blob_sha256 = sha256(judged.blob)
    store.put(judged)
    old_identity = (sha256(judged.blob[:-1]), judged.created_at - 1.0)
    assert store.quarantine(plan.key, "stale judgement", identity=old_identity) is False
    assert store.get(plan.key) is not None and store.quarantined() == []


def test_a_build_of_one_key_never_delays_a_hit_of_another(make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    from plancache.testing.candidates import CpuPlans

    hot = EXAMPLES["conv_bias_relu"]
    make_cache().get(hot.graph())  # stored
    cache = make_cache()
    autotuning, hit_done = threading.Event(), threading.Event()
    build = CpuPlans.build

    def slow_build(plans: CpuPlans, index: int) -> int:  # the other key's autotuning lasts until the hit is over
        if threading.current_thread() is builder:
            autotuning.set()
            hit_done.wait(30)
        return build(plans, index)

    monkeypatch.setattr(CpuPlans, "build", slow_build)
    builder = threading.Thread(target=cache.get, args=(MatmulBiasRelu(m=16).graph(),))
    builder.start()
    try:
        assert autotuning.wait(30), "the other key never started autotuning"
        started = time.perf_counter()
        cache.get(hot.graph())
        waited = time.perf_counter() - started
    finally:
        hit_done.set()
        builder.join(60)
    # A hit that waited for the build would wait until the build is over (30 s a candidate);
    # the bound is far above a busy machine's scheduling noise.
    assert waited < 3.0, f"a hit waited {waited:.2f} s for another key's build"


def test_lock_files_are_no_more_than_the_stripes(cache: PlanCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """locks/ keeps no file per key ever built: each key's build lock is one of STRIPES files."""
    from plancache.cache import flight

    monkeypatch.setattr(flight, "STRIPES", 2)
    for n in range(1, 6):
        cache.get(ConvBiasRelu(n=n).graph())
    assert 1 <= len(names := {p.name for p in (cache.directory / "locks").iterdir()}) <= 2
    assert names <= {"build-000.lock", "build-001.lock"}, names


def test_a_closed_cache_says_so(make_cache: MakeCache) -> None:
    cache = make_cache()
    cache.close()
    with pytest.raises(PlanCacheError, match="closed"):
        cache.get(EXAMPLES["conv_bias_relu"].graph())
    with pytest.raises(PlanCacheError, match="closed"):
        cache.store.connection()


def test_a_full_disk_at_open_gives_working_unpersisted_plans_and_moves_nothing(
    make_cache: MakeCache, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    first = make_cache()
    first.get(spec.graph())
    first.close()
    before = sorted(p.name for p in cache_dir.iterdir())

    def full(self: Store) -> None:
        import sqlite3

        raise sqlite3.OperationalError("disk I/O error")

    with monkeypatch.context() as patch:  # undone at the end of the block, PLANCACHE_DIR kept
        patch.setattr(Store, "_migrate", full)
        cache = make_cache()
        plan = cache.get(spec.graph())
    assert plan.source == "built" and cache.counters["unpersisted"] == 1
    assert "cannot open the plan store" in caplog.text
    assert sorted(p.name for p in cache_dir.iterdir() if not p.name.startswith("plans.db-")) == [
        n for n in before if not n.startswith("plans.db-")
    ], "a healthy store was moved aside"
    assert make_cache().get(EXAMPLES["conv_bias_relu"].graph()).source == "loaded"  # nothing lost


def test_eviction_happens_inside_the_write_and_keeps_the_new_entry(make_cache: MakeCache) -> None:
    cache = make_cache()
    plans = [cache.get(ConvBiasRelu(n=n).graph()) for n in range(1, 5)]
    store: Store = cache.store
    sizes = {p.key: len(store.get(p.key).blob) for p in plans}  # type: ignore[union-attr]
    assert store.total_size() == sum(sizes.values())  # tracked by the database itself
    newest = store.get(plans[-1].key)
    assert newest is not None
    evicted = store.put(newest, max_bytes=sizes[plans[-1].key] + 1)
    assert evicted == 3 and store.keys() == [plans[-1].key]
    assert store.total_size() == sizes[plans[-1].key]


def test_a_graph_the_backend_planned_cannot_be_planned_again(cache: PlanCache) -> None:
    graph = EXAMPLES["conv_bias_relu"].graph()
    cache.get(graph)
    other = PlanCache(cache.directory / "other", backend=CpuTestBackend())
    try:
        with pytest.raises(Exception, match="already planned"):
            other.get(graph)  # a planned pygraph is frozen, as in cuDNN
    finally:
        other.close()


def test_a_launch_the_library_refuses_is_one_plancache_error_naming_the_plan(
    cache: PlanCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = EXAMPLES["conv_bias_relu"]
    plan = cache.get(spec.graph())

    def fails(*args: Any) -> None:
        raise RuntimeError("cudaErrorIllegalAddress")

    monkeypatch.setattr(cache.backend.driver.simulated, "execute", fails)
    with pytest.raises(ExecutionError, match=f"plan {plan.key[:12]} failed to launch.*cudaErrorIllegalAddress") as info:
        plan.execute(spec.tensors(seed=1))
    assert isinstance(info.value, RuntimeError) and info.value.key == plan.key
