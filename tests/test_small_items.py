"""The smaller things a new user met in the first hour (fourth pass): recording, prewarm
from Python, `plancache sql`'s errors, names after `tune`, `--version --json`, and `dir(plancache)`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from graphs import ConvBiasRelu
from test_cli_first_hour import TEMPLATE_ENTRY, fill, one_line_error
from test_cli_first_hour import plancache as command

import plancache
from plancache import ConfigError, PlanCache
from plancache.cache.recording import record_to
from plancache.testing import CpuTestBackend
from plancache.workflows.manifest import load_manifest
from plancache.workflows.prewarm import prewarm
from plancache.workflows.tune import tune


def test_dir_of_the_package_shows_its_public_names_only() -> None:
    """dir(plancache) showed Any, TYPE_CHECKING, annotations and importlib."""
    shown = set(dir(plancache))
    assert not shown & {"Any", "TYPE_CHECKING", "annotations", "importlib"}
    assert set(plancache.__all__) <= shown and {"cache", "workflows", "testing"} <= shown


def test_prewarm_takes_a_manifest_document_or_a_list_of_its_entries(make_cache: Any) -> None:
    """prewarm(cache, {"version": 1, "entries": []}) raised AttributeError."""
    cache = make_cache()
    assert prewarm(cache, {"version": 1, "entries": []}, progress=False)["total"] == 0
    assert prewarm(cache, {"version": 1, "entries": [TEMPLATE_ENTRY]}, progress=False)["built"] == 1
    assert prewarm(cache, [TEMPLATE_ENTRY], progress=False)["hits"] == 1
    bad = prewarm(cache, {"version": 1, "entries": [{"template": "no_such_template"}]}, progress=False)
    assert bad["failed"] == 1 and "no_such_template" in bad["entries"][0]["error"]
    for wrong in (5, ["a manifest entry is not text"]):
        with pytest.raises(TypeError, match=r"entries are a manifest path, a manifest document"):
            prewarm(cache, wrong, progress=False)  # type: ignore[arg-type]


def test_a_recording_in_a_missing_directory_or_named_toml_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    """PLANCACHE_RECORD created missing directories silently, and a recording named .toml
    was written as JSON, which prewarm then refused as invalid TOML."""
    for path, why in ((tmp_path / "no" / "such" / "dir" / "r.json", "which is not a directory: create it first"),
                      (tmp_path / "recorded.toml", "recording is written as JSON")):  # fmt: skip
        monkeypatch.setenv("PLANCACHE_RECORD", str(path))
        with pytest.raises(ConfigError, match=rf"^PLANCACHE_RECORD='.*' .*{why}"):
            PlanCache(backend=CpuTestBackend())
        with pytest.raises(ConfigError, match=rf"^record_to\(path\)=.*{why}"):
            record_to(path)
    assert not (tmp_path / "no").exists() and not cache_dir.exists()


def test_a_recording_leaves_no_lock_file_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every recording left <file>.lock beside it."""
    (tmp_path / "rec").mkdir()
    recorded = tmp_path / "rec" / "recorded.json"
    monkeypatch.setenv("PLANCACHE_RECORD", str(recorded))
    with PlanCache(tmp_path / "cache", backend=CpuTestBackend()) as cache:
        cache.get(ConvBiasRelu().graph())
        cache.get(ConvBiasRelu(n=1).graph())
    assert [p.name for p in (tmp_path / "rec").iterdir()] == ["recorded.json"]
    entries, errors = load_manifest(recorded)
    assert len(entries) == 2 and errors == []


def test_sql_says_what_it_refused_in_its_own_words(tmp_path: Path) -> None:
    """Writes said only "not authorized", and a statement without rows quoted
    sqlite-utils ("query() can only be used with SQL that returns rows - use execute()")."""
    directory = tmp_path / "cache"
    fill(directory)
    d = ["--dir", str(directory), "sql"]
    cases = {
        "DELETE FROM plans": "it would delete from plans, and plancache sql only reads",
        "UPDATE plans SET label = 'x'": "it would update plans, and plancache sql only reads",
        "PRAGMA journal_mode=DELETE": "it would set PRAGMA journal_mode = DELETE, and plancache sql only reads",
        "BEGIN": "it returns no rows (plancache sql runs one SELECT, or a pragma that only reads)",
        "SELECT 1; SELECT 2": "it holds more than one statement",
    }
    for statement, words in cases.items():
        line = one_line_error(command(*d, statement))
        assert words in line and "not authorized" not in line and "execute()" not in line, (statement, line)


def test_version_is_json_with_json_in_either_order() -> None:
    """--version printed click's text line even with --json, which a script then failed to parse."""
    for args in (("--json", "--version"), ("--version", "--json")):
        result = command(*args)
        assert result.returncode == 0 and json.loads(result.stdout) == {"version": plancache.__version__}, args
    assert command("--version").stdout == f"plancache, version {plancache.__version__}\n"


def test_tune_keeps_the_tensor_names_show_lists(make_cache: Any) -> None:
    """After tune, show listed the tensors as u1..u4 (the replayed graph's names)."""
    cache = make_cache()
    plan = cache.get(ConvBiasRelu().graph())
    before = [t["name"] for t in cache.store.get(plan.key).tensors]
    assert tune(cache, [plan.key])["tuned"] == 1
    assert [t["name"] for t in cache.store.get(plan.key).tensors] == before == ["X", "W", "B", "Y"]
    shown = json.loads(command("--dir", str(cache.directory), "--json", "show", plan.key).stdout)
    assert [t["name"] for t in shown["tensors"]] == before


def test_a_number_of_thousands_of_digits_is_refused_naming_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5,000-digit PLANCACHE_MEMORY_PLANS gave Python's own int-conversion error, which
    named no variable; now the one line names it, its value cut short."""
    monkeypatch.setenv("PLANCACHE_MEMORY_PLANS", "9" * 5000)
    with pytest.raises(ConfigError, match=r"^PLANCACHE_MEMORY_PLANS='9+\.\.\. \(5002 characters\) is not a whole number"):
        PlanCache(backend=CpuTestBackend(), directory=None, read_only=True)
    with pytest.raises(ConfigError, match=r"^max_plans='9+\.\.\. \(5002 characters\)"):
        PlanCache(backend=CpuTestBackend(), max_plans="9" * 5000)


def test_an_empty_dir_option_is_refused_not_read_as_the_default(tmp_path: Path) -> None:
    """``--dir ''`` (a variable that expanded to nothing) named the default cache silently."""
    for args in (("--dir", "", "ls"), ("ls", "--dir", " ")):
        result = command(*args)
        assert result.returncode == 2 and "--dir is empty" in result.stderr, result


def test_a_home_that_does_not_exist_is_never_created(tmp_path: Path) -> None:
    """HOME=/nonexistent (as services set it) made /nonexistent/.cache/plancache: the
    default cache is refused instead, the program served from memory, nothing created."""
    import os
    import subprocess
    import sys

    home = tmp_path / "nonexistent"
    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from graphs import ConvBiasRelu\n"
        "from plancache import PlanCache\n"
        "from plancache.testing import CpuTestBackend\n"
        "cache = PlanCache(backend=CpuTestBackend())\n"
        "print(cache.get(ConvBiasRelu().graph()).source, cache.store is None)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLANCACHE_", "XDG_"))} | {"HOME": str(home)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["built", "True"], done.stdout
    assert "does not exist" in done.stderr and str(home) in done.stderr, done.stderr
    assert not home.exists()
    result = command("ls", env={"HOME": str(home), "PLANCACHE_DIR": None, "XDG_CACHE_HOME": None})
    assert one_line_error(result).endswith("set PLANCACHE_DIR, or pass a directory") and not home.exists()
