"""The candidate plumbing a GPU runs, run on the CPU test backend: ``autotuning.candidates``
is the one code path of both backends (the library's plans differ, nothing else), so what a
miss does on the device is checked here launch by launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from graphs import ConvBiasRelu

import plancache
from plancache import PlanCache
from plancache.testing import CpuTestBackend
from plancache.testing.candidates import candidate_workspace
from plancache.testing.library import HANDLE_BYTES


class Recording(CpuTestBackend):
    """Keeps, for each candidate launch, its stream, the thread's current stream then, and
    its workspace's size."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.launched: list[tuple[int | None, int, int | None]] = []

    def run(self, description: Any, tensors: Any, pack: Any, *, workspace: Any = None, stream: int | None = None,
            took: float = 0.0, **options: Any) -> None:  # fmt: skip
        if took:  # a candidate's launch (a stored plan's takes no time of the test device's clock)
            self.launched.append((stream, self.cuda.current_stream(), None if workspace is None else workspace.numel()))
        super().run(description, tensors, pack, workspace=workspace, stream=stream, took=took, **options)


def test_every_candidate_launch_is_on_plancaches_stream_with_a_workspace_of_its_own(tmp_path: Path) -> None:
    backend = Recording(candidates=4)
    cache = PlanCache(tmp_path, backend=backend, auto_prime=False)
    graph = ConvBiasRelu().graph()
    program = backend.cuda.new_stream(blocking=False)
    with backend.cuda.stream(program):
        plan = cache.get(graph, options=plancache.BuildOptions(policy="exhaustive"))
    assert plan.source == "built"
    own = backend.own_stream(0)
    assert backend.launched, "no candidate was launched"
    tensors = backend.plans(ConvBiasRelu().graph(), plancache.BuildOptions()).tensors
    for stream, current, workspace in backend.launched:
        assert stream == current == own, (
            f"a launch on stream {stream} (current {current}); plancache's is {own}, the program's {program}"
        )
        assert workspace == candidate_workspace(backend, None, tensors), "a candidate's launch without the workspace it asked for"
    assert backend.cuda.allocated == HANDLE_BYTES, "what the miss allocated was not given back (all but the handle's buffer)"


def test_candidates_are_timed_on_the_device_clock_and_the_fastest_right_one_wins(tmp_path: Path) -> None:
    backend = CpuTestBackend(candidates=4)
    cache = PlanCache(tmp_path, backend=backend, auto_prime=False)
    graph = ConvBiasRelu().graph()
    plans = backend.plans(ConvBiasRelu().graph(), plancache.BuildOptions())
    plan = cache.get(graph, options=plancache.BuildOptions(policy="exhaustive"))
    entry = cache.store.get(plan.key)
    firsts = {c["index"]: c["first_ms"] for c in entry.candidates}
    for index, first in firsts.items():  # a launch takes its simulated time, within the 0.1-0.2% jitter
        assert first == pytest.approx(plans.simulated_ms(index), rel=3e-3), entry.candidates
    fastest = min(firsts, key=plans.simulated_ms)
    chosen = next(c for c in entry.candidates if c["status"] == "chosen")
    assert chosen["index"] == fastest and chosen["median_ms"] == pytest.approx(plans.simulated_ms(fastest), rel=3e-3)


def test_a_workspace_over_what_the_budget_left_fails_that_candidate_alone(tmp_path: Path) -> None:
    backend = CpuTestBackend(candidates=4, extra_workspace={0: 1 << 40})
    cache = PlanCache(tmp_path, backend=backend, auto_prime=False)
    plan = cache.get(ConvBiasRelu().graph(), options=plancache.BuildOptions(policy="exhaustive"))
    entry = cache.store.get(plan.key)
    first = next(c for c in entry.candidates if c["index"] == 0)
    assert "over what is left of the timing budget" in (first.get("error") or ""), first
    assert plan.engine is not None and plan.engine.name != "test_engine_0"
    assert backend.cuda.peak < 1 << 40, "the workspace was allocated before it was checked against the budget"
