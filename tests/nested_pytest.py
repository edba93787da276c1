"""pytest started from a test, as the suite itself runs: for the tests of how the suite
behaves on machines set up differently (CI's machine-wide plugins, no redis-server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: What an xdist worker tells the code it runs; a pytest started from a test is no worker, and
#: a plugin that reads these (pytest-benchmark 5.2 warns, so the run ends) must not see them.
_XDIST_WORKER_VARS = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST")


def run_pytest(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A pytest run in a child process, with the suite's own configuration (its plugins only,
    warnings as errors) in one process (``-n 0``), as a test in this suite sees it."""
    clean = {name: value for name, value in env.items() if name not in _XDIST_WORKER_VARS}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, capture_output=True, text=True, env=clean, cwd=cwd, timeout=timeout, check=False)
