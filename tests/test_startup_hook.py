"""``PLANCACHE_PATCH_CUDNN=1 python app.py`` with no ``import plancache`` in app.py: the
start-up hook that a plancache install puts into site-packages, after a regular install (a
wheel) and after an editable one (``pip install -e``, the README's set-up) alike.

plancache is installed into a fresh virtual environment (no pip and no network needed:
this interpreter's pip builds with its own setuptools and installs with ``--target``),
which sees this interpreter's packages (cuDNN Frontend, torch) through a ``.pth`` of its
own while a test needs them. Programs then run there in fresh processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import site
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

APP = """
import json, sys
before = sorted(m for m in sys.modules if m.split(".")[0] in ("plancache", "cudnn", "torch"))
import cudnn  # the program's own import: nothing of plancache's in it
frontend = sys.modules.get("plancache.integrations.frontend")
print(json.dumps({
    "before": before,
    "installed": bool(frontend and frontend.installed()),
    "pipeline": hasattr(cudnn.pygraph.build_plans, "__plancache_original__"),
    "plancache": getattr(sys.modules.get("plancache"), "__file__", None),
}))
"""


@dataclass(frozen=True)
class Installed:
    kind: str  # "wheel" or "editable"
    python: Path
    purelib: Path
    source: Path  # the tree it was installed from (an editable install runs it in place)


def _run(*args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLANCACHE_PATCH_CUDNN")}
    environment.update(env)
    result = subprocess.run(list(args), env=environment, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


def _pip(*args: str) -> None:
    _run(sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index", "-q")


@pytest.fixture(scope="module", params=["wheel", "editable"])
def environment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, plancache_wheel: Path,
                plancache_source: Callable[[Path], Path]) -> Installed:  # fmt: skip
    """A fresh virtual environment with plancache installed: ``wheel`` installs the run's
    wheel of this tree, ``editable`` runs ``pip install -e`` of a copy of it."""
    kind = str(request.param)
    tmp = tmp_path_factory.mktemp(f"hook-{kind}")
    source = plancache_source(tmp / "src")
    _run(sys.executable, "-m", "venv", "--without-pip", str(tmp / "env"))
    python = tmp / "env" / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    if kind == "wheel":
        _pip("install", "--target", str(purelib), str(plancache_wheel))
    else:
        _pip("install", "--target", str(purelib), "-e", str(source))
    return Installed(kind, python, purelib, source)


def _outer_sites() -> list[str]:
    """This interpreter's site-packages (where cuDNN Frontend and torch are)."""
    return [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]


@contextlib.contextmanager
def seeing_outer_packages(environment: Installed) -> Iterator[None]:
    """The environment sees this interpreter's packages (after its own) while the block runs."""
    outer = environment.purelib / "_outer_site.pth"
    outer.write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in _outer_sites()))
    try:
        yield
    finally:
        outer.unlink()


def _app(environment: Installed, tmp_path: Path, **env: str) -> tuple[dict[str, object], str]:
    app = tmp_path / "app.py"
    app.write_text(APP)
    done = _run(str(environment.python), str(app), PLANCACHE_DIR=str(tmp_path / "c"), **env)
    return json.loads(done.stdout), done.stderr


def test_the_install_puts_the_hook_into_site_packages(environment: Installed) -> None:
    purelib = environment.purelib
    hook = (purelib / "plancache-startup.pth").read_text()
    assert hook.startswith("import os;") and "PLANCACHE_PATCH_CUDNN" in hook and "_plancache_startup" in hook
    record = next(purelib.glob("plancache-*.dist-info")) / "RECORD"
    assert "plancache-startup.pth," in record.read_text()  # so an uninstall removes it
    if environment.kind == "wheel":
        assert (purelib / "_plancache_startup.py").is_file()
        for module in ("integrations/frontend.py", "integrations/startup.py", "cache/cache.py", "runtime/plan.py"):
            assert (purelib / "plancache" / module).is_file(), module
    else:  # the sources stay where they are: nothing of them is copied
        assert not (purelib / "plancache").exists() and not (purelib / "_plancache_startup.py").exists()
        assert hook == (environment.source / "plancache-startup.pth").read_text()


@pytest.mark.parametrize("value", ["1", " Yes ", "on"])
def test_the_variable_patches_a_program_that_never_imports_plancache(environment: Installed, tmp_path: Path,
                                                                     value: str) -> None:  # fmt: skip
    with seeing_outer_packages(environment):
        patched, warned = _app(environment, tmp_path, PLANCACHE_PATCH_CUDNN=value)
        plain, _ = _app(environment, tmp_path)
    assert patched["before"] == [] and plain["before"] == []  # nothing imported at start-up
    assert patched["installed"] and patched["pipeline"] and "plancache" not in warned
    installed_from = environment.purelib if environment.kind == "wheel" else environment.source
    assert str(patched["plancache"]).startswith(str(installed_from))  # the installed package
    assert not plain["installed"] and not plain["pipeline"] and plain["plancache"] is None  # unset: nothing at all


@pytest.mark.parametrize(
    ("value", "warning"), [("0", None), ("off", None), ("bogus", "PLANCACHE_PATCH_CUDNN='bogus' is not a switch")]
)
def test_off_and_bad_values_patch_nothing_and_a_bad_one_warns_once(environment: Installed, tmp_path: Path, value: str,
                                                                   warning: str | None) -> None:  # fmt: skip
    with seeing_outer_packages(environment):
        result, stderr = _app(environment, tmp_path, PLANCACHE_PATCH_CUDNN=value)
    assert result["before"] == [] and not result["installed"] and not result["pipeline"]
    lines = [line for line in stderr.splitlines() if "plancache" in line]
    if warning is None:
        assert lines == [], stderr
    else:  # one line, though both the hook and the import of plancache read the variable
        assert len(lines) == 1 and warning in lines[0] and "not patched" in lines[0], stderr


def test_plancache_env_says_whether_the_hook_is_installed_and_active(environment: Installed) -> None:
    def hook_line(**env: str) -> str:
        with seeing_outer_packages(environment):
            done = _run(str(environment.python), "-m", "plancache", "env", "--json", **env)
        return str(json.loads(done.stdout)["startup_hook"])

    assert hook_line(PLANCACHE_PATCH_CUDNN="1").startswith(f"installed ({environment.purelib}); active")
    assert hook_line().endswith("inactive: PLANCACHE_PATCH_CUDNN is not on")
    assert "PLANCACHE_PATCH_CUDNN='maybe' is not a switch" in hook_line(PLANCACHE_PATCH_CUDNN="maybe")


def test_without_cudnn_the_hook_stays_quiet_and_import_plancache_warns(environment: Installed) -> None:
    python = str(environment.python)  # this environment alone: no cuDNN Frontend to import
    quiet = _run(python, "-W", "error", "-c", "import sys; print('cudnn' in sys.modules)", PLANCACHE_PATCH_CUDNN="1")
    assert quiet.stdout.strip() == "False" and quiet.stderr == ""
    warned = _run(python, "-W", "error", "-c", "import plancache.integrations.frontend as f; print(f.installed())",
                  PLANCACHE_PATCH_CUDNN="1")  # fmt: skip
    assert warned.stdout.strip() == "False" and "cannot be imported" in warned.stderr, warned.stderr


def test_plancache_env_names_a_missing_or_broken_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the hook in site-packages (an install from before editable installs carried
    it) the line says so and how to get it; a hook whose module is gone is broken."""
    import importlib.util

    import plancache.integrations.startup as startup

    monkeypatch.setattr(startup, "_site_directories", lambda: [str(tmp_path)])
    assert startup.startup_hook_status().startswith("not installed: no plancache-startup.pth in this interpreter's")
    (tmp_path / "plancache-startup.pth").write_text("")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "_plancache_startup" else found(name, *a))
    assert startup.startup_hook_status().startswith(f"broken: plancache-startup.pth is in {tmp_path}")
