#!/usr/bin/env python3
"""Model benchmark: start-up and step time of the example model in PyTorch eager, torch.compile and plancache.

The model of ``examples/resnet_attention.py`` (three fused convolutions and an attention
block, batch 8, bf16) runs in a fresh process per mode, in this order:

  eager              the model in PyTorch eager (``forward_eager``), no plancache
  compile-cold       ``torch.compile`` (default mode) of that model, empty inductor and triton caches
  compile-warm       the same with the caches the cold run filled
  plancache-nocache  the model through cuDNN graphs with heuristic builds, no cache (``RawPlans``)
  plancache-cold     through plancache on an empty cache directory: autotunes and stores
  plancache-warm     the same program on the filled directory, auto-prime off (PLANCACHE_AUTO_PRIME=0)
  plancache-primed   the same program and directory, auto-prime on (PLANCACHE_AUTO_PRIME=1)
  plancache-primed-device-first
                     the same, in a program whose first CUDA work comes before its weights
                     (``torch.cuda.set_device`` and a first tensor, as a launcher's rank set-up does)

Every process runs the same program: imports (and opens the cache), loads a checkpoint
(the model's weights plus a ``--checkpoint-mb`` MiB stand-in for a real model's other
weights) onto the GPU, computes the first output, then times steps and a CUDA-graph
replay of one step, and checks both outputs against the float32 PyTorch reference.
Prints a table; ``--out FILE`` also writes every figure as JSON. Needs an NVIDIA GPU.
``--smoke``: the model at tiny sizes on the CPU test backend, every mode's child run in
this process (its result still through JSON) with its mode's environment, through the same
plancache code (cold, warm, primed); torch.compile, the frontend's own builds (nocache) and
the CUDA-graph capture are reported as skipped.
"""

# ruff: noqa: E402 - the start stamp comes before the other imports on purpose
from __future__ import annotations

import time

T_START = time.perf_counter()  # first thing in a fresh process: before torch is imported

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the working tree's plancache, as scripts/gpu-check runs it
sys.path.insert(0, str(REPO / "scripts"))  # benchlib, also when this file is loaded by its path

import benchlib

EXAMPLE_PATH = REPO / "examples" / "resnet_attention.py"

MODES = ["eager", "compile-cold", "compile-warm", "plancache-nocache", "plancache-cold", "plancache-warm", "plancache-primed",
         "plancache-primed-device-first"]  # fmt: skip
PRIMED_MODES = ("plancache-primed", "plancache-primed-device-first")  # auto-prime at its default (on)
MODE_WIDTH = max(map(len, MODES))  # the table's first column
# A warm mode measures nothing without the cold run that fills its cache before it.
PREREQUISITES = {"compile-warm": "compile-cold", "plancache-warm": "plancache-cold", "plancache-primed": "plancache-cold",
                 "plancache-primed-device-first": "plancache-cold"}  # fmt: skip
COLD_MODES = ("compile-cold", "plancache-cold")  # run once: a second run would find the cache filled
APP = "bench_model"  # PLANCACHE_APP of every plancache mode: the primed run primes from what the earlier runs used
STAND_IN = "embedding"  # the checkpoint's stand-in for a real model's other weights
CHILD_TIMEOUT_S = 900
CAPTURE_WARMUP = 3
NO_GPU = (
    "bench_model.py: this times the example model on the GPU and needs an NVIDIA GPU (torch.cuda.is_available() is False); "
    "without one, `python -m pytest tests/test_example.py` runs the model through plancache on the CPU test backend"
)
MEDIAN_KEYS = (
    "import_s",
    "weights_s",
    "first_output_after_weights_s",
    "input_s",
    "first_output_s",
    "step_ms",
    "captured_step_ms",
    "process_s",
)
WORST_KEYS = ("rel_error", "captured_rel_error")
#: Modes a smoke run skips, and what of them needs a GPU.
GPU_ONLY_MODES = {
    "compile-cold": "torch.compile",
    "compile-warm": "torch.compile",
    "plancache-nocache": "the frontend's own heuristic builds",
}
SMOKE_SIZES = {"n": 1, "c": 8, "hw": 8, "width": 32, "heads": 2}  # the example model at tiny sizes


def load_example() -> ModuleType:
    """examples/resnet_attention.py by its path: ``examples`` is no package, and a package of
    that name installed elsewhere would win over a namespace package."""
    spec = importlib.util.spec_from_file_location("resnet_attention", EXAMPLE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["resnet_attention"] = module
    spec.loader.exec_module(module)
    if benchlib.smoke():  # tiny, on the CPU (the CPU test backend runs the plans there)
        module.set_sizes(**SMOKE_SIZES)
        module.STEPS, module.WARMUP_STEPS, module.DEVICE = 2, 1, "cpu"
    return module


# ---------------------------------------------------------------------- pure helpers (tested on the CPU)


def select_modes(text: str | None) -> list[str]:
    """The modes of ``--modes a,b,c`` in the canonical order, with the cold mode each warm one
    needs; all modes when ``text`` is None. Raises ValueError naming an unknown mode."""
    if text is None:
        return list(MODES)
    wanted = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(wanted - set(MODES))
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(MODES)}")
    if not wanted:
        raise ValueError(f"no mode given; the modes are {', '.join(MODES)}")
    wanted |= {PREREQUISITES[m] for m in wanted if m in PREREQUISITES}
    return [m for m in MODES if m in wanted]


def runs_of(mode: str, repeats: int) -> int:
    return 1 if mode in COLD_MODES else max(1, repeats)


def mode_dir(mode: str, root: Path) -> Path | None:
    """The plan cache directory of a plancache mode (shared by cold, warm and primed)."""
    return root / "plancache" if mode in ("plancache-cold", "plancache-warm", *PRIMED_MODES) else None


def child_env(mode: str, root: Path, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of one child: the compile caches under ``root`` for the compile modes
    (shared by cold and warm), the application name for the plancache modes, auto-prime
    on for the primed mode only. Settings of the caller that would change a mode are dropped."""
    env = {
        k: v
        for k, v in base.items()
        if k not in ("PLANCACHE_AUTO_PRIME", "PLANCACHE_APP", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    }
    if mode.startswith("compile-"):
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "compile" / "inductor")
        env["TRITON_CACHE_DIR"] = str(root / "compile" / "triton")
    if mode.startswith("plancache-"):
        env["PLANCACHE_APP"] = APP
        if mode not in PRIMED_MODES:
            env["PLANCACHE_AUTO_PRIME"] = "0"
    return env


def last_json(stdout: str) -> dict[str, Any] | None:
    """The last line of a child's stdout that is a JSON object (the child prints one after
    its step timings and a complete one at the end)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _numbers(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def aggregate(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from a mode's runs: the median of each timing, the worst relative
    error, every error and capture failure, and the last run's counters and stats."""
    row: dict[str, Any] = {"mode": mode, "runs": len(runs)}
    for key in MEDIAN_KEYS:
        values = _numbers(runs, key)
        row[key] = statistics.median(values) if values else None
    for key in WORST_KEYS:
        values = _numbers(runs, key)
        row[key] = max(values) if values else None
    errors = [r["error"] for r in runs if r.get("error")]
    row["error"] = "; ".join(errors) or None
    capture_errors = [r["capture_error"] for r in runs if r.get("capture_error")]
    row["capture_error"] = capture_errors[0] if capture_errors else None
    row["weights_match"] = all(r.get("weights_match", True) is not False for r in runs)
    row["skipped"] = next((r["skipped"] for r in runs if r.get("skipped")), None)
    for key in ("counters", "stats", "dynamo", "primer"):
        found = [r[key] for r in runs if r.get(key) is not None]
        if found:
            row[key] = found[-1]
    primed = [r["primer"] for r in runs if r.get("primer")]
    if primed:
        row["primer_done_before_weights"] = [sum(p.get("done_when_weights_loaded") is True for p in primed), len(primed)]
    return row


def problems(rows: list[dict[str, Any]], tolerance: float) -> list[str]:
    """What makes the bench fail: a mode that failed, an output off the reference by more
    than ``tolerance`` (or never checked), weights that did not survive the checkpoint."""
    found = []
    for r in rows:
        if r.get("skipped") and not r.get("error"):  # a smoke run's GPU-only mode
            continue
        if r.get("error"):
            found.append(f"{r['mode']} failed")
        if r.get("rel_error") is None or r["rel_error"] > tolerance:
            found.append(f"{r['mode']}: first output off the float32 reference (rel error {r.get('rel_error')})")
        if r.get("captured_rel_error") is not None and r["captured_rel_error"] > tolerance:
            found.append(f"{r['mode']}: captured output off the float32 reference (rel error {r['captured_rel_error']})")
        if r.get("weights_match") is False:
            found.append(f"{r['mode']}: weights loaded from the checkpoint differ from the example's")
    return found


def _cell(value: Any, width: int, spec: str, scale: float = 1.0) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value * scale:{width}{spec}}"


NOTES = [
    "eager: the model in PyTorch eager (bf16, PyTorch's own kernels), no plancache",
    "compile-cold / compile-warm: torch.compile of the eager model in its default mode (the first call compiles), "
    "with empty / filled TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR; mode='reduce-overhead' is not used (one compile mode): "
    "its captured step is the compiled step in a plain CUDA graph",
    "plancache-nocache: the same cuDNN graphs with heuristic builds and no cache (what a program does without plancache)",
    "plancache-cold: plancache on an empty cache directory (autotunes, stores); -warm: the same program on the filled "
    "directory with PLANCACHE_AUTO_PRIME=0; -primed: the same with PLANCACHE_AUTO_PRIME=1, which loads the plans "
    "of the application's last run on a background thread while the program loads its weights; -primed-device-first: "
    "the same in a program whose first CUDA work (torch.cuda.set_device, a first tensor) comes before its weights",
    "every process loads the same checkpoint (torch.load, every tensor to the GPU) between its imports and its first step; "
    "the parent wrote it just before, so it is read from the OS page cache",
    "first output after weights: from the weights on the GPU to the first output (input, plans or compile, first step); "
    "from process start: from the child's first statement, before `import torch`",
    "step: median of {steps} steps after {warmup} untimed ones, each CUDA-synchronized and timed alone (host + GPU); "
    "captured step: the same for replays of one step captured in one CUDA graph by plancache.capture in every mode "
    "(PyTorch's recipe: warm-up calls on a side stream, then torch.cuda.graph)",
    "process s: the whole fresh process, timed by the parent; each figure is the median of --repeats processes "
    "(cold modes run once: a second run would be warm)",
    "rel err: the larger of the first output's and the captured replay's relative error against the float32 PyTorch reference",
]


def format_table(rows: list[dict[str, Any]], header: Mapping[str, Any]) -> str:
    """The printed table: a header line of the set-up, one row per mode, then the notes."""
    lines = [
        f"\nexample model (3 fused convs + attention block, batch {header.get('batch')}, bf16), "
        f"{header.get('date')}, {header.get('gpu')}, torch {header.get('torch')}, cuDNN {header.get('cudnn')}, "
        f"cuDNN frontend {header.get('cudnn_frontend')}, checkpoint {header.get('checkpoint_mb')} MiB, "
        f"repeats {header.get('repeats')} (in rounds), CPUs {_cpus(header.get('cpus'))}",
        f"{'mode':{MODE_WIDTH}} {'first output after weights ms':>30} {'first output from start s':>26} {'step ms':>9} "
        f"{'captured step ms':>17} {'process s':>10} {'rel err':>9}",
    ]
    for r in rows:
        if r.get("skipped") and not r.get("error"):
            lines.append(f"{r['mode']:{MODE_WIDTH}} {r['skipped']}")
            continue
        if r.get("error") and r.get("first_output_s") is None:
            lines.append(f"{r['mode']:{MODE_WIDTH}} failed: {str(r['error']).splitlines()[0][:200]}")
            continue
        lines.append(
            f"{r['mode']:{MODE_WIDTH}} {_cell(r.get('first_output_after_weights_s'), 30, '.1f', 1e3)} "
            f"{_cell(r.get('first_output_s'), 26, '.3f')} {_cell(r.get('step_ms'), 9, '.3f')} "
            f"{_cell(r.get('captured_step_ms'), 17, '.3f')} {_cell(r.get('process_s'), 10, '.2f')} "
            f"{_cell(_worst(r), 9, '.1e')}"
        )
    notes = [n.format(steps=header.get("steps"), warmup=header.get("warmup")) for n in NOTES]
    for r in rows:
        if r.get("capture_error"):
            notes.append(f"captured step n/a for {r['mode']}: {str(r['capture_error']).splitlines()[0][:300]}")
        if r.get("error") and r.get("first_output_s") is not None:
            notes.append(f"{r['mode']} failed after its step timings: {str(r['error']).splitlines()[0][:300]}")
        if r.get("input_s") is not None and r["mode"] in ("eager", "plancache-warm", *PRIMED_MODES):
            notes.append(f"{r['mode']}: of its first output after weights, creating the input took {r['input_s'] * 1e3:.1f} ms")
        primer = r.get("primer")
        if primer and primer.get("primed"):
            notes.append(f"{r['mode']}: auto-prime loaded {primer['primed']} plans in {primer['seconds']:.3f} s from the cache's "
                         f"opening; the weights took {primer['weights_s']:.3f} s; primer done when they were loaded: "
                         f"{primer['done_when_weights_loaded']} (last run)")  # fmt: skip
        if r.get("primer_done_before_weights"):
            done, runs = r["primer_done_before_weights"]
            notes.append(f"{r['mode']}: the primer was done when the weights were loaded in {done} of {runs} processes")
    lines += ["notes:"] + [f"  - {n}" for n in notes]
    for r in rows:
        lines += primer_timeline(r)
    return "\n".join(lines)


#: What ``per_process`` lists of each process: (label, field, scale, format).
PER_PROCESS = (("first output after weights ms", "first_output_after_weights_s", 1e3, ".1f"),
               ("creating the input ms", "input_s", 1e3, ".1f"), ("step ms", "step_ms", 1.0, ".3f"),
               ("captured step ms", "captured_step_ms", 1.0, ".3f"))  # fmt: skip


def per_process(runs: Mapping[str, list[Mapping[str, Any]]]) -> list[str]:
    """Each process's figures behind the medians, in the order the processes ran: a median
    of a few processes hides whether they agree or fall into two groups."""
    lines = ["per process, in the order they ran:"]
    for mode, found in runs.items():
        if len(found) < 2:
            continue
        for label, field, scale, spec in PER_PROCESS:
            values = [r.get(field) for r in found]
            if all(v is None for v in values):
                continue
            cells = " ".join("-" if v is None else format(v * scale, spec) for v in values)
            lines.append(f"  {mode:{MODE_WIDTH}} {label:30} {cells}")
    return lines if len(lines) > 1 else []


def primer_timeline(row: Mapping[str, Any]) -> list[str]:
    """The primer's timeline of a mode's last run, in ms from the cache's opening: the
    opening of cuDNN's libraries, each device's readiness and cuDNN handle, then one line
    per plan: its read (ahead of the device), wait for builds, entry into the guest block,
    judging, finalize, and the first lookup's ask."""
    primer = row.get("primer") or {}
    timeline = primer.get("timeline")
    if not timeline:
        return []

    def ms(value: Any) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    def pair(found: Any) -> str:
        return f"{ms(found[0])}-{ms(found[1])}" if found else "-"

    handles = timeline.get("handle", {})
    ready = ", ".join(f"device {d} at {ms(t)} (its cuDNN handle {pair(handles.get(d))})"
                      for d, t in timeline.get("device_ready", {}).items()) or "no device"  # fmt: skip
    ready = f"cuDNN's libraries opened {pair(timeline.get('libraries'))}; {ready}"
    lines = [f"primer timeline of {row['mode']} (last run; ms from the cache's opening): {ready}; weights "
             f"loaded at {ms(primer.get('weights_at_s'))}, first output at {ms(primer.get('first_output_at_s'))}"]  # fmt: skip
    for plan in timeline.get("plans", []):
        stages = "  ".join(f"{stage} {pair(plan.get(stage)):>13}" for stage in ("read", "wait", "enter", "judge", "finalize"))
        lines.append(
            f"  {plan['key']} {plan['outcome']:8} {stages}  asked {ms(plan.get('asked')):>7}  {plan.get('label', '')[:50]}"
        )
    return lines


def _cpus(cpus: Any) -> str:
    """A CPU list as ranges (``0-15,32-47``), or the words saying why there is none."""
    if not isinstance(cpus, list) or not cpus:
        return str(cpus)
    ranges, start = [], cpus[0]
    for previous, cpu in zip(cpus, [*cpus[1:], None]):
        if cpu != previous + 1 if cpu is not None else True:
            ranges.append(f"{start}-{previous}" if previous != start else str(start))
            start = cpu
    return ",".join(ranges) + " (the GPU's NUMA node)"


def _worst(row: Mapping[str, Any]) -> float | None:
    values = [v for v in (row.get("rel_error"), row.get("captured_rel_error")) if v is not None]
    return max(values) if values else None


# ---------------------------------------------------------------------- the child: one fresh process, one mode


def rel_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def open_plans(mode: str, directory: str | None, example: ModuleType) -> Any:
    """The plans object of a plancache mode, created as soon as plancache is imported (which
    is when a cache with auto-prime starts loading plans); None for eager and compile."""
    if mode == "plancache-nocache":
        return example.RawPlans()
    if mode.startswith("plancache-"):
        import plancache  # noqa: F401 - imported here, as a program would at its start

        return example.CachedPlans(directory or "", backend=benchlib.backend())
    return None


def load_checkpoint(torch: Any, path: str, conv_layers: list[str]) -> dict[str, Any]:
    """What a real program does before its first step: read the checkpoint, then move every
    tensor to the GPU (conv weights channels_last, as ``weights()`` builds them)."""
    loaded = torch.load(path, map_location="cpu", mmap=False, weights_only=True)
    on_gpu = {}
    for name, tensor in loaded.items():
        t = tensor.to(benchlib.device())
        on_gpu[name] = t.to(memory_format=torch.channels_last) if name in conv_layers else t
    return on_gpu


def make_step(mode: str, example: ModuleType, torch: Any, plans: Any, w: dict[str, Any], x: Any) -> tuple[Callable[[], Any], Any]:
    """The step of a mode and, for the compile modes, the compiled function."""
    if plans is not None:
        return (lambda: example.forward(plans, torch, w, x)), None
    if mode.startswith("compile-"):

        def model(weights: dict[str, Any], inp: Any) -> Any:
            return example.forward_eager(torch, weights, inp)

        compiled = torch.compile(model)  # the default mode; it compiles on the first call
        return (lambda: compiled(w, x)), compiled
    return (lambda: example.forward_eager(torch, w, x)), None


def capture_step(torch: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """One step captured in a CUDA graph, the same way in every mode: ``plancache.capture``
    is PyTorch's recipe (warm-up calls on a side stream, then ``torch.cuda.graph``) and
    works for any CUDA work, plans or not. Returns the replay function."""
    import plancache

    benchlib.synchronize(torch)
    return plancache.capture(step, warmup=CAPTURE_WARMUP).replay


def single_tensor(out: Any) -> Any:
    """The model's output tensor, also when a replay returns it inside a tuple or list."""
    while isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    return out


def _cache_figures(plans: Any) -> dict[str, Any]:
    """The cache's counters and stats, whatever this version of plancache offers."""
    cache = getattr(plans, "cache", None)
    if cache is None:
        return {}
    figures: dict[str, Any] = {"counters": dict(getattr(cache, "counters", {}) or {})}
    try:
        figures["stats"] = cache.stats()
    except Exception as exc:  # figures only: never fail the run for them
        figures["stats"] = {"error": f"{type(exc).__name__}: {exc}"}
    return figures


def _dynamo_figures() -> dict[str, Any]:
    """Graph breaks and graphs of the compile modes (a private counter: None if it moved)."""
    try:
        from torch._dynamo.utils import counters

        return {"graph_breaks": sum(counters["graph_break"].values()), "unique_graphs": counters["stats"]["unique_graphs"]}
    except Exception:
        return {"graph_breaks": None, "unique_graphs": None}


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result, default=str), flush=True)


def run_child(mode: str, directory: str | None, checkpoint: str) -> dict[str, Any]:
    t_start = time.perf_counter() if benchlib.smoke() else T_START  # a smoke run's child runs in the parent's process
    if benchlib.smoke() and mode in GPU_ONLY_MODES:
        benchlib.gpu_only(f"{mode}: {GPU_ONLY_MODES[mode]}", lambda: None)
        return {"mode": mode, "skipped": benchlib.SKIPPED}
    example = load_example()  # standard library only: torch is imported next
    import torch

    if not benchlib.smoke() and not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    if mode.endswith("-device-first"):  # a launcher's rank set-up: the device, then a first tensor on it
        if benchlib.has_cuda(torch):
            torch.cuda.set_device(0)
        torch.ones(1, device=benchlib.device())
    plans = open_plans(mode, directory, example)
    t_imported = time.perf_counter()

    conv_layers = [layer for layer, name, _ in example.LAYERS if name == "conv_bias_act"]
    loaded = load_checkpoint(torch, checkpoint, conv_layers)
    benchlib.synchronize(torch)
    t_weights = time.perf_counter()
    primer = getattr(getattr(plans, "cache", None), "primer", None)
    primer_done_at_weights = None if primer is None else not primer.is_alive()
    w = {k: v for k, v in loaded.items() if k != STAND_IN}  # the model gets its own weights only, in every mode

    g = torch.Generator().manual_seed(1)
    n, c, hw = example.N, example.LAYERS[0][2]["c"], example.LAYERS[0][2]["h"]
    x = torch.randn(n, c, hw, hw, generator=g).to(torch.bfloat16).to(benchlib.device())
    x = x.to(memory_format=torch.channels_last)
    benchlib.synchronize(torch)
    t_input = time.perf_counter()
    step, compiled = make_step(mode, example, torch, plans, w, x)
    out = single_tensor(step())
    benchlib.synchronize(torch)
    t_first = time.perf_counter()

    times = example.step_times_ms(torch, step)
    result: dict[str, Any] = {
        "mode": mode, "import_s": t_imported - t_start, "weights_s": t_weights - t_imported,
        "first_output_after_weights_s": t_first - t_weights, "first_output_s": t_first - t_start,
        "input_s": t_input - t_weights,
        "step_ms": statistics.median(times), "step_ms_min": min(times), "steps": len(times),
        "captured_step_ms": None, "rel_error": None, "captured_rel_error": None, "capture_error": None,
    }  # fmt: skip
    emit(result)  # the step timings survive a capture that leaves the GPU unusable

    captured_out = None
    try:
        replay = benchlib.gpu_only("captured step: plancache.capture (a CUDA graph)", capture_step, torch, step)
        if replay is not None:
            captured_times = example.step_times_ms(torch, replay)
            captured_out = single_tensor(replay())
            benchlib.synchronize(torch)
            result["captured_step_ms"] = statistics.median(captured_times)
    except Exception as exc:  # one mode's capture failing is a figure, not a failed bench
        result["capture_error"] = f"{type(exc).__name__}: {exc}"[:2000]

    # Correctness, after every timing: the float32 reference, and the checkpoint's weights
    # against the example's own (same values, dtype, shape and memory layout).
    ref = example.forward_pytorch(torch, w, x)
    result["rel_error"] = rel_error(out, ref)
    if captured_out is not None:
        result["captured_rel_error"] = rel_error(captured_out, ref)
    expected = example.weights(torch, device=benchlib.device())
    result["weights_match"] = expected.keys() == w.keys() and all(
        w[k].dtype == t.dtype and w[k].shape == t.shape and w[k].stride() == t.stride() and bool(torch.equal(w[k], t))
        for k, t in expected.items()
    )
    result["checkpoint_tensors"] = len(loaded)
    if compiled is not None:
        result["dynamo"] = _dynamo_figures()
    result.update(_cache_figures(plans))
    if primer is not None:  # auto-prime: how long it took, and whether the weights outlasted it
        result["primer"] = {**primer.report, "done_when_weights_loaded": primer_done_at_weights,
                            "weights_s": t_weights - t_imported, "timeline": primer.timeline(),
                            "weights_at_s": t_weights - primer.opened, "first_output_at_s": t_first - primer.opened}  # fmt: skip
    if getattr(plans, "cache", None) is not None:
        plans.cache.close()
    return result


# ---------------------------------------------------------------------- the parent


def write_checkpoint(torch: Any, example: ModuleType, path: Path, megabytes: int) -> Path:
    """The model's weights (``weights()`` on the CPU) plus a ``megabytes`` MiB bfloat16
    stand-in for a real model's other weights, saved with torch.save."""
    state = dict(example.weights(torch, device="cpu"))
    if megabytes > 0:
        g = torch.Generator().manual_seed(2)
        block = (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)  # 1 MiB: 512 rows of 1024 bf16
        state[STAND_IN] = block.repeat(megabytes, 1)
    torch.save(state, path)
    return path


def gpu_cpus() -> set[int] | None:
    """The CPUs of the GPU's NUMA node (``nvidia-smi`` for its PCI address, then sysfs), as
    far as this process may use them; None when they cannot be told. Every child runs on
    them: a process placed on the other node steps slower, whatever its mode."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        bus = done.stdout.strip().splitlines()[0].strip().lower()
        domain, rest = bus.split(":", 1)
        listed = Path(f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest}/local_cpulist").read_text().strip()
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    cpus: set[int] = set()
    for part in listed.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    usable = cpus & os.sched_getaffinity(0)
    return usable or None


def run_mode(mode: str, root: Path, checkpoint: Path, index: int, cpus: set[int] | None = None) -> dict[str, Any]:
    """One fresh process of ``mode`` (on ``cpus`` when given); its JSON plus the process's
    wall time (and an error instead of an exception when it fails, so the other modes
    still run)."""
    args = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--checkpoint", str(checkpoint)]
    directory = mode_dir(mode, root)
    if directory is not None:
        args += ["--dir", str(directory)]
    started = time.perf_counter()
    if benchlib.smoke():
        return _run_mode_here(mode, directory, checkpoint, index, started)
    try:
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        done = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                              env=child_env(mode, root, os.environ), preexec_fn=pin)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {CHILD_TIMEOUT_S} s", "process_s": time.perf_counter() - started}
    process_s = time.perf_counter() - started
    result = last_json(done.stdout) or {"mode": mode}
    result["process_s"] = process_s
    result["stderr_tail"] = done.stderr[-2000:]  # warnings and logs of the run, for the JSON only
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        result["error"] = f"exit code {done.returncode}: {tail[0]}"
    print(f"  bench_model: {mode:18} run {index + 1} done in {process_s:.1f} s{' (FAILED)' if done.returncode else ''}",
          file=sys.stderr)  # fmt: skip
    return result


def _run_mode_here(mode: str, directory: Path | None, checkpoint: Path, index: int, started: float) -> dict[str, Any]:
    """A smoke run's child: ``run_child`` in this process under the child's environment
    (``child_env``, restored afterwards), its result through JSON as a child's stdout."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(child_env(mode, checkpoint.parent, saved))
    try:
        result = last_json(json.dumps(run_child(mode, None if directory is None else str(directory), str(checkpoint)),
                                      default=str)) or {"mode": mode}  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result["process_s"] = time.perf_counter() - started
    print(f"  bench_model: {mode:18} run {index + 1} done in {result['process_s']:.1f} s (smoke run: in this process)",
          file=sys.stderr)  # fmt: skip
    return result


def header_info(torch: Any, example: ModuleType, opts: argparse.Namespace) -> dict[str, Any]:
    try:
        import cudnn

        frontend = cudnn.__version__
    except Exception as exc:
        frontend = f"unavailable ({type(exc).__name__})"
    gpu = torch.cuda.get_device_name() if benchlib.has_cuda(torch) else "none (smoke run on the CPU test backend)"
    cudnn_version = torch.backends.cudnn.version() if benchlib.has_cuda(torch) else None
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "cudnn": cudnn_version, "cudnn_frontend": frontend, "batch": example.N,
            "checkpoint_mb": opts.checkpoint_mb, "repeats": opts.repeats, "steps": example.STEPS,
            "warmup": example.WARMUP_STEPS, "tolerance": example.TOLERANCE}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", help="write every row (and each run) as JSON here")
    parser.add_argument("--modes", help=f"a comma-separated subset of {','.join(MODES)} (run in that order; "
                        "a warm mode brings its cold mode)")  # fmt: skip
    parser.add_argument(
        "--checkpoint-mb", type=int, help="MiB of stand-in weights in the checkpoint (default 1024; 1 with --smoke)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per mode; cold modes run once (default 1)")
    parser.add_argument("--keep", metavar="DIR", help="put the checkpoint and caches in DIR (new or empty) and keep them")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child run, printed as JSON
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    benchlib.add_smoke_option(parser)
    opts = parser.parse_args(argv)
    if opts.checkpoint_mb is None:
        opts.checkpoint_mb = 1 if opts.smoke or benchlib.smoke() else 1024
    try:
        opts.modes = select_modes(opts.modes)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.checkpoint_mb < 0 or opts.repeats < 1:
        parser.error("--checkpoint-mb must be >= 0 and --repeats >= 1")
    if opts.keep and Path(opts.keep).exists() and any(Path(opts.keep).iterdir()):
        parser.error(f"--keep {opts.keep}: the directory must be new or empty (the cold modes need empty caches)")
    if opts.mode and not opts.checkpoint:
        parser.error("--mode needs --checkpoint FILE")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    benchlib.start_smoke(opts.smoke)
    if opts.mode:
        emit(run_child(opts.mode, opts.dir, opts.checkpoint))
        return
    import torch

    if not benchlib.smoke() and not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    example = load_example()
    root = benchlib.scratch("plancache-bench-model-", opts.keep)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in opts.modes}
    checkpoint = write_checkpoint(torch, example, root / "checkpoint.pt", opts.checkpoint_mb)
    checkpoint_bytes = checkpoint.stat().st_size
    cpus = None if benchlib.smoke() else gpu_cpus()
    # In rounds, every mode once per round (a cold mode in the first only, before the modes
    # that need it): a drift of the machine over the run touches every mode alike.
    for i in range(max(runs_of(mode, opts.repeats) for mode in opts.modes)):
        for mode in opts.modes:
            if i < runs_of(mode, opts.repeats):
                runs[mode].append(run_mode(mode, root, checkpoint, i, cpus))
    rows = [aggregate(mode, runs[mode]) for mode in opts.modes]
    header = header_info(torch, example, opts)
    header["checkpoint_bytes"] = checkpoint_bytes
    header["cpus"] = sorted(cpus) if cpus else "not pinned (the GPU's NUMA node is unknown)"
    print(format_table(rows, header))
    print("\n".join(per_process(runs)))
    benchlib.report_skipped("bench_model")
    if opts.out:
        Path(opts.out).write_text(json.dumps({"header": header, "rows": rows, "runs": runs}, indent=2, default=str))
    failed = problems(rows, example.TOLERANCE)
    if failed:
        raise SystemExit("bench_model.py: " + "; ".join(failed))


if __name__ == "__main__":
    main()
