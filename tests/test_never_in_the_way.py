"""Never in the way: plan loads cannot break the program's GPU work, and a cache problem is
never the program's.

The CPU test backend's ``SimulatedCuda`` behaves as the GPU does where loads are hazardous
(see plancache.testing.device): a load's warm-up captures its handle's stream, work on a
capturing stream is dropped, the legacy stream is refused beside a capture of a blocking
stream, and unsafe calls invalidate another thread's global-mode capture unless made in
relaxed mode. ``during_warmup`` runs the program's work at the moment the warm-up capture
is open: the race a GPU shows one run in four, every time.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from graphs import ConvBiasRelu

import plancache
from plancache import CaptureInProgressError, PlanCache
from plancache.guest.block import known_captures
from plancache.testing import LEGACY, CpuTestBackend, CudaError
from plancache.testing.driver import Handle as _Handle

SPECS = [ConvBiasRelu(n=n) for n in (1, 2, 3)]


def stored(tmp_path: Path) -> None:
    with PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False) as cache:
        for spec in SPECS:
            cache.get(spec.graph())


def loading_cache(tmp_path: Path, **options: Any) -> PlanCache:
    """A cache whose loads take the frontend's path (the fallback of blobs the native path
    was not tested on), with its warm-up capture, unless ``native=True``."""
    stored(tmp_path)
    options.setdefault("native", False)
    return PlanCache(tmp_path, backend=CpuTestBackend(**options), auto_prime=False)


# ------------------------------------------------------------------ the warm-up of a load


def test_program_work_on_the_legacy_stream_during_a_load_runs(tmp_path: Path) -> None:
    cache = loading_cache(tmp_path)
    backend = cache.backend
    ran: list[int] = []
    backend.during_warmup = lambda: backend.cuda.launch(lambda: ran.append(1), LEGACY)
    for spec in SPECS:
        assert cache.get(spec.graph()).source == "loaded"
    assert ran == [1, 1, 1] and backend.cuda.errors == []
    # What the frontend alone does with a handle on the NULL stream: a blocking stream.
    with pytest.raises(CudaError, match="cudaErrorStreamCaptureImplicit"):
        backend.warmup(_Handle(stream=None))


def test_a_device_synchronization_during_a_warm_up_capture_fails_as_on_the_gpu(tmp_path: Path) -> None:
    # The one hazard plancache cannot take away (docs/priming.md): the frontend's warm-up
    # keeps a capture open while it loads a plan's kernels, and a device-wide
    # synchronization of another thread in global mode then fails and breaks that capture.
    cache = loading_cache(tmp_path)
    backend = cache.backend
    failed: list[BaseException] = []

    def program_synchronizes() -> None:  # on the program's thread, while the load's capture is open
        try:
            backend.cuda.synchronize_device()
        except CudaError as exc:
            failed.append(exc)

    backend.during_warmup = lambda: (t := threading.Thread(target=program_synchronizes), t.start(), t.join())
    plan = cache.get(SPECS[0].graph())
    assert failed and "not permitted when stream is capturing" in str(failed[0])
    assert plan.source == "unpersisted" and cache.counters["load_failures"] >= 1
    assert cache.store is not None and cache.store.quarantined() == [], "the entry is kept"


def test_a_load_beside_another_threads_global_capture_leaves_it_intact(tmp_path: Path) -> None:
    cache = loading_cache(tmp_path)
    cuda = cache.backend.cuda
    program = cuda.new_stream(blocking=False)
    cuda.begin_capture(program, "global")  # torch.cuda.graph's default mode
    loaded: list[str] = []
    thread = threading.Thread(target=lambda: loaded.extend(cache.get(s.graph()).source for s in SPECS))
    thread.start()
    thread.join()
    cuda.end_capture(program)  # raises cudaErrorStreamCaptureInvalidated if a load broke it
    assert loaded == ["loaded"] * 3
    # Without relaxed mode the warm-up's cudaMalloc invalidates the capture.
    cuda.begin_capture(program, "global")
    failure: list[BaseException] = []

    def unguarded() -> None:
        try:
            cache.backend.warmup(_Handle(stream=cuda.new_stream(blocking=False)))
        except CudaError as exc:
            failure.append(exc)

    thread = threading.Thread(target=unguarded)
    thread.start()
    thread.join()
    assert failure and "cudaErrorStreamCaptureUnsupported" in str(failure[0])
    with pytest.raises(CudaError, match="Invalidated"):
        cuda.end_capture(program)


def test_work_on_the_programs_own_stream_is_never_swallowed_by_a_load(tmp_path: Path) -> None:
    cache = loading_cache(tmp_path)
    backend = cache.backend
    program = backend.cuda.new_stream(blocking=False)
    handle = backend.handles.take(0)
    backend.driver.set_stream(handle, program)
    backend.handles.give(0, handle)  # a pooled handle that last launched on the program's stream
    ran: list[int] = []
    backend.during_warmup = lambda: backend.cuda.launch(lambda: ran.append(1), program)
    cache.get(SPECS[0].graph())
    assert ran == [1], "the program's work on its own stream was captured into the warm-up and lost"
    # What a load on a handle that carries the program's stream would do:
    backend.warmup(_Handle(stream=program))
    assert ran == [1], "work launched during that warm-up was recorded into it, not run"


def test_a_lookup_while_this_thread_captures_is_refused_and_the_capture_holds(tmp_path: Path) -> None:
    cache = loading_cache(tmp_path)
    cuda = cache.backend.cuda
    warm = cache.get(SPECS[0].graph())
    stream = cuda.new_stream(blocking=False)
    cuda.begin_capture(stream, "thread_local")
    with cuda.stream(stream):
        assert cache.get(SPECS[0].graph()) is warm or cache.get(SPECS[0].graph()).key == warm.key  # memory: fine
        with pytest.raises(CaptureInProgressError, match="before capturing"):
            cache.get(SPECS[1].graph())
    capture = cuda.end_capture(stream)
    assert capture.invalidated is None and capture.recorded == 0
    assert cache.get(SPECS[1].graph()).source == "loaded", "the refused lookup left nothing half done"


def test_the_callers_stream_device_mode_and_generator_are_as_they_were(tmp_path: Path) -> None:
    stored(tmp_path)
    backend = CpuTestBackend(devices=2)
    cache = PlanCache(tmp_path / "two", backend=backend, auto_prime=False)
    cuda = backend.cuda
    mine = cuda.new_stream(blocking=False)
    backend.use_device(1)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    with cuda.stream(mine):
        cache.get(SPECS[0].graph())  # a miss: autotune, on plancache's own stream
        fresh = PlanCache(tmp_path / "two", backend=backend, auto_prime=False)
        fresh.get(SPECS[0].graph())  # a hit: a load
        assert cuda.current_stream() == mine
    assert backend.current_device() == 1 and cuda.mode() == "global"
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_miss_compares_its_candidates_on_plancaches_own_stream_not_the_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparisons are device work of the miss as the launches are: on the program's
    stream they would queue behind its work and allocate from its pool."""
    from plancache.autotuning import consensus

    backend = CpuTestBackend()
    cache = PlanCache(tmp_path, backend=backend, auto_prime=False)
    compared_on: list[int] = []
    compare = consensus.compare

    def recording(*args: Any) -> Any:
        compared_on.append(backend.cuda.current_stream())
        return compare(*args)

    monkeypatch.setattr(consensus, "compare", recording)
    program = backend.cuda.new_stream(blocking=False)
    with backend.cuda.stream(program):
        assert cache.get(SPECS[0].graph()).source == "built"
        assert backend.cuda.current_stream() == program
    assert compared_on, "the miss compared no candidates"
    assert set(compared_on) == {backend.own_stream(0)}, f"compared on streams {compared_on}, the program's is {program}"


def test_no_handle_is_created_while_a_capture_plancache_runs(tmp_path: Path) -> None:
    cache = loading_cache(tmp_path)
    created_at: list[float] = []
    ended = 0.0

    def lookup() -> None:
        cache.get(SPECS[0].graph())
        created_at.append(time.monotonic())

    with known_captures.running():
        thread = threading.Thread(target=lookup)
        thread.start()
        time.sleep(0.3)
        assert cache.backend.driver.simulated.handles_created == 0
        ended = time.monotonic()
    thread.join()
    assert cache.backend.driver.simulated.handles_created == 1 and created_at[0] >= ended
    # Woken when the capture ended: not after the pool's 30 s wait ran out (a stall).
    assert created_at[0] - ended < 10, f"the lookup went on {created_at[0] - ended:.1f} s after the capture ended"


# ------------------------------------------------------------------ cache problems


def test_a_shared_directory_is_refused_without_failing_the_program(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="plancache"):
        cache = PlanCache(shared, backend=CpuTestBackend(), auto_prime=False)
        plan = cache.get(SPECS[0].graph())
    assert plan.source == "built" and cache.store is None
    notes = [r.getMessage() for r in caplog.records if "not storing plans" in r.getMessage()]
    assert len(notes) == 1 and "writable by other users" in notes[0]
    assert sorted(p.name for p in shared.iterdir()) == [], "nothing was written into a directory that is not the cache's"


# ------------------------------------------------------------------ the primer


def test_auto_prime_is_on_by_default_and_zero_turns_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored(tmp_path)
    monkeypatch.delenv("PLANCACHE_AUTO_PRIME", raising=False)
    on = PlanCache(tmp_path, backend=CpuTestBackend())
    assert on.primer is not None
    on.close()
    monkeypatch.setenv("PLANCACHE_AUTO_PRIME", "0")
    off = PlanCache(tmp_path, backend=CpuTestBackend())
    assert off.primer is None
    off.close()


def test_the_primer_makes_no_cuda_call_before_the_program_uses_the_device(tmp_path: Path) -> None:
    with PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False, app="app") as cache:
        for spec in SPECS:
            cache.get(spec.graph())
    backend = CpuTestBackend(in_use=[])
    cache = PlanCache(tmp_path, backend=backend, app="app", auto_prime=True)
    time.sleep(0.3)
    assert backend.loads == 0 and [t for t in backend.touched if t[0] == "plancache-primer"] == []
    backend.use_device(0)  # the program's first CUDA work
    assert cache.primer is not None
    cache.primer.join(10)
    assert cache.primer.report["primed"] == 3 and backend.loads == 3
    assert [t for t in backend.touched if t[0] == "plancache-primer"] == []
    cache.close()


def test_close_stops_and_joins_the_primer(tmp_path: Path) -> None:
    with PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False, app="app") as cache:
        for spec in SPECS:
            cache.get(spec.graph())
    backend = CpuTestBackend(load_delay=0.2)  # slow loads
    cache = PlanCache(tmp_path, backend=backend, app="app", auto_prime=True)
    time.sleep(0.1)
    cache.close()
    assert cache.primer is not None and not cache.primer.is_alive()
    loads = backend.loads
    time.sleep(0.5)
    assert backend.loads == loads < 3


def test_the_primer_is_silent_at_interpreter_exit(tmp_path: Path) -> None:
    with PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False, app="app") as cache:
        for spec in SPECS:
            cache.get(spec.graph())
    code = (
        "import time, plancache\n"
        "from plancache.testing import CpuTestBackend\n"
        "b = CpuTestBackend(load_delay=0.3)\n"
        f"c = plancache.PlanCache({str(tmp_path)!r}, backend=b, app='app', auto_prime=True)\n"
        "time.sleep(0.1)\n"
        "print('exiting', flush=True)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "exiting"
    assert done.stderr == "", done.stderr
    assert time.monotonic() - started < 30


def test_plancache_capture_counts_as_a_known_capture() -> None:
    assert known_captures.active == 0
    with known_captures.running():
        assert known_captures.active == 1
    assert known_captures.active == 0 and plancache.capture is not None


def test_a_load_on_a_device_with_a_sticky_error_keeps_the_entry(tmp_path: Path) -> None:
    # A context a sticky error killed fails every call, setting the device up included: the
    # process's failure, never the entry's (a lookup keeps the entry on TransientLoadError;
    # the guest block's own failure escaped the judging and read as the library refusing it).
    stored(tmp_path)
    backend = CpuTestBackend()
    cache = PlanCache(tmp_path, backend=backend, auto_prime=False)
    backend.cuda.poisoned = "an illegal memory access was encountered"
    with pytest.raises(plancache.TransientLoadError, match="failed for now"):
        backend.load(cache.store.get(cache.store.keys()[0]).blob, [], 0)
    cache.close()
