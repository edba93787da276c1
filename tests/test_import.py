"""Importing plancache is cheap and GPU-free; every public name resolves, and so does every
import path the documents, scripts, examples and the start-up hook use, and every path a
module had before the layers got folders of their own."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import plancache

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, time
started = time.perf_counter()
import plancache
elapsed = time.perf_counter() - started
print(json.dumps({"seconds": elapsed, "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cudnn", "redis"))}))
"""


def test_import_loads_no_gpu_library() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["modules"] == []


def test_every_public_name_resolves() -> None:
    for name in plancache.__all__:
        assert getattr(plancache, name) is not None, name
    assert plancache.key.environment_id is not None  # submodules load on attribute access too


def test_every_subpackage_is_shipped() -> None:
    """A folder of the package missing from pyproject.toml's list would be missing from
    every non-editable install."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "plancache").rglob("__init__.py")}
    assert found <= listed, f"not shipped: {sorted(found - listed)}"


#: Paths that modules had at the package root, and where they live now.
MOVED = {
    "plancache.builder": "plancache.cache.builder",
    "plancache.flight": "plancache.cache.flight",
    "plancache.loads": "plancache.cache.loads",
    "plancache.lookup": "plancache.cache.lookup",
    "plancache.priming": "plancache.cache.priming",
    "plancache.recording": "plancache.cache.recording",
    "plancache.plan": "plancache.runtime.plan",
    "plancache.capturing": "plancache.runtime.capturing",
    "plancache.frontend": "plancache.integrations.frontend",
    "plancache.frontend_adopt": "plancache.integrations.frontend_adopt",
    "plancache.frontend_pipeline": "plancache.integrations.frontend_pipeline",
}

#: Documented before the layers had folders (README, docs/, scripts/, the start-up hook),
#: and public names the package promises, whether or not a document names them today.
PROMISED = [
    "plancache.PlanCache", "plancache.Plan", "plancache.install", "plancache.uninstall", "plancache.jit",
    "plancache.graph_cache", "plancache.capture", "plancache.plan_of", "plancache.templates", "plancache.buckets",
    "plancache.testing.CpuTestBackend", "plancache.testing.TwoDeviceCpuTestBackend", "plancache.cache.PlanCache",
    "plancache.frontend.use", "plancache.frontend.current", "plancache.frontend.install_from_environment",
    "plancache.frontend.installed", "plancache.recording.record_to", "plancache.priming.Primer",
    "plancache.plan.Plan", "plancache.capturing.capture", "plancache.manifest.code_references", "plancache.remote.RemoteTier",
]  # fmt: skip

#: Where import paths are documented: every ``plancache.X`` and ``from plancache.X import Y`` there.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), ROOT / "_plancache_startup.py", ROOT / "setup.py"]  # fmt: skip
_FROM = re.compile(r"^\s*from (plancache(?:\.\w+)*) import \(?([\w ,]+)", re.M)
_DOTTED = re.compile(r"(?<![\w./-])(plancache(?:\.\w+)+)")


def _documented() -> list[str]:
    paths = set()
    for document in DOCUMENTS:
        text = document.read_text()
        paths.update(_DOTTED.findall(text))
        for module, names in _FROM.findall(text):
            paths.update(f"{module}.{name.split(' as ')[0].strip()}" for name in names.split(",") if name.strip())
    return sorted(paths)


PROBE_PATHS = """
import importlib, json, sys
found, missing = [], []
for path in sys.argv[1:]:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that imports, then attributes
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            missing.append(path)
        break
    else:
        missing.append(path)
print(json.dumps({"missing": missing, "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cudnn"))}))
"""


def test_every_documented_and_promised_path_resolves_without_torch_or_cudnn() -> None:
    paths = sorted({*_documented(), *PROMISED, *MOVED})
    assert "plancache.PlanCache" in paths and len(paths) > 40
    out = subprocess.run([sys.executable, "-c", PROBE_PATHS, *paths], check=True, capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["missing"] == []
    assert result["modules"] == [], "resolving the documented paths imported torch or cuDNN"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_under_its_old_path_as_the_same_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new and sys.modules[old] is new
    assert getattr(plancache, old.rpartition(".")[2]) is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]  # its own identity, untouched


OLD_STATEMENTS = """
import warnings
warnings.simplefilter("error")  # no ImportWarning about __package__ or __spec__ either
import plancache.frontend as f
from plancache.recording import record_to
from plancache.frontend_pipeline import Planner
import plancache.integrations.frontend as g
assert f is g and record_to.__module__ == "plancache.cache.recording" and Planner.__module__.startswith("plancache.integrations")
assert f._pipeline().__name__ == "plancache.integrations.frontend_pipeline"  # relative imports inside still work
"""


def test_old_import_statements_work_in_a_fresh_interpreter() -> None:
    subprocess.run([sys.executable, "-c", OLD_STATEMENTS], check=True, capture_output=True, text=True, timeout=120)


def test_the_old_paths_stay_out_of_the_way_of_other_imports() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("plancache.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("plancache.cache.frontend")  # only the root's old names are aliased
