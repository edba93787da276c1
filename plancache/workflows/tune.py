"""``plancache tune``: finish the autotuning that a miss's time budget cut short.

A miss tunes only as long as ``PLANCACHE_AUTOTUNE_BUDGET`` allows (docs/checking.md); its
entry then records how far it got (``timing``: ``tuned`` of ``candidates``, ``stopped``).
Offline, on the same GPU, each such entry's graph is replayed from its description and
autotuned again without a budget; the choice replaces the entry, and later lookups, in
other processes or on other machines through a bundle or the fleet, run the better plan.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ..autotuning.autotune import Stopped
from ..cudnn.replay import rebuild_graph
from ..errors import DamagedEntryError
from ..key import BuildOptions, environment_id
from .steps import Interrupted, Progress, Status

__all__ = ["cut_short", "tune", "tune_report"]


def cut_short(entry: Any) -> bool:
    """Whether ``entry``'s autotuning stopped at the miss budget."""
    return (entry.timing or {}).get("stopped") == Stopped.BUDGET


def _options(recorded: dict[str, Any]) -> BuildOptions:
    """The build options an entry was keyed with (as ``BuildOptions.to_dict`` wrote them)."""
    names = ("policy", "top_k", "heuristic_modes", "workspace_limit", "kernel_cache")
    return BuildOptions(**{n: recorded[n] for n in names if n in recorded and not (n == "top_k" and recorded[n] is None)})


def tune(cache: Any, keys: Iterable[str] | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Autotune again, without a budget, the entries of this environment whose miss stopped
    at the budget (or ``keys``, full digests, whatever their record says). Returns
    ``{"rows": [...], "tuned": n, "failed": n}``; each row names the key, the candidates
    tuned before and after, the plan chosen before and after, and the seconds spent. Ctrl-C
    raises ``Interrupted`` whose ``report`` holds the rows finished (``interrupted`` True)."""
    store = cache.store
    if store is None:
        return {**tune_report([]), "why": "no store: plans are not persisted here"}
    wanted = list(keys) if keys is not None else None
    env_id = environment_id(cache.environment)
    todo = []
    rows: list[dict[str, Any]] = []
    for digest in wanted if wanted is not None else store.keys():
        try:
            entry = store.get(digest)
            why = None if entry is None or entry.env_id == env_id else (
                f"belongs to environment {entry.env_id}, not this GPU's {env_id}: tune it there")  # fmt: skip
        except DamagedEntryError as exc:  # one row that cannot be decoded: the others are still tuned
            entry, why = None, str(exc)
        if why is not None:
            if wanted is not None:  # named by the user: say why nothing happens
                rows.append({"key": digest, "status": Status.FAILED, "error": why})
        elif entry is not None and (wanted is not None or cut_short(entry)):
            todo.append(entry)
    bar = Progress(len(todo), progress, desc="tune")
    before_tuning = len(rows)  # the named keys refused before any tuning
    try:
        for entry in todo:
            started = time.perf_counter()
            row: dict[str, Any] = {"key": entry.key, "before": _summary(entry)}
            try:
                cache.tune(_named_as(rebuild_graph(entry.description), entry), options=_options(entry.options))
                after = store.get(entry.key)
                row["after"] = _summary(after) if after is not None else None
                row["status"] = Status.TUNED
            except Exception as exc:  # one graph that cannot be tuned here does not stop the others
                row["status"], row["error"] = Status.FAILED, f"{type(exc).__name__}: {exc}"
            row["seconds"] = round(time.perf_counter() - started, 3)
            bar.update(row["status"], row["seconds"])
            rows.append(row)
    except KeyboardInterrupt:  # Ctrl-C (or a signal the command maps to it): the rows finished are reported
        raise Interrupted(rows, tune_report(rows, not_run=len(todo) - (len(rows) - before_tuning))) from None
    finally:
        bar.close()
    return tune_report(rows)


def tune_report(rows: list[dict[str, Any]], *, not_run: int | None = None) -> dict[str, Any]:
    """``tune``'s report of ``rows``; ``not_run``: the run was interrupted with that many left."""
    return {
        "rows": rows,
        "tuned": sum(r["status"] == Status.TUNED for r in rows),
        "failed": sum(r["status"] == Status.FAILED for r in rows),
        "interrupted": not_run is not None,
        "not_run": not_run or 0,
    }


def _named_as(graph: Any, entry: Any) -> Any:
    """``graph`` (replayed from ``entry``'s description, which drops names: its tensors are
    u1, u2...) with the tensor names of ``entry``, so that the entry tuning stores in its
    place shows them as before (names are not keyed)."""
    names = {spec["uid"]: spec["name"] for spec in entry.tensors}
    for tensor in list(graph.tensors.values()):
        uid = tensor.uid if not callable(getattr(tensor, "get_uid", None)) else tensor.get_uid()
        if not tensor.is_virtual and uid in names:
            tensor.set_name(names[uid])
    return graph


def _summary(entry: Any) -> dict[str, Any]:
    timing = entry.timing or {}
    engine = entry.engine or {}
    return {"engine": engine.get("name"), "tuned": timing.get("tuned"), "candidates": timing.get("candidates"),
            "stopped": timing.get("stopped")}  # fmt: skip
