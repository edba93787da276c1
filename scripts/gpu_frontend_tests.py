#!/usr/bin/env python3
"""cuDNN Frontend's own Python tests, run in one pytest process per run, with and without the drop-in.

The frontend's test files (``test_matmul_bias_relu.py``, the convolution, batch-norm,
layer-norm, RMS-norm and instance-norm tests, with their ``conftest.py``) are not part of
this project: they are fetched from the frontend's repository into a directory of their
own (``--tests``, default ``.frontend-tests``, git-ignored) and carried to the GPU machine,
with the ``conftest.py``, ``test_utils.py`` and ``pytest.ini`` of the frontend's
``test/python`` (``pytest.ini`` declares the ``L0`` marks and selects them: without it every
file fails, plain runs too), and the ``looseversion`` wheel among the carried ones.
The script runs a sequence of them (``--files``) in ONE pytest process per run, so later
files run after the earlier ones in the same process, as a user's test session does:

  cold       PLANCACHE_PATCH_CUDNN=1, a fresh PLANCACHE_DIR: plancache autotunes and stores
  warm       the same PLANCACHE_DIR, a fresh process each run (``--runs``)
  noprime    as warm, with PLANCACHE_AUTO_PRIME=0: no primer threads (``--noprime-runs``)
  plain      PLANCACHE_PATCH_CUDNN unset: the frontend alone (``--plain-runs``)

Per run it records the exit code, the failed test ids with pytest's one-line reason, the
warnings plancache printed (candidates without a majority, with their groups and how far
apart; loads that failed; plans not stored because they could not be loaded back) and the
lines that name a failed CUDA graph capture; with ``--stats`` the cache's
``plancache stats --json`` after each drop-in run. It prints one line per mode
(``gpu_frontend_tests: warm 20 runs, 0 failed``), a table of the failing test ids and how
often each failed per mode, the no-majority warnings (which graph, groups, worst element
per bound), and writes everything as JSON with ``--out``. Exit status: 0 when every run of the
drop-in has the frontend's own outcome: with plain runs, each drop-in run fails no test that
no plain run failed and every test that every plain run failed (a test of the frontend that
fails without plancache is its own outcome, not plancache's); without plain runs, when no run
failed. A run that crashed or timed out, without a failed test to name, always fails.

    python scripts/gpu_frontend_tests.py --runs 20 --plain-runs 5 --out frontend-tests.json
    python scripts/gpu_frontend_tests.py --runs 20 --parallel 4     # four warm processes at once
    python scripts/gpu_frontend_tests.py --files test_instancenorm.py --runs 40 --noprime-runs 40
    python scripts/gpu_frontend_tests.py --select "test_in or test_layernorm" --stats

plancache patches the frontend through its start-up hook: each run's process imports
``_plancache_startup`` (what the installed ``plancache-startup.pth`` imports) before
pytest, so the tree's plancache patches the frontend whether or not it is installed.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import benchlib

ROOT = Path(__file__).resolve().parent.parent
#: The sequence of the issue: matmul, convolution, batch norm, layer norm, RMS norm, instance norm.
DEFAULT_FILES = (
    "test_matmul_bias_relu.py", "test_conv_bias.py", "test_conv_fprop.py", "test_conv_genstats.py",
    "test_conv_reduction.py", "test_batchnorm.py", "test_layernorm.py", "test_rmsnorm.py", "test_instancenorm.py",
)  # fmt: skip
#: The launcher of one run: the start-up hook (inert without PLANCACHE_PATCH_CUDNN), then pytest.
LAUNCH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import _plancache_startup, pytest; code = pytest.main(sys.argv[1:]); "
    "print('gpu_frontend_tests: patched=%s' % ('plancache.integrations.frontend' in sys.modules), file=sys.stderr); "
    "sys.exit(int(code))"
)
#: What plancache's warnings say, by kind (the lines start with "plancache:").
WARNING_KINDS = (
    ("no_majority", "disagree and no majority agrees"),
    ("left_to_frontend", "the frontend plans it"),
    ("load_failure", "failed ("),
    ("unloadable", "not storing the plan of"),
    ("unusable", "is unusable"),
    ("judge_disagrees", "the judge refuses a plan"),
    ("priming", "priming stopped"),
)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$")
#: A CUDA graph capture named in the output; not the link to pytest's page on capturing
#: warnings that ends every run with a warning.
_CAPTURE = re.compile(r"capture(?!-warnings)", re.IGNORECASE)


def classify(line: str) -> str:
    for kind, text in WARNING_KINDS:
        if text in line:
            return kind
    return "other"


def parse_run(stdout: str, stderr: str) -> dict[str, Any]:
    """The failed test ids (with pytest's short reason), plancache's warnings by kind, and
    the lines naming a CUDA graph capture, from one run's output."""
    failed: dict[str, str] = {}
    warnings: dict[str, list[str]] = collections.defaultdict(list)
    capture: list[str] = []
    summary = ""
    for line in (stdout + "\n" + stderr).splitlines():
        line = line.rstrip()
        match = _FAILED.match(line)
        if match:
            failed.setdefault(match.group(1), (match.group(2) or "")[:300])
        elif "plancache:" in line:
            text = line[line.index("plancache:") :]
            if text not in warnings[classify(text)]:
                warnings[classify(text)].append(text[:2000])
        if _CAPTURE.search(line) and "plancache:" not in line and len(capture) < 20:
            capture.append(line[:500])
        if re.search(r"\b(passed|failed|error|no tests ran)\b.* in [0-9.]+s", line):
            summary = line.strip("= ")
    patched = "gpu_frontend_tests: patched=True" in stderr
    return {"failed": failed, "warnings": dict(warnings), "capture_lines": capture, "summary": summary, "patched": patched}


def pytest_args(tests: Path, files: Sequence[str], select: str | None, extra: Sequence[str]) -> list[str]:
    args = [str(tests / f) for f in files]
    # -rfE: one line per failure with its reason; -s and no logging plugin: plancache's
    # warnings reach stderr for passing tests too (pytest would keep them for failures only).
    args += ["-q", "-p", "no:cacheprovider", "-p", "no:logging", "-s", "-rfE", "--rootdir", str(tests)]
    if select:
        args += ["-k", select]
    return args + list(extra)


def run_once(mode: str, tests: Path, files: Sequence[str], cache_dir: Path, select: str | None, extra: Sequence[str],
             timeout: float, stats: bool, python: str = sys.executable) -> dict[str, Any]:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "1000"  # pytest cuts each failure's reason to the terminal's width
    if mode != "plain":
        env["PLANCACHE_PATCH_CUDNN"] = "1"
        env["PLANCACHE_DIR"] = str(cache_dir)
        env["PLANCACHE_APP"] = "frontend-tests"
        if mode == "noprime":
            env["PLANCACHE_AUTO_PRIME"] = "0"
    command = [python, "-c", LAUNCH, str(ROOT), *pytest_args(tests, files, select, extra)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code = -9
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        err += f"\ngpu_frontend_tests: timed out after {timeout:.0f} s"
    run = {"mode": mode, "exit_code": code, "seconds": round(time.perf_counter() - started, 2), **parse_run(out, err)}
    if code not in (0, 5) and not run["failed"]:  # crashed, timed out or refused: keep its tail
        run["tail"] = (out[-1500:] + "\n" + err[-2500:]).strip()
    if stats and mode != "plain":
        run["stats"] = cache_stats(cache_dir, env, python)
    return run


def cache_stats(cache_dir: Path, env: Mapping[str, str], python: str = sys.executable) -> Any:
    """``plancache stats --json`` of the cache directory (its error, when it fails)."""
    env = {k: v for k, v in env.items() if k != "PLANCACHE_PATCH_CUDNN"}
    done = subprocess.run([python, "-m", "plancache", "stats", "--dir", str(cache_dir), "--json"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"error": (done.stdout + done.stderr)[-500:], "exit_code": done.returncode}


def failed_run(run: Mapping[str, Any]) -> bool:
    return run["exit_code"] not in (0, 5) or bool(run["failed"])  # 5: no test collected (a --select of nothing)


def plain_outcome_differs(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each run whose outcome is not the frontend's own (the plain runs'), one line each.

    Without plain runs nothing fails on its own, so any failed test differs."""
    plain = [set(r["failed"]) for r in runs if r["mode"] == "plain"]
    always = set.intersection(*plain) if plain else set()
    ever = set().union(*plain)
    differs = []
    for i, run in enumerate(runs):
        name = f"{run['mode']} #{run.get('index', i)}"
        failed = set(run["failed"])
        if failed_run(run) and not failed:
            differs.append(f"{name}: exit {run['exit_code']} without a failed test")
        elif run["mode"] != "plain" and (failed - ever or always - failed):
            differs.append(
                f"{name}: fails {', '.join(sorted(failed - ever)) or '-'}; passes {', '.join(sorted(always - failed)) or '-'}"
            )
    return differs


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode: runs, failed runs, how often each test id failed, and the warnings seen."""
    modes: dict[str, Any] = {}
    for run in runs:
        mode = modes.setdefault(run["mode"], {"runs": 0, "failed_runs": 0, "failed_tests": collections.Counter(),
                                              "warnings": collections.Counter(), "capture_runs": 0})  # fmt: skip
        mode["runs"] += 1
        mode["failed_runs"] += failed_run(run)
        mode["failed_tests"].update(run["failed"].keys())
        mode["capture_runs"] += bool(run["capture_lines"])
        for kind, lines in run["warnings"].items():
            mode["warnings"][kind] += len(lines)
    return {name: {**m, "failed_tests": dict(m["failed_tests"]), "warnings": dict(m["warnings"])} for name, m in modes.items()}


def report(runs: Sequence[Mapping[str, Any]], out: Any = sys.stdout) -> dict[str, Any]:
    summary = summarize(runs)
    for name, mode in summary.items():
        warned = ", ".join(f"{k} {v}" for k, v in sorted(mode["warnings"].items())) or "none"
        print(f"gpu_frontend_tests: {name} {mode['runs']} runs, {mode['failed_runs']} failed "
              f"(plancache warnings: {warned}; runs naming a capture: {mode['capture_runs']})", file=out)  # fmt: skip
    tests = sorted({t for m in summary.values() for t in m["failed_tests"]})
    if tests:
        names = list(summary)
        print(f"\n{'failing test':70} " + " ".join(f"{n:>8}" for n in names), file=out)
        for test in tests:
            print(f"{test[:70]:70} " + " ".join(f"{summary[n]['failed_tests'].get(test, 0):>8}" for n in names), file=out)
        reasons = collections.Counter((t, r) for run in runs for t, r in run["failed"].items())
        print("\nreasons:", file=out)
        for (test, reason), count in reasons.most_common(12):
            print(f"  {count}x {test}: {reason[:240]}", file=out)
    seen = collections.Counter(line for run in runs for line in run["warnings"].get("no_majority", []))
    if seen:
        print("\nno majority (each distinct warning, how many runs):", file=out)
        for line, count in seen.most_common(8):
            print(f"  {count}x {line[:700]}", file=out)
    other = collections.Counter(
        line for run in runs for kind in ("load_failure", "unloadable") for line in run["warnings"].get(kind, [])
    )
    for line, count in other.most_common(6):
        print(f"  {count}x {line[:500]}", file=out)
    captures = collections.Counter(line for run in runs for line in run["capture_lines"])
    for line, count in captures.most_common(6):
        print(f"  capture {count}x: {line[:300]}", file=out)
    for run in runs:
        if "tail" in run:
            print(
                f"\n{run['mode']} run exited {run['exit_code']} without a failed test; its output ends:\n{run['tail'][-1200:]}",
                file=out,
            )
            break
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tests", default=".frontend-tests", help="directory of the frontend's test files and conftest.py")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES), help="comma-separated test files, run in this order")
    parser.add_argument("--select", default=None, help="pytest -k expression")
    parser.add_argument("--runs", type=int, default=20, help="warm runs")
    parser.add_argument("--noprime-runs", type=int, default=0, help="warm runs with PLANCACHE_AUTO_PRIME=0")
    parser.add_argument("--plain-runs", type=int, default=3, help="runs without the drop-in")
    parser.add_argument(
        "--no-cold", action="store_true", help="skip the cold run (the cache directory then starts empty for warm)"
    )
    parser.add_argument("--cache-dir", default=None, help="PLANCACHE_DIR of the drop-in runs (default: a fresh temporary one)")
    parser.add_argument("--stats", action="store_true", help="record `plancache stats --json` after each drop-in run")
    parser.add_argument("--record-corpus", type=Path, default=None,
                        help="add the stored entries to the judge's corpus there (scripts/record_plans.py)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument(
        "--parallel", type=int, default=1,
        help="runs of one mode at once, each its own process (the cold run is always alone, first)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the runs and the summary as JSON here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    tests = Path(args.tests).resolve()
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    missing = [f for f in files if not (tests / f).is_file()]
    if not tests.is_dir() or missing:
        print(f"gpu_frontend_tests: no such test files in {tests}: {', '.join(missing) or '(no directory)'}", file=sys.stderr)
        return 2
    cache_dir = Path(args.cache_dir) if args.cache_dir else benchlib.scratch("plancache-frontend-tests-")
    plan = (
        ([] if args.no_cold else ["cold"]) + ["warm"] * args.runs + ["noprime"] * args.noprime_runs + ["plain"] * args.plain_runs
    )
    print(
        f"gpu_frontend_tests: {len(files)} files from {tests}, cache {cache_dir}, runs: {', '.join(f'{m} {plan.count(m)}' for m in dict.fromkeys(plan))}"
    )
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()

    def one(i: int, mode: str) -> dict[str, Any]:
        run = run_once(mode, tests, files, cache_dir, args.select, args.pytest_args, args.timeout, args.stats)
        run["index"] = i
        failed = ", ".join(run["failed"]) or ("-" if not failed_run(run) else f"exit {run['exit_code']}")
        print(f"  {mode:8} #{i:<3} exit {run['exit_code']:>3} {run['seconds']:7.1f} s  {run['summary'][:60]:60} failed: {failed[:200]}",
              flush=True)  # fmt: skip
        if mode != "plain" and not run["patched"]:
            print(f"  (run #{i}: plancache did not patch the frontend in this process)", flush=True)
        return run

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for mode, indices in itertools.groupby(range(len(plan)), key=lambda i: plan[i]):
            batch = list(indices)
            width = 1 if mode == "cold" else max(1, args.parallel)
            for start in range(0, len(batch), width):  # one mode at a time, `width` runs of it at once
                runs.extend(pool.map(lambda i: one(i, plan[i]), batch[start : start + width]))
    print()
    summary = report(runs)
    print(f"gpu_frontend_tests: {time.perf_counter() - started:.0f} s in all")
    if args.record_corpus is not None:
        from record_plans import record

        print(f"gpu_frontend_tests: {record([cache_dir], args.record_corpus, source='frontend-tests')} entries recorded")
    if args.out:
        Path(args.out).write_text(json.dumps({"files": files, "tests": str(tests), "cache_dir": str(cache_dir), "select": args.select,
                                              "summary": summary, "runs": runs}, indent=1, default=str))  # fmt: skip
    differs = plain_outcome_differs(runs)
    for line in differs:
        print(f"gpu_frontend_tests: not the frontend's own outcome: {line}")
    own = sorted(summary.get("plain", {}).get("failed_tests", {}))
    if not differs:
        print(
            f"gpu_frontend_tests: every run has the frontend's own outcome (failing without plancache too: {', '.join(own) or 'none'})"
        )
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
