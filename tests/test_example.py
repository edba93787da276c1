"""The example model runs through plancache on the CPU test backend and matches PyTorch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from plancache.testing import CpuTestBackend

pytestmark = pytest.mark.slow  # the whole example model, end to end

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet_attention.py"


def load_example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("resnet_attention", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["resnet_attention"] = module
    spec.loader.exec_module(module)
    return module


def test_example_model_matches_pytorch_and_reuses_plans(tmp_path: Path) -> None:
    example = load_example()
    example.set_sizes(n=1)  # keep the CPU reference quick
    w = example.weights(torch, device="cpu")
    x = torch.randn(1, 64, 56, 56).to(torch.bfloat16).to(memory_format=torch.channels_last)
    plans = example.CachedPlans(str(tmp_path / "cache"), backend=CpuTestBackend())
    out = example.forward(plans, torch, w, x)
    ref = example.forward_pytorch(torch, w, x)
    assert float((out.float() - ref).norm() / ref.norm()) <= example.TOLERANCE
    # six distinct graphs: the Q, K and V projections share one plan
    assert plans.cache.counters["builds"] == 6
    assert plans.cache.counters["memory_hits"] == 0
    plans.cache.close()
