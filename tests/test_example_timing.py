"""examples/resnet_attention.py times only the steps, and its PyTorch eager model (the
comparison it prints beside plancache) computes the same thing as the reference."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet_attention.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("resnet_attention_timing", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.set_sizes(n=1)  # keep the CPU run quick
    return module


def test_eager_model_matches_the_reference_on_the_cpu() -> None:
    example = load_example()
    w = example.weights(torch, device="cpu")
    x = torch.randn(1, 64, 56, 56).to(torch.bfloat16).to(memory_format=torch.channels_last)
    out = example.forward_eager(torch, w, x)
    ref = example.forward_pytorch(torch, w, x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert float((out.float() - ref).norm() / ref.norm()) <= example.TOLERANCE


class FakeCuda:
    """Records the order of steps and synchronizations."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("sync")


def test_each_timed_step_is_synchronized_and_timed_alone() -> None:
    example = load_example()
    log: list[str] = []
    fake_torch = type("FakeTorch", (), {"cuda": FakeCuda(log)})()

    def step() -> None:
        log.append("step")
        time.sleep(0.002)

    times = example.step_times_ms(fake_torch, step, steps=5, warmup=2)
    assert len(times) == 5 and all(t >= 2.0 for t in times) and all(t < 200 for t in times)
    assert log == ["step", "step", "sync"] + ["step", "sync"] * 5  # warm-up untimed; each timed step waits for the GPU
    assert example.STEPS >= 10 and example.WARMUP_STEPS >= 1
