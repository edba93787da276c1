"""Smoke runs of the GPU scripts and the example's demo on the CPU test backend (``--smoke``,
scripts/benchlib.py).

Each script runs in this process through its ``main(argv)``, at tiny sizes, through the code
its GPU run takes (``PlanCache.get``, ``Plan.execute``, priming, the store, its table and
JSON), with only the parts that need real cuDNN or CUDA reported as skipped: a script that
would crash on a GPU in plancache's part of it fails here first. The figures mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
EXAMPLES = SCRIPTS.parent / "examples"

#: script -> (extra arguments, lines its output must have, whether it writes --out JSON)
RUNS: dict[str, tuple[list[str], list[str], bool]] = {
    "bench_startup": (
        [],
        [
            "plancache start-up benchmark",
            "TOTAL (s)",
            "launch host time",
            "top-K simulated",
            "cold misses by stage, ms, the largest first",
            "bench_startup smoke run: 4 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "bench_dynamic": (
        [],
        [
            "plancache dynamic-shape benchmark",
            "conv: first-call latency",
            "sdpa: first-call latency",
            "counters: cold",
            "bench_dynamic smoke run:",
        ],
        True,
    ),
    "bench_many_plans": (
        ["--profile"],
        [
            "plancache many-plan start-up benchmark",
            "stored 10 of 10 graphs cold",
            "served: {'loaded': 10}; frontend fallbacks: none",
            "plancache's own share per hit: median",
            "bare cuDNN finalize loop (C API, nothing else):",
            "frontend deserialize loop: skipped ms",
            "primed (the default): all in memory",
            "10 lookups",
            "the garbage collector's",
            "stages:     us/hit  stage of a store hit's own share",
            "describe and key the graph",
            "profile: own us/hit with callees calls/hit  function (profiled: slower than unprofiled)",
            "profile: -- plancache's functions, most time with callees",
            "bench_many_plans smoke run: 1 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "bench_miss": (
        [],
        [
            "cold: its lookup's stages and candidates",
            "ms: ",
            "judge ",
            "store_write ",
            "conv_bias_relu            skipped ",
            "sdpa_causal ",
            "warm from ['loaded']",
            "bench_miss: worst cold/frontend ratio skipped",
            "bench_miss smoke run: 1 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "bench_model": (
        [],
        [
            "example model (3 fused convs + attention block, batch 1, bf16)",
            "plancache-cold ",
            "plancache-primed ",
            "plancache-primed-device-first ",
            "compile-cold                  skipped: needs a GPU",
            "bench_model smoke run: 4 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "gpu_native": (
        [],
        [
            "conv_bias_relu         skipped ",
            "sdpa_paged             skipped ",
            "moe_grouped_matmul     skipped ",
            "gpu_native smoke run: 7 of 7 graphs loaded and launched natively, none compared",
            "gpu_native smoke run: 7 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "gpu_gate": (
        [],
        [
            "built/conv_bias_relu             (as it is)                   passes           native                   1  ok",
            "recorded/sdpa_backward           replacement at 2^62          REPLACEMENT      refused                  0  ok",
            "gpu_gate smoke run: 102 of 102 mutated blobs kept off the native path, 0 failure(s)",
        ],
        True,
    ),
    "gpu_corpus": (
        [],
        [
            "plancache copied from the tree (a smoke run: no wheel built)",
            "printed True)",
            "_smoke_lookup                        smoke: one PlanCache.get           ok ",
            "1 of 1 programs pass; the variable check passes",
            "gpu_corpus smoke run: 1 GPU-only part(s) skipped: needs a GPU",
            "the 15 cuDNN Frontend programs of corpus/: skipped: needs a GPU",
        ],
        True,
    ),
    "gpu_hazards": (
        [],
        [
            "setup: 5 plans stored under 'gpu-hazards'",
            "weights      1        0      0       0     0 ",
            "kernels      1        0      0       0     0 ",
            "captures     1        0      0       0     0 ",
            "lookups      1        0      0       0     0 ",
            "per process: ",
            "iterations during priming (median); without each one's first (CUDA's set-up): ",
            "gpu_hazards smoke run: 2 GPU-only part(s) skipped: needs a GPU",
            "gpu_hazards: PASSED",
        ],
        True,
    ),
    "gpu_right_result": (
        [],
        [
            "heuristic        18     18    18",
            "topk             18     18    18",
            "exhaustive       18     18    18",
            "warm  paged_decode         source loaded",
            "warm  moe_grouped_matmul   source loaded",
            "gpu_right_result smoke run: 3 GPU-only part(s) skipped: needs a GPU",
            "gpu_right_result: PASSED",
        ],
        True,
    ),
    "gpu_sweep_epilogues": (
        [],
        [
            "graphs 8 (failed 0), candidates launched 32, judged by the oracle 32, right 24",
            "matmul bfloat16 small relu_clip_0_1            wrong: cpu-test-eng2  majority=True",
            "conv   bfloat16 small gelu                     wrong: cpu-test-eng2  majority=True",
            "false rejections (right, rejected): 0 of 24",
            "misses (wrong, in the majority): 0",
            "graphs without a majority: 0",
            "gpu_sweep_epilogues smoke run: 1 GPU-only part(s) skipped: needs a GPU",
        ],
        True,
    ),
    "key_oracle": (
        [],
        [
            "conv_fprop               variants   2",
            "sdpa                     variants   2",
            "60  skipped: needs a GPU",
            "key_oracle smoke run: 1 GPU-only part(s) skipped: needs a GPU",
            "key oracle smoke run: 60 of 60 variants keyed by plancache, 60 alike after",
        ],
        False,
    ),
    "resnet_attention": (
        [],
        [
            "time to first output in this process (a smoke run on the CPU test backend: it measures nothing);",
            "nocache    skipped: needs a GPU (cuDNN Frontend's own heuristic builds)",
            "cold     ",
            "{'misses': 6, 'builds': 6}",
            "bundle   ",
            "{'hits': 6}",
            "eager    ",
        ],
        True,
    ),
    "probe_launch_parts": (
        [],
        [
            '{"graph": "conv_bias_act", "source": "loaded"',
            '{"graph": "sdpa", "source": "loaded"',
            "probe_launch_parts smoke run:",
        ],
        False,
    ),
    "probe_hit_parts": (
        [],
        [
            "plancache store hit by part, us per call (best of 5 runs of 3)",
            "  of which the blob's checksum",
            "the same parts in one sequence",
            "whole hit below the key",
            "sum of the parts after the key",
            "probe_hit_parts smoke run: 0 GPU-only part(s) skipped: needs a GPU",
        ],
        False,
    ),
    "probe_first_load": (
        [],
        [
            '{"case": "alone", ',
            "made-in-init-beside-copy (median of 1 processes; ms from the device's setup):",
            "  handle ",
            "  finalize 2 ",
            "  launch 2 second ",
            "probe_first_load smoke run: 2 GPU-only part(s) skipped: needs a GPU",
        ],
        False,
    ),
}


def load(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = SCRIPTS / f"{name}.py" if (SCRIPTS / f"{name}.py").exists() else EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"smoke_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_script_runs_its_gpu_path_on_the_cpu_test_backend(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    extra, lines, writes_json = RUNS[name]
    monkeypatch.setenv("PLANCACHE_SCRIPT_SMOKE", "1")  # restored afterwards (--smoke sets it too)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scripts' own directories
    monkeypatch.syspath_prepend(str(SCRIPTS))  # their `import benchlib`
    out = tmp_path / f"{name}.json"
    argv = ["--smoke", *extra, *(["--out", str(out)] if writes_json else [])]
    monkeypatch.delitem(sys.modules, "benchlib", raising=False)  # each run starts with its own list of skipped parts
    before = set(sys.modules)
    try:
        status = load(name, monkeypatch).main(argv)
    finally:  # the scripts it imported (gpu_right_result at its smoke sizes...) go with it
        for module in set(sys.modules) - before:
            if Path(getattr(sys.modules[module], "__file__", None) or "/").parent in (SCRIPTS, EXAMPLES):
                del sys.modules[module]
    assert status in (None, 0), f"{name} --smoke returned {status}"
    printed = capsys.readouterr().out
    for line in lines:
        assert line in printed, f"{name} --smoke did not print {line!r}:\n{printed[-3000:]}"
    assert "Traceback" not in printed
    assert "FAILED" not in printed, printed[-3000:]  # a part that failed, printed as a row
    if writes_json:
        json.loads(out.read_text(), parse_constant=pytest.fail)  # strict JSON: no NaN or Infinity


def test_miss_stages_time_each_stage_of_a_miss_and_give_the_timing_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The benchmarks' stage timer (``benchlib.MissStages``) covers a miss's stages within its
    wall time, sees a hit pass only its key and judge, and leaves the GPU timing as it was."""
    import time

    from graphs import ConvBiasRelu

    from plancache import PlanCache
    from plancache.testing import CpuTestBackend

    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.delitem(sys.modules, "benchlib", raising=False)
    import benchlib

    import plancache.cudnn.backend as cudnn_backend_module
    from plancache.autotuning.consensus import Consensus

    timing, add = cudnn_backend_module.event_times, Consensus.add
    cache = PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False)
    with benchlib.MissStages(cache) as stages:
        started = time.perf_counter()
        cache.get(ConvBiasRelu(n=2).graph())
        wall = time.perf_counter() - started
        miss = stages.take()
        cache.lookup.memory.clear()
        cache.get(ConvBiasRelu(n=2).graph())  # from the store
        hit = stages.take()
    cache.close()
    assert cudnn_backend_module.event_times is timing and Consensus.add is add
    assert set(miss["seconds"]) == set(benchlib.MISS_STAGES)
    ran = {stage for stage, calls in miss["calls"].items() if calls}
    assert {"key", "lock", "planning", "build", "launch", "compare", "serialize", "load_back", "judge",
            "store_write"} <= ran, ran  # fmt: skip
    assert miss["calls"]["compare"] == miss["calls"]["launch"]  # each candidate launched is compared
    assert 0 < sum(miss["seconds"].values()) <= wall
    assert {stage for stage, calls in hit["calls"].items() if calls} == {"key", "judge"}, hit
    assert "other " in benchlib.stage_row(miss, wall)
    # Each build is kept with its candidate, and the builds' seconds are the build stage's.
    assert len(miss["builds"]) == miss["calls"]["build"] and not hit["builds"]
    assert sum(b["seconds"] for b in miss["builds"]) <= miss["seconds"]["build"]
    assert all(b["compiles"] is False for b in miss["builds"])  # the CPU test backend compiles nothing at run time
    assert miss["timed_one_by_one"] == 0  # the CPU test backend times without CUDA events
    assert "run by run" in benchlib.stage_row({**miss, "timed_one_by_one": 1, "calls": {**miss["calls"], "timing": 1},
                                               "seconds": {**miss["seconds"], "timing": 0.001}}, wall)  # fmt: skip
