"""The first hour, fifth pass: what a new user met on a fresh clone. A recording switched
off, a key named by one character, a speed-up against the chosen plan itself, a command
whose reader went away, the example's temporary directory, a benchmark's --keep FILE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from graphs import ConvBiasRelu
from test_cli_first_hour import BACKEND, ROOT, fill, one_line_error
from test_cli_first_hour import plancache as command

from plancache import ConfigError, PlanCache
from plancache.testing import CpuTestBackend
from plancache.workflows.report import speedup


@pytest.mark.parametrize("off", ["0", "off", "no", "False"])
def test_a_recording_switched_off_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, off: str) -> None:
    """PLANCACHE_RECORD=0 (or off, no) recorded every graph into a file named 0 in the
    current directory; every other setting reads those words as off."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLANCACHE_RECORD", off)
    with PlanCache(tmp_path / "cache", backend=CpuTestBackend()) as cache:
        cache.get(ConvBiasRelu().graph())
        assert cache.lookup.recorders == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_a_recording_switched_on_without_a_file_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PLANCACHE_RECORD", "on")
    with pytest.raises(ConfigError, match=r"^PLANCACHE_RECORD='on' is a switch, but a recording needs a file"):
        PlanCache(tmp_path / "cache", backend=CpuTestBackend())


def test_rm_refuses_a_key_prefix_shorter_than_four_characters(tmp_path: Path) -> None:
    """`plancache rm 0` removed whichever plan's key began with 0."""
    directory = tmp_path / "cache"
    keys = fill(directory)
    line = one_line_error(command("--dir", str(directory), "rm", keys[0][0]))
    assert "too short: give at least 4 characters" in line
    line = one_line_error(command("--dir", str(directory), "show", keys[0][:3]))
    assert "too short" in line
    assert command("--dir", str(directory), "rm", keys[0][:4]).returncode == 0


def test_a_speed_up_is_never_taken_against_the_chosen_plan_itself() -> None:
    """A miss budget that cut the timing short leaves the first candidate that built only
    checked (its outputs compared, never timed): `inspect` then took the chosen one for the
    heuristic's choice and reported a 1.00x speed-up of it over itself."""

    def c(index: int, status: str, median: float | None = None) -> dict[str, Any]:
        return {"index": index, "status": status, "median_ms": median, "first_ms": None}

    assert speedup([c(0, "checked"), c(1, "chosen", 1.0)]) == (None, 0, None)
    assert speedup([c(0, "rejected"), c(1, "chosen", 1.0)]) == (None, 0, None)
    assert speedup([c(0, "failed"), c(1, "checked"), c(2, "chosen", 1.0)]) == (None, 1, None)


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(tmp_path: Path) -> None:
    """`plancache show KEY | head -1` exited 1, which the exit-code table keeps for a
    failure told in one line on stderr, with nothing on stderr."""
    directory = tmp_path / "cache"
    key = fill(directory)[0]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    done = subprocess.run([sys.executable, "-m", "plancache", "--dir", str(directory), "show", key], stdout=write,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.slow
def test_the_example_leaves_no_temporary_directory(tmp_path: Path) -> None:
    """Every run of the example left /tmp/plancache-example-* behind."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "resnet_attention.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_benchmark_keep_that_is_a_file_is_refused_before_any_phase(tmp_path: Path) -> None:
    """`bench_startup.py --keep FILE` ran three phases (15 s), then a 15-line traceback."""
    kept = tmp_path / "a-file"
    kept.write_text("mine")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_startup.py"), "--keep", str(kept)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "is not a directory" in done.stderr
    assert kept.read_text() == "mine"


_SIGTERM_BACKEND = """
import os, signal
from plancache.testing import CpuTestBackend


class TermOnSecond(CpuTestBackend):
    \"\"\"Sends its own process SIGTERM as the second graph's candidates are asked for.\"\"\"

    asked = 0

    def plans(self, *args, **kwargs):
        type(self).asked += 1
        if type(self).asked == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().plans(*args, **kwargs)
"""


def _stopped_by_sigterm(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "sigterm_backend.py").write_text(_SIGTERM_BACKEND)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'mods'}{os.pathsep}{ROOT}",
        "PLANCACHE_BACKEND": "sigterm_backend:TermOnSecond",
    }
    return subprocess.run([sys.executable, "-m", "plancache", *args, "--json"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)  # fmt: skip


@pytest.mark.slow
def test_sigterm_stops_a_prewarm_that_reports_what_it_finished(tmp_path: Path) -> None:
    """SIGTERM (what timeout, CI runners, Kubernetes and Slurm send) ended `prewarm` with
    exit 143 and nothing on stdout or stderr; Ctrl-C reported the entries done."""
    import json

    entries = [{"template": "matmul_bias_act", "params": {"b": 1, "m": 4, "k": 8, "n": n}} for n in (3, 5, 7)]
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"version": 1, "entries": entries}))
    done = _stopped_by_sigterm(tmp_path, "--dir", str(tmp_path / "cache"), "prewarm", str(manifest), "--no-progress")
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip() == "plancache: interrupted"
    report = json.loads(done.stdout)
    assert report["interrupted"] is True and report["built"] == 1 and report["not_run"] == 2


@pytest.mark.slow
def test_sigterm_stops_a_tune_that_reports_the_rows_it_finished(tmp_path: Path) -> None:
    """`tune` died silently on SIGTERM, and after Ctrl-C printed only `interrupted`,
    dropping the rows it had finished."""
    import json

    directory = tmp_path / "cache"
    keys = fill(directory, strides=(1, 2, 3))
    done = _stopped_by_sigterm(tmp_path, "--dir", str(directory), "tune", *keys, "--no-progress")
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip() == "plancache: interrupted"
    report = json.loads(done.stdout)
    assert report["interrupted"] is True and report["not_run"] == 2
    assert [row["status"] for row in report["rows"]] == ["tuned"]


def test_tune_keeps_each_entrys_hit_count_and_last_use(tmp_path: Path) -> None:
    """`plancache tune` reset every re-tuned entry's hit count and last use (`stats` hits
    1414 -> 0), which users read to find their hot plans and eviction to find cold ones."""
    import json
    import sqlite3

    directory = tmp_path / "cache"
    keys = fill(directory)
    with sqlite3.connect(directory / "plans.db") as conn:
        conn.execute("UPDATE plans SET hit_count = 1414, last_used_at = 1000.0 WHERE key = ?", (keys[0],))
    conn.close()
    tuned = command("--dir", str(directory), "tune", keys[0], "--json", env={"PLANCACHE_BACKEND": BACKEND})
    assert tuned.returncode == 0 and json.loads(tuned.stdout)["tuned"] == 1, tuned.stderr
    with sqlite3.connect(directory / "plans.db") as conn:
        kept = conn.execute("SELECT hit_count, last_used_at FROM plans WHERE key = ?", (keys[0],)).fetchone()
    conn.close()
    assert kept == (1414, 1000.0)


def test_a_damaged_record_of_use_is_not_carried_into_the_plan_that_replaces_it(tmp_path: Path) -> None:
    """The use kept over a replacement is the old row's only when it reads back: a damaged
    one would make the new, sound plan unreadable."""
    import sqlite3

    from plancache import Store

    directory = tmp_path / "cache"
    key = fill(directory)[0]
    store = Store(directory)
    try:
        entry = store.get(key)
        assert entry is not None
        store.connection().execute("UPDATE plans SET hit_count = 'many' WHERE key = ?", (key,))
        store.put(entry)
        again = store.get(key)
        assert again is not None and again.hit_count == entry.hit_count
        store.connection().execute("UPDATE plans SET hit_count = 7 WHERE key = ?", (key,))
        store.put(entry)
        assert store.get(key).hit_count == 7  # type: ignore[union-attr]
    finally:
        store.close()
    assert sqlite3.connect(directory / "plans.db").execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_cache_path_under_a_file_is_refused_not_read_as_empty(tmp_path: Path) -> None:
    """`--dir FILE/sub ls` said "nothing is cached there yet" for a path that can never
    exist, where a mistyped directory gets that note."""
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    line = one_line_error(command("--dir", str(a_file / "sub"), "ls"))
    assert f"can never be a cache directory: {a_file} is not a directory" in line
    missing = command("--dir", str(tmp_path / "missing" / "sub"), "ls")
    assert missing.returncode == 0 and "which does not exist: nothing is cached there yet" in missing.stderr


def test_every_command_shows_dir_as_a_path() -> None:
    """`plancache --help` said `--dir PATH`, each command's help `--dir TEXT`."""
    for name in ("ls", "stats", "show", "prewarm", "export", "import"):
        shown = command(name, "--help").stdout
        assert "--dir PATH" in shown and "--dir TEXT" not in shown, name


def test_without_a_gpu_the_first_error_points_to_the_cpu_test_backend(tmp_path: Path) -> None:
    """The quick start on a machine without a GPU: the error said a GPU is needed and not
    what runs instead, and `templates.allocate(..., device="cuda")` raised torch's bare
    AssertionError."""
    import torch

    from plancache import NoGpuError
    from plancache.workflows import templates

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with PlanCache(tmp_path / "cache") as cache, pytest.raises(NoGpuError, match=r"plancache\.testing\.CpuTestBackend"):
        cache.get(ConvBiasRelu().graph())
    with pytest.raises(NoGpuError, match=r"no CUDA device is visible; pass device='cpu'"):
        templates.allocate("conv_bias_act", device="cuda", n=1, c=8, h=6, w=6, k=4)
    assert set(templates.allocate("conv_bias_act", device="cpu", n=1, c=8, h=6, w=6, k=4)) == {1, 2, 3, 4}


@pytest.mark.parametrize(
    ("arguments", "read"),
    [
        ({"max_plans": "10"}, ("max_plans", 10)),  # the text PLANCACHE_MEMORY_PLANS takes
        ({"max_plans": 10}, ("max_plans", 10)),
        ({"read_only": "no"}, ("read_only", False)),
        ({"read_only": 0}, ("read_only", False)),  # 0 and 1 as PLANCACHE_..._=0 and =1 read
        ({"read_only": 1}, ("read_only", True)),
        ({"lock_timeout": "60"}, ("lock_timeout", 60.0)),
        ({"max_size": "off"}, ("max_size", None)),  # as PLANCACHE_AUTOTUNE_BUDGET=off: no limit
        ({"max_size": "NONE"}, ("max_size", None)),
    ],
)
def test_every_argument_takes_its_python_value_or_its_variables_text(make_cache: Any, arguments: dict[str, Any],
                                                                      read: tuple[str, Any]) -> None:  # fmt: skip
    """`max_plans="10"` and `read_only="no"` were accepted while `read_only=1` was refused;
    `PLANCACHE_MAX_SIZE=off` was refused while `PLANCACHE_AUTOTUNE_BUDGET=off` meant no limit."""
    make_cache().close()  # a store to open read-only
    cache = make_cache(**arguments)
    name, value = read
    got = {"max_plans": lambda: cache.memory.capacity, "read_only": lambda: cache.local.read_only,
           "lock_timeout": lambda: cache.lock_timeout, "max_size": lambda: cache.max_size}[name]()  # fmt: skip
    assert got == value


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"lock_timeout": -1}, r"^PlanCache\(lock_timeout\)=-1 is not a number of seconds above 0"),
        ({"read_only": 2}, r"^PlanCache\(read_only\)=2 is not a switch"),
        ({"max_plans": 2.5}, r"^max_plans=2\.5 is not a whole number of plans"),
        ({"max_plans": True}, r"^max_plans=True is not a whole number of plans"),
    ],
)
def test_an_argument_outside_the_rule_is_a_config_error_naming_it(make_cache: Any, arguments: dict[str, Any],
                                                                 named: str) -> None:  # fmt: skip
    """`lock_timeout=-1` was a plain ValueError, unlike every other argument."""
    with pytest.raises(ConfigError, match=named) as caught:
        make_cache(**arguments)
    assert "\n" not in str(caught.value)


def test_words_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """Policy names were case-sensitive while switches were not."""
    from plancache import BuildOptions
    from plancache.config import AUTO_PRIME, MAX_SIZE

    assert BuildOptions(policy="TopK") == BuildOptions(policy="topk")
    assert BuildOptions(heuristic_modes=("a", "Fallback")).heuristic_modes == ("A", "FALLBACK")
    for name, text, value in (("PLANCACHE_AUTO_PRIME", "OFF", False), ("PLANCACHE_MAX_SIZE", "Off", None)):
        monkeypatch.setenv(name, text)
        assert (AUTO_PRIME if name == "PLANCACHE_AUTO_PRIME" else MAX_SIZE).from_env() is value


def test_an_export_into_a_missing_directory_is_refused_and_creates_none(tmp_path: Path) -> None:
    """`export NEW/DIR/x.bundle` created the missing directories without a word."""
    fill(tmp_path / "cache")
    target = tmp_path / "new" / "dir" / "x.bundle"
    line = one_line_error(command("--dir", str(tmp_path / "cache"), "export", str(target)))
    assert f"{target.parent} is not a directory; create it first" in line
    assert not (tmp_path / "new").exists()
    target.parent.mkdir(parents=True)
    assert command("--dir", str(tmp_path / "cache"), "export", str(target)).returncode == 0 and target.is_file()
