"""scripts/gpu_frontend_tests.py on a tiny fake test directory: its machinery (one pytest
process per run, cold, warm, unprimed and plain runs, failed ids, plancache's warnings,
stats, the JSON) runs on the CPU, so the GPU run cannot fail on it for a trivial reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.slow
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


def _run(mode: str, index: int, failed: dict[str, str], exit_code: int | None = None) -> dict[str, Any]:
    code = (1 if failed else 0) if exit_code is None else exit_code
    return {"mode": mode, "index": index, "exit_code": code, "failed": failed}


def test_a_test_that_fails_without_plancache_too_is_the_frontends_own_outcome() -> None:
    # what an H100 gave: one frontend test fails in every run, plain included (cuDNN refuses its engine config)
    own = {"test_conv_bias.py::test_conv_relu_execution_plan_creation": "cudnnGraphNotSupportedError"}
    runs = [_run("cold", 0, own), _run("warm", 1, own), _run("warm", 2, own), _run("plain", 3, own)]
    script = _script()
    assert script.plain_outcome_differs(runs) == []
    # a drop-in run that fails another test, or passes the one every plain run fails, differs
    runs[1] = _run("warm", 1, {**own, "test_a.py::test_ok": "AssertionError"})
    runs[2] = _run("warm", 2, {})
    assert script.plain_outcome_differs(runs) == [
        "warm #1: fails test_a.py::test_ok; passes -",
        "warm #2: fails -; passes test_conv_bias.py::test_conv_relu_execution_plan_creation",
    ]
    # a test that fails in only some plain runs may fail or pass under the drop-in
    flaky = {"test_b.py::test_flaky[0]": "AssertionError"}
    runs = [_run("warm", 0, flaky), _run("warm", 1, {}), _run("plain", 2, flaky), _run("plain", 3, {})]
    assert script.plain_outcome_differs(runs) == []
    # a crash without a failed test to name differs in any mode; with no plain run, any failure differs
    assert script.plain_outcome_differs([_run("plain", 0, {}, exit_code=-9)]) == ["plain #0: exit -9 without a failed test"]
    assert script.plain_outcome_differs([_run("warm", 0, own)]) == [
        "warm #0: fails test_conv_bias.py::test_conv_relu_execution_plan_creation; passes -"
    ]


@pytest.mark.slow
def test_the_script_passes_when_the_only_failure_is_the_frontends_own(tmp_path: Path, capsys: Any) -> None:
    tests = tmp_path / "fe"
    tests.mkdir()
    (tests / "test_a.py").write_text(FAKE_PASS)
    (tests / "test_c.py").write_text("def test_unsupported():\n    raise RuntimeError('CUDNN_STATUS_NOT_SUPPORTED')\n")
    script = _script()
    args = ["--tests", str(tests), "--files", "test_a.py,test_c.py", "--runs", "1", "--cache-dir", str(tmp_path / "c")]
    assert script.main([*args, "--plain-runs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "every run has the frontend's own outcome (failing without plancache too: test_c.py::test_unsupported)" in printed
    assert script.main([*args, "--plain-runs", "0"]) == 1  # nothing to compare with: a failure is a failure
    assert "not the frontend's own outcome: cold #0: fails test_c.py::test_unsupported; passes -" in capsys.readouterr().out
