"""Every stored plan loads back: a plan built on a miss is stored only after it was loaded
back from its blob (``Backend.load_back``, or the lookup's own ``load``); one that cannot be
is used by the process that built it, never stored, and counted in ``stats`` with why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from graphs import ConvBiasRelu, assert_runs_correctly

from plancache import PlanCache
from plancache.testing import CpuTestBackend

MakeCache = Callable[..., PlanCache]


def test_a_plan_that_cannot_be_loaded_back_runs_but_is_never_stored(make_cache: MakeCache,
                                                                    caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    spec = ConvBiasRelu()
    cache = make_cache(backend=CpuTestBackend(unloadable=range(4)))
    plan = cache.get(spec.graph())
    assert plan.source == "built"
    assert_runs_correctly(plan, spec)  # the process that built it runs it
    assert cache.store.keys() == [] and cache.counters["unloadable"] == 1
    refused = cache.stats()["unstored_plans"][plan.key]
    assert refused["graph"].startswith("CONV_FPROP")
    assert refused["why"] == "unloadable"
    assert refused["reason"] == (
        "it could not be loaded back from its blob (NativeError: cudnnBackendFinalize(EXECUTION_PLAN) failed: "
        "CUDNN_STATUS_NOT_SUPPORTED (3000): the test plan of an unloadable= candidate)"
    )
    assert plan.native.__class__.__name__ == "FrontendGraph", "runs as built, through the frontend's path"
    assert [r.message for r in caplog.records].count(
        f"plancache: not storing the plan of {plan.key[:12]} ({refused['graph']}): {refused['reason']}"
    ) == 1
    again = make_cache(backend=CpuTestBackend(unloadable=range(4)))  # a new process: nothing to hit, it builds again
    assert again.get(spec.graph()).source == "built" and again.counters["misses"] == 1


def test_the_lookups_own_load_decides_what_is_stored(make_cache: MakeCache) -> None:
    """``PlanCache.get(load=...)``: a hit is loaded by it (once), and a miss is stored only
    once it loaded the new plan back."""
    spec = ConvBiasRelu()
    calls: list[bytes] = []

    def refusing(blob: bytes, tensors: Any, device: int) -> Any:
        calls.append(blob)
        raise RuntimeError("this caller cannot load it")

    cache = make_cache()
    plan = cache.get(spec.graph(), load=refusing)
    assert len(calls) == 1 and cache.store.keys() == []
    assert "RuntimeError: this caller cannot load it" in cache.stats()["unstored_plans"][plan.key]["reason"]
    stored = make_cache().get(spec.graph())  # the backend's own load: stored
    fresh = make_cache()
    loaded: list[Any] = []

    def loading(blob: bytes, tensors: Any, device: int) -> Any:
        native = fresh.backend.load(blob, tensors, device)
        loaded.append(native)
        return native

    hit = fresh.get(spec.graph(), load=loading)
    assert hit.source == "loaded" and hit.key == stored.key and loaded == [hit.native]
    assert_runs_correctly(hit, spec)
