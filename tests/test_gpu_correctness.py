"""GPU tests of the never-wrong guarantees on real cuDNN plans, checked against PyTorch:
many threads and streams sharing a plan with a big workspace, CUDA-graph capture from a
thread that never launched the plan, two GPUs (a device switch after the cache was made,
a plan launched while another device is current, two ranks sharing one cache directory),
and child processes. Skipped without CUDA (the two-GPU ones with fewer than two devices);
run by scripts/gpu-check. Each test takes seconds (the module well under two minutes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (torch.cuda.device_count() < 2)"
)

import plancache  # noqa: E402
from plancache.autotuning.candidates import Candidates  # noqa: E402
from plancache.workflows import templates  # noqa: E402

#: Relative error (norm) of bf16 outputs against a float32 PyTorch reference.
TOLERANCE = 1e-2
#: Small graphs for the multi-process tests: a conv, a matmul and an attention.
GRAPHS: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 4, "c": 32, "h": 28, "w": 28, "k": 32}),
    ("matmul_bias_act", {"b": 2, "m": 256, "n": 256, "k": 128}),
    ("sdpa", {"b": 1, "h": 4, "s": 256, "d": 64, "causal": True}),
]
CONV = ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64})
SMALL_MATMUL = ("matmul_bias_act", {"b": 4, "m": 256, "n": 512, "k": 256})
#: Long-K matmuls: one 128x128 output tile and a long reduction, which the fast engines
#: split across SMs and sum through their workspace. Tried in order until a plan needs one.
SPLIT_K = {"b": 1, "m": 128, "n": 128, "k": 65536, "bias": False, "act": None}
WORKSPACE_ATTEMPTS: list[tuple[dict[str, Any], plancache.BuildOptions]] = [
    (SPLIT_K, plancache.BuildOptions()),
    (SPLIT_K, plancache.BuildOptions(policy="exhaustive")),
    ({**SPLIT_K, "m": 64, "n": 64, "k": 131072}, plancache.BuildOptions(policy="exhaustive")),
]
THREADS = 4
LAUNCHES_PER_THREAD = 2000
INPUTS_PER_THREAD = 2  # launch i of a thread reads input set i % INPUTS_PER_THREAD


def relative_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def check_template(plan: plancache.Plan, name: str, params: dict[str, Any], device: str = "cuda", seed: int = 0) -> float:
    """Run ``plan`` on fresh template tensors on ``device``; its relative error."""
    tensors = templates.allocate(name, device=device, seed=seed, **params)
    plan.execute(tensors)
    torch.cuda.synchronize(tensors[4].device)
    return relative_error(tensors[4], templates.reference(name, tensors, **params))


def refill(tensors: dict[int, Any], name: str, params: dict[str, Any], seed: int) -> None:
    """New values in the inputs of ``tensors`` (same storage: a captured graph reads them)
    and NaN in the output, so an output nothing wrote fails the check."""
    fresh = templates.allocate(name, device=str(tensors[4].device), seed=seed, **params)
    for uid, tensor in tensors.items():
        if uid == 4:
            tensor.fill_(float("nan"))
        else:
            tensor.copy_(fresh[uid])


# ---------------------------------------------------------------------------- a plan with a workspace


@dataclass
class WorkspaceCase:
    """A long-K matmul whose plan needs a workspace, stored in ``directory``: autotuned and
    stored by the cache (``blob`` None), or, if no autotuned plan needed one, the candidate
    with the largest workspace, serialized (``blob``) and loaded by ``plan``."""

    params: dict[str, Any]
    options: plancache.BuildOptions
    route: str
    workspace_size: int
    directory: Path
    blob: bytes | None = None
    tensors: list[Any] | None = None

    def plan(self, cache: plancache.PlanCache) -> plancache.Plan:
        """The plan, deserialized by ``cache`` on the current device (never launched yet)."""
        if self.blob is None:
            return cache.get(templates.build("matmul_bias_act", **self.params), options=self.options)
        device = cache.backend.current_device()
        native = cache.backend.load(self.blob, self.tensors, device)
        return plancache.Plan(key="largest-workspace-candidate", backend=cache.backend, native=native, tensors=self.tensors or [],
                              workspace_size=self.workspace_size, engine=None, source="loaded", device=device)  # fmt: skip


@pytest.fixture(scope="module")
def workspace_case(tmp_path_factory: pytest.TempPathFactory) -> WorkspaceCase:
    directory = tmp_path_factory.mktemp("workspace") / "cache"
    builder = plancache.PlanCache(directory)
    tried = []
    try:
        for params, options in WORKSPACE_ATTEMPTS:
            plan = builder.get(templates.build("matmul_bias_act", **params), options=options)
            shape = "x".join(str(params[d]) for d in ("m", "n", "k"))
            tried.append(f"{shape} {options.policy}: {plan.workspace_size} bytes ({plan.engine.name if plan.engine else '?'})")
            if plan.workspace_size > 0:
                return WorkspaceCase(params, options, f"autotuned {shape} ({options.policy})", plan.workspace_size, directory)
        # No autotuned plan needed a workspace: take the candidate that needs the most.
        params, options = WORKSPACE_ATTEMPTS[0]
        candidates = Candidates.of(builder.backend, templates.build("matmul_bias_act", **params), options, {})
        best = None
        try:
            for index in range(len(candidates)):
                if candidates.build(index) is None:
                    built = candidates.finish(index)
                    if built.workspace_size > (best.workspace_size if best else 0):
                        best = built
        finally:
            candidates.close()
        if best is None:
            pytest.fail("no plan of a long-K matmul needs a workspace; tried " + "; ".join(tried))
        name = best.engine.name if best.engine else "?"
        return WorkspaceCase(params, options, f"candidate {name}, the largest workspace (autotuned: {'; '.join(tried)})",
                             best.workspace_size, directory, blob=best.blob, tensors=list(best.tensors))  # fmt: skip
    finally:
        builder.close()


def _bf16(shape: tuple[int, ...], seed: int) -> Any:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=generator, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("streams_of", ["own", "shared"])
def test_many_threads_share_a_plan_with_a_big_workspace(workspace_case: WorkspaceCase, streams_of: str) -> None:
    """THREADS threads, each on its own stream (or all on one stream), launch one plan
    LAUNCHES_PER_THREAD times back to back into their own outputs, with inputs of their
    own. A workspace shared by two streams, or by two threads on one stream (whose kernels
    interleave there), or reused before the launch that got it finished, gives wrong sums."""
    cache = plancache.PlanCache(workspace_case.directory)
    plan = workspace_case.plan(cache)
    assert plan.workspace_size > 0, f"the plan needs no workspace: {workspace_case.route}"
    b, m, n, k = (workspace_case.params[d] for d in ("b", "m", "n", "k"))
    inputs = [[_bf16((b, m, k), seed=100 * t + j) for j in range(INPUTS_PER_THREAD)] for t in range(THREADS)]
    weights = [_bf16((b, k, n), seed=100 * t + 99) for t in range(THREADS)]
    outputs = [
        torch.full((LAUNCHES_PER_THREAD, b, m, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(THREADS)
    ]
    shared = torch.cuda.Stream()
    streams = [torch.cuda.Stream() if streams_of == "own" else shared for _ in range(THREADS)]
    torch.cuda.synchronize()  # the side streams read what the default stream wrote
    barrier = threading.Barrier(THREADS)
    failures: list[str] = []

    def launch(t: int) -> None:
        try:
            barrier.wait(timeout=60)
            with torch.cuda.stream(streams[t]):
                for i in range(LAUNCHES_PER_THREAD):
                    plan.execute({1: inputs[t][i % INPUTS_PER_THREAD], 2: weights[t], 4: outputs[t][i]})
            streams[t].synchronize()
        except BaseException as exc:  # reported by the main thread
            failures.append(f"thread {t}: {type(exc).__name__}: {exc}")
            barrier.abort()

    started = time.perf_counter()
    threads = [threading.Thread(target=launch, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert not any(thread.is_alive() for thread in threads), "a launching thread hung"
    assert failures == []

    wrong, worst = 0, 0.0
    for t in range(THREADS):
        refs = torch.stack([torch.matmul(x.float(), weights[t].float()) for x in inputs[t]])
        expected = refs[torch.arange(LAUNCHES_PER_THREAD, device="cuda") % INPUTS_PER_THREAD]
        got = outputs[t].float()
        scale = refs.pow(2).mean().sqrt()
        bad = ((got - expected).abs() > 1e-2 * expected.abs() + 1e-2 * scale) | got.isnan()
        wrong += int(bad.flatten(1).any(dim=1).sum())
        errors = (got - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)
        worst = max(worst, float(errors.nan_to_num(nan=float("inf")).max()))
        del refs, expected, got, bad
    launches = THREADS * LAUNCHES_PER_THREAD
    print(f"{launches} launches from {THREADS} threads on {len(set(map(id, streams)))} streams in {seconds:.2f} s; "
          f"workspace {plan.workspace_size} bytes ({workspace_case.route}); wrong {wrong}; worst relative error {worst:.1e}")  # fmt: skip
    assert wrong == 0, f"{wrong} of {launches} launches gave wrong results (worst relative error {worst:.1e})"


# ---------------------------------------------------------------------------- capture from another thread


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unprepared"])
@pytest.mark.parametrize("case", ["conv", "big_workspace_matmul"])
def test_a_thread_that_never_launched_the_plan_captures_and_replays_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, case: str, prepare: bool
) -> None:
    """The plan is loaded in the main thread (deserialized, never launched); another thread
    captures its launch into a CUDA graph on a side stream and replays it. Without
    ``prepare()`` the handle pool must already hold the handle the capture leases: a handle
    created inside a capture would invalidate it."""
    import cudnn

    if case == "conv":
        name, params = CONV
        directory = tmp_path / "cache"
        with plancache.PlanCache(directory) as builder:
            builder.get(templates.build(name, **params))
        cache = plancache.PlanCache(directory)
        plan = cache.get(templates.build(name, **params))
    else:
        ws: WorkspaceCase = request.getfixturevalue("workspace_case")
        name, params = "matmul_bias_act", ws.params
        cache = plancache.PlanCache(ws.directory)
        plan = ws.plan(cache)
        assert plan.workspace_size > 0
    assert plan.source == "loaded"
    static = templates.allocate(name, device="cuda", seed=20, **params)
    torch.cuda.synchronize()

    created: list[bool] = []  # per cuDNN handle created from now on: was a capture under way?
    real_create = cudnn.create_handle

    def spy(*args: Any, **kwargs: Any) -> Any:
        created.append(bool(torch.cuda.is_current_stream_capturing()))
        return real_create(*args, **kwargs)

    monkeypatch.setattr(cudnn, "create_handle", spy)
    outcome: dict[str, Any] = {}

    def capture() -> None:
        try:
            if prepare:
                plan.prepare()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                plan.execute(static)
            refill(static, name, params, seed=21)
            graph.replay()
            torch.cuda.synchronize()
            outcome["error"] = relative_error(static[4], templates.reference(name, static, **params))
            outcome["graph"] = graph
        except BaseException as exc:
            outcome["exception"] = "".join(traceback.format_exception(exc))

    thread = threading.Thread(target=capture)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the capturing thread hung (waiting for a cuDNN handle?)"
    assert "exception" not in outcome, outcome.get("exception")
    assert True not in created, "a cuDNN handle was created inside the capture"
    assert created == [], f"{len(created)} cuDNN handle(s) created for a plan whose device already had one"
    assert outcome["error"] <= TOLERANCE, f"replay in the capturing thread: relative error {outcome['error']:.2e}"
    refill(static, name, params, seed=22)  # the captured graph replays from the main thread too
    outcome["graph"].replay()
    torch.cuda.synchronize()
    assert relative_error(static[4], templates.reference(name, static, **params)) <= TOLERANCE


# ---------------------------------------------------------------------------- two GPUs

_SWITCH_CHILD = r"""
import json, sys, torch, plancache
from plancache.workflows import templates
name, params, directory, variant = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]

def run(plan, device, seed):
    t = templates.allocate(name, device=f"cuda:{device}", seed=seed, **params)
    plan.execute(t)
    torch.cuda.synchronize(device)
    ref = templates.reference(name, t, **params)
    return {"device": plan.device, "source": plan.source, "key": plan.key, "out_device": str(t[4].device),
            "error": float((t[4].float() - ref).norm() / ref.norm())}

assert torch.cuda.current_device() == 0
cache = plancache.PlanCache(directory)  # created while device 0 is current
result = {}
if variant == "used_on_device_0":
    zero = cache.get(templates.build(name, **params))
    result["zero"] = run(zero, 0, 1)
torch.cuda.set_device(1)
key = cache.key(templates.build(name, **params))  # the current device: 1
plan = cache.get(templates.build(name, **params))
result["one"] = run(plan, 1, 2)
if variant == "used_on_device_0":
    result["zero_again"] = run(zero, 0, 3)  # device 1 is current: runs on device 0 all the same
entry = cache.store.get(plan.key)
result.update(key=key.digest, key_environment=key.parts["environment"], environment_0=cache.backend.environment(0),
              environment_1=cache.backend.environment(1), current_environment=cache.environment,
              entry_environment=entry.environment if entry is not None else None, counters=cache.counters,
              memory=sorted([k, d] for k, d in cache.memory.keys()), current_device=torch.cuda.current_device())
print(json.dumps(result))
"""


@needs_two_gpus
@pytest.mark.parametrize("variant", ["fresh", "used_on_device_0"])
def test_a_cache_made_on_device_0_builds_and_runs_on_device_1_after_set_device(tmp_path: Path, variant: str) -> None:
    """In a fresh process: a PlanCache made while device 0 is current (and, in one variant,
    used there first), then ``torch.cuda.set_device(1)``: ``get`` keys the graph with device
    1's environment and returns a plan of device 1 that runs there correctly."""
    name, params = SMALL_MATMUL
    out = subprocess.run([sys.executable, "-c", _SWITCH_CHILD, name, json.dumps(params), str(tmp_path / "cache"), variant],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    one = r["one"]
    assert (one["device"], one["out_device"], r["current_device"]) == (1, "cuda:1", 1)
    assert one["error"] <= TOLERANCE
    assert r["key_environment"] == r["environment_1"] == r["current_environment"] == r["entry_environment"]
    assert one["key"] == r["key"]
    assert [one["key"], 1] in r["memory"]
    same_environment = r["environment_0"] == r["environment_1"]
    if variant == "fresh":
        assert one["source"] == "built" and r["counters"]["builds"] == 1
        return
    zero, again = r["zero"], r["zero_again"]
    assert (zero["device"], zero["out_device"], zero["source"]) == (0, "cuda:0", "built")
    assert zero["error"] <= TOLERANCE and again["error"] <= TOLERANCE and again["device"] == 0
    assert [zero["key"], 0] in r["memory"]
    # Identical GPUs share an environment: device 0's stored plan is loaded onto device 1.
    assert one["source"] == ("loaded" if same_environment else "built")
    assert r["counters"]["builds"] == (1 if same_environment else 2)


@needs_two_gpus
def test_a_device_1_plan_runs_on_device_1_while_device_0_is_current(tmp_path: Path) -> None:
    name, params = SMALL_MATMUL
    cache = plancache.PlanCache(tmp_path / "cache")
    with torch.cuda.device(1):
        plan = cache.get(templates.build(name, **params))
    assert plan.device == 1 and torch.cuda.current_device() == 0
    tensors = templates.allocate(name, device="cuda:1", seed=5, **params)
    side = torch.cuda.Stream(device=0)
    with torch.cuda.stream(side):  # device 0 current, on a side stream of its own
        plan.execute(tensors)
        assert torch.cuda.current_device() == 0, "execute left another device current"
    torch.cuda.synchronize(1)
    assert relative_error(tensors[4], templates.reference(name, tensors, **params)) <= TOLERANCE

    outcome: dict[str, Any] = {}

    def from_a_new_thread() -> None:  # new threads start on device 0
        try:
            outcome["current"] = torch.cuda.current_device()
            outcome["error"] = check_template(plan, name, params, device="cuda:1", seed=6)
        except BaseException as exc:
            outcome["exception"] = "".join(traceback.format_exception(exc))

    thread = threading.Thread(target=from_a_new_thread)
    thread.start()
    thread.join(timeout=60)
    assert "exception" not in outcome, outcome.get("exception")
    assert outcome["current"] == 0 and outcome["error"] <= TOLERANCE

    on_zero = templates.allocate(name, device="cuda:0", **params)
    with pytest.raises(plancache.TensorMismatchError, match="cuda:1"):
        plan.execute(on_zero)
    torch.cuda.synchronize()
    assert torch.isnan(on_zero[4]).all(), "a refused launch wrote the output"


def _graph_runner(device: int, directory: str, barrier: Any, queue: Any) -> None:
    """A spawned process: set ``device``, open the cache, wait for the others (if any), then
    get and run every graph of GRAPHS on it and report."""
    try:
        torch.cuda.set_device(device)
        cache = plancache.PlanCache(directory)
        env_id = plancache.key.environment_id(cache.environment)
        if barrier is not None:
            barrier.wait(timeout=120)
        plans = []
        for name, params in GRAPHS:
            plan = cache.get(templates.build(name, **params))
            error = check_template(plan, name, params, device=f"cuda:{device}", seed=10 + device)
            plans.append({"key": plan.key, "source": plan.source, "device": plan.device, "error": error})
        queue.put({"device": device, "env_id": env_id, "gpu": torch.cuda.get_device_name(device), "plans": plans,
                   "counters": dict(cache.counters)})  # fmt: skip
        cache.close()
    except BaseException:
        queue.put({"device": device, "exception": traceback.format_exc()})


def _spawn(targets: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Run ``_graph_runner`` once per argument tuple, each in a spawned process; their reports."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    barrier = context.Barrier(len(targets)) if len(targets) > 1 else None
    procs = [context.Process(target=_graph_runner, args=(*args, barrier, queue)) for args in targets]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + 300
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(queue.get(timeout=1.0 if any(p.is_alive() for p in procs) else 5.0))
            except Empty:
                if not any(p.is_alive() for p in procs):
                    break  # a child died without reporting
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    failed = [r["exception"] for r in results if "exception" in r]
    assert failed == [], "\n".join(failed)
    assert len(results) == len(procs), (
        f"{len(procs) - len(results)} child(ren) did not report; exit codes {[p.exitcode for p in procs]}"
    )
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return sorted(results, key=lambda r: r["device"])


@needs_two_gpus
def test_two_ranks_on_two_gpus_share_one_cache_directory(tmp_path: Path) -> None:
    """Two processes, one per GPU, the same cache directory and graphs, started together:
    each key is autotuned once per environment (once in all, on two identical GPUs) and
    both ranks compute correct outputs on their own device."""
    directory = str(tmp_path / "cache")
    ranks = _spawn([(0, directory), (1, directory)])
    for r in ranks:
        assert [p["device"] for p in r["plans"]] == [r["device"]] * len(GRAPHS)
        assert max(p["error"] for p in r["plans"]) <= TOLERANCE, r
    keys = {p["key"] for r in ranks for p in r["plans"]}
    builds = sum(r["counters"]["builds"] for r in ranks)
    print(f"environments {[r['env_id'] for r in ranks]}; builds per rank {[r['counters']['builds'] for r in ranks]}")
    assert builds == len(keys), f"{builds} builds for {len(keys)} keys"
    if ranks[0]["gpu"] == ranks[1]["gpu"]:
        assert ranks[0]["env_id"] == ranks[1]["env_id"], "two GPUs of one model and machine differ in environment"
        assert builds == len(GRAPHS)
        for first, second in zip(ranks[0]["plans"], ranks[1]["plans"]):
            assert sorted([first["source"], second["source"]]) == ["built", "loaded"]


# ---------------------------------------------------------------------------- child processes


def test_a_spawned_child_loads_what_the_parent_built(tmp_path: Path) -> None:
    """The parent builds and runs plans; a 'spawn' child of it, with the same cache
    directory (the parent's cache still open), builds nothing and computes correctly."""
    directory = str(tmp_path / "cache")
    cache = plancache.PlanCache(directory)
    plans = []
    for name, params in GRAPHS:
        plan = cache.get(templates.build(name, **params))
        assert check_template(plan, name, params) <= TOLERANCE
        plans.append(plan)
    (child,) = _spawn([(0, directory)])
    assert [p["source"] for p in child["plans"]] == ["loaded"] * len(GRAPHS)
    assert child["counters"]["builds"] == 0 and child["counters"]["misses"] == 0
    assert [p["key"] for p in child["plans"]] == [p.key for p in plans]
    assert max(p["error"] for p in child["plans"]) <= TOLERANCE
    for plan, (name, params) in zip(plans, GRAPHS):  # the parent's plans still run
        assert check_template(plan, name, params, seed=3) <= TOLERANCE


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_holds_none_of_the_parents_handles_or_plans(tmp_path: Path) -> None:
    """CUDA cannot be used in a forked child, so the child only checks that the cache and
    its backend forgot the parent's cuDNN handles and loaded plans (it touches no GPU)."""
    cache = plancache.PlanCache(tmp_path / "cache")
    name, params = GRAPHS[0]
    assert check_template(cache.get(templates.build(name, **params)), name, params) <= TOLERANCE
    handles = cache.backend.handles
    assert sum(handles._count.values()) >= 1 and len(cache.memory) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fresh = cache.backend.handles  # the child's own pool: the parent's stays the parent's
            code = 0 if (fresh is not handles and fresh._count == {} and fresh._free == {} and len(cache.memory) == 0) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept the parent's handles or plans"
    assert check_template(cache.get(templates.build(name, **params)), name, params, seed=1) <= TOLERANCE


def test_autotuning_leaves_the_callers_random_stream_alone(tmp_path: Path) -> None:
    """A miss times candidates on random inputs of its own generator: the numbers the
    program draws next are the ones it would have drawn without plancache."""
    torch.manual_seed(1234)
    expected = torch.rand(8, device="cuda")
    torch.manual_seed(1234)
    cache = plancache.PlanCache(tmp_path / "rng", options=plancache.BuildOptions(policy="exhaustive"))
    plan = cache.get(templates.build("matmul_bias_act", b=2, m=64, k=64, n=64))
    assert plan.source == "built"
    assert torch.equal(torch.rand(8, device="cuda"), expected)
    cache.close()
