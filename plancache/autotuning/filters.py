"""The program's own filters on its plans, held on every candidate autotuning builds.

A program that calls ``deselect_workspace_greater_than(limit)`` says how much memory a plan
may use; ``deselect_engines(names)`` says which engines may not run. Autotuning must never
launch, time or choose a plan outside them. The frontend holds them in its own planning
(``build_plans``), but autotuning builds candidates by index (``build_plan_at_index``),
where the frontend checks the workspace of its Python engines' plans only. So every backend
asks ``outside_filters`` about each candidate it has built: a candidate outside them
counts as one that could not be built, with the reason, which the stored entry keeps in its
candidate record.

The workspace limit is the lookup's (``BuildOptions.workspace_limit``: the tighter of the
program's and the cache's, keyed); the engine filters are the graph's own, as its
description records them (keyed too). Note filters (``deselect_behavior_notes`` and the
like) are set on the graph autotuning builds (``replay``), and the frontend and cuDNN
refuse a candidate they bar when it is built: a plan's notes are not known here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import format_size
from ..key import BuildOptions

__all__ = ["outside_filters"]


def outside_filters(engine: str, workspace_size: int, description: Mapping[str, Any], options: BuildOptions) -> str | None:
    """Why a built candidate, of engine ``engine`` (the plan's name) needing
    ``workspace_size`` bytes of workspace, must not run for the graph ``description`` under
    ``options``; None when the program allows it."""
    limit = options.workspace_limit
    if limit is not None and workspace_size > limit:
        return (f"needs {format_size(workspace_size)} ({workspace_size} bytes) of workspace, over the limit of "
                f"{format_size(limit)} ({limit} bytes)")  # fmt: skip
    for name in description.get("flags", {}).get("deselected_engines") or ():
        if name in engine:  # the frontend's rule: a deselected name excludes every plan whose name contains it
            return f"engine {engine!r} is deselected (deselect_engines: {name!r})"
    return None
