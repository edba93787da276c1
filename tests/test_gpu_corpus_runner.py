"""scripts/gpu_corpus.py on a CPU, over stand-in programs: it installs plancache's wheel
into a fresh environment whose start-up hook patches the programs, runs each in its three
fresh processes, and judges and prints every row, whatever one program does (a crash in one
phase, a hang past ``--timeout``).

The stand-ins are not GPU programs: they import cuDNN Frontend (which the hook patches),
look one graph up through the installed plancache on its CPU test backend, so that the
store holds plancache's own rows (the plan the cold run stores, the hit the warm run
records when it exits), and print the report line the corpus programs print. The runner
reads those rows as it reads a GPU run's: a change to what plancache stores, or to when it
writes a hit, fails this test as it would fail the corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STAND_IN = """
import json, os, sys, time
import cudnn  # the program's own import: the start-up hook patches cuDNN Frontend here
patched = os.environ.get("PLANCACHE_PATCH_CUDNN") == "1"
BEHAVIOUR
if patched:  # one lookup through plancache: the cold run stores the plan, the warm run hits it
    from plancache import PlanCache
    from plancache.testing import CpuTestBackend
    from plancache.workflows import templates

    cache = PlanCache(backend=CpuTestBackend(), auto_prime=False)  # PLANCACHE_DIR: the runner's, per program
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
    "hangs_cold": "if patched and not os.path.exists(os.path.join(os.environ['PLANCACHE_DIR'], 'plans.db')): time.sleep(120)",
}


def test_the_runner_judges_every_program_and_survives_failing_ones(tmp_path: Path, plancache_wheel: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, behaviour in BEHAVIOURS.items():
        (corpus / f"{name}.py").write_text(STAND_IN.replace("BEHAVIOUR", behaviour).replace("NAME", name))
    out = tmp_path / "corpus.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_corpus.py"), "--corpus", str(corpus), "--out", str(out),
         "--timeout", "10", "--jobs", "3", "--wheel", str(plancache_wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # two programs fail
    report = json.loads(out.read_text())
    assert report["install"]["installed"].startswith("wheel plancache-") and report["install"]["hook"]
    programs = report["programs"]
    assert set(programs) == set(BEHAVIOURS)
    steady = programs["steady"]
    assert steady["pass"], steady["failures"]
    assert steady["stored"] == 1 and steady["warm_hits"] == 1 and steady["first_call_ms"]["warm"] == 1.0
    assert not programs["crashes_warm"]["pass"] and any("outcomes differ" in f for f in programs["crashes_warm"]["failures"])
    assert not programs["hangs_cold"]["pass"] and "timeout" in json.dumps(programs["hangs_cold"]["failures"])
    table = done.stdout
    assert all(name in table for name in BEHAVIOURS) and "1 of 3 programs pass" in table
