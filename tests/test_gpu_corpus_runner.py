"""scripts/gpu_corpus.py on a CPU, over stand-in programs: it installs plancache into a fresh
environment whose start-up hook patches the programs, runs each in its three fresh
processes, and judges and prints every row, whatever one program does (a crash in one
phase, a hang past ``--timeout``, a stored plan outside its program's limit).

The stand-ins are not GPU programs: they import cuDNN Frontend (which the hook patches),
look one graph up through the installed plancache on its CPU test backend, so that the
store holds plancache's own rows (the plan the cold run stores, the hit the warm run
records when it exits; for a plan that cannot be loaded back, none, and plancache's own
warning), and print the report line the corpus programs print. The runner reads those rows
as it reads a GPU run's. Only ``over_its_limit`` writes a row by hand: a plan stored outside
the program's workspace limit, which plancache never stores, so that the runner is seen
to catch it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STAND_IN = """
import json, os, sqlite3, sys, time
import cudnn  # the program's own import: the start-up hook patches cuDNN Frontend here
patched = os.environ.get("PLANCACHE_PATCH_CUDNN") == "1"
backend_options, outside = {}, False
BEHAVIOUR
if patched and outside:  # a row plancache never writes: a plan over the program's workspace limit
    os.makedirs(os.environ["PLANCACHE_DIR"], exist_ok=True)
    conn = sqlite3.connect(os.path.join(os.environ["PLANCACHE_DIR"], "plans.db"))
    conn.execute("CREATE TABLE IF NOT EXISTS plans (key TEXT PRIMARY KEY, label TEXT, hit_count INTEGER NOT NULL DEFAULT 0, "
                 "workspace_size INTEGER, options_json TEXT, graph_json TEXT, engine_json TEXT)")
    if conn.execute("SELECT count(*) FROM plans").fetchone()[0]:
        conn.execute("UPDATE plans SET hit_count = hit_count + 1")
    else:
        conn.execute("INSERT INTO plans VALUES ('key', 'MATMUL', 0, 4096, ?, '{}', '{}')", (json.dumps({"workspace_limit": 1024}),))
    conn.commit()
elif patched:  # one lookup through plancache: the cold run stores the plan, the warm run hits it
    from plancache import PlanCache
    from plancache.testing import CpuTestBackend
    from plancache.workflows import templates

    cache = PlanCache(backend=CpuTestBackend(**backend_options), auto_prime=False)  # PLANCACHE_DIR: the runner's, per program
    cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=3))
    cache.close()  # writes the warm run's hit
print("CORPUS_RESULT " + json.dumps({
    "program": "NAME", "idiom": "stand-in", "outcome": "ok", "ok": True, "graphs": {"g": {"first_call_ms": 1.0}},
    "first_call_ms_total": 1.0, "outputs": {}, "notes": [], "plancache_loaded": "plancache" in sys.modules,
    "pipeline_patched": hasattr(cudnn.pygraph.build_plans, "__plancache_original__"),
}))
"""

BEHAVIOURS = {
    "steady": "",
    "crashes_warm": "if patched and os.path.exists(os.path.join(os.environ['PLANCACHE_DIR'], 'plans.db')): os._exit(3)",
    # Sleeps past any --timeout the tests give (the runner kills it when that expires).
    "hangs_cold": "if patched and not os.path.exists(os.path.join(os.environ['PLANCACHE_DIR'], 'plans.db')): time.sleep(3600)",
    "over_its_limit": "outside = True",
    "not_loadable": "backend_options = {'unloadable': range(8)}",
}
PASSING = {"steady", "not_loadable"}


def _corpus(tmp_path: Path, names: list[str]) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in names:
        (corpus / f"{name}.py").write_text(STAND_IN.replace("BEHAVIOUR", BEHAVIOURS[name]).replace("NAME", name))
    return corpus


@pytest.fixture(scope="module")
def program_timeout() -> float:
    """Seconds a stand-in process may take: a multiple of what starting one costs on this
    machine now (a Python that imports cuDNN Frontend, torch and plancache, measured three
    at once as the runner's three jobs start them), at least 10. A fixed 10 s timed out
    the passing programs of a machine busy with other work."""
    started = time.perf_counter()
    starts = [subprocess.Popen([sys.executable, "-c", "import cudnn, torch, plancache.testing"]) for _ in range(3)]
    for start in starts:
        start.wait(timeout=600)
    return max(10.0, 3 * (time.perf_counter() - started))


def _run_corpus(
    tmp_path: Path, corpus: Path, timeout: float, *options: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "corpus.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_corpus.py"), "--corpus", str(corpus), "--out", str(out),
         "--timeout", f"{timeout:.1f}", "--jobs", "3", *options],
        capture_output=True, text=True, timeout=60 + 20 * timeout,  # five programs, three phases, three at a time
    )  # fmt: skip
    return done, json.loads(out.read_text())


def test_the_runner_judges_every_program_and_survives_failing_ones(
    tmp_path: Path, plancache_wheel: Path, program_timeout: float
) -> None:
    done, report = _run_corpus(tmp_path, _corpus(tmp_path, list(BEHAVIOURS)), program_timeout, "--wheel", str(plancache_wheel))
    assert done.returncode == 1, done.stdout + done.stderr  # three programs fail
    assert report["install"]["installed"].startswith("wheel plancache-") and report["install"]["hook"]
    assert report["install"]["variable_check"] == "True"
    programs = report["programs"]
    assert set(programs) == set(BEHAVIOURS)
    assert {name for name, verdict in programs.items() if verdict["pass"]} == PASSING, done.stdout
    steady = programs["steady"]
    assert steady["stored"] == 1 and steady["warm_hits"] == 1 and steady["first_call_ms"]["warm"] == 1.0
    assert programs["not_loadable"]["stored"] == 0 and programs["not_loadable"]["refused"] == 1
    over = programs["over_its_limit"]
    assert over["limits"] == "1 OUTSIDE" and any("over the limit of 1024" in f for f in over["failures"])
    assert not programs["crashes_warm"]["pass"] and any("outcomes differ" in f for f in programs["crashes_warm"]["failures"])
    assert not programs["hangs_cold"]["pass"] and "timeout" in json.dumps(programs["hangs_cold"]["failures"])
    table = done.stdout
    assert all(name in table for name in BEHAVIOURS) and "2 of 5 programs pass; the variable check passes" in table


def test_the_runner_installs_plancache_as_the_readme_sets_it_up(tmp_path: Path, program_timeout: float) -> None:
    """``--install editable``: ``pip install -e`` of the tree, where the variable patches too."""
    done, report = _run_corpus(tmp_path, _corpus(tmp_path, ["steady"]), program_timeout, "--install", "editable")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["install"]["installed"] == "editable (pip install -e of the tree)" and report["install"]["hook"]
    assert report["install"]["variable_check"] == "True" and report["programs"]["steady"]["pass"]
    assert "1 of 1 programs pass; the variable check passes" in done.stdout
