#!/usr/bin/env python3
"""Prewarm on one GPU against prewarm on every local GPU, from the command line.

Writes a manifest of GRAPHS graphs (the start-up suite, the example model's layers and a
few more shapes), then times, each in a fresh empty cache directory and as a whole
process (imports, workers, builds):

  one GPU     plancache prewarm MANIFEST
  all GPUs    plancache prewarm MANIFEST --devices all

and checks that both built the same keys. Needs two or more NVIDIA GPUs of one model.
``--policy`` picks the build policy of both runs (default: the command's, topk);
``--out FILE`` writes the figures as JSON.

    python scripts/bench_prewarm_devices.py [--policy exhaustive] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.6  # all-GPU wall time / one-GPU wall time on two GPUs

GRAPHS: list[tuple[str, dict[str, Any]]] = [
    # the start-up suite
    ("conv_bias_act", {"n": 32, "c": 128, "h": 56, "w": 56, "k": 256}),
    ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    ("conv_bias_act", {"n": 16, "c": 256, "h": 28, "w": 28, "k": 256, "bias": False, "act": None}),
    ("matmul_bias_act", {"b": 16, "m": 512, "k": 1024, "n": 512}),
    ("matmul_bias_act", {"b": 8, "m": 1024, "k": 1024, "n": 1024, "bias": False, "act": None}),
    ("sdpa", {"b": 4, "h": 16, "s": 1024, "d": 64, "causal": True}),
    ("sdpa", {"b": 2, "h": 32, "s": 2048, "d": 128, "causal": False}),
    # the example model's layers
    ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 128, "stride": 2}),
    ("conv_bias_act", {"n": 8, "c": 128, "h": 28, "w": 28, "k": 128}),
    ("matmul_bias_act", {"b": 8, "m": 784, "k": 128, "n": 128, "act": None}),
    ("matmul_bias_act", {"b": 8, "m": 784, "k": 128, "n": 128, "act": "relu"}),
    ("sdpa", {"b": 8, "h": 2, "s": 784, "d": 64, "causal": False}),
    # more shapes of a model of the same kinds
    ("conv_bias_act", {"n": 16, "c": 128, "h": 28, "w": 28, "k": 256, "stride": 2}),
    ("matmul_bias_act", {"b": 4, "m": 2048, "k": 1024, "n": 4096, "act": "gelu"}),
    ("sdpa", {"b": 4, "h": 8, "s": 4096, "d": 64, "causal": True}),
    ("sdpa", {"b": 16, "h": 12, "s": 512, "d": 64, "causal": False}),
]


def prewarm(directory: Path, manifest: Path, policy: str | None, devices: str | None) -> dict[str, Any]:
    args = [sys.executable, "-m", "plancache", "--dir", str(directory), "prewarm", str(manifest), "--json", "--no-progress"]
    if policy:
        args += ["--policy", policy]
    if devices:
        args += ["--devices", devices]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"bench_prewarm_devices: {' '.join(args[2:])} exited {done.returncode}")
    report = json.loads(done.stdout)
    return {"wall_s": wall, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=["topk", "exhaustive", "heuristic"], default=None)
    parser.add_argument("--out", help="write the figures as JSON")
    opts = parser.parse_args()
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        raise SystemExit(f"bench_prewarm_devices: needs two or more NVIDIA GPUs; this machine has {count}")
    root = benchlib.scratch("plancache-prewarm-devices-")
    manifest = root / "manifest.json"
    entries = [{"name": f"{name} {i}", "template": name, "params": params} for i, (name, params) in enumerate(GRAPHS)]
    manifest.write_text(json.dumps({"version": 1, "entries": entries}, indent=1))
    one = prewarm(root / "one", manifest, opts.policy, None)
    every = prewarm(root / "all", manifest, opts.policy, "all")
    keys_one = sorted(r["key"] for r in one["report"]["entries"])
    keys_all = sorted(r["key"] for r in every["report"]["entries"])
    per_device: dict[str, int] = {}
    for record in every["report"]["entries"]:
        per_device[str(record.get("device"))] = per_device.get(str(record.get("device")), 0) + 1
    ratio = every["wall_s"] / one["wall_s"]
    same = keys_one == keys_all and None not in keys_one
    print(f"\nprewarm of {len(GRAPHS)} graphs (policy {opts.policy or 'topk'}), whole processes, fresh cache directories,"
          f" {torch.cuda.get_device_name(0)} x{count}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")  # fmt: skip
    print(f"{'run':12} {'wall s':>8} {'built':>6} {'failed':>7}  entries per device")
    for label, run in (("one GPU", one), ("all GPUs", every)):
        report = run["report"]
        shown = per_device if run is every else {str(r.get("device", 0)): len(report["entries"]) for r in report["entries"][:1]}
        print(f"{label:12} {run['wall_s']:8.1f} {report['built']:6d} {report['failed']:7d}  {shown}")
    print(f"all GPUs / one GPU: {ratio:.2f}x (target <= {TARGET}x on two GPUs: {ratio <= TARGET}); "
          f"identical keys: {same} ({len(set(keys_one))} distinct)")  # fmt: skip
    if opts.out:
        Path(opts.out).write_text(json.dumps({"one": one, "all": every, "ratio": ratio, "identical_keys": same,
                                              "graphs": len(GRAPHS), "devices": count}, indent=2))  # fmt: skip
    if not same or one["report"]["failed"] or every["report"]["failed"]:
        raise SystemExit("bench_prewarm_devices: the runs failed or built different keys")


if __name__ == "__main__":
    main()
