"""The README's quick start runs as written (on the CPU test backend here; tests/test_gpu.py
runs it on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2, "the README lost its quick start"
    return blocks[0] + "\n" + blocks[1]


def run_quick_start(device: str, cache_factory: str) -> dict[str, Any]:
    code = quick_start_code().replace('device="cuda"', f'device="{device}"')
    code = code.replace("plancache.PlanCache()", cache_factory)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_quick_start_runs_and_matches_pytorch(tmp_path: Path) -> None:
    namespace = run_quick_start(
        "cpu",
        f"__import__('plancache').PlanCache({str(tmp_path)!r}, backend=__import__('plancache.testing').testing.CpuTestBackend())",
    )
    x, w, b, y = (namespace[n] for n in ("x", "w", "b", "y"))
    ref = torch.relu(torch.nn.functional.conv2d(x.float(), w.float(), padding=1) + b.float())
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
    assert namespace["plan"].source == "built"
