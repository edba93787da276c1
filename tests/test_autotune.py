"""The timing policy, on fake candidate sets whose build results and timings are set by
the test."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence

import pytest
import torch

from plancache import BuildError, BuildOptions, BuiltPlan, EngineChoice, TensorSpec, TimingPolicy
from plancache.autotuning.autotune import autotune
from plancache.autotuning.bounds import Bound
from plancache.autotuning.inputs import Refusal


class FakeCandidates:
    """``medians[i]``: what candidate i's careful runs measure; ``firsts[i]``: its single
    first run (defaults to the median); ``failing``: indices whose build fails;
    ``results[i]``: the value candidate i computes (default: all the same, 1.0);
    ``engines[i]``: its engine id (default: 100 + i; None: cuDNN could not say); ``names[i]``:
    its plan name (default: fake{i}); ``not_ready``: why nothing may be
    launched (what ``prepare`` says); ``compiling``: indices that compile at run time;
    ``build_seconds[i]``: how far building candidate i moves ``clock`` (nothing else does)."""

    def __init__(
        self,
        medians: Sequence[float],
        *,
        failing: Sequence[int] = (),
        firsts: Sequence[float] | None = None,
        results: Sequence[float] | None = None,
        engines: Sequence[int | None] | None = None,
        names: Sequence[str] | None = None,
        not_ready: str | None = None,
        compiling: Sequence[int] = (),
        build_seconds: Sequence[float] | None = None,
    ) -> None:
        self.medians = list(medians)
        self.firsts = list(firsts) if firsts is not None else list(medians)
        self.results = list(results) if results is not None else [1.0] * len(medians)
        self.engines = list(engines) if engines is not None else [100 + i for i in range(len(medians))]
        self.names = list(names) if names is not None else [f"fake{i}" for i in range(len(medians))]
        self.failing = set(failing)
        self.not_ready = not_ready
        self.compiling = set(compiling)
        self.build_seconds = list(build_seconds) if build_seconds is not None else [0.0] * len(medians)
        self.now = 0.0  # a clock that only builds move
        self.build_calls: list[int] = []
        self.time_calls: list[tuple[int, int]] = []
        self.output_calls: list[int] = []
        self.prepared = False
        self.streaming = False
        self.closed = False

    def __len__(self) -> int:
        return len(self.medians)

    def engine(self, index: int) -> EngineChoice:
        return EngineChoice(engine_id=self.engines[index], knobs={"k": index}, name=self.names[index])

    def clock(self) -> float:
        return self.now

    def build(self, index: int) -> None:
        self.build_calls.append(index)
        self.now += self.build_seconds[index]
        if index in self.failing:
            raise BuildError(f"engine {index} not supported", reason="not built")

    def prepare(self, budget: object) -> Refusal | None:
        self.prepared = self.not_ready is None
        return None if self.not_ready is None else Refusal(self.not_ready)

    def compiles(self, index: int) -> bool:
        return index in self.compiling

    def bounds(self) -> dict[int, Bound]:
        return {1: Bound(relative=0.0025, absolute=0.0)}  # 1% of the value, at FAR = 4 bounds

    @contextlib.contextmanager
    def streamed(self) -> Iterator[None]:
        assert self.prepared, "streamed before the inputs were prepared"
        self.streaming = True
        try:
            yield
        finally:
            self.streaming = False

    def outputs(self, index: int) -> dict[int, object]:
        assert self.prepared and index in self.build_calls and index not in self.failing
        assert self.streaming, "launched outside the candidates' own stream"
        self.output_calls.append(index)
        return {1: torch.full((4,), self.results[index])}

    def time(self, index: int, runs: int) -> list[float]:
        assert self.prepared and index in self.output_calls, "timed a candidate that was not checked"
        self.time_calls.append((index, runs))
        if runs == 1:
            return [self.firsts[index]]
        median = self.medians[index]
        # Spread around the median so that only the median, not the mean, equals it.
        return sorted([median * 0.5, median, median, median * 10.0][: max(runs, 1)] + [median] * max(0, runs - 4))

    def finish(self, index: int) -> BuiltPlan:
        return BuiltPlan(native=index, blob=b"", tensors=[], workspace_size=0, engine=self.engine(index))

    def close(self) -> None:
        self.closed = True

    def timed(self, runs: int | None = None) -> list[int]:
        return [i for i, r in self.time_calls if runs is None or r == runs]


def statuses(result: object) -> list[str]:
    return [r.status for r in result.candidates]  # type: ignore[attr-defined]


def test_heuristic_checks_its_choice_against_one_more_and_times_nothing() -> None:
    cands = FakeCandidates([5.0, 4.0, 3.0, 0.1, 0.1], failing=[0, 1])
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert result.winner == 2  # not 3, although 3 would be faster: heuristic order rules
    assert cands.build_calls == [0, 1, 2, 3]  # 3 only to compare 2 with
    assert cands.output_calls == [2, 3]
    assert cands.time_calls == []
    assert statuses(result) == ["failed", "failed", "chosen", "checked", "not_built"]
    assert result.candidates[0].error == "engine 0 not supported"
    assert result.timing["method"] == "not timed: heuristic policy" and result.timing["tuned"] == 2
    assert result.check["status"] == "agreed" and result.check["agreeing"] == 2
    assert result.policy == "heuristic"
    assert result.persist


def test_topk_builds_and_times_only_k() -> None:
    cands = FakeCandidates([5.0, 4.0, 3.0, 2.0, 1.0, 0.5])
    result = autotune(cands, BuildOptions(policy="topk", top_k=3), TimingPolicy(runs=5, prune_factor=100.0))
    assert cands.build_calls == [0, 1, 2]
    assert sorted(cands.timed(1)) == [0, 1, 2]
    assert sorted(cands.timed(5)) == [0, 1, 2]
    assert result.winner == 2
    assert statuses(result) == ["timed", "timed", "chosen", "not_built", "not_built", "not_built"]
    assert result.candidates[2].median_ms == 3.0
    assert len(result.candidates[2].times_ms) == 5
    assert result.timing["runs"] == 5 and result.timing["prune_factor"] == 100.0


def test_topk_counts_only_candidates_that_built() -> None:
    cands = FakeCandidates([5.0, 0.1, 4.0, 3.0, 1.0], failing=[1])
    result = autotune(cands, BuildOptions(policy="topk", top_k=3), TimingPolicy(prune_factor=100.0))
    assert cands.build_calls == [0, 1, 2, 3]  # 1 failed, so 3 is built to make K
    assert 1 not in cands.timed()
    assert result.winner == 3
    assert statuses(result) == ["timed", "failed", "timed", "chosen", "not_built"]


def test_failed_builds_are_skipped_and_reported() -> None:
    cands = FakeCandidates([2.0, 0.1, 1.0], failing=[1])  # the fastest one fails to build
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(prune_factor=100.0))
    assert result.winner == 2
    assert result.candidates[1].status == "failed"
    assert result.candidates[1].error == "engine 1 not supported"
    assert result.candidates[1].median_ms is None


def test_exhaustive_builds_every_candidate() -> None:
    cands = FakeCandidates([3.0, 2.0, 4.0, 1.5, 2.5, 6.0, 1.6, 9.0, 7.0, 1.7])
    result = autotune(cands, BuildOptions(policy="exhaustive", top_k=2), TimingPolicy(prune_factor=100.0))
    assert cands.build_calls == list(range(10))
    assert sorted(cands.timed(1)) == list(range(10))
    assert result.winner == 3


def test_slow_first_runs_are_pruned_before_careful_timing() -> None:
    # First runs: 1.0 is the best; 3.0 is exactly at the factor (kept), 3.5 and 40 beyond it.
    cands = FakeCandidates([1.0, 0.9, 0.8, 0.7], firsts=[1.0, 3.5, 3.0, 40.0])
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(runs=3, prune_factor=3.0))
    assert statuses(result) == ["timed", "pruned", "chosen", "pruned"]
    assert sorted(cands.timed(3)) == [0, 2]  # pruned candidates get no careful timing
    assert result.candidates[1].first_ms == 3.5
    assert result.candidates[1].median_ms is None
    assert result.winner == 2


def test_a_zero_first_run_is_the_best_not_missing() -> None:
    cands = FakeCandidates([0.0, 1.0, 2.0], firsts=[0.0, 1.0, 2.0])
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(prune_factor=3.0))
    assert statuses(result) == ["chosen", "pruned", "pruned"]


def test_the_lowest_median_wins_not_the_first_run() -> None:
    # Candidate 0 had the luckiest first run; candidate 1 has the lower median.
    cands = FakeCandidates([2.0, 1.0], firsts=[0.5, 1.2])
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(runs=7, prune_factor=3.0))
    assert result.winner == 1
    assert result.candidates[0].median_ms == 2.0 and result.candidates[1].median_ms == 1.0


def test_ties_go_to_the_lower_index() -> None:
    cands = FakeCandidates([3.0, 1.0, 1.0, 1.0])
    result = autotune(cands, BuildOptions(policy="exhaustive"))
    assert result.winner == 1
    assert statuses(result) == ["timed", "chosen", "timed", "timed"]


def test_a_single_buildable_candidate_is_chosen_without_timing() -> None:
    cands = FakeCandidates([1.0, 2.0, 3.0], failing=[0, 2])
    result = autotune(cands, BuildOptions(policy="topk", top_k=8))
    assert result.winner == 1
    assert cands.time_calls == []
    assert statuses(result) == ["failed", "chosen", "failed"]


def test_all_failed_is_a_build_error_with_every_reason() -> None:
    cands = FakeCandidates([1.0, 2.0, 3.0], failing=[0, 1, 2])
    with pytest.raises(BuildError) as info:
        autotune(cands, BuildOptions(policy="exhaustive"))
    assert info.value.reason == "all failed"
    message = str(info.value)
    assert "3 candidate plans" in message
    assert all(f"#{i}: engine {i} not supported" in message for i in range(3))
    assert isinstance(info.value, RuntimeError)


def test_no_candidates_is_a_build_error() -> None:
    with pytest.raises(BuildError) as info:
        autotune(FakeCandidates([]), BuildOptions())
    assert info.value.reason == "no candidates"


def test_reports_are_json_serializable() -> None:
    cands = FakeCandidates([1.0, 3.0, 0.5], failing=[0])
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(runs=3))
    reports = json.loads(json.dumps([r.to_dict() for r in result.candidates]))
    assert [r["engine"]["engine_id"] for r in reports] == [100, 101, 102]
    assert reports[2]["status"] == "chosen" and reports[2]["times_ms"]
    assert result.autotune_seconds >= 0
    json.dumps(result.timing)


# ------------------------------------------------------------------ checking candidates


def test_a_wrong_candidate_that_is_the_fastest_is_rejected_and_never_chosen() -> None:
    for policy in ("topk", "exhaustive"):
        cands = FakeCandidates([1.0, 2.0, 0.01, 3.0], results=[1.0, 1.0, 1.5, 1.0])
        result = autotune(cands, BuildOptions(policy=policy, top_k=4), TimingPolicy(prune_factor=1000.0))
        assert result.winner == 0
        assert result.candidates[2].status == "rejected"
        # |1.5 - 1| against a bound of 0.0025 * 1.5, on each of its 4 elements
        assert result.candidates[2].deviation == pytest.approx(0.5 / (0.0025 * 1.5))
        assert result.candidates[2].outside == 4 and result.candidates[2].fraction == 1.0
        assert "disagrees with the 3 candidates that agree" in (result.candidates[2].error or "")
        assert 2 not in cands.timed()
        assert result.check["rejected"] == [
            {"index": 2, "engine": "fake2", "outside": 4, "fraction": 1.0, "worst": pytest.approx(0.5 / (0.0025 * 1.5))}
        ]
        assert result.persist


def test_the_heuristic_first_choice_when_wrong_is_outvoted() -> None:
    cands = FakeCandidates([1.0] * 6, results=[7.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert cands.output_calls == [0, 1, 2]  # 0 and 1 disagree: one more makes a majority
    assert result.winner == 1
    assert statuses(result)[:3] == ["rejected", "chosen", "checked"]


def test_knob_variants_of_one_wrong_engine_are_no_majority() -> None:
    # 0 and 1 are one engine with two knob settings, both wrong: they agree with each other,
    # two against one, and are still no majority, since they are one engine.
    cands = FakeCandidates([1.0] * 3, results=[7.0, 7.0, 1.0], engines=[0, 0, 1])
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert cands.output_calls == [0, 2, 1]  # another engine is asked before a knob variant
    assert result.check["status"] == "no majority" and not result.persist


def test_a_wrong_first_choice_is_outvoted_by_other_engines_before_its_variants_are_asked() -> None:
    cands = FakeCandidates([1.0] * 5, results=[7.0, 7.0, 1.0, 1.0, 1.0], engines=[0, 0, 1, 2, 3])
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert result.winner == 2 and cands.output_calls == [0, 2, 3]
    assert {r["index"] for r in result.check["rejected"]} == {0}


def test_an_unknown_engine_id_is_read_from_the_plan_name() -> None:
    """cuDNN could not give the engine ids (``get_engine_and_knobs_at_index`` raised): every
    candidate fell into one engine, so eng0 and its knob variant, both wrong, agreed as
    that one engine's check and were stored."""
    cands = FakeCandidates([1.0] * 4, results=[7.0, 7.0, 1.0, 1.0], engines=[None] * 4,
                           names=["eng0_k2=1", "eng0_k24=0", "eng2_k3=0", "eng31"])  # fmt: skip
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert result.winner == 2 and cands.output_calls == [0, 2, 3]


def test_a_lone_candidate_is_stored_unchecked_only_when_no_other_runs() -> None:
    """Twelve builds failing after the first launch ended the check with one candidate
    launched and more untried, and that one (wrong) was stored as "single"."""
    cands = FakeCandidates([1.0] * 16, results=[7.0] + [1.0] * 15, failing=range(1, 13))
    result = autotune(cands, BuildOptions(policy="heuristic"))
    assert 13 in cands.output_calls and result.check["status"] != "single"
    assert not (result.persist and result.winner == 0)


def test_topk_launches_more_than_k_until_a_majority_stands() -> None:
    cands = FakeCandidates([1.0] * 6, results=[7.0, 7.0, 1.0, 1.0, 1.0, 1.0], engines=[0, 0, 1, 2, 3, 4])
    result = autotune(cands, BuildOptions(policy="topk", top_k=4), TimingPolicy(prune_factor=1000.0))
    # other engines before knob variants for the check, then the heuristics' order up to
    # four; 2 against 2 after four: one more
    assert cands.output_calls == [0, 2, 3, 1, 4]
    assert result.winner == 2
    assert sorted(cands.timed(1)) == [2, 3, 4]


def test_no_majority_gives_the_frontend_choice_not_to_be_persisted() -> None:
    cands = FakeCandidates([2.0, 1.0], results=[1.0, 2.0])
    result = autotune(cands, BuildOptions(policy="exhaustive"))
    assert not result.persist
    assert result.winner == 0  # the first that builds: what the frontend itself runs
    assert result.check["status"] == "no majority"
    assert result.check["groups"] == [["fake0"], ["fake1"]]
    assert result.check["spread"] == {"outside": 4, "fraction": 1.0, "worst": pytest.approx(1 / (0.0025 * 2))}  # |2 - 1| / bound
    assert cands.time_calls == []


def test_nothing_is_launched_when_the_inputs_cannot_be_made_safe() -> None:
    cands = FakeCandidates([2.0, 1.0, 0.5], failing=[0], not_ready="plancache does not know the role of tensor uid 7")
    result = autotune(cands, BuildOptions(policy="exhaustive"))
    assert result.winner == 1  # the heuristics' order, as the frontend would
    assert cands.output_calls == [] and cands.time_calls == []
    assert result.check == {"status": "not run", "rule": 2, "why": "plancache does not know the role of tensor uid 7"}
    assert result.timing["method"] == "not timed: plancache does not know the role of tensor uid 7"
    assert result.persist


def test_non_finite_differences_are_rejected_and_stored_as_json() -> None:
    cands = FakeCandidates([1.0, 1.0, 1.0], results=[1.0, float("nan"), 1.0])
    result = autotune(cands, BuildOptions(policy="exhaustive"))
    assert result.candidates[1].status == "rejected" and result.candidates[1].deviation is None
    assert "NaN" in (result.candidates[1].error or "") and result.candidates[1].outside == 4
    json.dumps(result.check, allow_nan=False)


# ------------------------------------------------------------------ the miss budget


def test_tuning_stops_at_the_budget_and_says_how_far_it_got() -> None:
    # The first candidate (the frontend's own cost) takes 1 s; each other 0.3 s; a budget
    # of 1.5 leaves 0.5 s: the check's second candidate, one more for tuning, then stop.
    cands = FakeCandidates([3.0, 2.0, 1.0, 0.5, 0.1], build_seconds=[1.0, 0.3, 0.3, 0.3, 0.3])
    result = autotune(cands, BuildOptions(policy="topk", top_k=4), TimingPolicy(budget=1.5, prune_factor=100.0), started=0.0,
                      clock=cands.clock)  # fmt: skip
    assert cands.build_calls == [0, 1, 2]
    assert result.timing["tuned"] == 3 and result.timing["candidates"] == 5 and result.timing["stopped"] == "budget"
    assert result.timing["reference_seconds"] == 1.0
    assert result.winner == 2 and result.persist


def test_the_check_launches_what_it_needs_past_the_budget() -> None:
    # The first two disagree: a third decides, however little budget is left.
    cands = FakeCandidates([1.0, 1.0, 1.0], results=[2.0, 1.0, 1.0], build_seconds=[1.0, 5.0, 5.0])
    result = autotune(cands, BuildOptions(policy="topk"), TimingPolicy(budget=1.0), started=0.0, clock=cands.clock)
    assert cands.build_calls == [0, 1, 2]
    assert result.check["status"] == "agreed" and result.winner in (1, 2) and result.persist
    assert result.candidates[0].status == "rejected"


def test_the_check_asks_another_engine_that_compiles_nothing_first() -> None:
    cands = FakeCandidates([1.0] * 4, engines=[7, 7, 8, 9], compiling=[2])
    result = autotune(cands, BuildOptions(policy="heuristic"), TimingPolicy(budget=1.5), started=0.0, clock=cands.clock)
    assert cands.build_calls == [0, 3]  # not 1 (the same engine), not 2 (runtime compiled)
    assert result.check["status"] == "agreed" and result.winner == 0


def test_tuning_passes_over_a_candidate_whose_build_would_outlast_the_budget() -> None:
    # As matmul 8x1024x1024x1024 on an H100: planning 71 ms, the heuristics' first plan built
    # in 0.2 ms, the check's other engine compiled at run time in 31 ms; the next candidate
    # compiles too (217 ms), past the budget. A runtime compilation is expected to take as
    # long as the longest seen in the miss; a build that compiles nothing, no time.
    cands = FakeCandidates([1.0, 0.9, 0.8, 0.7, 0.6], engines=[7, 8, 9, 7, 7], compiling=[1, 2],
                           build_seconds=[0.01, 0.4, 3.0, 0.01, 0.01])  # fmt: skip
    result = autotune(cands, BuildOptions(policy="topk", top_k=3), TimingPolicy(budget=1.5, prune_factor=100.0), started=-1.0,
                      clock=cands.clock)  # fmt: skip
    assert cands.build_calls == [0, 1, 3]  # the check (0 and 1), then 3, not 2
    assert result.candidates[2].status == "not_built" and result.timing["stopped"] == "budget"
    assert result.winner == 3 and result.timing["tuned"] == 3


def test_a_runtime_compilation_not_seen_yet_is_expected_to_cost_the_frontend_s_whole_build() -> None:
    cands = FakeCandidates([1.0, 0.9, 0.8], engines=[7, 8, 9], compiling=[2], build_seconds=[0.01, 0.01, 0.01])
    tight = autotune(cands, BuildOptions(policy="topk", top_k=3), TimingPolicy(budget=1.5), started=-1.0, clock=cands.clock)
    assert cands.build_calls == [0, 1] and tight.timing["stopped"] == "budget"
    cands = FakeCandidates([1.0, 0.9, 0.8], engines=[7, 8, 9], compiling=[2], build_seconds=[0.01, 0.01, 0.01])
    ample = autotune(cands, BuildOptions(policy="topk", top_k=3), TimingPolicy(budget=3.0), started=-1.0, clock=cands.clock)
    assert cands.build_calls == [0, 1, 2] and "stopped" not in ample.timing


def test_a_graph_of_one_engine_is_checked_by_two_of_its_variants_not_all() -> None:
    cands = FakeCandidates([1.0] * 30, engines=[5] * 30)
    result = autotune(cands, BuildOptions(policy="heuristic"), TimingPolicy(budget=1.5), started=0.0, clock=cands.clock)
    assert cands.build_calls == [0, 1]
    assert result.check["status"] == "agreed" and result.check["compared"] == 2


def test_without_a_budget_every_candidate_the_policy_wants_is_tuned() -> None:
    cands = FakeCandidates([3.0, 2.0, 1.0, 0.5, 0.1], build_seconds=[1.0, 0.3, 0.3, 0.3, 0.3])
    result = autotune(cands, BuildOptions(policy="exhaustive"), TimingPolicy(budget=math.inf, prune_factor=100.0), started=0.0,
                      clock=cands.clock)  # fmt: skip
    assert cands.build_calls == [0, 1, 2, 3, 4] and result.winner == 4
    assert "stopped" not in result.timing and result.timing["tuned"] == 5


def test_the_budget_is_read_from_the_environment() -> None:
    from plancache.config import AUTOTUNE_BUDGET, ConfigError

    assert AUTOTUNE_BUDGET.from_env({}) == 1.5
    assert AUTOTUNE_BUDGET.from_env({"PLANCACHE_AUTOTUNE_BUDGET": " 2 "}) == 2.0
    assert AUTOTUNE_BUDGET.from_env({"PLANCACHE_AUTOTUNE_BUDGET": "off"}) == math.inf
    for bad in ("0.5", "nan", "abc", "-1"):
        with pytest.raises(ConfigError, match="PLANCACHE_AUTOTUNE_BUDGET"):
            AUTOTUNE_BUDGET.from_env({"PLANCACHE_AUTOTUNE_BUDGET": bad})


def test_attention_with_the_io_type_left_unset_is_bounded_as_with_it_set() -> None:
    """A graph that leaves io_data_type unset, its tensors carrying bf16 themselves: the
    bound lost the rounding of attention's probabilities to bf16 (0.0078 became 2.7e-6),
    so two right implementations were judged apart and nothing was stored."""
    import cudnn

    from plancache.autotuning.bounds import bounds
    from plancache.key import describe

    dt = cudnn.data_type
    dims, strides = [1, 2, 64, 32], [2 * 64 * 32, 64 * 32, 32, 1]

    def description(io_set: bool) -> dict[str, object]:
        g = cudnn.pygraph(intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          **({"io_data_type": dt.BFLOAT16} if io_set else {}))  # fmt: skip
        q, k, v = (g.tensor(name=n, dim=dims, stride=strides, data_type=dt.BFLOAT16, uid=i) for i, n in enumerate("qkv", 1))
        o, _ = g.sdpa(q=q, k=k, v=v, is_inference=True, attn_scale=32**-0.5, use_causal_mask=True)
        o.set_output(True).set_uid(4).set_dim(dims).set_stride(strides).set_data_type(dt.BFLOAT16)
        return describe(g)

    specs = [TensorSpec(uid=i, name=n, dims=tuple(dims), strides=tuple(strides), dtype="data_type.BFLOAT16", is_output=i == 4)
             for i, n in enumerate("qkvo", 1)]  # fmt: skip
    pack = {i: torch.rand(dims).to(torch.bfloat16) for i in (1, 2, 3)}
    assert bounds(description(False), specs, pack)[4] == bounds(description(True), specs, pack)[4]
