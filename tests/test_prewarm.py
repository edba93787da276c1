"""plancache prewarm and warm start on the CPU test backend: resumable builds, dry runs,
failing entries, progress, the CLI command, and loading plans before the first step."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from plancache import BuildOptions, PlanCache, Store
from plancache.cli import cli
from plancache.store import maintenance
from plancache.testing import CpuTestBackend
from plancache.workflows import templates
from plancache.workflows.manifest import load_manifest
from plancache.workflows.prewarm import prewarm, warm_start
from plancache.workflows.steps import Progress

MakeCache = Callable[..., PlanCache]
BACKEND = "plancache.testing:CpuTestBackend"

GOOD = [
    {"template": "conv_bias_act", "params": {"n": [1, 2], "c": 8, "h": 6, "w": 6, "k": 4}},
    {"template": "matmul_bias_act", "params": {"b": 2, "m": 4, "k": 16, "n": 8, "act": "gelu"}},
    {"template": "sdpa", "params": {"b": 1, "h": 2, "s": 8, "d": 16}},
]


def manifest(tmp_path: Path, *entries: Any, name: str = "manifest.json") -> Path:
    """Entry i of the file is on line 3 + i."""
    body = ",\n".join(f"  {json.dumps(e)}" for e in entries)
    path = tmp_path / name
    path.write_text('{"version": 1,\n "entries": [\n' + body + "\n]}\n")
    return path


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_BACKEND", BACKEND)


def statuses(report: dict[str, Any]) -> list[str]:
    return [r["status"] for r in report["entries"]]


# ---------------------------------------------------------------------------- prewarm


def test_prewarm_builds_everything_then_resumes_with_hits_only(tmp_path: Path, make_cache: MakeCache) -> None:
    path = manifest(tmp_path, *GOOD)
    first = make_cache()
    report = prewarm(first, path, progress=False)
    assert (report["total"], report["built"], report["hits"], report["failed"]) == (4, 4, 0, 0)
    assert first.counters["builds"] == 4
    assert len(first.store.keys()) == 4
    first.close()

    second = make_cache()
    again = prewarm(second, path, progress=False)
    assert (again["built"], again["hits"], again["failed"]) == (0, 4, 0)
    assert second.counters["builds"] == 0 and second.counters["misses"] == 0
    assert [r["key"] for r in again["entries"]] == [r["key"] for r in report["entries"]]
    # Skipping a stored plan is not a use of it: hit counts stay untouched.
    second.flush()
    assert all(row["hit_count"] == 0 for row in maintenance.list_entries(second.store))


@pytest.mark.parametrize(
    ("backend", "why"),
    [({"unloadable": [0, 1, 2, 3]}, "no candidate loads back from its blob"), ({"candidates": 2, "wrong": [1]}, "no majority")],
)
def test_a_plan_prewarm_could_not_store_is_never_reported_built(
    tmp_path: Path, make_cache: MakeCache, backend: dict[str, Any], why: str
) -> None:
    """Built but not stored (why): "unpersisted", so the command exits 1; it reported
    "built" and exited 0, and every later prewarm built it again."""
    path = manifest(tmp_path, GOOD[1])
    cache = make_cache(backend=CpuTestBackend(**backend))
    report = prewarm(cache, path, progress=False)
    assert statuses(report) == ["unpersisted"] and cache.store.keys() == []
    cache.close()


def test_resuming_builds_again_what_a_lookup_would_refuse(tmp_path: Path, make_cache: MakeCache) -> None:
    """An entry checked under an older rule (after an upgrade, from an older bundle) has a
    sound blob, but the lookup chooses it again: prewarm must too, or every model process
    autotunes it at start-up."""
    path = manifest(tmp_path, GOOD[1])
    first = make_cache()
    key = prewarm(first, path, progress=False)["entries"][0]["key"]
    entry = first.store.get(key)
    first.close()
    entry.check = {**entry.check, "rule": 1}
    entry.meta_sha256 = entry.meta_digest()
    store = Store(first.directory)
    store.put(entry)
    store.close()
    second = make_cache()
    assert statuses(prewarm(second, path, progress=False)) == ["built"]
    second.close()
    model = make_cache()
    model.get(templates.build("matmul_bias_act", **GOOD[1]["params"]))
    assert model.counters["hits"] == 1 and model.counters["rechecks"] == 0
    model.close()


def test_interrupted_prewarm_resumes_where_it_stopped(tmp_path: Path, make_cache: MakeCache) -> None:
    entries, _ = load_manifest(manifest(tmp_path, *GOOD))
    cache = make_cache()
    prewarm(cache, entries[:2], progress=False)
    report = prewarm(cache, entries, progress=False)
    assert statuses(report) == ["hit", "hit", "built", "built"]


def test_failing_entries_are_reported_and_the_rest_still_build(tmp_path: Path, make_cache: MakeCache) -> None:
    path = manifest(
        tmp_path,
        GOOD[0],
        {"template": "conv_bias_act", "params": {"n": 1, "c": 8, "h": 6, "w": 6}},  # line 4: k missing
        {
            "builder": "plancache.workflows.templates:build",
            "args": ["matmul_bias_act"],
            "kwargs": {"b": 1, "m": 4, "k": 8, "n": 3, "act": "elu"},
        },
        {"builder": "no_such_pkg.graphs:g"},  # line 6
        GOOD[2],
    )
    cache = make_cache()
    report = prewarm(cache, path, progress=False)
    assert (report["built"], report["failed"]) == (3, 3)
    failed = sorted((r["index"], r["line"]) for r in report["entries"] if r["status"] == "failed")
    assert failed == [(1, 4), (2, 5), (3, 6)]
    by_index = {r["index"]: r for r in report["entries"] if r["status"] == "failed"}
    assert "missing ['k']" in by_index[1]["error"]
    assert "manifest.json:5: entry 2" in by_index[2]["error"] and "elu" in by_index[2]["error"]
    assert "no_such_pkg" in by_index[3]["error"]
    assert len(cache.store.keys()) == 3


def test_a_build_error_of_one_graph_does_not_stop_the_others(tmp_path: Path, make_cache: MakeCache) -> None:
    from plancache.testing import CpuTestBackend

    cache = make_cache(backend=CpuTestBackend(candidates=2, unbuildable=[0, 1]))
    report = prewarm(cache, manifest(tmp_path, *GOOD), progress=False)
    assert report["failed"] == 4 and all("BuildError" in r["error"] for r in report["entries"])


def test_dry_run_lists_keys_and_builds_nothing(tmp_path: Path, make_cache: MakeCache) -> None:
    path = manifest(tmp_path, *GOOD)
    cache = make_cache()
    report = prewarm(cache, path, dry_run=True, progress=False)
    assert statuses(report) == ["would_build"] * 4 and report["would_build"] == 4
    assert cache.counters["builds"] == 0 and cache.store.keys() == []
    entries, _ = load_manifest(path)
    assert [r["key"] for r in report["entries"]] == [cache.key(e.build()).digest for e in entries]

    prewarm(cache, path, progress=False)
    assert statuses(prewarm(cache, path, dry_run=True, progress=False)) == ["hit"] * 4


def test_duplicates_and_policy_option(tmp_path: Path, make_cache: MakeCache) -> None:
    cache = make_cache()
    path = manifest(tmp_path, GOOD[1], GOOD[1], {**GOOD[1], "options": {"policy": "exhaustive"}})
    report = prewarm(cache, path, progress=False, options=BuildOptions(policy="heuristic"))
    assert statuses(report) == ["built", "duplicate", "built"]
    assert sorted(row["policy"] for row in maintenance.list_entries(cache.store)) == ["exhaustive", "heuristic"]


class _Terminal(io.StringIO):
    """stdout and stderr of one terminal: what both write lands in one place."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_when_stderr_is_a_terminal() -> None:
    stream = _Terminal()
    bar = Progress(3, True, stream)
    bar.update("built", 1.5)
    bar.update("hit", 0.01)
    bar.close()
    text = stream.getvalue()
    assert "prewarm:  67%" in text and "2/3" in text and "built=1, hit=1, last=0.01s" in text

    tune = _Terminal()
    bar = Progress(2, True, tune, desc="tune")
    bar.update("tuned", 3.0)
    bar.close()
    assert "tuned=1, last=3.00s" in tune.getvalue() and "hit" not in tune.getvalue()  # no count tune has no use for

    quiet = io.StringIO()  # not a terminal: nothing
    bar = Progress(3, True, quiet)
    bar.update("built", 1.0)
    bar.close()
    assert quiet.getvalue() == ""


def test_rows_printed_during_the_progress_bar_start_at_the_left_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal each entry's row was printed after the bar's text (a carriage return
    and no clearing): every row then began with the bar. The bar is cleared before a row."""
    from plancache.workflows.steps import run_each

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    rows = [{"status": "built", "seconds": 0.5}, {"status": "hit", "seconds": 0.01}, {"status": "built", "seconds": 0.2}]
    records = run_each(rows, lambda row: row, progress=True, on_record=lambda record: print(f"ROW {record['status']}"))
    assert records == rows
    for line in terminal.getvalue().split("ROW ")[1:]:
        assert line.startswith(("built", "hit"))
    before = [terminal.getvalue()[i - 1] for i in range(len(terminal.getvalue())) if terminal.getvalue().startswith("ROW", i)]
    assert len(before) == 3 and set(before) == {"\r"}, before  # the bar's line cleared, the row from its start


# ---------------------------------------------------------------------------- warm start


def test_warm_start_from_a_manifest_loads_plans_before_the_first_step(tmp_path: Path, make_cache: MakeCache) -> None:
    path = manifest(tmp_path, *GOOD)
    builder = make_cache()
    prewarm(builder, manifest(tmp_path, *GOOD[:2], name="part.json"), progress=False)  # sdpa is not built
    builder.close()

    cache = make_cache()
    report = warm_start(cache, path)
    assert len(report["loaded"]) == 3 and len(report["missing"]) == 1 and report["failed"] == {}
    assert report["labels"][report["missing"][0]].startswith("sdpa b=1")
    assert report["errors"] == [] and report["seconds"] >= 0
    loads = cache.backend.loads  # type: ignore[attr-defined]
    plan = cache.get(templates.build("conv_bias_act", n=2, c=8, h=6, w=6, k=4))
    assert plan.source == "loaded"
    assert cache.backend.loads == loads and cache.counters["memory_hits"] == 1  # type: ignore[attr-defined]


def test_warm_start_reports_entries_that_cannot_be_keyed(tmp_path: Path, make_cache: MakeCache) -> None:
    path = manifest(
        tmp_path, GOOD[1], {"template": "sdpa", "params": {"b": 1}}, {"builder": "plancache.workflows.templates:build"}
    )
    report = warm_start(make_cache(), path)
    assert report["missing"] and report["loaded"] == []
    assert sorted(e["index"] for e in report["errors"]) == [1, 2]
    assert all("manifest.json:" in e["error"] for e in report["errors"])


def test_warm_start_without_a_manifest_loads_every_entry_of_this_environment(tmp_path: Path, make_cache: MakeCache) -> None:
    prewarm(make_cache(), manifest(tmp_path, *GOOD), progress=False)
    report = warm_start(make_cache())
    assert len(report["loaded"]) == 4 and report["missing"] == [] and report["failed"] == {}


# ---------------------------------------------------------------------------- CLI


def test_cli_prewarm_json_then_resume(tmp_path: Path, cli_env: None, cache_dir: Path) -> None:
    path = manifest(tmp_path, *GOOD)
    runner = CliRunner()
    result = runner.invoke(cli, ["prewarm", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["built"], report["failed"]) == (4, 0)
    again = json.loads(runner.invoke(cli, ["prewarm", str(path), "--json"]).stdout)
    assert (again["built"], again["hits"]) == (0, 4)
    assert stored_keys(cache_dir) == 4


def stored_keys(cache_dir: Path) -> int:
    if not (cache_dir / "plans.db").exists():
        return 0
    store = Store(cache_dir)
    try:
        return len(store.keys())
    finally:
        store.close()


def test_cli_prewarm_dry_run_and_policy(tmp_path: Path, cli_env: None, cache_dir: Path) -> None:
    path = manifest(tmp_path, *GOOD)
    runner = CliRunner()
    result = runner.invoke(cli, ["prewarm", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert sum(line.startswith("would_build") for line in lines) == 4
    assert "4 would build" in lines[-1]
    assert stored_keys(cache_dir) == 0

    result = runner.invoke(cli, ["prewarm", str(path), "--policy", "heuristic", "--json"])
    assert result.exit_code == 0
    store = Store(cache_dir)
    assert {row["policy"] for row in maintenance.list_entries(store)} == {"heuristic"}
    store.close()


# ---------------------------------------------------------------------------- --dry-run on any machine


def _tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.fixture
def no_gpu_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything sets up the cuDNN backend, asks the CUDA driver, or
    initializes CUDA through torch."""
    import torch

    from plancache.cudnn import backend as cudnn_backend

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a dry run touched the GPU")

    monkeypatch.setattr(cudnn_backend.CudnnBackend, "__init__", refuse)
    monkeypatch.setattr(cudnn_backend, "libcuda", refuse)
    monkeypatch.setattr(cudnn_backend, "probe_environment", refuse)
    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "init", refuse)


def test_dry_run_checks_a_manifest_without_a_gpu_and_writes_nothing(tmp_path: Path, cache_dir: Path, no_gpu_work: None) -> None:
    path = manifest(tmp_path, *GOOD, GOOD[1], {"template": "conv3d_zzz"})
    result = CliRunner().invoke(cli, ["prewarm", str(path), "--dry-run", "--json"])  # the default backend: cuDNN
    assert result.exit_code == 3, result.output  # the bad entry
    report = json.loads(result.stdout)
    assert [r["status"] for r in report["entries"]] == ["failed"] + ["checked"] * 4 + ["duplicate"]
    assert report["checked"] == 4 and report["duplicates"] == 1 and report["environment"] is None and report["dry_run"]
    assert all(r["key"] is None for r in report["entries"])
    assert "conv3d_zzz" in report["entries"][0]["error"]
    assert not cache_dir.exists()

    good = manifest(tmp_path, *GOOD, name="good.json")
    result = CliRunner().invoke(cli, ["prewarm", str(good), "--dry-run", "--policy", "exhaustive"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("4 entries: 4 checked (keys need this machine's GPU")
    assert not cache_dir.exists()


def test_dry_run_on_this_machine_in_a_fresh_process_needs_no_gpu(tmp_path: Path) -> None:
    """The command as a user runs it, with the default (cuDNN) backend: on a machine without
    a GPU (CI) it checks the manifest and exits 0; on any machine it creates nothing."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "PLANCACHE_BACKEND"}
    env["PYTHONPATH"] = str(root)
    result = subprocess.run([sys.executable, "-m", "plancache", "--dir", str(cache), "prewarm", str(root / "examples" / "manifest.json"),
                             "--dry-run", "--json"], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["checked"] == report["total"] == 7 and report["failed"] == 0
    assert not cache.exists()


def test_dry_run_with_a_backend_gives_its_keys_and_reads_the_store_without_writing(
    tmp_path: Path, cli_env: None, cache_dir: Path, make_cache: MakeCache
) -> None:
    path = manifest(tmp_path, *GOOD)
    result = CliRunner().invoke(cli, ["prewarm", str(path), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in json.loads(result.stdout)["entries"]] == ["would_build"] * 4
    assert not cache_dir.exists()

    cache = make_cache()
    report = prewarm(cache, path, progress=False)
    cache.close()
    before = _tree(cache_dir)
    result = CliRunner().invoke(cli, ["prewarm", str(path), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    dry = json.loads(result.stdout)
    assert [r["status"] for r in dry["entries"]] == ["hit"] * 4
    assert [r["key"] for r in dry["entries"]] == [r["key"] for r in report["entries"]]
    assert dry["environment"] == report["environment"]
    # Everything stays as it was, with no -wal or -shm left beside plans.db (a read-only
    # SQLite connection once left both behind).
    assert _tree(cache_dir) == before


def test_cli_prewarm_exit_code_3_when_an_entry_fails(tmp_path: Path, cli_env: None) -> None:
    path = manifest(tmp_path, GOOD[1], {"template": "conv3d_zzz"})
    result = CliRunner().invoke(cli, ["prewarm", str(path)])
    assert result.exit_code == 3
    assert "failed" in result.stdout and "line 4" in result.stdout and "conv3d_zzz" in result.stdout
    assert "1 failed" in result.stdout.splitlines()[-1]


def test_cli_prewarm_on_a_broken_manifest_and_a_bad_backend(
    tmp_path: Path, cli_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    result = CliRunner().invoke(cli, ["prewarm", str(broken), "--json"])
    assert result.exit_code == 3 and result.stderr.startswith(f"plancache: error: {broken}:1: not valid JSON")
    assert json.loads(result.stdout) == {"error": result.stderr.strip().removeprefix("plancache: error: "), "exit_code": 3}

    monkeypatch.setenv("PLANCACHE_BACKEND", "plancache.testing:NoSuchBackend")
    result = CliRunner().invoke(cli, ["prewarm", str(manifest(tmp_path, *GOOD))])
    assert result.exit_code == 2 and "NoSuchBackend" in result.output


def test_cli_help_texts() -> None:
    runner = CliRunner()
    for command in ("prewarm", "export", "import", "inspect"):
        result = runner.invoke(cli, [command, "--help"])
        assert result.exit_code == 0 and len(result.output.splitlines()) > 5


def test_primer_loads_healthy_entries_in_the_background_and_writes_nothing(make_cache: MakeCache) -> None:
    from plancache.testing import CpuTestBackend
    from plancache.workflows.prewarm import prime

    builder = make_cache()
    graphs = [templates.build("conv_bias_act", n=n, c=4, h=6, w=6, k=4, dtype="float32") for n in (1, 2)]
    keys = [builder.get(g).key for g in graphs]
    builder.close()
    store = Store()  # damage the second entry: priming skips it, it does not fail
    store.connection().execute("UPDATE plans SET blob_sha256 = 'x' WHERE key = ?", (keys[1],))
    store.close()
    backend = CpuTestBackend()
    cache = make_cache(backend=backend)
    primer = prime(cache)
    primer.join(timeout=30)
    assert not primer.is_alive()
    assert primer.report["primed"] == 1 and list(primer.report["skipped"]) == [keys[1]]
    assert "checksum" in primer.report["skipped"][keys[1]]
    assert backend.loads == 1
    assert cache.counters["hits"] == 0 and cache.counters["corrupt"] == 0, "priming is no hit, and leaves repairs to lookups"
    assert cache.store.get(keys[1]) is not None, "priming never writes: the damaged entry is its lookup's to quarantine"
    plan = cache.get(templates.build("conv_bias_act", n=1, c=4, h=6, w=6, k=4, dtype="float32"))
    assert plan.source == "loaded" and cache.counters["memory_hits"] == 1 and backend.loads == 1, "the primed plan serves it"
