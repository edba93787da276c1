"""Which candidate to keep: the timing policy, independent of any GPU library.

A miss builds the candidates in the heuristics' order and times them through the
``CandidateSet`` seam. Candidates whose single timed run is far slower than the best
single run are dropped before the careful timing (on an H200 the slowest candidates were
up to 1,400x slower than the best); the rest get the median of several runs; the lowest
median wins, ties to the lower index.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import BuildError
from ..key import BuildOptions
from .backend import CandidateSet

__all__ = ["AutotuneResult", "CandidateReport", "TimingPolicy", "autotune"]

log = logging.getLogger("plancache")


@dataclass(frozen=True)
class TimingPolicy:
    """How candidates are timed. Not part of the key: it changes how carefully the plan
    was chosen, not what a plan computes. Recorded with every entry."""

    runs: int = 7  # timed runs per surviving candidate (after one warm-up)
    prune_factor: float = 3.0  # drop candidates slower than this many times the best first run

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "method": "CUDA events around each run after 1 warm-up; median"}


@dataclass
class CandidateReport:
    """What happened to one candidate."""

    index: int
    engine: dict[str, Any]
    status: str  # chosen | timed | pruned | failed | not_built
    first_ms: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AutotuneResult:
    winner: int
    candidates: list[CandidateReport]
    policy: str
    autotune_seconds: float
    timing: dict[str, Any]


def _build_in_order(cands: CandidateSet, want: int, reports: list[CandidateReport]) -> list[int]:
    """Build candidates in heuristic order until ``want`` succeeded."""
    built: list[int] = []
    for index in range(len(cands)):
        report = reports[index]
        if len(built) >= want:
            break
        error = cands.build(index)
        if error is None:
            built.append(index)
            report.status = "timed"
        else:
            report.status = "failed"
            report.error = error
    return built


def _launch_failed(report: CandidateReport, exc: Exception) -> None:
    report.status = "failed"
    report.error = f"launch: {type(exc).__name__}: {str(exc)[:300]}"
    log.debug("plancache: candidate #%d failed to launch: %s", report.index, exc)


def autotune(cands: CandidateSet, options: BuildOptions, timing: TimingPolicy | None = None) -> AutotuneResult:
    """Pick a candidate under ``options.policy``; raises ``BuildError`` when none builds."""
    timing = timing or TimingPolicy()
    started = time.perf_counter()
    count = len(cands)
    if count == 0:
        raise BuildError("cuDNN offered no candidate plan for this graph", reason="no candidates")
    reports = [CandidateReport(index=i, engine=cands.engine(i).to_dict(), status="not_built") for i in range(count)]
    want = {"heuristic": 1, "topk": options.top_k, "exhaustive": count}[options.policy]
    built = _build_in_order(cands, want, reports)
    if not built:
        reasons = "; ".join(f"#{r.index}: {r.error}" for r in reports if r.error)[:2000]
        raise BuildError(f"none of the {count} candidate plans could be built: {reasons}", reason="all failed")

    if options.policy == "heuristic" or len(built) == 1:
        winner = built[0]
        reports[winner].status = "chosen"
        return AutotuneResult(winner, reports, options.policy, time.perf_counter() - started, {"method": "not timed"})

    launched = []
    for index in built:
        try:
            reports[index].first_ms = cands.time(index, 1)[0]
        except Exception as exc:  # one candidate that cannot launch is dropped, not the miss
            _launch_failed(reports[index], exc)
            continue
        launched.append(index)
    if not launched:
        raise BuildError("every candidate that built failed to run", reason="all failed")
    built = launched
    # Not ``first_ms or inf``: a run timed at 0.0 ms is the best, not missing.
    best_first = min(ms for i in built if (ms := reports[i].first_ms) is not None)
    survivors = []
    for index in built:
        first = reports[index].first_ms
        if first is not None and first > timing.prune_factor * best_first:
            reports[index].status = "pruned"
        else:
            survivors.append(index)
    for index in list(survivors):
        try:
            times = cands.time(index, timing.runs)
        except Exception as exc:
            _launch_failed(reports[index], exc)
            survivors.remove(index)
            continue
        reports[index].times_ms = times
        reports[index].median_ms = statistics.median(times)
    if not survivors:
        raise BuildError("every candidate that built failed to run", reason="all failed")
    winner = min(survivors, key=lambda i: (reports[i].median_ms, i))
    reports[winner].status = "chosen"
    elapsed = time.perf_counter() - started
    log.debug(
        "plancache: autotuned %d/%d candidates (%d pruned) in %.3f s; chose #%d (%.4f ms)",
        len(built), count, len(built) - len(survivors), elapsed, winner, reports[winner].median_ms,
    )  # fmt: skip
    return AutotuneResult(winner, reports, options.policy, elapsed, timing.to_dict())
