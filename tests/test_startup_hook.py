"""``PLANCACHE_PATCH_CUDNN=1 python app.py`` with no ``import plancache`` in app.py: the
start-up hook a plancache wheel installs into site-packages.

The package is built into a wheel and installed into a fresh virtual environment (no pip
and no network needed: the wheel is built with this interpreter's setuptools and unpacked
with ``pip install --target``), which sees this interpreter's packages (cuDNN Frontend,
torch) through a ``.pth`` of its own. Programs then run there in fresh processes.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
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


def _run(*args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLANCACHE_PATCH_CUDNN")}
    environment.update(env)
    result = subprocess.run(list(args), env=environment, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory, plancache_wheel: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a fresh virtual environment with plancache's wheel in it."""
    tmp = tmp_path_factory.mktemp("hook")
    wheel = plancache_wheel
    _run(sys.executable, "-m", "venv", "--without-pip", str(tmp / "env"))
    python = tmp / "env" / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(purelib), str(wheel))
    return python, purelib


def _outer_sites() -> list[str]:
    """This interpreter's site-packages (where cuDNN Frontend and torch are)."""
    return [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]


def test_the_wheel_installs_the_hook_into_site_packages(environment: tuple[Path, Path]) -> None:
    _, purelib = environment
    hook = (purelib / "plancache-startup.pth").read_text()
    assert hook.startswith("import os;") and "PLANCACHE_PATCH_CUDNN" in hook and "_plancache_startup" in hook
    assert (purelib / "_plancache_startup.py").is_file()
    for module in ("integrations/frontend.py", "integrations/startup.py", "cache/cache.py", "runtime/plan.py"):
        assert (purelib / "plancache" / module).is_file(), module
    record = next(purelib.glob("plancache-*.dist-info")) / "RECORD"
    assert "plancache-startup.pth," in record.read_text()  # so an uninstall removes it


def test_the_variable_patches_a_program_that_never_imports_plancache(environment: tuple[Path, Path], tmp_path: Path) -> None:
    import json

    python, purelib = environment
    outer = purelib / "_outer_site.pth"  # the environment sees this interpreter's packages
    outer.write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in _outer_sites()))
    app = tmp_path / "app.py"
    app.write_text(APP)
    try:
        patched = json.loads(_run(str(python), str(app), PLANCACHE_PATCH_CUDNN="1", PLANCACHE_DIR=str(tmp_path / "c")).stdout)
        plain = json.loads(_run(str(python), str(app), PLANCACHE_DIR=str(tmp_path / "c")).stdout)
    finally:
        outer.unlink()
    assert patched["before"] == [] and plain["before"] == []  # nothing imported at start-up
    assert patched["installed"] and patched["pipeline"]
    assert patched["plancache"].startswith(str(purelib))  # the installed package, not the tree
    assert not plain["installed"] and not plain["pipeline"] and plain["plancache"] is None


def test_without_cudnn_the_hook_stays_quiet_and_import_plancache_warns(environment: tuple[Path, Path]) -> None:
    python, _ = environment  # this environment alone: no cuDNN Frontend to import
    quiet = _run(str(python), "-W", "error", "-c", "import sys; print('cudnn' in sys.modules)", PLANCACHE_PATCH_CUDNN="1")
    assert quiet.stdout.strip() == "False" and quiet.stderr == ""
    warned = _run(
        str(python),
        "-W",
        "error",
        "-c",
        "import plancache; print(plancache.integrations.frontend.installed())",
        PLANCACHE_PATCH_CUDNN="1",
    )
    assert warned.stdout.strip() == "False" and "cannot be imported" in warned.stderr, warned.stderr
