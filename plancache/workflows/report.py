"""A readable report of stored plans: what ``plancache inspect`` prints.

Per entry: the op summary, tensor shapes and data types, the chosen engine, the timing
table of the candidates, the speed-up of the chosen plan over the heuristics' first
choice (the plan an untuned build would have used), hits and age.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..autotuning.autotune import CandidateStatus
from ..key import Policy
from ..store import Entry

__all__ = ["age", "entry_report", "report_lines", "speedup"]

# Every status of a candidate that built (the heuristic policy keeps the first of them, timed
# or not: a miss budget may cut the timing short after the comparison of outputs).
_BUILT = (CandidateStatus.CHOSEN, CandidateStatus.TIMED, CandidateStatus.PRUNED, CandidateStatus.CHECKED,
          CandidateStatus.REJECTED)  # fmt: skip


def _dtype(name: Any) -> str:
    text = str(name) if name is not None else "?"
    return text.split(".", 1)[1].lower() if text.startswith("data_type.") else text


def speedup(candidates: Sequence[Mapping[str, Any]]) -> tuple[float | None, int | None, str | None]:
    """(speed-up, heuristic choice index, basis) of the chosen candidate over the first one
    that built, which is what the heuristic policy would have kept. Medians when both
    were timed carefully, else single first runs (a pruned first choice has only that)."""
    built = [c for c in candidates if c.get("status") in _BUILT]
    chosen = next((c for c in built if c["status"] == CandidateStatus.CHOSEN), None)
    if not built or chosen is None:
        return None, None, None
    first = min(built, key=lambda c: c["index"])
    for field, basis in (("median_ms", "median"), ("first_ms", "first run")):
        a, b = first.get(field), chosen.get(field)
        if a is not None and b:
            return a / b, first["index"], basis
    return None, first["index"], None


def entry_report(entry: Entry, now: float | None = None) -> dict[str, Any]:
    """The inspect report of one stored entry, as JSON-ready data."""
    now = time.time() if now is None else now
    # Read as the store writes them: a record of another shape raises here.
    description: Mapping[str, Any] = entry.description
    records: Sequence[Mapping[str, Any]] = entry.tensors
    candidates: Sequence[Mapping[str, Any]] = entry.candidates
    nodes = description.get("nodes", [])
    ops = [f"{n['type']}({n['params']['mode']})" if isinstance(n.get("params"), dict) and n["params"].get("mode") else n["type"]
           for n in nodes]  # fmt: skip
    tensors = [{"uid": t["uid"], "name": t["name"], "io": "out" if t["is_output"] else "in", "dims": t["dims"],
                "strides": t["strides"], "dtype": _dtype(t.get("dtype"))} for t in records]  # fmt: skip
    context = description.get("context", {})
    ratio, baseline, basis = speedup(candidates)
    rows = [{"index": c["index"], "engine": (c.get("engine") or {}).get("name", ""),
             **{name: c.get(name) for name in ("status", "median_ms", "first_ms", "error")}} for c in candidates]  # fmt: skip
    return {
        "key": entry.key,
        "ops": "+".join(ops),
        "env_id": entry.env_id,
        "gpu": entry.environment.get("gpu_name"),
        "tensors": tensors,
        "dtypes": {"io": sorted({t["dtype"] for t in tensors}), "compute": _dtype(context.get("compute_data_type"))},
        "engine": entry.engine,
        "policy": entry.policy,
        "options": entry.options,
        "candidates": rows,
        "heuristic_choice": baseline,
        "speedup": ratio,
        "speedup_basis": basis,
        "hits": entry.hit_count,
        "age_s": max(0.0, now - entry.created_at),
        "last_used_s": max(0.0, now - entry.last_used_at) if entry.last_used_at else None,
        "build_seconds": entry.build_seconds,
        "autotune_seconds": entry.autotune_seconds,
        "blob_size": len(entry.blob),
        "workspace_size": entry.workspace_size,
    }


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _ms(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def report_lines(report: Mapping[str, Any]) -> Iterable[str]:
    """The text form of one ``entry_report``."""
    yield f"{report['key']}  {report['ops']}"
    for t in report["tensors"]:
        yield f"  {t['io']:3} uid {t['uid']:<4} {t['name'][:16]:16} {t['dtype']:9} dims {t['dims']} strides {t['strides']}"
    engine = report.get("engine") or {}
    yield f"  engine     {engine.get('name', '?')} (id {engine.get('engine_id')}, knobs {engine.get('knobs')})"
    yield f"  policy     {report['policy']}, compute {report['dtypes']['compute']} on {report.get('gpu')} [{report['env_id']}]"
    if report["speedup"] is not None:
        yield f"  speed-up   {report['speedup']:.2f}x over the heuristics' first choice #{report['heuristic_choice']} ({report['speedup_basis']})"
    else:
        untimed = " (the heuristics' first choice was kept untimed)" if report["policy"] == Policy.HEURISTIC else ""
        yield f"  speed-up   -{untimed}"
    yield (f"  hits {report['hits']}, age {age(report['age_s'])}, last used {age(report['last_used_s'])} ago, "
           f"build {report['build_seconds']:.2f}s (timing {report['autotune_seconds']:.2f}s)")  # fmt: skip
    rows = [c for c in report["candidates"] if c["status"] != CandidateStatus.NOT_BUILT]
    if rows:
        widths = max(len(c["engine"]) for c in rows)
        yield f"    {'#':>3}  {'ENGINE':{widths}}  {'STATUS':8}  {'MEDIAN_MS':>10}  {'FIRST_MS':>10}"
        for c in rows:
            mark = " <" if c["status"] == CandidateStatus.CHOSEN else ""
            yield f"    {c['index']:>3}  {c['engine']:{widths}}  {c['status']:8}  {_ms(c['median_ms']):>10}  {_ms(c['first_ms']):>10}{mark}"
