"""Which candidate to keep: checked against the others, then timed. No GPU library here.

A miss builds candidates in the heuristics' order through the ``CandidateSet`` seam and
launches each once on the same inputs (``prepare``: the caller's tensors, else synthetic
ones valid for each tensor's role). Their outputs are compared (``engines.consensus``):
a candidate outside the majority is rejected, with the error measured, and never chosen.
A majority needs at least two candidates of two different engines (knob variants of one
engine tend to share its mistakes) and more than half of those compared; candidates are
added in order until one forms, or none are left.

Then, per policy: ``heuristic`` keeps the first candidate of the majority (it launches two
or more, times none); ``topk`` and ``exhaustive`` time the majority (``topk`` launches at
least ``top_k`` candidates, ``exhaustive`` all) and keep the fastest: one timed run each
drops the hopeless (on an H200 the slowest were 1,400x slower than the best), the rest get
the median of several runs; ties go to the lower index.

Where no majority forms among two or more, the result is the frontend's own choice (the
first candidate that builds), marked not to be persisted. Where nothing may be launched
(a tensor of unknown role, the memory budget, a capture), it is the same choice, persisted
and recorded as not checked, with the reason: exactly what the frontend alone would run.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from ..config import AUTOTUNE_MEMORY, MemoryBudget
from ..errors import BuildError
from ..key import BuildOptions
from .backend import CandidateSet
from .consensus import Consensus, Group

__all__ = ["AutotuneResult", "CandidateReport", "TimingPolicy", "autotune"]

log = logging.getLogger("plancache")


@dataclass(frozen=True)
class TimingPolicy:
    """How candidates are timed. Not part of the key: it changes how carefully the plan
    was chosen, not what a plan computes. Recorded with every entry."""

    runs: int = 7  # timed runs per surviving candidate (after one warm-up)
    prune_factor: float = 3.0  # drop candidates slower than this many times the best first run
    memory: MemoryBudget = field(default_factory=AUTOTUNE_MEMORY.from_env)

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "prune_factor": self.prune_factor, "memory": self.memory.describe(),
                "method": "CUDA events around each run after 1 warm-up; median"}  # fmt: skip


@dataclass
class CandidateReport:
    """What happened to one candidate: chosen | timed | pruned | checked (agreed, not timed)
    | rejected (disagreed with the majority) | failed | not_built."""

    index: int
    engine: dict[str, Any]
    status: str
    first_ms: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    error: str | None = None
    deviation: float | None = None  # error of its outputs against the majority's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AutotuneResult:
    winner: int
    candidates: list[CandidateReport]
    policy: str
    autotune_seconds: float
    timing: dict[str, Any]
    check: dict[str, Any]  # how the choice was checked; stored with the entry
    persist: bool = True  # False: no majority, the frontend's choice for this process only


def autotune(cands: CandidateSet, options: BuildOptions, timing: TimingPolicy | None = None) -> AutotuneResult:
    """Pick a checked candidate under ``options.policy``; raises ``BuildError`` when none builds."""
    timing = timing or TimingPolicy()
    started = time.perf_counter()
    count = len(cands)
    if count == 0:
        raise BuildError("cuDNN offered no candidate plan for this graph", reason="no candidates")
    reports = [CandidateReport(index=i, engine=cands.engine(i).to_dict(), status="not_built") for i in range(count)]
    why = cands.prepare(timing.memory)
    if why is not None:
        winner = _first_buildable(cands, reports)
        check = {"status": "not run", "why": why}
        return AutotuneResult(
            winner, reports, options.policy, time.perf_counter() - started, {"method": f"not timed: {why}"}, check
        )
    want = {"heuristic": 2, "topk": max(2, options.top_k), "exhaustive": count}[options.policy]
    consensus = Consensus(cands.tolerance())
    launched = _launch_until_majority(cands, reports, consensus, want)
    # Built: launched, or failed only at launch. The frontend's own choice is the first.
    built = [r.index for r in reports if r.status == "checked" or (r.error or "").startswith("launch")]
    if not built:
        _none_built(reports, count)
    if not launched:
        raise BuildError("every candidate that built failed to run", reason="all failed")
    majority = _majority(consensus, launched, reports)
    if majority is None:
        return _no_majority(consensus, reports, options, started, launched[0] if len(launched) == 1 else built[0])
    check = _check_record(consensus, majority, reports)
    if options.policy == "heuristic":
        winner = min(majority.members)
        reports[winner].status = "chosen"
        return AutotuneResult(winner, reports, options.policy, time.perf_counter() - started,
                              {"method": "not timed: heuristic policy"}, check)  # fmt: skip
    winner = _time_majority(cands, reports, sorted(majority.members), timing)
    reports[winner].status = "chosen"
    elapsed = time.perf_counter() - started
    log.debug("plancache: autotuned %d/%d candidates (%d rejected) in %.3f s; chose #%d (%.4f ms)", len(launched), count,
              len(check["rejected"]), elapsed, winner, reports[winner].median_ms or 0.0)  # fmt: skip
    return AutotuneResult(winner, reports, options.policy, elapsed, timing.to_dict(), check)


def _first_buildable(cands: CandidateSet, reports: list[CandidateReport]) -> int:
    for report in reports:
        error = cands.build(report.index)
        if error is None:
            report.status = "chosen"
            return report.index
        report.status, report.error = "failed", error
    _none_built(reports, len(reports))


def _none_built(reports: list[CandidateReport], count: int) -> NoReturn:
    reasons = "; ".join(f"#{r.index}: {r.error}" for r in reports if r.error)[:2000]
    raise BuildError(f"none of the {count} candidate plans could be built: {reasons}", reason="all failed")


def _launch_until_majority(cands: CandidateSet, reports: list[CandidateReport], consensus: Consensus, want: int) -> list[int]:
    """Build and launch candidates in order until ``want`` were compared and a majority
    stands, or none are left; returns the candidates launched."""
    launched: list[int] = []
    for report in reports:
        if len(launched) >= want and _majority(consensus, launched, reports) is not None:
            break
        error = cands.build(report.index)
        if error is not None:
            report.status, report.error = "failed", error
            continue
        try:
            outputs = cands.outputs(report.index)
        except Exception as exc:  # one candidate that cannot launch is dropped, not the miss
            _launch_failed(report, exc)
            continue
        consensus.add(report.index, outputs)
        report.status = "checked"
        launched.append(report.index)
    return launched


def _majority(consensus: Consensus, launched: list[int], reports: list[CandidateReport]) -> Group | None:
    """The majority group, when it holds two engines, or when every candidate launched agreed
    and there is no other candidate left to ask (knob variants of one engine only)."""
    group = consensus.majority()
    if group is None:
        return None
    engines = {reports[i].engine.get("engine_id", i) for i in group.members}
    if len(engines) >= 2:
        return group
    untried = any(r.status == "not_built" for r in reports)
    return group if not untried and len(consensus.groups) == 1 else None


def _launch_failed(report: CandidateReport, exc: Exception) -> None:
    report.status = "failed"
    report.error = f"launch: {type(exc).__name__}: {str(exc)[:300]}"
    log.debug("plancache: candidate #%d failed to launch: %s", report.index, exc)


def _check_record(consensus: Consensus, majority: Group, reports: list[CandidateReport]) -> dict[str, Any]:
    """Mark the outliers rejected and say how the choice was checked (stored with the entry)."""
    rejected = []
    for index, error in sorted(consensus.outliers(majority).items()):
        report = reports[index]
        report.status, report.deviation = "rejected", _number(error)
        measured = f"error {error:.3g}" if math.isfinite(error) else "infinities or NaNs where the others have none"
        report.error = (
            f"disagrees with the {len(majority.members)} candidates that agree: {measured} > tolerance {consensus.tolerance:.3g}"
        )
        rejected.append({"index": index, "engine": report.engine.get("name", ""), "error": _number(error)})
    for index in majority.members:
        reports[index].deviation = majority.errors.get(index, 0.0)
    return {"status": "agreed", "compared": consensus.compared, "agreeing": len(majority.members),
            "tolerance": consensus.tolerance, "metric": "max |a - b| / max |b| over each output", "rejected": rejected}  # fmt: skip


def _no_majority(consensus: Consensus, reports: list[CandidateReport], options: BuildOptions, started: float,
                 first: int) -> AutotuneResult:  # fmt: skip
    """One candidate alone, or candidates without a majority: the frontend's choice."""
    if consensus.compared == 1:
        reports[first].status = "chosen"
        check = {"status": "single", "compared": 1, "agreeing": 1, "tolerance": consensus.tolerance, "rejected": []}
        return AutotuneResult(first, reports, options.policy, time.perf_counter() - started,
                              {"method": "not timed: one candidate launched"}, check)  # fmt: skip
    groups = [[reports[i].engine.get("name") or f"#{i}" for i in g.members] for g in consensus.groups]
    for report in reports:
        if report.status == "checked":
            report.status = "rejected"
            report.error = "no majority of the candidates agreed"
    reports[first].status = "chosen"
    check = {"status": "no majority", "compared": consensus.compared, "groups": groups, "spread": _number(consensus.spread()),
             "tolerance": consensus.tolerance, "rejected": []}  # fmt: skip
    return AutotuneResult(first, reports, options.policy, time.perf_counter() - started,
                          {"method": "not timed: no majority"}, check, persist=False)  # fmt: skip


def _time_majority(cands: CandidateSet, reports: list[CandidateReport], members: list[int], timing: TimingPolicy) -> int:
    """Time the agreeing candidates; the fastest median wins (ties to the lower index)."""
    firsts: dict[int, float] = {}
    for index in members:
        try:
            firsts[index] = reports[index].first_ms = cands.time(index, 1)[0]
        except Exception as exc:
            _launch_failed(reports[index], exc)
    if not firsts:
        raise BuildError("every candidate that agreed failed to run again", reason="all failed")
    # Not ``first_ms or inf``: a run timed at 0.0 ms is the best, not missing.
    best = min(firsts.values())
    medians: dict[int, float] = {}
    for index, first in firsts.items():
        report = reports[index]
        if first > timing.prune_factor * best:
            report.status = "pruned"
            continue
        try:
            report.times_ms = cands.time(index, timing.runs)
        except Exception as exc:
            _launch_failed(report, exc)
            continue
        report.status = "timed"
        medians[index] = report.median_ms = statistics.median(report.times_ms)
    if not medians:
        raise BuildError("every candidate that agreed failed to run again", reason="all failed")
    return min(medians, key=lambda i: (medians[i], i))


def _number(value: float) -> float | None:
    """A measured error as stored: None for infinite (JSON, and the checksums, have no inf)."""
    return value if math.isfinite(value) else None


def check_summary(check: Mapping[str, Any] | None) -> str:
    """One line for people: how a stored choice was checked."""
    if not check:
        return "never checked (stored before plancache checked candidates)"
    status = check.get("status")
    if status == "agreed":
        rejected = ", ".join(str(r.get("engine")) for r in check.get("rejected") or []) or "none"
        return f"agreed: {check.get('agreeing')} of {check.get('compared')} candidates; rejected: {rejected}"
    if status == "not run":
        return f"not checked: {check.get('why')}"
    return str(status)
