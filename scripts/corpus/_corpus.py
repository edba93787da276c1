"""What the corpus programs share: a handle, first-call timing, the float32 check, the report.

Nothing here knows of plancache (the programs are plain cuDNN Frontend code, and run the
same with or without ``PLANCACHE_PATCH_CUDNN=1``). Each program calls ``run(name, idiom,
body)``; ``body(report)`` builds and runs its graphs and reports each output against a
float32 PyTorch reference. The program then prints one line,

    CORPUS_RESULT {"program": ..., "outcome": "ok" | "rejected: ..." | "error: ...",
                   "graphs": {name: {"first_call_ms": ...}}, "outputs": {name: {...}}, ...}

and, when ``CORPUS_OUT`` names a file, saves its outputs there (``torch.save``) for
scripts/gpu_corpus.py to compare across runs. ``first_call_ms`` is the wall time from the
graph's construction to the end of its first execution (synchronized): what a program
waits for the first time it runs a graph.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import cudnn
import torch

PREFIX = "CORPUS_RESULT "


def handle_on_current_stream() -> Any:
    """A cuDNN handle that runs on PyTorch's current stream, as the frontend's samples make one."""
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    return handle


def workspace_for(graph: Any) -> torch.Tensor:
    return torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)


def row_major(dims: list[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


class Report:
    def __init__(self, program: str, idiom: str) -> None:
        self.program, self.idiom = program, idiom
        self.graphs: dict[str, dict[str, float]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}
        self.saved: dict[str, torch.Tensor] = {}
        self.outcome = "ok"
        self.notes: list[str] = []

    @contextlib.contextmanager
    def first_call(self, name: str) -> Iterator[None]:
        """Time one graph's first call: construction, planning and first execution."""
        torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:  # a rejection's time too: how long the program waits to learn it
            torch.cuda.synchronize()
            self.graphs[name] = {"first_call_ms": round(1e3 * (time.perf_counter() - started), 3)}

    def output(self, name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
        """Compare an output with its float32 reference; keep it for the cross-run check."""
        error = rel_error(got, want)
        self.outputs[name] = {
            "rel_err_vs_fp32": error,
            "tolerance": tolerance,
            "ok": bool(error <= tolerance),
            "checksum": float(got.double().sum()),
            "abs_checksum": float(got.double().abs().sum()),
            "shape": list(got.shape),
            "dtype": str(got.dtype).removeprefix("torch."),
        }
        self.saved[name] = got.detach().to("cpu").clone()

    def emit(self) -> None:
        build_plans = getattr(cudnn.pygraph, "build_plans", None)
        result = {
            "program": self.program,
            "idiom": self.idiom,
            "outcome": self.outcome,
            "ok": self.outcome == "ok" and all(o["ok"] for o in self.outputs.values()),
            "graphs": self.graphs,
            "first_call_ms_total": round(sum(g["first_call_ms"] for g in self.graphs.values()), 3),
            "outputs": self.outputs,
            "notes": self.notes,
            # Seen from the program without importing anything: is plancache in this process,
            # and are the frontend's planning calls wrapped?
            "plancache_loaded": "plancache" in sys.modules,
            "pipeline_patched": hasattr(build_plans, "__plancache_original__"),
            "versions": {
                "cudnn_frontend": cudnn.__version__,
                "cudnn": cudnn.backend_version_string(),
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(),
            },
        }
        path = os.environ.get("CORPUS_OUT")
        if path:
            torch.save(self.saved, path)
        print(PREFIX + json.dumps(result), flush=True)


def run(program: str, idiom: str, body: Callable[[Report], None]) -> None:
    """Run ``body``; a rejection (``cudnn.cudnnGraphNotSupportedError``, caught the way
    frontend code catches it) or any other error is the program's outcome, reported like a
    result: the report line is printed whatever happens."""
    torch.manual_seed(0)
    report = Report(program, idiom)
    try:
        body(report)
    except cudnn.cudnnGraphNotSupportedError as exc:
        report.outcome = f"rejected: {type(exc).__name__}"
        report.notes.append(str(exc)[:300])
    except Exception as exc:
        report.outcome = f"error: {type(exc).__name__}"
        report.notes.append(traceback.format_exc()[-1500:])
    report.emit()
