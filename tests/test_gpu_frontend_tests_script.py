"""scripts/gpu_frontend_tests.py on a tiny fake test directory: its machinery (one pytest
process per run, cold, warm, unprimed and plain runs, failed ids, plancache's warnings,
stats, the JSON) runs on the CPU, so the GPU run cannot fail on it for a trivial reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _script() -> Any:
    if str(ROOT / "scripts") not in sys.path:  # where the script, run as one, finds benchlib
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("gpu_frontend_tests", ROOT / "scripts" / "gpu_frontend_tests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


FAKE_CONFTEST = """
import os, sys
def pytest_configure(config):
    # what a warm run of the drop-in prints, as plancache's logger writes it
    if os.environ.get("PLANCACHE_PATCH_CUDNN") and os.environ.get("PLANCACHE_AUTO_PRIME") != "0":
        print("plancache: the candidates of abc (INSTANCENORM_BWD) disagree and no majority agrees: "
              "eng1 = eng2; eng3 (worst element 75.2 times its bound, over 3)", file=sys.stderr)
"""
FAKE_PASS = "def test_ok():\n    assert 1 + 1 == 2\n"
FAKE_FAIL = """
import os
import pytest
@pytest.mark.parametrize("p", [0, 1])
def test_flaky(p):
    assert not (p == 0 and os.environ.get("PLANCACHE_PATCH_CUDNN")), "cuda_graph_end_capture failed: a previous error during capture"
"""


def test_the_script_runs_every_mode_and_reports_failures(tmp_path: Path, capsys: Any) -> None:
    tests = tmp_path / "fe"
    tests.mkdir()
    (tests / "conftest.py").write_text(FAKE_CONFTEST)
    (tests / "test_a.py").write_text(FAKE_PASS)
    (tests / "test_b.py").write_text(FAKE_FAIL)
    out = tmp_path / "runs.json"
    script = _script()
    code = script.main(["--tests", str(tests), "--files", "test_a.py,test_b.py", "--runs", "2", "--noprime-runs", "1",
                        "--plain-runs", "1", "--cache-dir", str(tmp_path / "cache"), "--stats", "--out", str(out),
                        "--parallel", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 1
    assert "gpu_frontend_tests: cold 1 runs, 1 failed" in printed
    assert "gpu_frontend_tests: warm 2 runs, 2 failed" in printed
    assert "gpu_frontend_tests: noprime 1 runs, 1 failed" in printed
    assert "gpu_frontend_tests: plain 1 runs, 0 failed" in printed
    assert "test_b.py::test_flaky[0]" in printed and "INSTANCENORM_BWD" in printed
    data = json.loads(out.read_text())
    warm = data["summary"]["warm"]
    assert warm["failed_tests"] == {"test_b.py::test_flaky[0]": 2} and warm["warnings"] == {"no_majority": 2}
    assert data["summary"]["noprime"]["warnings"] == {}
    runs = data["runs"]
    assert [r["mode"] for r in runs] == ["cold", "warm", "warm", "noprime", "plain"]  # two warm runs at once, in order
    assert [r["index"] for r in runs] == [0, 1, 2, 3, 4]
    assert all("previous error during capture" in r["failed"]["test_b.py::test_flaky[0]"] for r in runs[:4])
    assert all(isinstance(r.get("stats"), dict) for r in runs[:4]) and "stats" not in runs[4]


def test_a_missing_directory_or_file_is_refused(tmp_path: Path, capsys: Any) -> None:
    script = _script()
    assert script.main(["--tests", str(tmp_path / "nothing"), "--runs", "1"]) == 2
    (tmp_path / "fe").mkdir()
    assert script.main(["--tests", str(tmp_path / "fe"), "--files", "test_x.py"]) == 2
    assert "test_x.py" in capsys.readouterr().err


def test_a_run_is_read_by_what_it_printed() -> None:
    script = _script()
    stdout = (
        "FAILED test_b.py::test_flaky[0] - AssertionError: cuda_graph_end_capture failed\n"
        "-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html\n"
        "=== 1 failed, 3 passed, 1 warning in 2.50s ===\n"
    )
    stderr = (
        "plancache: no plan of this graph is stored (its candidates did not agree, or loading the stored one "
        "failed for now); the frontend plans it\n"
    )
    run = script.parse_run(stdout, stderr)
    assert run["failed"] == {"test_b.py::test_flaky[0]": "AssertionError: cuda_graph_end_capture failed"}
    assert run["capture_lines"] == ["FAILED test_b.py::test_flaky[0] - AssertionError: cuda_graph_end_capture failed"]
    assert list(run["warnings"]) == ["left_to_frontend"]
    assert run["summary"] == "1 failed, 3 passed, 1 warning in 2.50s"
