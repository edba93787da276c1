"""Which candidate to keep: checked against the others, then timed, within a budget. No GPU
library here.

A miss builds candidates through the ``CandidateSet`` seam and launches each once on the
same inputs (the caller's tensors, else synthetic ones valid for each tensor's role). Their
outputs are compared element by element (``autotuning.consensus``): a candidate outside the
majority is rejected, with how far it is measured, and never chosen.

**The budget.** The heuristics' first candidate is built and launched first: the time from
the miss's start to then is what the frontend alone would have spent, the *reference*.
Everything after must end within ``budget`` times it (``PLANCACHE_AUTOTUNE_BUDGET``, default
1.5), except the check: a majority needs two engines (knob variants of one engine tend to
share its mistakes; one engine is enough when the graph has no other) and more than half of
those compared, and candidates are launched until one stands, past the budget if need be,
up to ``CHECK_LIMIT`` of them. Correctness before speed. For the check, candidates of another
engine that need no runtime compilation come first: they build in milliseconds, a
runtime-compiled one in hundreds (the frontend says which in each plan's behavior notes).

Then, per policy: ``heuristic`` keeps the first candidate of the majority and times none;
``topk`` and ``exhaustive`` launch more candidates (``top_k`` in all, or every one) and time
the majority (one run each drops the hopeless: on an H200 the slowest were 1,400x slower
than the best; the rest get the median of several runs; ties go to the lower index), as
long as the budget lasts. A candidate compiled at run time is launched only where its build
is expected to end within the budget (as long as the longest compilation the miss saw, the
reference where it saw none); the next one is asked instead. Where it ran out, the record
says how far tuning got (``tuned``/``candidates``, ``stopped``), and ``plancache tune``
finishes it offline.

Where no majority forms, the result is the frontend's own choice (the first candidate that
builds), marked not to be persisted. Where nothing may be launched (a tensor of unknown
role, the memory budget, a capture), it is the same choice, persisted and recorded as not
checked, with the reason: exactly what the frontend alone would run.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from ..config import AUTOTUNE_BUDGET, AUTOTUNE_MEMORY, MemoryBudget, StrEnum, argument, number, whole_number
from ..errors import BuildError
from ..key import BuildOptions, Policy
from .candidates import CandidateSet
from .consensus import FAR, RULE, Agreement, Consensus, Group

__all__ = ["CHECK_LIMIT", "AutotuneResult", "CandidateReport", "CandidateStatus", "CheckStatus", "Stopped", "TimingPolicy",
           "autotune"]  # fmt: skip

#: Candidates the check may launch in all while it looks for a majority, the budget spent or not.
CHECK_LIMIT = 6

log = logging.getLogger("plancache")


@dataclass(frozen=True)
class TimingPolicy:
    """How candidates are timed. Not part of the key: it changes how carefully the plan
    was chosen, not what a plan computes. Recorded with every entry."""

    runs: int = 7  # timed runs per surviving candidate (after one warm-up)
    prune_factor: float = 3.0  # drop candidates slower than this many times the best first run
    #: What autotuning may allocate on the device (PLANCACHE_AUTOTUNE_MEMORY, read when not
    #: given): a ``MemoryBudget``, or text as the variable takes it (``"25%"``, ``"4G"``).
    memory: MemoryBudget = None  # type: ignore[assignment]
    #: A miss's time as a multiple of the frontend's own build (PLANCACHE_AUTOTUNE_BUDGET,
    #: read when not given); ``math.inf`` or ``"off"``: no limit (what ``plancache tune`` uses).
    budget: float = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # Read as the settings are: runs=2.5 or prune_factor="fast" are refused here, not at the first miss.
        object.__setattr__(self, "runs", argument("TimingPolicy(runs)", self.runs, whole_number(1, "timed runs")))
        object.__setattr__(self, "prune_factor", argument("TimingPolicy(prune_factor)", self.prune_factor,
                                                          number(1.0, "a factor over the best first run")))  # fmt: skip
        object.__setattr__(self, "memory", AUTOTUNE_MEMORY.given_or_env(self.memory, "TimingPolicy(memory=)"))
        object.__setattr__(self, "budget", AUTOTUNE_BUDGET.given_or_env(self.budget, "TimingPolicy(budget=)"))

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "prune_factor": self.prune_factor, "memory": self.memory.describe(),
                "budget": self.budget if math.isfinite(self.budget) else None,
                "method": "CUDA events around each run after 1 warm-up; median"}  # fmt: skip


class CandidateStatus(StrEnum):
    """What happened to one candidate, as stored (``checked``: agreed, not timed)."""

    CHOSEN = "chosen"
    TIMED = "timed"
    PRUNED = "pruned"
    CHECKED = "checked"
    REJECTED = "rejected"
    FAILED = "failed"
    NOT_BUILT = "not_built"


class CheckStatus(StrEnum):
    """How a choice was checked (the ``status`` of the check stored with an entry)."""

    AGREED = "agreed"
    SINGLE = "single"
    NO_MAJORITY = "no majority"
    NOT_RUN = "not run"


class Stopped(StrEnum):
    """Why tuning stopped before every candidate was tried (``timing["stopped"]``)."""

    BUDGET = "budget"


@dataclass
class CandidateReport:
    """What happened to one candidate (``CandidateStatus``)."""

    index: int
    engine: dict[str, Any]
    status: CandidateStatus
    first_ms: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    error: str | None = None
    #: Against the majority's outputs (``autotuning.consensus.Agreement``): the largest
    #: difference of any element in units of its bound (None: infinite), and how many
    #: elements, and what fraction of them, lie outside their bound.
    deviation: float | None = None
    outside: int | None = None
    fraction: float | None = None
    built: bool = False  # not stored: it built (whatever happened at its launches)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["built"]
        return data


@dataclass
class AutotuneResult:
    winner: int
    candidates: list[CandidateReport]
    policy: Policy
    autotune_seconds: float
    timing: dict[str, Any]
    check: dict[str, Any]  # how the choice was checked; stored with the entry
    persist: bool = True  # False: no majority, the frontend's choice for this process only


def autotune(cands: CandidateSet, options: BuildOptions, timing: TimingPolicy | None = None, started: float | None = None,
             clock: Callable[[], float] = time.perf_counter) -> AutotuneResult:  # fmt: skip
    """Pick a checked candidate under ``options.policy`` within ``timing.budget``; raises
    ``BuildError`` when none builds. ``started``: when the miss began (by ``clock``; the
    frontend's planning before this call is part of the reference), now when not given."""
    timing = timing or TimingPolicy()
    started = clock() if started is None else started
    count = len(cands)
    if count == 0:
        raise BuildError("cuDNN offered no candidate plan for this graph", reason="no candidates")
    reports = [CandidateReport(index=i, engine=cands.engine(i).to_dict(), status=CandidateStatus.NOT_BUILT) for i in range(count)]
    refused = cands.prepare(timing.memory)
    if refused is not None:
        winner = _first_buildable(cands, reports)
        check: dict[str, Any] = {"status": CheckStatus.NOT_RUN, "rule": RULE, "why": refused.why}
        return AutotuneResult(winner, reports, options.policy, clock() - started, {"method": f"not timed: {refused.why}"}, check)
    # From here on, the miss's device work (the comparisons as much as the launches) is
    # queued on the candidates' own stream, never behind the program's work on its stream.
    with cands.streamed():
        return _tuned(_Tuning(cands, reports, timing, started, clock), options)


def _tuned(tuning: _Tuning, options: BuildOptions) -> AutotuneResult:
    """``autotune`` once the candidates' inputs are ready: the check, then the policy."""
    reports, clock = tuning.reports, tuning.clock
    majority = tuning.check()
    if not tuning.launched:
        if not _built(reports):
            _none_built(reports)
        raise BuildError("every candidate that built failed to run", reason="all failed")
    timed = options.policy is not Policy.HEURISTIC  # the heuristic policy keeps the majority's first
    want = max(2, options.top_k) if options.policy is Policy.TOPK else len(reports)
    if majority is not None and timed:
        majority = tuning.widen(want) or tuning.check()  # the candidates added may have split the majority
    if majority is None:
        return _no_majority(tuning, options)
    check = _check_record(tuning.consensus, majority, reports)
    if timed:
        winner, timing = tuning.time(sorted(majority.members)[:want]), tuning.timing.to_dict()
    else:
        winner, timing = min(majority.members), {"method": "not timed: heuristic policy"}
    reports[winner].status = CandidateStatus.CHOSEN
    elapsed = clock() - tuning.started
    if timed:
        log.debug("plancache: autotuned %d/%d candidates (%d rejected) in %.3f s; chose #%d (%.4f ms)", len(tuning.launched),
                  len(reports), len(check["rejected"]), elapsed, winner, reports[winner].median_ms or 0.0)  # fmt: skip
    return AutotuneResult(winner, reports, options.policy, elapsed, {**timing, **tuning.progress()}, check)


def _built(reports: list[CandidateReport]) -> list[int]:
    """The candidates that built (launched or not); the first is the frontend's own choice."""
    return [r.index for r in reports if r.built]


def _first_buildable(cands: CandidateSet, reports: list[CandidateReport]) -> int:
    for report in reports:
        try:
            cands.build(report.index)
        except BuildError as exc:
            report.status, report.error = CandidateStatus.FAILED, str(exc)
            continue
        report.status, report.built = CandidateStatus.CHOSEN, True
        return report.index
    _none_built(reports)


def _none_built(reports: list[CandidateReport]) -> NoReturn:
    reasons = "; ".join(f"#{r.index}: {r.error}" for r in reports if r.error)[:2000]
    raise BuildError(f"none of the {len(reports)} candidate plans could be built: {reasons}", reason="all failed")


_ENGINE_IN_NAME = re.compile(r"eng(\d+)(?![0-9])")


def _engine_of(report: CandidateReport) -> Any:
    """The engine a candidate is a knob variant of: its id, else (cuDNN could not say) the
    ``engN`` its plan name starts with (``eng0_k24=0`` is engine 0), else the candidate
    alone. An unknown id must not put every candidate in one engine: two variants of one
    wrong engine would then pass as the one engine's agreement."""
    engine_id = report.engine.get("engine_id")
    if engine_id is not None:
        return engine_id
    found = _ENGINE_IN_NAME.match(str(report.engine.get("name") or ""))
    return int(found.group(1)) if found else ("candidate", report.index)


class _Tuning:
    """One miss's candidates being launched, compared and timed against its deadline."""

    def __init__(self, cands: CandidateSet, reports: list[CandidateReport], timing: TimingPolicy, started: float,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.cands, self.reports, self.timing, self.clock = cands, reports, timing, clock
        self.started = started
        self.deadline = math.inf  # set once the first candidate ran: budget x the reference
        self.reference: float | None = None
        self.consensus = Consensus(cands.bounds())
        self.launched: list[int] = []
        self.stopped: Stopped | None = None
        self.engines = {_engine_of(r) for r in reports}
        self.longest_compile: float | None = None  # the longest build compiled at run time in this miss

    def _launch(self, report: CandidateReport) -> None:
        """Build and launch one candidate; one that runs joins the comparison."""
        begun = self.clock()
        try:
            self.cands.build(report.index)
        except BuildError as exc:
            report.status, report.error = CandidateStatus.FAILED, str(exc)
            return
        finally:
            if self.cands.compiles(report.index):
                self.longest_compile = max(self.longest_compile or 0.0, self.clock() - begun)
        report.built = True
        try:
            outputs = self.cands.outputs(report.index)
        except Exception as exc:  # one candidate that cannot launch is dropped, not the miss
            _launch_failed(report, exc)
            return
        self.consensus.add(report.index, outputs)
        report.status = CandidateStatus.CHECKED
        self.launched.append(report.index)
        if self.reference is None:  # the frontend's own cost: its heuristics and its first plan
            self.reference = self.clock() - self.started
            self.deadline = self.started + self.timing.budget * self.reference

    def _untried(self) -> list[CandidateReport]:
        return [r for r in self.reports if r.status is CandidateStatus.NOT_BUILT]

    def majority(self) -> Group | None:
        """The majority group, when it holds two engines, or the graph has one, or every
        candidate agreed and none is left to ask."""
        group = self.consensus.majority()
        if group is None:
            return None
        engines = {_engine_of(self.reports[i]) for i in group.members}
        if len(engines) >= 2 or len(self.engines) == 1:
            return group
        return group if not self._untried() and len(self.consensus.groups) == 1 else None

    def _check_order(self) -> list[CandidateReport]:
        """Untried candidates in the order the check asks them: the heuristics' own choice,
        then other engines before knob variants of those launched, and among each, those
        built without runtime compilation first; the heuristics' order within."""
        seen = {_engine_of(self.reports[i]) for i in self.launched}
        untried = self._untried()
        if not self.launched:
            return untried
        return sorted(untried, key=lambda r: (_engine_of(r) in seen, self.cands.compiles(r.index), r.index))

    def check(self) -> Group | None:
        """Launch candidates until a majority stands, past the budget if need be, up to
        ``CHECK_LIMIT`` launched, or none left."""
        # After the first launch, builds that fail count too, or a long run of them would go
        # on for long; but never before a second candidate ran, while one is left: a lone
        # candidate is stored unchecked ("single") only when it is the only one that runs.
        tries = 0
        while len(self.launched) < CHECK_LIMIT and (tries < 2 * CHECK_LIMIT or len(self.launched) < 2):
            if len(self.launched) >= 2 and self.majority() is not None:
                break
            order = self._check_order()
            if not order:
                break
            tries += bool(self.launched)
            self._launch(order[0])
        return self.majority() if len(self.launched) >= 2 or not self._untried() else None

    def _expected_build(self, report: CandidateReport) -> float:
        """How long building ``report`` is expected to take: 0 without runtime compilation
        (milliseconds at most); with it (25 to 550 ms on an H100), the longest seen in this
        miss, else the reference."""
        if not self.cands.compiles(report.index):
            return 0.0
        return self.longest_compile if self.longest_compile is not None else self.reference or 0.0

    def widen(self, want: int) -> Group | None:
        """Launch more candidates, in the heuristics' order, until ``want`` were compared or
        the budget is spent; the majority then. One whose build is expected to end past the
        budget is passed over (a runtime compilation can outlast the whole budget, where
        the next candidate builds in a millisecond)."""
        for report in self._untried():
            if len(self.launched) >= want:
                break
            now = self.clock()
            if now >= self.deadline:
                self.stopped = Stopped.BUDGET
                break
            if now + self._expected_build(report) > self.deadline:
                self.stopped = Stopped.BUDGET
                continue
            self._launch(report)
        return self.majority()

    def time(self, members: list[int]) -> int:
        """The fastest of ``members``: one run each (a launch: cheap next to a build), then the
        median of careful runs, fastest first, as long as the budget lasts (the fastest one
        always)."""
        reports, timing = self.reports, self.timing
        firsts: dict[int, float] = {}
        for index in members:
            try:
                firsts[index] = reports[index].first_ms = self.cands.time(index, 1)[0]
            except Exception as exc:
                _launch_failed(reports[index], exc)
        best = min(firsts.values(), default=0.0)  # not ``first_ms or inf``: a run timed at 0.0 ms is the best
        medians: dict[int, float] = {}
        for index, first in sorted(firsts.items(), key=lambda item: (item[1], item[0])):
            report = reports[index]
            if first > timing.prune_factor * best:
                report.status = CandidateStatus.PRUNED
                continue
            if medians and self.clock() >= self.deadline:
                self.stopped = Stopped.BUDGET
                continue
            try:
                report.times_ms = self.cands.time(index, timing.runs)
            except Exception as exc:
                _launch_failed(report, exc)
                continue
            report.status = CandidateStatus.TIMED
            medians[index] = report.median_ms = statistics.median(report.times_ms)
        if not medians:
            raise BuildError("every candidate that agreed failed to run again", reason="all failed")
        return min(medians, key=lambda i: (medians[i], i))

    def progress(self) -> dict[str, Any]:
        """How far tuning got, stored: ``plancache tune`` finishes what a budget stopped."""
        found: dict[str, Any] = {"tuned": len(self.launched), "candidates": len(self.reports)}
        if self.reference is not None:
            found["reference_seconds"] = round(self.reference, 6)
        if self.stopped is not None:
            found["stopped"] = self.stopped
        return found


def _launch_failed(report: CandidateReport, exc: Exception) -> None:
    report.status = CandidateStatus.FAILED
    report.error = f"launch: {type(exc).__name__}: {str(exc)[:300]}"
    log.debug("plancache: candidate #%d failed to launch: %s", report.index, exc)


def _check_record(consensus: Consensus, majority: Group, reports: list[CandidateReport]) -> dict[str, Any]:
    """Mark the outliers rejected and say how the choice was checked (stored with the entry)."""
    rejected = []
    for index, agreement in sorted(consensus.outliers(majority).items()):
        report = reports[index]
        report.status = CandidateStatus.REJECTED
        _note(report, agreement)
        measured = (
            f"{agreement.outside} of {agreement.elements} elements outside their bound, the worst {agreement.worst:.3g} times it"
            if math.isfinite(agreement.worst)
            else "infinities, NaNs or integers where the others differ"
        )
        report.error = f"disagrees with the {len(majority.members)} candidates that agree: {measured} (> {FAR:g})"
        rejected.append({"index": index, "engine": report.engine.get("name", ""), **agreement.to_dict()})
    for index in majority.members:
        _note(reports[index], majority.agreements.get(index, Agreement()))
    return {"status": CheckStatus.AGREED, "rule": RULE, "compared": consensus.compared, "agreeing": len(majority.members),
            "far": FAR, "metric": _METRIC, "rejected": rejected}  # fmt: skip


_METRIC = "every element within FAR times its bound: 1 ulp of the output + the rounding of its inputs' magnitudes"


def _note(report: CandidateReport, agreement: Agreement) -> None:
    recorded = agreement.to_dict()
    report.deviation, report.outside, report.fraction = recorded["worst"], recorded["outside"], recorded["fraction"]


def _no_majority(tuning: _Tuning, options: BuildOptions) -> AutotuneResult:
    """One candidate alone, or candidates without a majority: the frontend's choice."""
    consensus, reports = tuning.consensus, tuning.reports
    first = tuning.launched[0] if len(tuning.launched) == 1 else _built(reports)[0]
    elapsed = tuning.clock() - tuning.started
    if consensus.compared == 1:
        reports[first].status = CandidateStatus.CHOSEN
        check = {"status": CheckStatus.SINGLE, "rule": RULE, "compared": 1, "agreeing": 1, "rejected": []}
        return AutotuneResult(first, reports, options.policy, elapsed,
                              {"method": "not timed: one candidate launched", **tuning.progress()}, check)  # fmt: skip
    groups = [[reports[i].engine.get("name") or f"#{i}" for i in g.members] for g in consensus.groups]
    for report in reports:
        if report.status is CandidateStatus.CHECKED:
            report.status = CandidateStatus.REJECTED
            report.error = "no majority of the candidates agreed"
    reports[first].status = CandidateStatus.CHOSEN
    check = {"status": CheckStatus.NO_MAJORITY, "rule": RULE, "compared": consensus.compared, "groups": groups,
             "spread": consensus.spread().to_dict(), "far": FAR, "rejected": []}  # fmt: skip
    return AutotuneResult(first, reports, options.policy, elapsed, {"method": "not timed: no majority", **tuning.progress()},
                          check, persist=False)  # fmt: skip


def check_summary(check: Mapping[str, Any] | None) -> str:
    """One line for people: how a stored choice was checked."""
    if not check:
        return "never checked (stored before plancache checked candidates)"
    status = check.get("status")
    if check.get("rule") != RULE:
        return f"{status} under an older rule (each output's largest difference): chosen again when looked up"
    if status == CheckStatus.AGREED:
        rejected = ", ".join(_rejection(r) for r in check.get("rejected") or []) or "none"
        return f"agreed: {check.get('agreeing')} of {check.get('compared')} candidates, element by element; rejected: {rejected}"
    if status == CheckStatus.NOT_RUN:
        return f"not checked: {check.get('why')}"
    return str(status)


def _rejection(record: Mapping[str, Any]) -> str:
    worst = record.get("worst")
    far = "non-finite" if worst is None else f"worst {worst:.3g}x its bound"
    return f"{record.get('engine')} ({record.get('outside')} elements outside, {100 * float(record.get('fraction') or 0):.2g}%, {far})"
