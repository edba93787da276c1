#!/usr/bin/env python3
"""cuDNN Frontend programs, unchanged, with and without ``PLANCACHE_PATCH_CUDNN=1``.

Runs every program of scripts/corpus/ (plain frontend code: the five steps, ``build()``,
``with cudnn.graph(handle)``, the build inside ``execute()``, ``@cudnn.jit`` and
``@cudnn.graph_cache``; convolutions, matmul epilogues, attention forward and backward,
ragged and paged attention, paged decode as serving libraries write it, layer, RMS,
instance and batch norms, dynamic shapes with the frontend's kernel cache, a workspace
limit, a rejected graph) in three fresh processes each:

  frontend   no variable: the frontend's own planning (plancache installed, and inert)
  cold       PLANCACHE_PATCH_CUDNN=1, an empty PLANCACHE_DIR: plancache autotunes and stores
  warm       PLANCACHE_PATCH_CUDNN=1, the same PLANCACHE_DIR, a new process: every plan a hit

and checks, per program: the same outcome in the three; every output within its tolerance
of a float32 PyTorch reference, and the cold and warm outputs within it of the frontend's;
plancache in the patched processes only; after the cold run one stored plan per graph, or a
notice saying why a plan was not stored (one that could not be loaded back); the warm run
stores nothing new and hits every stored plan; no stored plan outside its program's limits
(more workspace than its ``deselect_workspace_greater_than``, an engine it deselected). It
prints a table with each program's first-call latency in the three (construction, planning
and first execution of every graph, in milliseconds) and writes everything as JSON with
``--out``.

plancache is installed the way a user installs it, so that the start-up hook is what
patches the programs: a wheel built from this tree (``--install wheel``, the default), or a
copy of the tree installed as the README's set-up does (``--install editable``: ``pip
install -e``), with this interpreter's setuptools and no network, into a fresh virtual
environment that sees this interpreter's packages (torch, cuDNN Frontend, plancache's
dependencies) through a ``.pth`` file. Before the programs, the README's check of the
variable runs there (``PLANCACHE_PATCH_CUDNN=1 python -c "import cudnn, sys; print('plancache'
in sys.modules)"`` must print True). The programs run with that environment's interpreter. A failing program, or one that hangs or
crashes, fails its row; the table is printed whatever happens. Programs run in parallel
(``--jobs``), so latencies include some contention; ``--jobs 1`` runs them one at a time.

    python scripts/gpu_corpus.py --out corpus.json                 # every program
    python scripts/gpu_corpus.py --install editable --out corpus.json
    python scripts/gpu_corpus.py --programs layernorm_jit --jobs 1

Needs an NVIDIA GPU, torch, cuDNN Frontend 1.32 and plancache's dependencies importable
by this interpreter (``PYTHONPATH`` may point at unpacked wheels), and ``setuptools`` for
the wheel (without it, the tree is copied into the environment instead, and the JSON says
so). Exit status: 0 when every program passes, 1 otherwise.

``--smoke``: the same orchestration on a CPU with one trivial program: the corpus listed,
plancache copied from the tree into a fresh virtual environment (no wheel built), the
variable's check and the environment's probe there, then ``scripts/corpus/_smoke_lookup.py``
(cuDNN Frontend imported and patched by the hook, one ``PlanCache.get`` on the CPU test
backend) in its three fresh processes, read, judged, the table and JSON. The cuDNN Frontend
programs of the corpus are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402 - after the path it is found on

CORPUS = ROOT / "scripts" / "corpus"
#: A smoke run's one program: not a cuDNN program (its name keeps it out of the listing).
SMOKE_PROGRAM = CORPUS / "_smoke_lookup.py"
PREFIX = "CORPUS_RESULT "
#: What every report line holds (scripts/corpus/_corpus.py writes it).
REPORT_KEYS = frozenset(
    {"outcome", "ok", "idiom", "graphs", "first_call_ms_total", "outputs", "plancache_loaded", "pipeline_patched"}
)
PHASES = ("frontend", "cold", "warm")
#: What the wheel is built from.
SHIPPED_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "plancache-startup.pth", "_plancache_startup.py")
SHIPPED_FOLDERS = ("plancache", "migrations")
#: How the cold run says that a plan it built was not stored, because it could not be loaded
#: back (the cache's warning, once per key: "... the plan of KEY (GRAPH): WHY").
NOT_STORED = "plancache: not storing the plan of "
#: The README's check of the variable, run in the environment before the programs.
VARIABLE_CHECK = "import cudnn, sys; print('plancache' in sys.modules)"


# ---------------------------------------------------------------------- the environment


def _run(args: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def _outer_site_dirs() -> list[str]:
    """Where this interpreter finds its packages: its site-packages (and the user's)."""
    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    unique: list[str] = []
    for d in dirs:
        if Path(d).is_dir() and d not in unique:
            unique.append(d)
    return unique


def _pythonpath_without_tree() -> str:
    """``PYTHONPATH`` minus this source tree: the programs must import the installed plancache."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return os.pathsep.join(kept)


#: Without a virtual environment: this interpreter, the site folder added as site-packages
#: is (its .pth files run, the start-up hook with them) ahead of everything, then the program.
_ADD_SITE = (
    "import os, runpy, site, sys\n"
    "folder, program = sys.argv[1], sys.argv[2]\n"
    "site.addsitedir(folder)\n"
    "sys.path.remove(folder); sys.path.insert(0, folder); sys.path.insert(0, os.path.dirname(program))\n"
    "sys.argv = [program]\n"
    "runpy.run_path(program, run_name='__main__')\n"
)


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    """This interpreter's pip, offline, with this interpreter's setuptools."""
    return _run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index", "-q"])


def _copy_tree(root: Path) -> Path:
    """What a clone holds of plancache, copied: building writes build/ and *.egg-info
    beside the sources, and an editable install runs them where they are."""
    source = root / "src"
    source.mkdir()
    for name in SHIPPED_FILES:
        shutil.copy2(ROOT / name, source / name)
    for folder in SHIPPED_FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return source


def _build_wheel(root: Path, source: Path, report: dict[str, Any]) -> Path | None:
    built = _pip("wheel", "-w", str(root / "dist"), str(source))
    wheels = sorted((root / "dist").glob("plancache-*.whl")) if built.returncode == 0 else []
    if not wheels:
        report["wheel_error"] = (built.stderr or built.stdout)[-1500:]
    return wheels[0] if wheels else None


def install(root: Path, wheel: Path | None, kind: str = "wheel") -> dict[str, Any]:
    """plancache installed as a user installs it, start-up hook included, in the
    site-packages of a fresh virtual environment that also sees this interpreter's packages:
    ``kind`` "wheel" (``wheel``, else one built from the tree; else the tree copied),
    "editable" (a copy of the tree, ``pip install -e``) or "copy" (the tree copied, no
    wheel built: a smoke run). ``launch``: the command line that
    runs a program there (the program's path appended); ``variable_check``: what the README's
    check of the variable printed there."""
    report: dict[str, Any] = {}
    source = _copy_tree(root)
    if kind == "wheel":
        wheel = wheel or _build_wheel(root, source, report)
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")])
    python = root / "env" / ("Scripts" if os.name == "nt" else "bin") / "python"
    if made.returncode == 0 and python.exists():
        purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
        launch = [str(python)]
    else:  # no venv here: a site folder this interpreter adds before running each program
        report["venv_error"] = made.stderr[-1500:]
        purelib = root / "site"
        purelib.mkdir()
        launch = [sys.executable, "-c", _ADD_SITE, str(purelib)]
    if kind == "editable":  # the README's set-up
        done = _pip("install", "--target", str(purelib), "-e", str(source))
        if done.returncode != 0:
            raise SystemExit(f"gpu_corpus: pip install -e of the tree failed: {done.stderr[-1500:]}")
        report["installed"] = "editable (pip install -e of the tree)"
    elif wheel is not None:
        done = _pip("install", "--target", str(purelib), str(wheel))
        if done.returncode != 0:
            raise SystemExit(f"gpu_corpus: installing {wheel.name} failed: {done.stderr[-1500:]}")
        report["installed"] = f"wheel {wheel.name}"
    else:  # what the wheel holds, copied: the package, the hook module and its .pth
        shutil.copytree(ROOT / "plancache", purelib / "plancache", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ROOT / "migrations", purelib / "plancache" / "migrations", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("_plancache_startup.py", "plancache-startup.pth"):
            shutil.copy2(ROOT / name, purelib / name)
        report["installed"] = "copied from the tree (" + (
            "a smoke run: no wheel built)" if kind == "copy" else "no wheel could be built)"
        )
    if launch[0] == str(python):
        # The environment sees this interpreter's packages, after its own (so its plancache wins).
        lines = [f"import site; site.addsitedir({d!r})\n" for d in _outer_site_dirs()]
        (purelib / "_outer_site.pth").write_text("".join(lines))
    report.update(python=launch[0], launch=launch, site_packages=str(purelib), hook=(purelib / "plancache-startup.pth").is_file(),
                  environment="virtual environment" if launch[0] == str(python) else "site folder added by each process")  # fmt: skip
    report["variable_check"] = variable_check(root, launch)
    return report


def variable_check(root: Path, launch: list[str]) -> str:
    """What ``PLANCACHE_PATCH_CUDNN=1 python -c "import cudnn, sys; print('plancache' in
    sys.modules)"`` prints in the environment ("True" when the start-up hook patches)."""
    check = root / "variable_check.py"
    check.write_text(VARIABLE_CHECK + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_") and k != "PYTHONPATH"}
    if _pythonpath_without_tree():
        env["PYTHONPATH"] = _pythonpath_without_tree()
    env["PLANCACHE_PATCH_CUDNN"] = "1"
    env["PLANCACHE_DIR"] = str(root / "variable-check-cache")
    done = _run([*launch, str(check)], env=env)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else f"failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"


# ---------------------------------------------------------------------- one program


def outside_limits(
    workspace_size: int, options: dict[str, Any], description: dict[str, Any], engine: dict[str, Any]
) -> str | None:
    """How a stored plan breaks its program's limits: more workspace than the limit its
    entry records, or an engine the program deselected; None when it keeps them."""
    limit = options.get("workspace_limit")
    if limit is not None and workspace_size > limit:
        return f"needs {workspace_size} bytes of workspace, over the limit of {limit}"
    name = str(engine.get("name", ""))
    barred = [n for n in (description.get("flags") or {}).get("deselected_engines") or () if n in name]
    return f"runs engine {name!r}, which the program deselected ({barred[0]!r})" if barred else None


def _store_counts(directory: Path) -> dict[str, Any]:
    """Stored plans, their hits, the workspace limits their programs set and the plans outside
    them, read from the cache's database (nothing to read: zeros)."""
    path = directory / "plans.db"
    if not path.exists():
        return {"entries": 0, "hits": 0, "workspace_limits": [], "outside_limits": []}
    try:
        conn = sqlite3.connect(path, timeout=30)  # the program has exited: nothing else has it open
        try:
            rows = conn.execute(
                "SELECT key, label, hit_count, workspace_size, options_json, graph_json, engine_json FROM plans"
            ).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return {"entries": -1, "hits": -1, "workspace_limits": [], "outside_limits": [], "error": str(exc)}
    limits, outside = set(), []
    for key, label, _hits, workspace, options_json, graph_json, engine_json in rows:
        options = json.loads(options_json)
        if options.get("workspace_limit") is not None:
            limits.add(int(options["workspace_limit"]))
        problem = outside_limits(int(workspace), options, json.loads(graph_json), json.loads(engine_json or "{}"))
        if problem is not None:
            outside.append(f"{key[:12]} ({label}): {problem}")
    return {"entries": len(rows), "hits": sum(int(r[2]) for r in rows), "workspace_limits": sorted(limits),
            "outside_limits": outside}  # fmt: skip


def run_phase(launch: list[str], program: Path, phase: str, cache_dir: Path, out_file: Path, timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_") and k not in ("PYTHONPATH", "CORPUS_OUT")}
    env.update(PYTHONPATH=_pythonpath_without_tree(), PLANCACHE_DIR=str(cache_dir), CORPUS_OUT=str(out_file),
               PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    if phase != "frontend":
        env["PLANCACHE_PATCH_CUDNN"] = "1"
    started = time.perf_counter()
    record: dict[str, Any] = {"phase": phase}
    try:
        done = _run([*launch, str(program)], timeout=timeout, env=env, cwd=str(program.parent))
        record["returncode"] = done.returncode
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        record["returncode"] = "timeout"
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
    record["process_s"] = round(time.perf_counter() - started, 2)
    lines = [line for line in stdout.splitlines() if line.startswith(PREFIX)]
    if lines:
        try:
            result = json.loads(lines[-1][len(PREFIX) :])
            missing = REPORT_KEYS - set(result) if isinstance(result, dict) else REPORT_KEYS
            if missing:
                raise ValueError(f"the report line lacks {sorted(missing)}")
            record["result"] = result
        except ValueError as exc:  # JSONDecodeError is one
            record["parse_error"] = str(exc)
    record["notices"] = sorted({line.strip() for line in stderr.splitlines() if "plancache:" in line})[:20]
    record["not_stored"] = sorted({line.strip() for line in stderr.splitlines() if line.strip().startswith(NOT_STORED)})
    if "result" not in record:
        record["stderr_tail"] = stderr[-3000:]
    record["store"] = _store_counts(cache_dir)
    return record


def run_program(launch: list[str], program: Path, root: Path, timeout: float) -> dict[str, Any]:
    cache_dir = root / "caches" / program.stem
    runs: dict[str, Any] = {}
    for phase in PHASES:
        out_file = root / "outputs" / f"{program.stem}.{phase}.pt"
        runs[phase] = run_phase(launch, program, phase, cache_dir, out_file, timeout)
        runs[phase]["outputs_file"] = str(out_file)
        print(
            f"  {program.stem:36} {phase:8} {runs[phase]['process_s']:6.1f} s  {_outcome(runs[phase])}",
            file=sys.stderr,
            flush=True,
        )
    return runs


# ---------------------------------------------------------------------- the verdict


def _outcome(run: dict[str, Any]) -> str:
    result = run.get("result")
    if result is None:
        return f"no report ({run['parse_error']})" if "parse_error" in run else f"crashed (exit {run.get('returncode')})"
    return str(result["outcome"])


def _compare_outputs(runs: dict[str, Any]) -> dict[str, Any]:
    """Relative differences of the cold and warm outputs from the frontend's (and warm from
    cold), output by output; None where torch or a file is missing."""
    try:
        import torch
    except ImportError:
        return {}
    loaded: dict[str, Any] = {}
    for phase in PHASES:
        path = Path(runs[phase].get("outputs_file", ""))
        if path.is_file():
            loaded[phase] = torch.load(path)
    diffs: dict[str, Any] = {}
    reference = loaded.get("frontend", {})
    for name in reference:
        entry: dict[str, float | None] = {}
        for phase, base in (("cold", "frontend"), ("warm", "frontend"), ("warm", "cold")):
            got, base_t = loaded.get(phase, {}).get(name), loaded.get(base, {}).get(name)
            if got is None or base_t is None or got.shape != base_t.shape:
                entry[f"{phase}_vs_{base}"] = None
                continue
            got, base_t = got.double(), base_t.double()
            entry[f"{phase}_vs_{base}"] = float((got - base_t).norm() / base_t.norm().clamp_min(1e-12))
        diffs[name] = entry
    return diffs


def judge(runs: dict[str, Any]) -> dict[str, Any]:
    """The program's checks: a list of failures (empty: it passes) and the figures."""
    failures: list[str] = []
    results = {phase: runs[phase].get("result") for phase in PHASES}
    outcomes = {phase: _outcome(runs[phase]) for phase in PHASES}
    if len(set(outcomes.values())) != 1:
        failures.append(f"outcomes differ: {outcomes}")
    frontend = results["frontend"]
    ok = frontend is not None and frontend["outcome"] == "ok"
    for phase, result in results.items():
        if result is None:
            failures.append(f"{phase}: no result ({outcomes[phase]})")
            continue
        if result["outcome"] == "ok" and not result["ok"]:
            bad = {k: round(v["rel_err_vs_fp32"], 5) for k, v in result["outputs"].items() if not v["ok"]}
            failures.append(f"{phase}: outputs off the float32 reference {bad}")
        expected = phase != "frontend"
        if result["plancache_loaded"] != expected or result["pipeline_patched"] != expected:
            failures.append(f"{phase}: plancache loaded={result['plancache_loaded']} patched={result['pipeline_patched']}")
    diffs = _compare_outputs(runs) if ok else {}
    if ok and results["cold"] and results["warm"]:
        for output, entry in diffs.items():
            tolerance = frontend["outputs"][output]["tolerance"]
            for key in ("cold_vs_frontend", "warm_vs_frontend"):
                if entry.get(key) is None or entry[key] > tolerance:
                    failures.append(f"{output}: {key} = {entry.get(key)} (tolerance {tolerance})")
    cold_store, warm_store = runs["cold"]["store"], runs["warm"]["store"]
    graphs = len(frontend["graphs"]) if frontend else 0
    # Plans the cold run built and did not store, each with its reason: one that could not be
    # loaded back is never stored (and a warm run builds it again, storing nothing).
    refused = len(runs["cold"].get("not_stored", []))
    if ok:
        if cold_store["entries"] + refused != graphs:
            failures.append(f"cold run stored {cold_store['entries']} plans and refused {refused} for {graphs} graphs")
        if warm_store["entries"] != cold_store["entries"]:
            failures.append(f"warm run stored {warm_store['entries'] - cold_store['entries']} new plans")
        warm_hits = warm_store["hits"] - cold_store["hits"]
        if warm_hits < cold_store["entries"] or cold_store["entries"] + refused == 0:
            failures.append(f"warm run hit {warm_hits} of {cold_store['entries']} stored plans")
    elif cold_store["entries"] != 0:
        failures.append(f"{cold_store['entries']} plans stored for a rejected graph")
    failures.extend(f"stored plan outside its program's limits: {problem}" for problem in warm_store["outside_limits"])
    latency = {phase: (results[phase] or {}).get("first_call_ms_total") for phase in PHASES}
    errors = {phase: max((o["rel_err_vs_fp32"] for o in (results[phase] or {}).get("outputs", {}).values()), default=None)
              for phase in PHASES}  # fmt: skip
    return {
        "pass": not failures,
        "failures": failures,
        "idiom": (frontend or results["cold"] or {}).get("idiom", "?"),
        "outcome": outcomes["frontend"],
        "graphs": graphs,
        "stored": cold_store["entries"],
        "refused": refused,
        "warm_hits": warm_store["hits"] - cold_store["hits"],
        "limits": _limits_cell(warm_store),
        "first_call_ms": latency,
        "first_call_ms_by_graph": {phase: (results[phase] or {}).get("graphs") for phase in PHASES},
        "max_rel_err_vs_fp32": errors,
        "output_diffs": diffs,
        "notices": runs["cold"]["notices"],
    }


def _limits_cell(store: dict[str, Any]) -> str:
    """The table's word on the programs' limits: "-" (none set), "ok 1.0 MiB" (every stored
    plan within them), or how many plans broke them."""
    if store["outside_limits"]:
        return f"{len(store['outside_limits'])} OUTSIDE"
    limits = store.get("workspace_limits") or []
    return "ok " + "/".join(_size(limit) for limit in limits) if limits else "-"


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _ms(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, (int, float)) else "-"


def _err(value: Any) -> str:
    return f"{value:.1e}" if isinstance(value, (int, float)) else "-"


def print_table(verdicts: dict[str, dict[str, Any]], environment: dict[str, Any], install_report: dict[str, Any]) -> None:
    print(f"\ncuDNN Frontend corpus, unchanged programs  ({environment.get('summary', '')}; plancache "
          f"{install_report['installed']}; PLANCACHE_PATCH_CUDNN=1 python -c \"{VARIABLE_CHECK}\" printed "
          f"{install_report['variable_check']})")  # fmt: skip
    head = (f"{'program':36} {'idiom':34} {'outcome':22} {'max err vs fp32 f/c/w':24} {'graphs':>6} {'stored':>6} "
            f"{'refused':>7} {'warm hits':>9} {'limits':>12}  {'first call ms: frontend':>23} {'cold':>9} {'warm':>9}  "
            "verdict")  # fmt: skip
    print(head)
    print("-" * len(head))
    totals = dict.fromkeys(PHASES, 0.0)
    for name, v in verdicts.items():
        errs = "/".join(_err(v["max_rel_err_vs_fp32"][p]) for p in PHASES)
        lat = v["first_call_ms"]
        for phase in PHASES:
            totals[phase] += lat[phase] or 0.0
        print(f"{name:36} {v['idiom'][:34]:34} {v['outcome'][:22]:22} {errs:24} {v['graphs']:>6} {v['stored']:>6} "
              f"{v['refused']:>7} {v['warm_hits']:>9} {v['limits']:>12}  {_ms(lat['frontend']):>23} {_ms(lat['cold']):>9} "
              f"{_ms(lat['warm']):>9}  {'pass' if v['pass'] else 'FAIL'}")  # fmt: skip
    print("-" * len(head))
    print(f"{'total':36} {'':34} {'':22} {'':24} {'':>6} {'':>6} {'':>7} {'':>9} {'':>12}  {_ms(totals['frontend']):>23} "
          f"{_ms(totals['cold']):>9} {_ms(totals['warm']):>9}")  # fmt: skip
    for name, v in verdicts.items():
        for failure in v["failures"]:
            print(f"  FAIL {name}: {failure}")
        for line in v["notices"]:
            print(f"  note {name} (cold): {line[:200]}")


def environment_of(launch: list[str]) -> dict[str, Any]:
    probe = (
        "import json, sys, torch, cudnn\n"
        "def ask(f):\n"
        "    try:\n"
        "        return f()\n"
        "    except Exception as exc:\n"
        "        return f'unknown ({type(exc).__name__})'\n"
        "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'gpu': ask(torch.cuda.get_device_name) if torch.cuda.is_available() else None,"
        " 'cudnn': ask(cudnn.backend_version_string), 'cudnn_frontend': cudnn.__version__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_") and k != "PYTHONPATH"}
    if _pythonpath_without_tree():
        env["PYTHONPATH"] = _pythonpath_without_tree()
    probe_file = Path(tempfile.mkdtemp(prefix="plancache-probe-")) / "probe.py"
    probe_file.write_text(probe)
    done = _run([*launch, str(probe_file)], env=env)
    shutil.rmtree(probe_file.parent, ignore_errors=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    info: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    info["summary"] = f"{info['gpu']}, cuDNN {info['cudnn']}, Frontend {info['cudnn_frontend']}, torch {info['torch']}"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write every figure and check as JSON here")
    parser.add_argument("--jobs", type=int, default=0, help="programs run at once (default: up to 8, half the CPUs)")
    parser.add_argument("--programs", help="comma-separated program names (default: all of scripts/corpus/)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one process may take")
    parser.add_argument(
        "--install",
        choices=("wheel", "editable"),
        default="wheel",
        help="how plancache is installed: a wheel (default), or pip install -e of the tree (the README's set-up)",
    )
    parser.add_argument("--wheel", type=Path, help="install this plancache wheel instead of building one from the tree")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (caches, outputs, the environment)")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="the folder of programs (default: scripts/corpus)")
    benchlib.add_smoke_option(parser)
    opts = parser.parse_args(argv)
    smoke = benchlib.start_smoke(opts.smoke)

    started = time.perf_counter()
    programs = sorted(p for p in opts.corpus.glob("[a-z]*.py"))
    if opts.programs:
        wanted = {p.strip() for p in opts.programs.split(",") if p.strip()}
        programs = [p for p in programs if p.stem in wanted]
        missing = wanted - {p.stem for p in programs}
        if missing:
            parser.error(f"no such corpus program: {', '.join(sorted(missing))}")
    if smoke:
        benchlib.gpu_only(f"the {len(programs)} cuDNN Frontend programs of {opts.corpus.name}/", lambda: None)
        programs = [SMOKE_PROGRAM]
    root = benchlib.scratch("plancache-corpus-", opts.keep)
    (root / "outputs").mkdir(exist_ok=True)
    if opts.wheel is not None and opts.install != "wheel":
        parser.error("--wheel installs a wheel: it goes with --install wheel")
    install_report = install(root, opts.wheel, "copy" if smoke and opts.wheel is None else opts.install)
    launch = install_report["launch"]
    environment = environment_of(launch)
    if "error" in environment:
        print(f"gpu_corpus: the environment cannot import torch and cuDNN Frontend:\n{environment['error']}", file=sys.stderr)
        return 1
    jobs = 1 if smoke else opts.jobs or max(1, min(8, (os.cpu_count() or 2) // 2, len(programs)))
    print(f"gpu_corpus: {len(programs)} programs x {len(PHASES)} fresh processes, {jobs} at once; {environment['summary']}; "
          f"plancache {install_report['installed']} in a {install_report['environment']}; work in {root}", file=sys.stderr)  # fmt: skip

    verdicts: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_program, launch, program, root, opts.timeout): program.stem for program in programs}
        for future in as_completed(futures):
            name = futures[future]
            try:
                raw[name] = future.result()
                verdicts[name] = judge(raw[name])
            except Exception as exc:  # the runner's own failure on one program never stops the table
                verdicts[name] = {"pass": False, "failures": [f"runner error: {type(exc).__name__}: {exc}"], "idiom": "?",
                                  "outcome": "runner error", "graphs": 0, "stored": 0, "refused": 0, "warm_hits": 0, "limits": "?",
                                  "first_call_ms": dict.fromkeys(PHASES), "max_rel_err_vs_fp32": dict.fromkeys(PHASES),
                                  "notices": []}  # fmt: skip
    verdicts = dict(sorted(verdicts.items()))
    print_table(verdicts, environment, install_report)
    passed = sum(v["pass"] for v in verdicts.values())
    seconds = time.perf_counter() - started
    hooked = install_report["variable_check"] == "True"
    print(f"\n{passed} of {len(verdicts)} programs pass; the variable check {'passes' if hooked else 'FAILS'}; "
          f"{seconds:.0f} s in all")  # fmt: skip
    if opts.out:
        document = {"environment": environment, "install": install_report, "jobs": jobs, "seconds": round(seconds, 1),
                    "passed": passed, "programs": verdicts, "runs": raw}  # fmt: skip
        Path(opts.out).write_text(json.dumps(document, indent=2, default=str))
        print(f"JSON written to {opts.out}")
    benchlib.report_skipped("gpu_corpus")
    return 0 if passed == len(verdicts) and hooked else 1


if __name__ == "__main__":
    sys.exit(main())
