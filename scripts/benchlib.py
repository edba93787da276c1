"""Helpers shared by the benchmark scripts: fresh-process phases and GPU timing.

Each benchmark runs every phase in a fresh Python process (``run_phase``), because what a
user pays at start-up only shows in a process that has loaded nothing yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any


def parse_or_run_phase(description: str, phases: dict[str, Any]) -> argparse.Namespace | None:
    """The command line shared by the benchmarks. With ``--phase``, run that phase here (in
    the fresh process the parent started), print its JSON and return None; else return the
    options of the parent run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--phase", choices=sorted(phases))
    parser.add_argument("--args", default="{}")
    parser.add_argument("--out", help="write all figures as JSON here")
    parser.add_argument("--keep", metavar="DIR", help="build the cache in DIR (new or empty) and keep it, to explore with "
                        "`plancache --dir DIR ls`; default: a temporary directory, removed at the end")  # fmt: skip
    opts = parser.parse_args()
    if opts.phase:
        print(json.dumps(phases[opts.phase](json.loads(opts.args))))
        return None
    return opts


def run_phase(script: str, phase: str, **args: Any) -> dict[str, Any]:
    """Run ``script --phase PHASE --args JSON`` in a fresh process; its last stdout line is JSON."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, script, "--phase", phase, "--args", json.dumps(args)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"phase {phase} failed with exit code {out.returncode}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - started
    print(f"  phase {phase:12} done in {result['process_seconds']:.1f} s (fresh process)", file=sys.stderr)
    return result


def gpu_ms(torch: Any, fn: Any, iters: int = 20, repeats: int = 7) -> float:
    """GPU milliseconds per call: median of ``repeats`` batches of ``iters`` calls, each
    queued behind a GPU sleep so host launch overhead does not pace the kernels."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues all iters meanwhile
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / iters)
    return statistics.median(times)


def host_us(torch: Any, launch: Any, launches: int = 200, loops: int = 25) -> float:
    """Host microseconds per call of ``launch`` in a tight loop: the median of ``loops``
    loops of ``launches`` calls. Each loop starts on an idle GPU and queues few enough
    launches that the GPU's launch queue (about a thousand entries) never fills, so the
    loop times the host's enqueueing even when the kernels are slower than it."""
    for _ in range(50):
        launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        started = time.perf_counter()
        for _ in range(launches):
            launch()
        times.append((time.perf_counter() - started) / launches * 1e6)
        torch.cuda.synchronize()  # outside the time: the next loop starts on an idle GPU
    return statistics.median(times)


def rel_error(out: Any, ref: Any) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def require_gpu(what: str) -> Any:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            f"{what} needs an NVIDIA GPU: it times cuDNN plan builds. Without one, "
            "`python -m pytest` runs the full cache on the CPU test backend."
        )
    return torch


def versions(torch: Any) -> dict[str, Any]:
    import cudnn

    return {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
            "cudnn_frontend": cudnn.__version__, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
