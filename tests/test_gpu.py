"""GPU tests: real cuDNN plans against PyTorch. Skipped without CUDA; run by scripts/gpu-check."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

import plancache  # noqa: E402
from plancache.store import maintenance  # noqa: E402
from plancache.workflows import templates  # noqa: E402

CASES = {
    "conv_bias_relu": ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    "matmul_bias_relu": ("matmul_bias_act", {"b": 4, "m": 512, "n": 1024, "k": 512}),
    "sdpa_causal": ("sdpa", {"b": 2, "h": 8, "s": 512, "d": 64, "causal": True}),
}
TOLERANCE = 1e-2  # relative error of bf16 outputs against a float32 PyTorch reference


def relative_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def run_and_check(plan: plancache.Plan, name: str, params: dict[str, Any], seed: int = 0) -> float:
    tensors = templates.allocate(name, device="cuda", seed=seed, **params)
    plan.execute(tensors)
    torch.cuda.synchronize()
    return relative_error(tensors[4], templates.reference(name, tensors, **params))


@pytest.fixture
def cache(tmp_path: Path) -> plancache.PlanCache:
    return plancache.PlanCache(tmp_path / "cache")


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_pytorch(cache: plancache.PlanCache, case: str) -> None:
    name, params = CASES[case]
    plan = cache.get(templates.build(name, **params))
    assert plan.source == "built"
    assert run_and_check(plan, name, params) <= TOLERANCE
    entry = cache.store.get(plan.key)
    assert entry is not None and entry.checksum_ok()
    assert any(c["status"] == "chosen" for c in entry.candidates)


_CHILD = r"""
import json, sys, torch, plancache
from plancache.workflows import templates
name, params = sys.argv[1], json.loads(sys.argv[2])
cache = plancache.PlanCache(sys.argv[3])
plan = cache.get(templates.build(name, **params))
t = templates.allocate(name, device="cuda", seed=1, **params)
plan.execute(t); torch.cuda.synchronize()
ref = templates.reference(name, t, **params)
err = float((t[4].float() - ref).norm() / ref.norm())
print(json.dumps({"source": plan.source, "counters": cache.counters, "error": err}))
"""


@pytest.mark.parametrize("case", sorted(CASES))
def test_fresh_process_hit_builds_nothing(tmp_path: Path, case: str) -> None:
    name, params = CASES[case]
    directory = tmp_path / "cache"
    first = plancache.PlanCache(directory)
    first.get(templates.build(name, **params))
    first.close()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, name, json.dumps(params), str(directory)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["source"] == "loaded"
    assert result["counters"]["builds"] == 0 and result["counters"]["misses"] == 0
    assert result["error"] <= TOLERANCE


def captured(plan: plancache.Plan, tensors: dict[int, Any]) -> Any:
    """A CUDA graph of one launch of ``plan`` on ``tensors`` (warmed up outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.execute(tensors)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.execute(tensors)
    return graph


def replay_error(graph: Any, tensors: dict[int, Any], name: str, params: dict[str, Any]) -> float:
    """The replayed graph's error against the reference, on fresh inputs copied in."""
    fresh = templates.allocate(name, device="cuda", seed=3, **params)
    for uid in (1, 2, 3):
        tensors[uid].copy_(fresh[uid])
    tensors[4].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return relative_error(tensors[4], templates.reference(name, tensors, **params))


def test_a_miss_compares_its_candidates_on_its_own_stream(cache: plancache.PlanCache,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from plancache.autotuning import consensus

    compared_on: list[int] = []
    compare = consensus.compare

    def recording(*args: Any) -> Any:
        compared_on.append(torch.cuda.current_stream().cuda_stream)
        return compare(*args)

    monkeypatch.setattr(consensus, "compare", recording)
    name, params = CASES["conv_bias_relu"]
    program = torch.cuda.Stream()
    with torch.cuda.stream(program):
        plan = cache.get(templates.build(name, **params))
        assert torch.cuda.current_stream() == program
    assert plan.source == "built" and run_and_check(plan, name, params) <= TOLERANCE
    assert compared_on, "the miss compared no candidates"
    assert program.cuda_stream not in compared_on and torch.cuda.default_stream().cuda_stream not in compared_on


def test_cuda_graph_capture_replays(cache: plancache.PlanCache) -> None:
    name, params = CASES["conv_bias_relu"]
    plan = cache.get(templates.build(name, **params)).prepare()
    tensors = templates.allocate(name, device="cuda", seed=2, **params)
    assert replay_error(captured(plan, tensors), tensors, name, params) <= TOLERANCE


def test_a_captured_plan_built_here_replays_after_its_cache_is_gone(tmp_path: Path) -> None:
    """A plan this process autotuned runs on the frontend's graph (not the C API's plan,
    which pins itself); cuDNN releases a runtime-compiled plan's code with the plan, so a
    CUDA graph captured from it must keep it alive after the cache and the Plan are gone."""
    import gc

    import cudnn

    name, params = CASES["sdpa_causal"]
    cache = plancache.PlanCache(tmp_path / "cache", auto_prime=False)
    plan = cache.get(templates.build(name, **params)).prepare()
    assert plan.source == "built", plan.source
    tensors = templates.allocate(name, device="cuda", seed=2, **params)
    graph = captured(plan, tensors)
    cache.close()
    del plan, cache
    gc.collect()
    for _ in range(3):  # what the released code's memory is given to next
        templates.build(name, **{**params, "s": 256}).build([cudnn.heur_mode.A])
    assert replay_error(graph, tensors, name, params) <= TOLERANCE


def test_wrong_tensors_are_refused_before_launch(cache: plancache.PlanCache) -> None:
    name, params = CASES["matmul_bias_relu"]
    plan = cache.get(templates.build(name, **params))
    good = templates.allocate(name, device="cuda", **params)
    cases = {
        "shape": {**good, 1: good[1][:, :-1]},
        "dtype": {**good, 2: good[2].half()},
        "device": {**good, 3: good[3].cpu()},
        "missing": {k: v for k, v in good.items() if k != 2},
        "unknown": {**good, 99: good[1]},
    }
    for what, tensors in cases.items():
        with pytest.raises(plancache.TensorMismatchError):
            plan.execute(tensors)
        torch.cuda.synchronize()
        assert torch.isnan(good[4]).all(), f"{what}: the plan launched"


def _rank(directory: str, queue: Any) -> None:
    name, params = CASES["sdpa_causal"]
    cache = plancache.PlanCache(directory)
    plan = cache.get(templates.build(name, **params))
    error = run_and_check(plan, name, params, seed=os.getpid() % 7)
    queue.put({"builds": cache.counters["builds"], "source": plan.source, "error": error})


def test_eight_processes_autotune_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(str(tmp_path / "cache"), queue)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(r["builds"] for r in results) == 1
    assert sorted(r["source"] for r in results) == ["built"] + ["loaded"] * 7
    assert max(r["error"] for r in results) <= TOLERANCE


def test_flipped_blob_is_rebuilt_from_engine(tmp_path: Path) -> None:
    name, params = CASES["conv_bias_relu"]
    directory = tmp_path / "cache"
    first = plancache.PlanCache(directory)
    key = first.get(templates.build(name, **params)).key
    first.close()
    with sqlite3.connect(directory / "plans.db") as conn:
        blob = bytearray(conn.execute("SELECT blob FROM plans WHERE key = ?", (key,)).fetchone()[0])
        blob[len(blob) // 2] ^= 0x40
        conn.execute("UPDATE plans SET blob = ? WHERE key = ?", (bytes(blob), key))
    second = plancache.PlanCache(directory)
    plan = second.get(templates.build(name, **params))
    assert plan.source == "rebuilt"
    assert second.counters["corrupt"] == 1 and second.counters["rebuilds"] == 1
    assert run_and_check(plan, name, params) <= TOLERANCE
    assert len(second.store.quarantined()) == 1
    stored = second.store.get(key)
    assert stored is not None and stored.checksum_ok()


_DYNAMIC_CHILD = r"""
import json, sys, torch, plancache
from plancache.workflows import templates
cache = plancache.PlanCache(sys.argv[1], persist_kernel_cache=True)
params = {"c": 32, "h": 28, "w": 28, "k": 32, "n": 5, "dynamic": True}
plan = cache.get(templates.build("conv_bias_act", **params))
t = templates.allocate("conv_bias_act", device="cuda", **params)
plan.execute(t); torch.cuda.synchronize()
ref = templates.reference("conv_bias_act", t, **params)
print(json.dumps({"counters": cache.counters, "error": float((t[4].float() - ref).norm() / ref.norm())}))
"""


def test_dynamic_shapes_share_and_persist_the_kernel_cache(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = plancache.PlanCache(directory, persist_kernel_cache=True)
    for n in (1, 2, 3, 4):
        params = {"c": 32, "h": 28, "w": 28, "k": 32, "n": n, "dynamic": True}
        plan = cache.get(templates.build("conv_bias_act", **params))
        assert run_and_check(plan, "conv_bias_act", params) <= TOLERANCE
    assert cache.backend.attach_kernel_cache(templates.build("conv_bias_act", **params))
    env_id = plancache.key.environment_id(cache.environment)
    stored = cache.store.get_kernel_cache(env_id)
    assert stored is not None and len(stored[0]) > 0
    cache.close()
    out = subprocess.run([sys.executable, "-c", _DYNAMIC_CHILD, str(directory)], check=True,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["counters"]["kernel_cache_restores"] == 1 and result["counters"]["builds"] == 1
    assert result["error"] <= TOLERANCE


def test_bucketed_batch_matches_the_exact_result(cache: plancache.PlanCache) -> None:
    from plancache.workflows import buckets

    params = {"c": 32, "h": 14, "w": 14, "k": 32, "n": 5}
    tensors = templates.allocate("conv_bias_act", device="cuda", **params)
    size = buckets.round_up(5, buckets.powers_of_two(32))
    plan = cache.get(templates.build("conv_bias_act", **{**params, "n": size}))
    # Only the batch-carrying tensors grow: the image (uid 1) and the output (uid 4).
    padded = {uid: (buckets.pad_to(t, 0, size) if uid in (1, 4) else t) for uid, t in tensors.items()}
    plan.execute(padded)
    torch.cuda.synchronize()
    ref = templates.reference("conv_bias_act", tensors, **params)
    assert relative_error(padded[4][:5], ref) <= TOLERANCE


_FLEET_NODE = r"""
import json, sys, torch, plancache
from plancache.workflows import templates
from plancache.tiers.remote import RemoteTier
name, params = sys.argv[1], json.loads(sys.argv[2])
tier = RemoteTier(sys.argv[4], secret=b"gpu-fleet-secret-0123456789abcdef")
cache = plancache.PlanCache(sys.argv[3], remote=tier)
plan = cache.get(templates.build(name, **params))
t = templates.allocate(name, device="cuda", seed=4, **params)
plan.execute(t); torch.cuda.synchronize()
ref = templates.reference(name, t, **params)
print(json.dumps({"source": plan.source, "counters": cache.counters, "remote": tier.stats(),
                  "error": float((t[4].float() - ref).norm() / ref.norm())}))
"""


def test_fleet_plan_from_another_machine(tmp_path: Path) -> None:
    """Two processes with their own cache directories (two machines) share one Redis: the
    second executes, correctly, the plan the first autotuned."""
    import shutil
    import socket
    import time

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (scripts/gpu-check carries one as .whl/deb)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}/0"
        name, params = CASES["sdpa_causal"]
        results = []
        for machine in ("a", "b"):
            out = subprocess.run([sys.executable, "-c", _FLEET_NODE, name, json.dumps(params), str(tmp_path / machine), url],
                                 check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()
    first, second = results
    assert first["source"] == "built" and first["remote"]["publishes"] == 1
    assert second["source"] == "loaded" and second["counters"]["builds"] == 0
    assert second["remote"]["remote_hits"] == 1
    assert max(first["error"], second["error"]) <= TOLERANCE


def test_every_readme_snippet_on_the_gpu(tmp_path: Path) -> None:
    """Every Python snippet of README.md, the gpu-only ones included, as written."""
    import functools

    from test_readme import quick_start_matches_pytorch, run_readme, snippets

    ran = 0
    try:
        for snippet, namespace in run_readme("cuda", functools.partial(plancache.PlanCache, tmp_path), gpu=True):
            torch.cuda.synchronize()
            ran += 1
            if ran == 1:  # the quick start
                quick_start_matches_pytorch(namespace, TOLERANCE)
            if "plancache.install()" in snippet.code:  # the frontend's own g.execute: y = conv(x, w)
                x, w, y = (namespace[n] for n in ("x", "w", "y"))
                assert relative_error(y, torch.nn.functional.conv2d(x.float(), w.float(), padding=1)) <= TOLERANCE
    finally:
        plancache.uninstall()
    assert ran == len(snippets())


def _plancache_cli(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "plancache", *args, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_prewarm_export_import_and_warm_start(tmp_path: Path) -> None:
    """The offline workflow on real plans: prewarm a manifest, resume it (all hits), ship it
    as a bundle into another directory, warm-start from it and execute correctly."""
    from plancache.workflows import prewarm as prewarm_module

    manifest = str(Path(__file__).resolve().parent.parent / "examples" / "manifest.json")
    source, target, bundle = tmp_path / "a", tmp_path / "b", tmp_path / "plans.bundle"
    first = _plancache_cli("--dir", str(source), "prewarm", manifest, "--no-progress")
    assert (first["failed"], first["built"]) == (0, 7)
    again = _plancache_cli("--dir", str(source), "prewarm", manifest, "--no-progress")
    assert (again["built"], again["hits"]) == (0, 7)
    assert _plancache_cli("--dir", str(source), "export", str(bundle))["entries"] == 7
    assert len(_plancache_cli("--dir", str(target), "import", str(bundle), "--allow-unsigned")["imported"]) == 7
    cache = plancache.PlanCache(target)
    report = prewarm_module.warm_start(cache, manifest)
    assert len(report["loaded"]) == 7 and report["missing"] == [] and report["failed"] == {}
    name, params = "conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64, "act": "relu"}
    plan = cache.get(templates.build(name, **params))
    assert cache.counters["memory_hits"] == 1 and cache.counters["builds"] == 0
    assert run_and_check(plan, name, params) <= TOLERANCE


_RECORDING_MODEL = r"""
import sys, torch, plancache
from plancache.workflows import templates
cache = plancache.PlanCache(sys.argv[1])
for name, params in [("conv_bias_act", {"n": 2, "c": 32, "h": 14, "w": 14, "k": 32}),
                     ("sdpa", {"b": 1, "h": 4, "s": 256, "d": 64, "causal": True})]:
    plan = cache.get(templates.build(name, **params))
    t = templates.allocate(name, device="cuda", **params)
    plan.execute(t)
torch.cuda.synchronize()
print(sorted(key for key, _device in cache.memory.keys()))
"""


def test_recorded_graphs_prewarm_to_the_same_keys(tmp_path: Path) -> None:
    recorded = tmp_path / "recorded.json"
    env = {**os.environ, "PLANCACHE_RECORD": str(recorded)}
    run = subprocess.run([sys.executable, "-c", _RECORDING_MODEL, str(tmp_path / "model")], env=env,
                         check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    keys = run.stdout.strip().splitlines()[-1]
    report = _plancache_cli("--dir", str(tmp_path / "fresh"), "prewarm", str(recorded), "--no-progress")
    assert (report["failed"], report["built"]) == (0, 2)
    built = sorted(r["key"] for r in report["entries"] if r["status"] == "built")
    assert built == sorted(json.loads(keys.replace("'", '"')))


def test_a_graph_cudnn_rejects_is_a_clear_error_and_nothing_is_stored(cache: plancache.PlanCache) -> None:
    import cudnn

    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, compute_data_type=cudnn.data_type.FLOAT)
    a = graph.tensor(name="A", dim=[4, 16, 32], stride=[512, 32, 1], data_type=cudnn.data_type.BFLOAT16, uid=1)
    b = graph.tensor(name="B", dim=[4, 48, 8], stride=[384, 8, 1], data_type=cudnn.data_type.BFLOAT16, uid=2)
    graph.matmul(a, b, name="mm").set_output(True).set_uid(3)
    with pytest.raises(plancache.InvalidGraphError) as error:
        cache.get(graph)
    assert error.value.node == "mm" and "mm" in str(error.value)
    assert maintenance.list_entries(cache.store) == []


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("conv_bias_act", {"n": 4, "c": 32, "h": 28, "w": 28, "k": 32, "layout": "nchw"}),
        ("matmul_bias_act", {"b": 2, "m": 256, "n": 128, "k": 64, "layout": "nt"}),
        ("matmul_bias_act", {"b": 2, "m": 256, "n": 128, "k": 64, "layout": "tn"}),
        ("sdpa", {"b": 1, "h": 4, "s": 256, "d": 64, "layout": "bhsd"}),
    ],
)
def test_other_template_layouts_match_pytorch(cache: plancache.PlanCache, name: str, params: dict[str, Any]) -> None:
    try:
        plan = cache.get(templates.build(name, **params))
    except plancache.InvalidGraphError as error:  # cuDNN may not support a layout: say so, clearly
        pytest.fail(f"cuDNN refused {name} in layout {params['layout']}: {error}")
    assert run_and_check(plan, name, params) <= TOLERANCE
