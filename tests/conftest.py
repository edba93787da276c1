"""Fixtures shared by the CPU tests: a private cache directory per test and caches that
run real cudnn.pygraph graphs through ``CpuTestBackend``."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from redis_fixtures import make_tier, own_server, redis_server  # noqa: F401 - fixtures for the Redis tests

from plancache import PlanCache, Store
from plancache.testing import CpuTestBackend

# One thread for torch's CPU kernels, here and in every process a test starts: the suite runs
# on two workers (`-n 2`), and the test backend's tensors are tiny, so a second thread per
# process only makes the workers' threads wait on each other (tens of times slower under load).
# Set before anything imports torch (plancache imports it lazily); a value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_ENV_VARS = ("PLANCACHE_MAX_SIZE", "PLANCACHE_ALLOW_SHARED_DIR", "PLANCACHE_REDIS_URL", "PLANCACHE_RECORD", "PLANCACHE_BACKEND",
             "PLANCACHE_APP", "PLANCACHE_PATCH_CUDNN", "PLANCACHE_MEMORY_PLANS")  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def system_temp_dir_left_clean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """For the whole run, the system temporary directory of the tests and of every process
    they start (``TMPDIR``) is one fresh directory; at the end it must be empty, so a test,
    script or benchmark that leaves files behind fails the run. Not counted: what others
    own and clean up: a child pytest's ``pytest-of-*`` folder (kept by design), this
    process's multiprocessing folder ``pymp-*`` (removed when it exits), and the temporary
    files ``etilqs_*`` of SQLite in processes that tests SIGKILL on purpose."""
    scratch = tmp_path_factory.mktemp("system-tmp")
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    try:
        yield scratch
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith(("pytest-of-", "pymp-", "etilqs_")))
    assert not left, f"the tests left files in the system temporary directory: {left}"


#: What plancache's wheel is built from.
SHIPPED = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "plancache-startup.pth", "_plancache_startup.py")


def _copy_source(destination: Path) -> Path:
    """A copy of what plancache is built from, in ``destination`` (building writes build/
    and *.egg-info next to the sources, which must not land in the work tree)."""
    root = Path(__file__).resolve().parents[1]
    destination.mkdir()
    for name in SHIPPED:
        shutil.copy2(root / name, destination / name)
    for folder in ("plancache", "migrations"):
        shutil.copytree(root / folder, destination / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


@pytest.fixture(scope="session")
def plancache_source() -> Callable[[Path], Path]:
    """``copy(destination)``: a copy of plancache's sources there, for the tests that install
    it as a user does (a wheel, ``pip install -e``)."""
    return _copy_source


@pytest.fixture(scope="session")
def plancache_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plancache's wheel, built once per run from this tree with this interpreter's
    setuptools (no network), for the tests that install it as a user does. Once per run,
    not once per worker: the workers of one run share it through a directory named after
    the run, the first to come builds it under a file lock, the others wait and take it."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    tmp = tmp_path_factory.getbasetemp().parent / f"wheel-{run}" if run else tmp_path_factory.mktemp("wheel")
    tmp.mkdir(exist_ok=True)
    with FileLock(str(tmp / "build.lock")):
        found = sorted((tmp / "dist").glob("plancache-*.whl"))
        if not found:
            source = _copy_source(tmp / "src")
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                                    "-q", "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True,
                                   timeout=300)  # fmt: skip
            assert built.returncode == 0, built.stderr[-3000:]
            found = sorted((tmp / "dist").glob("plancache-*.whl"))
    (wheel,) = found
    return wheel


class _JudgeDisagreements(logging.Handler):
    """Keeps every warning that the judge refused a plan the frontend had just built."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "the judge refuses a plan cuDNN Frontend just built" in message:
            self.seen.append(message)


@pytest.fixture(autouse=True)
def judge_agrees_with_the_frontend(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test in which the judge refuses a plan just built for its own graph fails: that
    is a defect of the judge (plancache serves such a plan and never stores it, so nothing
    else in the test may notice). ``@pytest.mark.judge_disagreement``: a test that makes
    the judge disagree on purpose."""
    handler = _JudgeDisagreements()
    logger = logging.getLogger("plancache")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.seen and request.node.get_closest_marker("judge_disagreement") is None:
        pytest.fail(f"the judge disagreed with the frontend: {handler.seen[0]}")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own PLANCACHE_DIR under tmp_path (not created yet), so no test
    can touch the user's cache or another test's."""
    directory = tmp_path / "plancache"
    monkeypatch.setenv("PLANCACHE_DIR", str(directory))
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    # Auto-prime is off unless a test turns it on (test_priming.py): a background primer
    # would turn the store hits that other tests count into memory hits.
    monkeypatch.setenv("PLANCACHE_AUTO_PRIME", "0")
    # No miss budget unless a test sets one (test_miss_budget.py): the CPU test backend's
    # candidates take milliseconds of real work, and a wall-clock budget would make which
    # of them a test sees depend on the machine's load.
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_BUDGET", "off")
    return directory


@pytest.fixture
def backend() -> CpuTestBackend:
    return CpuTestBackend()


@pytest.fixture
def make_cache(backend: CpuTestBackend) -> Iterator[Callable[..., PlanCache]]:
    """Open a PlanCache on $PLANCACHE_DIR (CpuTestBackend unless ``backend=`` is given);
    every cache opened is closed after the test."""
    opened: list[PlanCache] = []

    def make(**kwargs: Any) -> PlanCache:
        kwargs.setdefault("backend", CpuTestBackend())
        cache = PlanCache(**kwargs)
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        cache.close()


@pytest.fixture
def cache(make_cache: Callable[..., PlanCache], backend: CpuTestBackend) -> PlanCache:
    """A PlanCache on $PLANCACHE_DIR with the ``backend`` fixture's CpuTestBackend."""
    return make_cache(backend=backend)


@pytest.fixture
def store(cache_dir: Path) -> Iterator[Store]:
    s = Store()
    yield s
    s.close()


@pytest.fixture
def db(cache_dir: Path) -> Iterator[Callable[[], sqlite3.Connection]]:
    """Open the cache's database directly (for inspecting or damaging it); closed after."""
    connections: list[sqlite3.Connection] = []

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(cache_dir / "plans.db", isolation_level=None)
        conn.row_factory = sqlite3.Row
        connections.append(conn)
        return conn

    yield connect
    for conn in connections:
        conn.close()
