"""A miss within its time budget, and ``plancache tune`` finishing what the budget cut short.

The budget is wall-clock (``PLANCACHE_AUTOTUNE_BUDGET`` times the frontend's own build):
here every candidate build sleeps 0.2 s on the CPU test backend, which dwarfs the rest of
a miss, so where tuning stops does not depend on the machine's load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch  # imported by every program that runs cuDNN graphs, before its first miss
from click.testing import CliRunner

import plancache
from plancache import BuildOptions
from plancache.cli import cli
from plancache.testing import CpuTestBackend
from plancache.workflows import templates
from plancache.workflows.tune import tune

assert torch.__version__  # the import above is there for its side effect: a miss does not pay it

GRAPH = {"b": 1, "m": 16, "n": 16, "k": 32, "dtype": "float32"}


def graph() -> Any:
    return templates.build("matmul_bias_act", **GRAPH)


def cache(tmp_path: Path, **backend: Any) -> plancache.PlanCache:
    return plancache.PlanCache(tmp_path, backend=CpuTestBackend(**backend), auto_prime=False)


def test_a_miss_stops_tuning_at_the_budget_and_tune_finishes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_BUDGET", "1.5")
    first = cache(tmp_path, candidates=6, build_delay=0.2)
    plan = first.get(graph(), options=BuildOptions(policy="topk", top_k=4))
    entry = first.store.get(plan.key)
    assert entry is not None and entry.check is not None and entry.check["status"] == "agreed"
    # the frontend's own choice, then one more for the check (past the budget), then stop
    assert entry.timing["tuned"] == 2 and entry.timing["candidates"] == 6 and entry.timing["stopped"] == "budget"
    assert entry.timing["reference_seconds"] >= 0.2
    report = tune(first)
    assert report["tuned"] == 1 and report["failed"] == 0
    row = report["rows"][0]
    assert row["before"]["tuned"] == 2 and row["after"]["tuned"] == 4 and row["after"]["stopped"] is None
    tuned = first.store.get(plan.key)
    assert tuned is not None and "stopped" not in tuned.timing
    first.close()
    later = cache(tmp_path, candidates=6)  # a later process runs the better plan
    again = later.get(graph(), options=BuildOptions(policy="topk", top_k=4))
    assert again.source == "loaded" and again.engine is not None and again.engine.to_dict() == tuned.engine
    assert tune(later)["rows"] == []  # nothing left to finish


def test_the_check_launches_its_candidates_whatever_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The heuristics' first choice is wrong: a third candidate must decide, past the budget.
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_BUDGET", "1")
    c = cache(tmp_path, candidates=5, wrong=[0], build_delay=0.2)
    plan = c.get(graph(), options=BuildOptions(policy="heuristic"))
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None and entry.check["status"] == "agreed"
    assert plan.engine is not None and plan.engine.name != "test_engine_0"
    assert entry.timing["tuned"] == 3


def test_tune_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_BUDGET", "1")
    c = cache(tmp_path, build_delay=0.2)
    key = c.get(graph()).key
    c.close()
    monkeypatch.setenv("PLANCACHE_BACKEND", "plancache.testing:CpuTestBackend")
    result = CliRunner().invoke(cli, ["tune", "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.output)
    assert [r["key"] for r in report["rows"]] == [key] and report["tuned"] == 1
    result = CliRunner().invoke(cli, ["tune", "--dir", str(tmp_path)])
    assert result.exit_code == 0 and "nothing to tune" in result.output


def test_tune_says_why_it_leaves_a_named_entry_and_passes_a_damaged_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key of another GPU's environment, named on the command line, was dropped in
    silence ("nothing to tune", exit 0); one row that cannot be decoded stopped the whole
    run (exit 1) before any sound entry was tuned."""
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_BUDGET", "1")
    other = cache(tmp_path, build_delay=0.2, environment={"gpu_name": "Other test device"})
    foreign = other.get(graph()).key
    other.close()
    mine = cache(tmp_path, build_delay=0.2)
    cut_short = mine.get(graph()).key
    mine.get(templates.build("matmul_bias_act", **{**GRAPH, "m": 32}))
    damaged = mine.get(templates.build("matmul_bias_act", **{**GRAPH, "m": 48})).key
    mine.store.connection().execute("UPDATE plans SET tensors_json = '{bad json' WHERE key = ?", (damaged,))
    mine.close()
    monkeypatch.setenv("PLANCACHE_BACKEND", "plancache.testing:CpuTestBackend")
    named = CliRunner().invoke(cli, ["tune", "--dir", str(tmp_path), foreign])
    assert named.exit_code == 3 and "belongs to environment" in named.output
    everything = CliRunner().invoke(cli, ["tune", "--dir", str(tmp_path), "--json"])
    assert everything.exit_code == 0, everything.output
    import json

    tuned = [r["key"] for r in json.loads(everything.output)["rows"] if r["status"] == "tuned"]
    assert cut_short in tuned and damaged not in tuned
    shown = CliRunner().invoke(cli, ["inspect", "--dir", str(tmp_path), "--json"])
    assert shown.exit_code == 0 and cut_short in shown.output
