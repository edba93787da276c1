"""scripts/bench_model.py: what it does without a GPU (mode selection, each child's
environment, aggregation of repeats, the table, the failure checks), and that without a
GPU it exits 1 with one line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_model.py"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_bench()
HEADER = {"date": "2026-12-01", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cudnn": 91900, "cudnn_frontend": "1.32.0",
          "batch": 8, "checkpoint_mb": 1024, "repeats": 3, "steps": 20, "warmup": 3}  # fmt: skip


def run(mode: str, **figures: Any) -> dict[str, Any]:
    base = {"mode": mode, "import_s": 2.0, "weights_s": 1.0, "first_output_after_weights_s": 0.05, "first_output_s": 3.05,
            "step_ms": 0.5, "captured_step_ms": 0.2, "process_s": 4.0, "rel_error": 2e-3, "captured_rel_error": 2e-3,
            "capture_error": None, "weights_match": True}  # fmt: skip
    return {**base, **figures}


def test_all_modes_by_default_in_the_canonical_order() -> None:
    assert bench.select_modes(None) == bench.MODES
    assert bench.MODES == ["eager", "compile-cold", "compile-warm", "plancache-nocache", "plancache-cold", "plancache-warm",
                           "plancache-primed", "plancache-primed-device-first"]  # fmt: skip


def test_a_subset_runs_in_the_canonical_order_with_the_cold_run_each_warm_one_needs() -> None:
    assert bench.select_modes("plancache-primed, eager") == ["eager", "plancache-cold", "plancache-primed"]
    assert bench.select_modes("compile-warm") == ["compile-cold", "compile-warm"]
    assert bench.select_modes("plancache-warm,plancache-warm,plancache-nocache") == [
        "plancache-nocache", "plancache-cold", "plancache-warm"]  # fmt: skip
    assert bench.select_modes("compile-cold") == ["compile-cold"]


def test_unknown_or_empty_modes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown mode.*warmish"):
        bench.select_modes("eager,warmish")
    with pytest.raises(ValueError, match="no mode"):
        bench.select_modes(" , ")


def test_modes_on_the_command_line(tmp_path: Path) -> None:
    assert bench.parse_args(["--modes", "plancache-warm"]).modes == ["plancache-cold", "plancache-warm"]
    with pytest.raises(SystemExit) as bad:
        bench.parse_args(["--modes", "nope"])
    assert bad.value.code == 2
    (tmp_path / "left-over").write_text("x")
    with pytest.raises(SystemExit):  # the cold modes need empty caches
        bench.parse_args(["--keep", str(tmp_path)])


def test_cold_modes_run_once_the_others_repeat() -> None:
    assert [bench.runs_of(m, 3) for m in bench.MODES] == [3, 1, 3, 3, 1, 3, 3, 3]
    assert bench.runs_of("eager", 1) == 1


def test_each_child_environment(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "PLANCACHE_AUTO_PRIME": "0", "PLANCACHE_APP": "other", "TRITON_CACHE_DIR": "/elsewhere"}
    env = {mode: bench.child_env(mode, tmp_path, base) for mode in bench.MODES}
    for mode in bench.MODES:
        assert env[mode]["PATH"] == "/bin"
    # the compile modes share their own caches under the bench's root; no other mode has them
    assert env["compile-cold"]["TORCHINDUCTOR_CACHE_DIR"] == env["compile-warm"]["TORCHINDUCTOR_CACHE_DIR"]
    assert env["compile-cold"]["TRITON_CACHE_DIR"] == env["compile-warm"]["TRITON_CACHE_DIR"]
    assert Path(env["compile-cold"]["TRITON_CACHE_DIR"]).is_relative_to(tmp_path)
    assert "TRITON_CACHE_DIR" not in env["eager"] and "TORCHINDUCTOR_CACHE_DIR" not in env["plancache-warm"]
    # every plancache mode records under one application name; only the primed ones have
    # auto-prime at its default (on), the others turn it off
    for mode in ("plancache-nocache", "plancache-cold", "plancache-warm", "plancache-primed", "plancache-primed-device-first"):
        assert env[mode]["PLANCACHE_APP"] == "bench_model"
        assert env[mode].get("PLANCACHE_AUTO_PRIME") == (None if mode.startswith("plancache-primed") else "0")
    for mode in ("eager", "compile-warm"):
        assert "PLANCACHE_AUTO_PRIME" not in env[mode]
    assert "PLANCACHE_APP" not in env["eager"]
    assert bench.mode_dir("plancache-cold", tmp_path) == bench.mode_dir("plancache-primed", tmp_path) is not None
    assert bench.mode_dir("plancache-primed-device-first", tmp_path) == bench.mode_dir("plancache-cold", tmp_path)
    assert bench.mode_dir("plancache-nocache", tmp_path) is None and bench.mode_dir("eager", tmp_path) is None


def test_the_last_json_line_of_a_child_wins() -> None:
    out = 'a log line\n{"mode": "eager", "step_ms": 1}\n{"mode": "eager", "step_ms": 1, "rel_error": 0.001}\n'
    assert bench.last_json(out) == {"mode": "eager", "step_ms": 1, "rel_error": 0.001}
    assert bench.last_json("no json here\n[1, 2]\n") is None


def test_repeats_aggregate_to_medians_and_the_worst_error() -> None:
    runs = [run("plancache-warm", step_ms=0.5, process_s=5.0, rel_error=1e-3, counters={"hits": 6}),
            run("plancache-warm", step_ms=0.7, process_s=4.0, rel_error=3e-3, captured_step_ms=None,
                capture_error="RuntimeError: capture failed"),
            run("plancache-warm", step_ms=0.6, process_s=6.0, rel_error=2e-3, captured_step_ms=0.3, counters={"hits": 7})]  # fmt: skip
    row = bench.aggregate("plancache-warm", runs)
    assert row["runs"] == 3
    assert row["step_ms"] == 0.6 and row["process_s"] == 5.0
    assert row["captured_step_ms"] == 0.25  # the median of the replays that were captured
    assert row["rel_error"] == 3e-3
    assert row["capture_error"] == "RuntimeError: capture failed"
    assert row["counters"] == {"hits": 7} and row["error"] is None and row["weights_match"] is True
    empty = bench.aggregate("eager", [run("eager", captured_step_ms=None, captured_rel_error=None, weights_match=False)])
    assert empty["captured_step_ms"] is None and empty["captured_rel_error"] is None and empty["weights_match"] is False


def test_how_often_the_primer_was_done_before_the_weights_is_counted_over_the_processes() -> None:
    runs = [run("plancache-primed", primer={"primed": 6, "seconds": 0.3, "weights_s": 0.9, "done_when_weights_loaded": done})
            for done in (True, False, True)]  # fmt: skip
    row = bench.aggregate("plancache-primed", runs)
    assert row["primer_done_before_weights"] == [2, 3]
    assert "plancache-primed: the primer was done when the weights were loaded in 2 of 3 processes" in bench.format_table(
        [row], HEADER
    )
    assert "primer_done_before_weights" not in bench.aggregate("plancache-warm", [run("plancache-warm")])


def test_the_table() -> None:
    rows = [bench.aggregate("eager", [run("eager")]),
            bench.aggregate("compile-cold", [run("compile-cold", first_output_after_weights_s=41.5, captured_step_ms=None,
                                                 captured_rel_error=None, capture_error="RuntimeError: not capturable\nmore")]),
            bench.aggregate("plancache-cold", [{"mode": "plancache-cold", "process_s": 1.0, "error": "exit code 1: boom"}])]  # fmt: skip
    text = bench.format_table(rows, HEADER)
    lines = text.strip().splitlines()
    assert "2026-12-01" in lines[0] and "NVIDIA H200" in lines[0] and "91900" in lines[0] and "1.32.0" in lines[0]
    assert "batch 8" in lines[0] and "1024 MiB" in lines[0] and "2.11.0+cu130" in lines[0]
    for column in ("first output after weights ms", "first output from start s", "step ms", "captured step ms", "process s",
                   "rel err"):  # fmt: skip
        assert column in lines[1]
    eager, compiled, failed = lines[2:5]
    assert eager.split() == ["eager", "50.0", "3.050", "0.500", "0.200", "4.00", "2.0e-03"]
    assert compiled.split() == ["compile-cold", "41500.0", "3.050", "0.500", "n/a", "4.00", "2.0e-03"]
    assert len(eager) == len(compiled) == len(lines[1])  # columns line up, n/a too
    assert failed.startswith("plancache-cold") and "failed: exit code 1: boom" in failed
    assert "captured step n/a for compile-cold: RuntimeError: not capturable" in text
    assert "median of 20 steps after 3 untimed ones" in text and "default mode" in text and "reduce-overhead" in text


def test_what_fails_the_bench() -> None:
    good = bench.aggregate("eager", [run("eager")])
    assert bench.problems([good], 2e-2) == []
    off = bench.aggregate("eager", [run("eager", rel_error=5e-2)])
    captured_off = bench.aggregate("plancache-warm", [run("plancache-warm", captured_rel_error=0.5)])
    failed = bench.aggregate("plancache-cold", [{"mode": "plancache-cold", "error": "exit code 1: boom"}])
    moved = bench.aggregate("compile-warm", [run("compile-warm", weights_match=False)])
    found = bench.problems([good, off, captured_off, failed, moved], 2e-2)
    assert any(p.startswith("eager: first output") for p in found)
    assert any(p.startswith("plancache-warm: captured output") for p in found)
    assert "plancache-cold failed" in found
    assert any(p.startswith("compile-warm: weights") for p in found)
    # a capture that failed is a figure (n/a), not a failure
    assert bench.problems([bench.aggregate("eager", [run("eager", captured_rel_error=None, capture_error="x")])], 2e-2) == []


@pytest.mark.slow
def test_without_a_gpu_it_says_so_in_one_line_and_exits_1() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint-mb", "1"], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs an NVIDIA GPU" in lines[0], done.stderr


def test_each_process_figures_are_listed_in_the_order_they_ran() -> None:
    runs = {"eager": [run("eager", step_ms=0.25, input_s=0.021), run("eager", step_ms=0.55, input_s=0.031)],
            "plancache-cold": [run("plancache-cold")]}  # fmt: skip
    lines = bench.per_process(runs)
    assert lines[0] == "per process, in the order they ran:"
    assert any(line.split()[0] == "eager" and "step ms" in line and line.endswith("0.250 0.550") for line in lines)
    assert any("creating the input ms" in line and line.endswith("21.0 31.0") for line in lines)
    assert not any("plancache-cold" in line for line in lines), "a mode run once has no spread to show"
    assert bench.per_process({"eager": [run("eager")]}) == []
