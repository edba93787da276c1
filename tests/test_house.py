"""The repository's own hygiene: what git, the linters and the packager see.

A package folder that ``.gitignore`` matches is invisible to ``git status``, skipped by
``git add .``, missing from a fresh clone and never linted (ruff honours ``.gitignore``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nested_pytest import run_pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("plancache", "tests", "scripts", "migrations", "examples")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def _source_folders() -> list[Path]:
    folders = {ROOT / root for root in SOURCE_ROOTS if (ROOT / root).is_dir()}
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*"):
            if path.is_dir() and "__pycache__" not in path.parts and any(path.glob("*.py")):
                folders.add(path)
    return sorted(folders)


def test_no_source_folder_is_ignored_by_git() -> None:
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout")
    probes = [str((folder / "new_module.py").relative_to(ROOT)) for folder in _source_folders()]
    result = _git("check-ignore", "--no-index", "-v", *probes)
    assert result.returncode == 1, f"git ignores files in source folders:\n{result.stdout}"


def test_every_package_folder_is_a_package_and_is_shipped() -> None:
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for init in (ROOT / "plancache").rglob("*.py"):
        folder = init.parent
        if "__pycache__" in folder.parts:
            continue
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} holds modules but no __init__.py"
        found.add(".".join(folder.relative_to(ROOT).parts))
    assert found <= declared, f"package folders missing from pyproject.toml: {sorted(found - declared)}"


@pytest.mark.parametrize("name", ["build", "dist", "out"])
def test_no_package_folder_is_named_like_build_output(name: str) -> None:
    assert not (ROOT / "plancache" / name).exists(), f"plancache/{name}/ reads as generated output to tools"


@pytest.mark.slow  # runs pytest itself, in a child process
def test_a_pytest_plugin_installed_elsewhere_does_not_change_the_suite(tmp_path: Path) -> None:
    """CI runs in a machine-wide Python where other pytest plugins may be installed; one that
    warns at start-up (as pytest-benchmark does under xdist) would end the run, because the
    suite turns warnings into errors. The suite loads only the plugins it names."""
    (tmp_path / "intruder.py").write_text(
        "def pytest_configure(config):\n    config.issue_config_time_warning(UserWarning('an intruding plugin'), stacklevel=2)\n"
    )
    dist = tmp_path / "intruder-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: intruder\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nintruder = intruder\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    run = run_pytest(["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                     cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
