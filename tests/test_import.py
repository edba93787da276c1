"""Importing plancache is cheap and GPU-free; every public name resolves."""

from __future__ import annotations

import json
import subprocess
import sys

import plancache

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
