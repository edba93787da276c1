"""Importing plancache is cheap and GPU-free; every public name resolves, and so does every
import path the documents, scripts, examples and the start-up hook use."""

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
    # What README's settings table names as raising or taking a setting (ConfigError was
    # only plancache.config.ConfigError).
    assert plancache.ConfigError is plancache.config.ConfigError and issubclass(plancache.ConfigError, ValueError)
    assert plancache.MemoryBudget is plancache.config.MemoryBudget and plancache.RemoteTier.__name__ == "RemoteTier"


def test_every_subpackage_is_shipped() -> None:
    """A folder of the package missing from pyproject.toml's list would be missing from
    every non-editable install."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "plancache").rglob("__init__.py")}
    assert found <= listed, f"not shipped: {sorted(found - listed)}"


#: Public names the package promises, whether or not a document names them today.
PROMISED = [
    "plancache.PlanCache", "plancache.Plan", "plancache.install", "plancache.uninstall", "plancache.jit",
    "plancache.graph_cache", "plancache.capture", "plancache.plan_of", "plancache.workflows.templates",
    "plancache.workflows.buckets", "plancache.testing.CpuTestBackend", "plancache.testing.TwoDeviceCpuTestBackend",
    "plancache.cache.PlanCache", "plancache.integrations.frontend.use", "plancache.integrations.frontend.current",
    "plancache.integrations.frontend.installed", "plancache.integrations.frontend.install_from_environment",
    "plancache.cache.recording.record_to", "plancache.cache.priming.Primer", "plancache.runtime.plan.Plan", "plancache.runtime.capturing.capture",
    "plancache.workflows.manifest.code_references", "plancache.tiers.remote.RemoteTier",
]  # fmt: skip

#: Where import paths are documented: every ``plancache.X`` and ``from plancache.X import Y`` there.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), ROOT / "_plancache_startup.py", ROOT / "setup.py"]  # fmt: skip
_FROM = re.compile(r"^\s*from (plancache(?:\.\w+)*) import \(?([\w ,]+)", re.M)
_DOTTED = re.compile(r"(?<![\w./-])(plancache(?:\.\w+)+)")
_LOGGER = re.compile(r"logger `[\w.]+`")  # a logger's name (plancache.frontend), not a module's path


def _documented() -> list[str]:
    paths = set()
    for document in DOCUMENTS:
        text = _LOGGER.sub("", document.read_text())
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
    paths = sorted({*_documented(), *PROMISED})
    assert "plancache.PlanCache" in paths and len(paths) > 40
    out = subprocess.run([sys.executable, "-c", PROBE_PATHS, *paths], check=True, capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["missing"] == []
    assert result["modules"] == [], "resolving the documented paths imported torch or cuDNN"


def test_a_module_is_imported_under_its_own_path_only() -> None:
    """No alias keeps a path that a module never had in this version (``plancache.frontend``
    for ``plancache.integrations.frontend``): an import of it fails like any unknown module."""
    for path in ("plancache.frontend", "plancache.templates", "plancache.recording", "plancache.no_such_module"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(path)
    assert not any(type(finder).__module__.startswith("plancache") for finder in sys.meta_path)


#: Typed user code as README shows it: a policy by its name or as a ``Policy``, which the
#: options read back. The ignore is needed (an unknown name is an error) and ``assert_type``
#: fails on ``Any``: both guard against a check that passes because plancache went unseen.
TYPED_USER_CODE = """
from typing import assert_type

from plancache import BuildOptions, Policy

options = BuildOptions(policy="exhaustive", top_k=4)
by_member = BuildOptions(policy=Policy.HEURISTIC, workspace_limit=1 << 30, kernel_cache=False)
assert_type(options.policy, Policy)
name: str = by_member.policy.value
BuildOptions(policy="fastest")  # type: ignore[arg-type]
from plancache import PlanCach  # type: ignore[attr-defined]  # a misspelt public name is an error
"""


@pytest.mark.slow  # mypy reads the whole package: 20 to 50 s
def test_typed_user_code_passes_mypy_strict(tmp_path: Path) -> None:
    from mypy import api

    snippet = tmp_path / "user_code.py"
    snippet.write_text(TYPED_USER_CODE)
    report, errors, status = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), "--config-file", "", str(snippet)])
    assert status == 0, report + errors


def test_policy_names_are_the_policies() -> None:
    """``PolicyName`` (what type checkers let callers pass) names every ``Policy``, no other."""
    import typing

    from plancache.key.key import POLICIES, PolicyName

    assert typing.get_args(PolicyName) == POLICIES
    assert plancache.Policy is plancache.key.Policy
    assert plancache.BuildOptions(policy="exhaustive") == plancache.BuildOptions(policy=plancache.Policy.EXHAUSTIVE)
    assert plancache.BuildOptions(policy="exhaustive").policy is plancache.Policy.EXHAUSTIVE
