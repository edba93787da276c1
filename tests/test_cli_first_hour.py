"""The `plancache` command as a user meets it in the first hour: one line per error with a
documented exit code (and, with --json, the error as JSON on stdout), commands that fail
before they create anything, a prewarm that never reports success for plans it could not
store, one verdict on a damaged store from every command, export that never replaces a
special file, rm that resolves every key first, options before or after the command, diffs
by path, manifests that run no code unless allowed, read commands that read a cache not
created yet as an empty one (and create nothing), and the README's set-up commands on a
machine without a GPU.

Commands run in this process (click's CliRunner), which is what they test; a fresh process
is started only where the process is the point: the README's main job, an example script,
a pytest run."""

from __future__ import annotations

import grp
import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from nested_pytest import run_pytest

from plancache import PlanCache
from plancache.cli import cli
from plancache.store import Store
from plancache.testing import CpuTestBackend
from plancache.workflows import templates

ROOT = Path(__file__).resolve().parent.parent
BACKEND = "plancache.testing:CpuTestBackend"
TEMPLATE_ENTRY = {"template": "matmul_bias_act", "params": {"b": 1, "m": 4, "k": 8, "n": 3}}


@dataclass(frozen=True)
class Run:
    """What one ``plancache`` command did: its exit code and output, and the exception it
    let out (``--debug``, or a bug: what a traceback would show)."""

    returncode: int
    stdout: str
    stderr: str
    exception: BaseException | None


def plancache(*args: str, env: dict[str, str | None] | None = None) -> Run:
    """``plancache ARGS`` in this process, with ``env`` over this process's environment (and
    the logging level that ``--debug`` changes put back afterwards)."""
    level = logging.getLogger().level
    try:
        result = CliRunner().invoke(cli, list(args), env=env)
    finally:
        logging.getLogger().setLevel(level)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    return Run(result.exit_code, result.stdout, result.stderr, escaped)


def one_line_error(result: Run, code: int = 1) -> str:
    """The result failed with ``code`` and exactly one line on stderr (no traceback)."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr, result.exception)
    assert result.exception is None, result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plancache: error: "), result.stderr
    return lines[0]


def fill(directory: Path, strides: tuple[int, ...] = (1, 2)) -> list[str]:
    cache = PlanCache(directory, backend=CpuTestBackend())
    try:
        return [cache.get(templates.build("conv_bias_act", n=1, c=8, h=6, w=6, k=4, stride=s)).key for s in strides]
    finally:
        cache.close()


def keys_in(directory: Path) -> list[str]:
    store = Store(directory)
    try:
        return store.keys()
    finally:
        store.close()


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Path, list[str]]:
    directory = tmp_path / "cache"
    return directory, fill(directory)


def write_manifest(path: Path, *entries: Any, **top: Any) -> Path:
    path.write_text(json.dumps({"version": 1, **top, "entries": list(entries)}, indent=1))
    return path


# ---------------------------------------------------------------------------- 1. PLANCACHE_MAX_SIZE


def test_cli_bad_max_size_is_one_line_exit_2_and_creates_nothing(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    cache = tmp_path / "cache"
    for value in ("banana", "-5", "1"):
        result = plancache("--dir", str(cache), "prewarm", str(manifest),
                           env={"PLANCACHE_MAX_SIZE": value, "PLANCACHE_BACKEND": BACKEND})  # fmt: skip
        line = one_line_error(result, 2)
        assert f"PLANCACHE_MAX_SIZE={value!r}" in line
        assert not cache.exists()


def test_cli_max_size_zero_keeps_everything_and_stats_shows_the_limit(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, keys = filled
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    result = plancache(
        "--dir", str(directory), "prewarm", str(manifest), env={"PLANCACHE_MAX_SIZE": "0", "PLANCACHE_BACKEND": BACKEND}
    )
    assert result.returncode == 0, result.stderr
    assert set(keys) < set(keys_in(directory)) and len(keys_in(directory)) == 3
    assert "size limit    none" in plancache("--dir", str(directory), "stats").stdout
    limited = plancache("--dir", str(directory), "stats", "--json", env={"PLANCACHE_MAX_SIZE": "2GB"})
    assert json.loads(limited.stdout)["max_size"] == 2 << 30


# ---------------------------------------------------------------------------- 2. export never replaces a special file


def test_export_refuses_a_symlink_and_a_fifo_and_leaves_them_alone(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = filled
    real = tmp_path / "real.txt"
    real.write_text("keep me")
    link = tmp_path / "link.bundle"
    link.symlink_to(real)
    fifo = tmp_path / "fifo.bundle"
    os.mkfifo(fifo)
    for target, kind in ((link, "a symbolic link"), (fifo, "a FIFO")):
        line = one_line_error(plancache("--dir", str(directory), "export", str(target)))
        assert str(target) in line and kind in line and "not a regular file" in line
    assert link.is_symlink() and real.read_text() == "keep me"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "fifo.bundle", "link.bundle", "real.txt"]  # no temp file


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="creating a device node needs root")
def test_export_as_root_refuses_a_device_node(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = filled
    node = tmp_path / "full"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 7))  # what /dev/full is, in a scratch directory
    line = one_line_error(plancache("--dir", str(directory), "export", str(node)))
    assert "a character device" in line
    assert stat.S_ISCHR(node.lstat().st_mode)


def test_export_replaces_a_regular_file_through_a_temporary_file(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, keys = filled
    target = tmp_path / "out" / "plans.bundle"
    target.parent.mkdir()
    target.write_text("old")
    result = plancache("--dir", str(directory), "export", str(target), "--json", "--force")
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["keys"]) == sorted(keys)
    assert target.read_bytes().startswith(b"PLANCACHE-BUNDLE\n")
    assert [p.name for p in target.parent.iterdir()] == ["plans.bundle"]


def test_export_refuses_an_existing_bundle_unless_force(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, keys = filled
    target = tmp_path / "plans.bundle"
    assert plancache("--dir", str(directory), "export", str(target), "--key", keys[0]).returncode == 0
    first = target.read_bytes()
    line = one_line_error(plancache("--dir", str(directory), "export", str(target)))
    assert line == f"plancache: error: refused: {target} exists; pass --force to replace it"
    assert target.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "plans.bundle"]  # no temporary file left
    result = plancache("--dir", str(directory), "export", str(target), "--force", "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)["keys"]) == sorted(keys) and target.read_bytes() != first


def test_export_without_replace_never_replaces_a_file_that_appears_meanwhile(tmp_path: Path) -> None:
    from plancache.errors import BundleError
    from plancache.workflows import bundle

    target = tmp_path / "plans.bundle"
    target.write_text("someone else's")
    with pytest.raises(BundleError, match="exists") as info:
        bundle.export_bundle(None, target, replace=False)
    assert info.value.reason == "exists" and target.read_text() == "someone else's"
    finished = tmp_path / ".plans.bundle.tmp"  # the export's temporary file, written while the target appeared
    finished.write_text("new bundle")
    with pytest.raises(BundleError, match="exists"):
        bundle._link_new(str(finished), target)
    assert target.read_text() == "someone else's"
    target.unlink()
    bundle._link_new(str(finished), target)
    assert target.read_text() == "new bundle" and not finished.exists()


def test_export_under_a_file_or_into_an_unwritable_directory_is_one_line(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = filled
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for target in (a_file / "plans.bundle", a_file / "sub" / "plans.bundle"):
        line = one_line_error(plancache("--dir", str(directory), "export", str(target)))
        assert "cannot write bundle" in line and "Not a directory" in line
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "plans.bundle"
    elif _sys_refuses_files():
        target = Path("/sys/plans.bundle")  # sysfs refuses new files even to root
    else:
        pytest.skip("no directory that refuses root's writes")
    line = one_line_error(plancache("--dir", str(directory), "export", str(target)))
    assert "cannot write bundle" in line and "Permission denied" in line


def _sys_refuses_files() -> bool:
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir="/sys")
    except PermissionError:
        return True
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return False


# ---------------------------------------------------------------------------- 3. one line per error


def test_a_backend_spec_that_is_not_a_backend_class_is_one_line(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    for spec, says in [("os:getcwd", "not a backend class"), ("os", "not a backend class spec"),
                       ("collections:OrderedDict", "not a backend class"), ("plancache.testing:Nope", "no attribute 'Nope'"),
                       ("no_such_module_zz:X", "cannot be imported")]:  # fmt: skip
        line = one_line_error(
            plancache("--dir", str(tmp_path / "c"), "prewarm", str(manifest), env={"PLANCACHE_BACKEND": spec}), 2
        )
        assert "PLANCACHE_BACKEND" in line and says in line, line
    assert not (tmp_path / "c").exists()


def test_an_environment_id_no_plan_has_is_one_line_for_export_and_import_and_creates_nothing(
    filled: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """A typo in --env exported an empty bundle (exit 0), or imported nothing without a word."""
    directory, _ = filled
    typo = plancache("--dir", str(directory), "export", "--env", "nope", str(tmp_path / "typo.bundle"))
    assert "names no environment of the plans in" in one_line_error(typo) and not (tmp_path / "typo.bundle").exists()
    bundle = tmp_path / "all.bundle"
    assert plancache("--dir", str(directory), "export", str(bundle)).returncode == 0
    line = one_line_error(plancache("--dir", str(tmp_path / "new"), "import", str(bundle), "--env", "nope", "--allow-unsigned"))
    assert "names no environment of the plans in bundle" in line and not (tmp_path / "new").exists()


def test_other_user_errors_are_one_line_and_debug_shows_the_traceback(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = filled
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert "is not a directory" in one_line_error(plancache("--dir", str(a_file), "ls"))
    assert "not a plancache bundle" in one_line_error(plancache("--dir", str(directory), "import", str(a_file)), 3)
    debug = plancache("ls", "--dir", str(a_file), "--debug")
    assert debug.returncode == 1 and type(debug.exception).__name__ == "CacheDirError"  # raised: Python prints its traceback
    usage = plancache("--dir", str(directory), "ls", "--no-such-option")
    assert usage.returncode == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the message of a machine without a GPU")
def test_the_example_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    example = [sys.executable, str(ROOT / "examples" / "resnet_attention.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*example, "--mode", "warm", "--dir", str(tmp_path / "d")], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "needs an NVIDIA GPU" in result.stderr
    assert not (tmp_path / "d").exists()
    usage = subprocess.run([*example, "--mode", "warm"], capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "needs --dir" in usage.stderr


# ---------------------------------------------------------------------------- 4. rm resolves every key first


def test_rm_removes_nothing_when_one_key_is_unknown_or_ambiguous(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    keys = fill(directory, strides=tuple(range(1, 18)))  # 17 keys: two share a first hex digit
    first = [k[0] for k in keys]
    shared = next(c for c in first if first.count(c) > 1)
    good = next(k for k in keys if k[0] != shared)
    line = one_line_error(plancache("--dir", str(directory), "rm", good[:12], "ffff0000"))
    assert "nothing removed" in line and "'ffff0000'" in line
    line = one_line_error(plancache("--dir", str(directory), "rm", good[:12], shared, "0000ffff"))
    assert f"key prefix {shared!r} is too short: give at least 4 characters" in line and "'0000ffff'" in line
    assert keys_in(directory) == sorted(keys)
    result = plancache("--dir", str(directory), "rm", good[:12], good, "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == {"removed": [good]}
    assert keys_in(directory) == sorted(k for k in keys if k != good)


# ---------------------------------------------------------------------------- 6. options before or after the command


def test_dir_json_and_debug_go_before_or_after_the_command(filled: tuple[Path, list[str]]) -> None:
    directory, keys = filled
    for args in (["--dir", str(directory), "ls", "--json"], ["ls", "--dir", str(directory), "--json"],
                 ["--json", "ls", "--dir", str(directory)], ["ls", "--json", "--debug", "--dir", str(directory)],
                 ["--debug", "--dir", "/nonexistent", "ls", "--dir", str(directory), "--json"]):  # fmt: skip
        result = plancache(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert sorted(r["key"] for r in json.loads(result.stdout)) == sorted(keys), args
    for command in (["stats"], ["show", keys[0][:8]], ["inspect"], ["verify"], ["diff", keys[0][:8], keys[1][:8]]):
        result = plancache(*command, "--dir", str(directory), "--json")
        assert result.returncode == (1 if command[0] == "diff" else 0), (command, result.stderr)  # diff: they differ
        json.loads(result.stdout)


# ---------------------------------------------------------------------------- 7. diff by path


def test_diff_prints_each_differing_path_with_both_values(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    one, two = fill(directory, strides=(1, 2))
    result = plancache("--dir", str(directory), "diff", one[:10], two[:10])
    assert result.returncode == 1 and result.stderr == "", result.stderr  # they differ: 1, as diff(1)
    assert "graph.nodes[0].params.stride: [1, 1] -> [2, 2]" in result.stdout.splitlines()
    assert "graph.tensors.u4.dim: [1, 4, 6, 6] -> [1, 4, 3, 3]" in result.stdout.splitlines()
    rows = json.loads(plancache("diff", one[:10], two[:10], "--dir", str(directory), "--json").stdout)
    assert {"path": "graph.nodes[0].params.stride", "a": [1, 1], "b": [2, 2]} in rows
    assert all(set(r) >= {"path", "a", "b"} for r in rows)
    same = plancache("--dir", str(directory), "diff", one[:10], one)
    assert same.stdout.strip() == "the keys have identical parts" and same.returncode == 0
    assert json.loads(plancache("--dir", str(directory), "--json", "diff", one, one).stdout) == []


def test_diff_names_paths_only_one_side_has() -> None:
    from plancache.cli.inspection import _difference, _differences

    a = {"graph": {"nodes": [{"params": {"mode": "relu"}}], "flags": {"x": 1}}, "options": {"policy": "topk"}}
    b = {"graph": {"nodes": [{"params": {"mode": "relu"}}, {"params": {}}], "flags": {}}, "options": {"policy": "topk", "k": 4}}
    rows = [_difference(*d) for d in _differences(a, b, "")]
    assert rows == [
        {"path": "graph.flags.x", "a": 1, "b": None, "absent": "b"},
        {"path": "graph.nodes[1]", "a": None, "b": {"params": {}}, "absent": "a"},
        {"path": "options.k", "a": None, "b": 4, "absent": "a"},
    ]


# ---------------------------------------------------------------------------- 8. manifests run no code unless allowed


@pytest.fixture
def code_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """A manifest with a builder entry whose module leaves a marker file when imported. What
    running it adds to ``sys.path`` and ``sys.modules`` in this process goes afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    marker = tmp_path / "imported.marker"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "marker_builders.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from plancache.workflows import templates\n"
        "def conv(n):\n    return templates.build('conv_bias_act', n=n, c=8, h=6, w=6, k=4)\n"
    )
    manifest = write_manifest(tmp_path / "code.json", TEMPLATE_ENTRY, {"builder": "marker_builders:conv", "args": [1]},
                              pythonpath=["mods"])  # fmt: skip
    yield manifest, marker
    sys.modules.pop("marker_builders", None)


def test_dry_run_lists_builder_entries_without_importing_them(code_manifest: tuple[Path, Path], tmp_path: Path) -> None:
    manifest, marker = code_manifest
    result = plancache(
        "--dir", str(tmp_path / "c"), "prewarm", str(manifest), "--dry-run", "--json", env={"PLANCACHE_BACKEND": BACKEND}
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["status"] for r in report["entries"]] == ["would_build", "listed"]
    assert report["entries"][1]["key"] is None and "marker_builders:conv" in report["entries"][1]["label"]
    assert not marker.exists()
    text = plancache(
        "--dir", str(tmp_path / "c"), "prewarm", str(manifest), "--dry-run", "--allow-code", env={"PLANCACHE_BACKEND": BACKEND}
    )
    assert "1 builder entries listed without importing them" in text.stdout.splitlines()[-1]
    assert not marker.exists()


def test_builder_entries_and_pythonpath_need_allow_code(code_manifest: tuple[Path, Path], tmp_path: Path) -> None:
    manifest, marker = code_manifest
    cache = tmp_path / "c"
    line = one_line_error(plancache("--dir", str(cache), "prewarm", str(manifest), env={"PLANCACHE_BACKEND": BACKEND}), 3)
    assert (
        "runs code" in line
        and "pythonpath ['mods']" in line
        and "builder marker_builders:conv" in line
        and "--allow-code" in line
    )
    assert not marker.exists() and not cache.exists()
    only_path = write_manifest(tmp_path / "path-only.json", TEMPLATE_ENTRY, pythonpath=["mods"])
    assert "pythonpath" in one_line_error(
        plancache("--dir", str(cache), "prewarm", str(only_path), env={"PLANCACHE_BACKEND": BACKEND}), 3
    )

    result = plancache(
        "--dir", str(cache), "prewarm", str(manifest), "--allow-code", "--json", env={"PLANCACHE_BACKEND": BACKEND}
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["built"] == 2 and marker.exists()


def test_manifest_api_without_code_imports_nothing_and_keeps_sys_path(code_manifest: tuple[Path, Path]) -> None:
    from plancache.workflows.manifest import code_references, load_manifest

    manifest, marker = code_manifest
    before = list(sys.path)
    entries, errors = load_manifest(manifest, allow_code=False)
    assert [e.kind for e in entries] == ["template"]
    assert (
        len(errors) == 2
        and "pythonpath" in errors[0].message
        and "entry 1: builder 'marker_builders:conv' refused" in errors[1].message
    )
    listed, none = load_manifest(manifest, listing=True)
    assert none == [] and [e.kind for e in listed] == ["template", "builder"] and listed[1].listed_only
    with pytest.raises(Exception, match="listed without importing it"):
        listed[1].build()
    assert code_references(manifest) == ["pythonpath ['mods']", "entry 1 (line 16): builder marker_builders:conv"]
    assert sys.path == before and "marker_builders" not in sys.modules and not marker.exists()


# ---------------------------------------------------------------------------- 9. a fresh machine: absent is empty


READ_COMMANDS = (["ls"], ["stats"], ["inspect"], ["verify"], ["verify", "--fix"], ["prune", "--quarantined"],
                 ["prune", "--older-than", "30", "--other-environments"])  # fmt: skip


def _shape(value: Any, name: str = "") -> Any:
    """What a script relies on in a JSON result: the keys of objects (not of the maps keyed
    by data: counters, policies, keys) and the kind of everything else."""
    if isinstance(value, dict):
        return "map" if name in _MAPS else {k: _shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return "list"
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


_MAPS = {"counters", "by_policy", "undecodable", "foreign", "damaged", "environments", "skipped", "failed"}


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_read_commands_on_a_fresh_machine_exit_0_and_create_nothing(command: list[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-cache-yet"
    result = plancache("--dir", str(missing), *command)
    assert result.returncode == 0, result.stderr
    assert f"no plans yet in {missing}" in result.stdout.splitlines()[0]
    assert result.stderr.strip() == f"plancache: note: --dir names {missing}, which does not exist: nothing is cached there yet"
    as_json = plancache("--dir", str(missing), *command, "--json")
    assert as_json.returncode == 0, as_json.stderr
    json.loads(as_json.stdout)  # JSON, nothing else, on stdout
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def test_an_absent_cache_reads_as_an_empty_one_in_the_same_json_shape(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    """The JSON of a cache with nothing yet has the shape of a filled cache's, and equals an
    existing empty store's (the path aside): a script needs no special case."""
    directory, _ = filled
    empty = tmp_path / "empty"
    Store(empty).close()
    for command in READ_COMMANDS:
        env = {"PLANCACHE_BACKEND": BACKEND}  # prune --other-environments asks the backend of a filled cache
        absent = json.loads(plancache("--dir", str(tmp_path / "absent"), *command, "--json", env=env).stdout)
        full = json.loads(plancache("--dir", str(directory), *command, "--json", env=env).stdout)
        blank = json.loads(plancache("--dir", str(empty), *command, "--json", env=env).stdout)
        if isinstance(absent, list):
            assert absent == [] == blank and isinstance(full, list) and full, command
            continue
        assert _shape(absent) == _shape(full) == _shape(blank), command
        strip = lambda d: {k: v for k, v in d.items() if k not in ("path", "file_bytes", "seconds")}  # noqa: E731
        assert strip(absent) == strip(blank), command
    assert not (tmp_path / "absent").exists()


def test_the_default_directory_absent_is_empty_without_a_note(tmp_path: Path) -> None:
    result = plancache("ls", env={"PLANCACHE_DIR": None, "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("no plans yet in ") and str(tmp_path) in result.stdout
    named = plancache("ls", env={"PLANCACHE_DIR": str(tmp_path / "typo")})
    assert named.returncode == 0 and "PLANCACHE_DIR names" in named.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_directory_without_a_plan_store_is_empty_and_stays_untouched(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in READ_COMMANDS:
        result = plancache("--dir", str(empty), *command)
        assert result.returncode == 0 and result.stderr == "", (command, result.stderr)
        assert f"no plans yet in {empty}" in result.stdout
    assert list(empty.iterdir()) == []


def test_a_key_asked_of_a_fresh_machine_is_not_found(tmp_path: Path) -> None:
    """A lookup by key fails on an absent cache as on an empty one: one line saying that
    nothing is cached yet, exit 1, nothing created."""
    missing = tmp_path / "typo"
    for command in (["show", "abcd"], ["diff", "ab", "cd"], ["inspect", "abcd"], ["rm", "abcd"],
                    ["export", str(tmp_path / "x.bundle"), "--key", "abcd"]):  # fmt: skip
        result = plancache("--dir", str(missing), *command, "--json")
        line = [x for x in result.stderr.splitlines() if x.startswith("plancache: error: ")]
        assert len(line) == 1 and ("no plans yet" in line[0] or "nothing is stored yet" in line[0]), (command, result.stderr)
        assert result.returncode == 1 and json.loads(result.stdout) == {"error": line[0][18:], "exit_code": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_numpy_and_tomli_are_declared_and_the_cpu_path_is_pinned() -> None:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=;\s\[]", d)[0] for d in project["dependencies"]]
    assert "numpy" in names and "tomli" in names
    # A table ({text = ...}) is deprecated by setuptools, whose builds refuse it from 2027-02-18.
    assert isinstance(project["license"], str)
    assert any("tomli" in d and "python_version < '3.11'" in d for d in project["dependencies"])
    lines = (ROOT / "constraints-cpu.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    for name in ("torch", "numpy", "nvidia-cudnn-frontend", "sqlite-utils", "filelock", "platformdirs", "click", "jsonschema",
                 "pytest", "pytest-xdist", "redis", "setuptools", "import-linter", "grimp", "vulture"):  # fmt: skip
        assert name in pins, name
    # pip applies -c to what it installs, not to the isolated build of plancache: setuptools'
    # pin holds only through PIP_CONSTRAINT, in every command that installs the pins.
    for path in ("README.md", ".ci/run"):
        text = (ROOT / path).read_text()
        assert "-c constraints-cpu.txt" not in text and "PIP_CONSTRAINT=constraints-cpu.txt" in text, path


# ---------------------------------------------------------------------------- 5. the README's set-up commands


@pytest.mark.slow
def test_the_main_job_without_a_gpu_runs_the_cache_on_the_cpu_and_exits_0(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the main job is the real benchmark (scripts/gpu-check)")
    out = tmp_path / "figures.json"
    scratch = tmp_path / "tmp"  # the system temporary directory of the run: nothing may stay there
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    kept = tmp_path / "kept"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_startup.py"), "--out", str(out), "--keep", str(kept)],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert list(scratch.iterdir()) == [], "the main job left files in the temporary directory"
    # It ends by saying how to explore what it built, which --keep kept (it deleted its cache).
    assert f"The cache is kept in {kept}. Explore what it built:" in result.stdout
    assert f"  plancache --dir {kept} ls" in result.stdout.splitlines()
    assert len(json.loads(plancache("--dir", str(kept), "--json", "ls").stdout)) == 7
    lines = result.stdout.splitlines()
    assert any(line.startswith("graph") and "miss ms" in line and "fresh-process hit ms" in line for line in lines)
    assert "need an NVIDIA GPU" in result.stdout and "second process: hits 7" in result.stdout
    figures = json.loads(out.read_text())
    assert [r["source"] for r in figures["hit"]["rows"]] == ["loaded"] * 7 and figures["stats"]["entries"] == 7


@pytest.mark.slow  # runs pytest itself, in a child process
def test_redis_tests_skip_with_a_reason_when_redis_server_is_absent(tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"  # a PATH without redis-server (python itself runs by its full path)
    empty_bin.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=str(empty_bin), PYTHONPATH=str(ROOT))
    result = run_pytest(["-rs", "tests/test_fleet.py::test_killed_server_leaves_local_operation_working",
                         "tests/test_fleet.py::test_a_plan_built_on_one_machine_is_a_hit_on_another"], cwd=ROOT, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout and "error" not in result.stdout.lower()
    assert "redis-server is not on PATH" in result.stdout


# ---------------------------------------------------------------------------- 10. one table of exit codes

SECRET = "s" * 32
REDIS = "redis://127.0.0.1:1/0"


def _exit_cases(tmp: Path, filled_dir: Path) -> list[tuple[str, list[str], dict[str, str], int]]:
    """(what, arguments, environment, expected exit code): every kind of outcome."""
    a_file = tmp / "a-file"
    a_file.write_text("")
    good = write_manifest(tmp / "good.json", TEMPLATE_ENTRY)
    failing = write_manifest(tmp / "failing.json", TEMPLATE_ENTRY, {"template": "conv3d_zzz"})
    broken = tmp / "broken.json"
    broken.write_text("{ not json")
    code = write_manifest(tmp / "code.json", {"builder": "mod:fn"})
    (tmp / "ctrl_c_mods").mkdir()
    (tmp / "ctrl_c_mods" / "ctrl_c_builder.py").write_text("def graph():\n    raise KeyboardInterrupt\n")
    ctrl_c = write_manifest(tmp / "ctrl-c.json", TEMPLATE_ENTRY, {"builder": "ctrl_c_builder:graph"}, pythonpath=["ctrl_c_mods"])
    damaged = tmp / "damaged"
    fill(damaged)

    with sqlite3.connect(damaged / "plans.db") as conn:
        conn.execute("UPDATE plans SET blob_sha256 = 'x'")
    conn.close()
    damaged_file = tmp / "damaged-file"
    damaged_file.mkdir(mode=0o700)
    (damaged_file / "plans.db").write_text("not a database")
    shared = tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    d, c, b = ["--dir", str(filled_dir)], ["--dir", str(tmp / "new")], {"PLANCACHE_BACKEND": BACKEND}
    return [
        ("a listing", [*d, "ls"], {}, 0),
        ("a listing of a cache not created yet", ["--dir", str(tmp / "absent"), "ls"], {}, 0),
        ("a prewarm", ["--dir", str(tmp / "built"), "prewarm", str(good)], b, 0),
        ("a cache path that is a file", ["--dir", str(a_file), "ls"], {}, 1),
        ("an unknown key", [*d, "show", "ffff0000"], {}, 1),
        ("a bundle that is no bundle", [*d, "import", str(a_file)], {}, 3),
        ("a bundle that does not exist", [*c, "import", str(tmp / "missing.bundle")], {}, 3),
        ("a manifest that does not exist", [*c, "prewarm", str(tmp / "missing.json")], b, 3),
        ("a cache directory other users can write", ["--dir", str(shared), "ls"], {}, 1),
        ("a damaged store", ["--dir", str(damaged_file), "ls"], {}, 1),
        ("PLANCACHE_AUTO_PRIME in a prewarm", [*c, "prewarm", str(good)], {**b, "PLANCACHE_AUTO_PRIME": "maybe"}, 2),
        ("an unknown option", [*d, "ls", "--no-such-option"], {}, 2),
        ("a bad option value", [*d, "prewarm", str(good), "--policy", "fastest"], b, 2),
        ("PLANCACHE_MAX_SIZE", [*c, "prewarm", str(good)], {**b, "PLANCACHE_MAX_SIZE": "banana"}, 2),
        ("PLANCACHE_MEMORY_PLANS", [*c, "prewarm", str(good)], {**b, "PLANCACHE_MEMORY_PLANS": "many"}, 2),
        ("PLANCACHE_ALLOW_SHARED_DIR", [*d, "ls"], {"PLANCACHE_ALLOW_SHARED_DIR": "1"}, 2),
        ("PLANCACHE_BACKEND", [*c, "prewarm", str(good)], {"PLANCACHE_BACKEND": "os:getcwd"}, 2),
        ("PLANCACHE_REDIS_URL without a secret", [*d, "stats"], {"PLANCACHE_REDIS_URL": REDIS}, 2),
        ("PLANCACHE_REDIS_TIMEOUT", [*d, "stats"],
         {"PLANCACHE_REDIS_URL": REDIS, "PLANCACHE_REDIS_SECRET": SECRET, "PLANCACHE_REDIS_TIMEOUT": "soon"}, 2),
        ("PLANCACHE_REDIS_TTL in a prewarm", [*c, "prewarm", str(good)],
         {**b, "PLANCACHE_REDIS_URL": REDIS, "PLANCACHE_REDIS_SECRET": SECRET, "PLANCACHE_REDIS_TTL": "-1"}, 2),
        ("a failing entry", ["--dir", str(tmp / "partial"), "prewarm", str(failing)], b, 3),
        ("a failing entry in a dry run", [*c, "prewarm", str(failing), "--dry-run"], {}, 3),
        ("a manifest that is not JSON", [*c, "prewarm", str(broken)], b, 3),
        ("a manifest that runs code", [*c, "prewarm", str(code)], b, 3),
        ("a store with a damaged entry", ["--dir", str(damaged), "verify"], {}, 3),
        ("a damaged store file", ["--dir", str(damaged_file), "verify"], {}, 3),
        ("Ctrl-C in a prewarm", ["--dir", str(tmp / "stopped"), "prewarm", "--allow-code", str(ctrl_c)], b, 130),
    ]  # fmt: skip


def test_every_outcome_exits_with_its_documented_code(
    filled: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plancache.cli import EXIT_CODES

    monkeypatch.setattr(sys, "path", list(sys.path))  # a manifest's pythonpath goes afterwards
    monkeypatch.delitem(sys.modules, "ctrl_c_builder", raising=False)
    directory, _ = filled
    cases = _exit_cases(tmp_path, directory)
    failures = []
    for what, args, env, expected in cases:
        result = plancache(*args, env=env)
        errors = [line for line in result.stderr.splitlines() if line.startswith(("plancache: error:", "Error:"))]
        if result.returncode != expected or (expected in (1, 2) and len(errors) != 1) or result.exception is not None:
            failures.append(f"{what}: exit {result.returncode}, expected {expected}: {result.stderr.strip()[-300:]}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "new").exists(), "a command that failed created the cache"
    # 141 needs a real pipe: test_a_reader_that_goes_away_ends_the_command_quietly_with_141
    assert {expected for *_, expected in cases} | {141} == set(EXIT_CODES), "every documented code has a case"


def test_the_exit_codes_are_documented_once_and_shown_by_help() -> None:
    from plancache.cli import EXIT_CODES

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Exit codes") :]
    rows = dict(re.findall(r"^\| `(\d+)` \| (.+) \|$", section.split("\n## ", 1)[0], re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES, (
        "README's table of exit codes differs from plancache.cli.EXIT_CODES"
    )
    assert len(re.findall(r"(?i)exit codes?:", readme)) == 0, "exit codes are listed in one table, not again in prose"
    help_text = " ".join(plancache("--help").stdout.split())
    for code, text in EXIT_CODES.items():
        assert f"{code} {' '.join(text.replace('`', '').split())}" in help_text, code


# ---------------------------------------------------------------------------- 11. prune --older-than


def _age_entries(directory: Path, keys: list[str], days: float) -> None:
    import time

    with sqlite3.connect(directory / "plans.db") as conn:
        conn.executemany("UPDATE plans SET last_used_at = ? WHERE key = ?", [(time.time() - days * 86400, k) for k in keys])
    conn.close()


def test_prune_older_than_0_refuses_to_remove_plans_just_used_unless_force(filled: tuple[Path, list[str]]) -> None:
    directory, keys = filled
    line = one_line_error(plancache("--dir", str(directory), "prune", "--older-than", "0"))
    assert "refused: --older-than 0 would remove 2 entries" in line and "2 of them used in the last day" in line
    assert "--force" in line and "--dry-run" in line
    assert keys_in(directory) == sorted(keys)
    _age_entries(directory, keys[:1], days=0.6)  # unused for 14 hours: used within the last day all the same
    line = one_line_error(plancache("--dir", str(directory), "prune", "--older-than", "0.5", "--quarantined"))
    assert "refused: --older-than 0.5 would remove 1 entries" in line and "(the latest 14h ago)" in line
    dry = plancache("--dir", str(directory), "prune", "--older-than", "0", "--dry-run", "--json")
    assert dry.returncode == 0 and len(json.loads(dry.stdout)["removed"]) == 2 and keys_in(directory) == sorted(keys)
    forced = plancache("--dir", str(directory), "prune", "--older-than", "0", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert sorted(r["key"] for r in json.loads(forced.stdout)["removed"]) == sorted(keys) and keys_in(directory) == []


def test_prune_below_a_day_of_entries_unused_for_days_needs_no_force(filled: tuple[Path, list[str]]) -> None:
    directory, keys = filled
    _age_entries(directory, keys[:1], days=3)
    line = one_line_error(plancache("--dir", str(directory), "prune", "--older-than", "0"))
    assert "would remove 2 entries" in line and "1 of them used in the last day" in line
    result = plancache("--dir", str(directory), "prune", "--older-than", "0.5", "--json")  # keys[1] was used just now
    assert result.returncode == 0, result.stderr
    assert [r["key"] for r in json.loads(result.stdout)["removed"]] == keys[:1] and keys_in(directory) == keys[1:]
    assert plancache("--dir", str(directory), "prune", "--older-than", "30").returncode == 0
    assert keys_in(directory) == keys[1:]


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "", "2d"])
def test_prune_older_than_takes_a_number_of_days(value: str, filled: tuple[Path, list[str]]) -> None:
    directory, keys = filled
    result = plancache("--dir", str(directory), "prune", "--older-than", value)
    assert result.returncode == 2
    assert f"Invalid value for '--older-than': {value!r} is not a number of days" in result.stderr, result.stderr
    assert "float" not in result.stderr.lower()
    assert keys_in(directory) == sorted(keys)


def test_prune_help_says_days() -> None:
    text = plancache("prune", "--help").stdout
    assert "--older-than DAYS" in text and "FLOAT" not in text and "--force" in text


# ---------------------------------------------------------------------------- 12. a prewarm that stores nothing says so


def _world_writable(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o777)
    return path


def test_a_prewarm_into_a_directory_it_cannot_use_fails_before_building(tmp_path: Path) -> None:
    """Into a directory other users can write, or one it cannot create (or, for a user
    other than root, one it cannot write), a prewarm once built every entry, stored none
    and exited 0 saying "3 built". It now refuses in one line before it builds anything."""
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [(_world_writable(tmp_path / "shared"), "PLANCACHE_ALLOW_SHARED_DIR=<group>"),
             (a_file / "cache", "cannot create cache directory")]  # fmt: skip
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        fill(locked)
        locked.chmod(0o500)
        cases.append((locked, "read-only"))
    for directory, says in cases:
        before = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else None
        result = plancache("--dir", str(directory), "prewarm", str(manifest), "--json", env={"PLANCACHE_BACKEND": BACKEND})
        line = one_line_error(result)
        assert says in line, line
        assert json.loads(result.stdout)["exit_code"] == 1 and "built" not in result.stdout
        assert (sorted(p.name for p in directory.iterdir()) if directory.is_dir() else None) == before


def test_plans_built_but_not_stored_fail_the_prewarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plancache.errors import StoreError

    def full(self: Store, entry: Any, **_: Any) -> int:
        raise StoreError(f"cannot store plan {entry.key[:12]}: database or disk is full", path=str(self.path))

    monkeypatch.setattr(Store, "put", full)
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    backend = {"PLANCACHE_BACKEND": BACKEND}
    result = plancache("--dir", str(tmp_path / "cache"), "prewarm", str(manifest), env=backend)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[0].startswith("unpersisted")
    assert "1 built (1 of them not stored" in result.stdout.splitlines()[-1]
    as_json = plancache("--dir", str(tmp_path / "cache"), "prewarm", str(manifest), "--json", env=backend)
    assert as_json.returncode == 1 and json.loads(as_json.stdout)["unpersisted"] == 1


# ---------------------------------------------------------------------------- 13. a failed command leaves no file


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="needs a machine without a GPU")
def test_a_prewarm_without_a_gpu_names_the_manifest_error_first_and_creates_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    junk = tmp_path / "junk.json"
    junk.write_text("{ junk")
    line = one_line_error(plancache("--dir", str(cache), "prewarm", str(junk)), 3)
    assert f"{junk}:1: not valid JSON" in line
    good = write_manifest(tmp_path / "good.json", TEMPLATE_ENTRY)
    assert "no CUDA device" in one_line_error(plancache("--dir", str(cache), "prewarm", str(good)))
    assert not cache.exists()


def test_a_manifest_or_bundle_that_is_missing_or_invalid_is_one_line_exit_3_on_stderr(tmp_path: Path) -> None:
    """Not click's four-line usage error (exit 2), and not a row on stdout."""
    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2")
    cache = ["--dir", str(tmp_path / "cache")]
    for args, says in [(["prewarm", str(tmp_path / "missing.json")], "missing.json: cannot read the manifest: No such file"),
                       (["prewarm", str(tmp_path)], "cannot read the manifest: is a directory, not a regular file"),
                       (["prewarm", str(broken)], "broken.json:1: not valid JSON"),
                       (["prewarm", str(broken), "--dry-run"], "broken.json:1: not valid JSON"),
                       (["import", str(tmp_path / "missing.bundle")], "cannot read bundle"),
                       (["import", str(broken)], "not a plancache bundle")]:  # fmt: skip
        result = plancache(*cache, *args, env={"PLANCACHE_BACKEND": BACKEND})
        assert says in one_line_error(result, 3) and result.stdout == "", (args, result.stdout)
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------- 14. --json: errors are JSON too


def test_with_json_every_error_is_json_on_stdout(filled: tuple[Path, list[str]], tmp_path: Path) -> None:
    directory, _ = filled
    d = ["--dir", str(directory)]
    for args, env, code in [([*d, "show", "ffff0000"], {}, 1), ([*d, "ls", "--no-such-option"], {}, 2),
                            (["--no-such-option", *d, "ls"], {}, 2), ([*d, "prune"], {}, 2),
                            ([*d, "ls"], {"PLANCACHE_MEMORY_PLANS": "nan"}, 2),
                            ([*d, "prewarm", str(tmp_path / "missing.json")], {}, 3),
                            (["--dir", str(tmp_path / "a-file" / "x"), "import", str(tmp_path / "x.bundle")], {}, 3)]:  # fmt: skip
        for place in ("after", "before"):
            argv = [*args, "--json"] if place == "after" else ["--json", *args]
            result = plancache(*argv, env=env)
            assert result.returncode == code, (argv, result.stderr)
            data = json.loads(result.stdout)
            assert data["exit_code"] == code and data["error"] in result.stderr, (argv, result.stdout, result.stderr)


# ---------------------------------------------------------------------------- 15. one verdict on a damaged store


def _damage_a_page(directory: Path) -> None:
    path = directory / "plans.db"
    data = bytearray(path.read_bytes())
    data[4096 * 2 : 4096 * 2 + 2000] = b"\x55" * 2000  # the pages after the schema: the plans table
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["a damaged page", "not a database"])
def test_every_command_reads_a_damaged_store_alike_and_only_verify_fix_repairs_it(damage: str, tmp_path: Path) -> None:
    """ls, show and inspect once exited 0 on a damaged plans.db while stats exited 1, and
    read commands quietly moved it aside; verify --fix left -wal and -shm files beside the
    copy it kept."""
    directory = tmp_path / "cache"
    keys = fill(directory)
    if damage == "a damaged page":
        _damage_a_page(directory)
    else:
        (directory / "plans.db").write_text("not a database")
    before = (directory / "plans.db").read_bytes()
    manifest = write_manifest(tmp_path / "m.json", TEMPLATE_ENTRY)
    d = ["--dir", str(directory)]
    lines = set()
    for command in (["ls"], ["stats"], ["inspect"], ["show", keys[0][:8]], ["diff", keys[0][:8], keys[1][:8]],
                    ["export", str(tmp_path / "x.bundle")], ["rm", keys[0][:8]], ["prune", "--quarantined"],
                    ["prewarm", str(manifest)], ["prewarm", str(manifest), "--dry-run"], ["sql", "SELECT 1"]):  # fmt: skip
        line = one_line_error(plancache(*d, *command, env={"PLANCACHE_BACKEND": BACKEND}))
        assert "is damaged" in line and "plancache verify --fix" in line, (command, line)
        lines.add(line)
    assert len(lines) == 1, lines
    assert (directory / "plans.db").read_bytes() == before, "a command moved or changed the damaged store"
    found = plancache(*d, "verify")
    assert found.returncode == 3 and "problem:" in found.stdout
    fixed = plancache(*d, "verify", "--fix")
    assert fixed.returncode == 3 and "moved the damaged file to" in fixed.stdout
    aside = [p.name for p in directory.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and not aside[0].endswith(("-wal", "-shm")), aside  # the copy alone, no -wal or -shm beside it
    assert plancache(*d, "verify").returncode == 0
    assert plancache(*d, "ls").returncode == 0


# ---------------------------------------------------------------------------- 16. a directory other users can write


def test_a_directory_other_users_can_write_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    """``ls`` on an empty one once said nothing at all. The opt-in names the group that
    shares it, and never covers a directory anyone can write."""
    shared = _world_writable(tmp_path / "shared")
    group = {"PLANCACHE_ALLOW_SHARED_DIR": grp.getgrgid(shared.stat().st_gid).gr_name}
    for command in (["ls"], ["stats", "--json"], ["verify"]):
        line = one_line_error(plancache("--dir", str(shared), *command))
        assert "writable by other users" in line and "PLANCACHE_ALLOW_SHARED_DIR=<group>" in line
        assert "writable by other users" in one_line_error(plancache("--dir", str(shared), *command, env=group))
    shared.chmod(0o770)
    allowed = plancache("--dir", str(shared), "ls", env=group)
    assert allowed.returncode == 0 and allowed.stdout.startswith("no plans yet")
    assert list(shared.iterdir()) == []


# ---------------------------------------------------------------------------- 17. plancache sql


def test_sql_answers_a_script_from_the_views_and_never_writes(filled: tuple[Path, list[str]]) -> None:
    directory, keys = filled
    d = ["--dir", str(directory)]
    rows = json.loads(
        plancache(*d, "sql", "SELECT key, label, engine, gpu, hit_count FROM entries ORDER BY key", "--json").stdout
    )
    assert [r["key"] for r in rows] == sorted(keys)
    assert all(r["engine"].startswith("test_engine_") and r["gpu"] and r["hit_count"] == 0 for r in rows)
    one = json.loads(plancache(*d, "sql", "SELECT key FROM plans WHERE key = :k", "-p", "k", keys[0], "--json").stdout)
    assert one == [{"key": keys[0]}]
    csv_text = plancache(*d, "sql", "SELECT key, blob FROM plans ORDER BY key", "--csv").stdout.splitlines()
    assert csv_text[0] == "key,blob" and re.fullmatch(r"[0-9a-f]{64},<\d+ bytes>", csv_text[1])
    blob = json.loads(plancache(*d, "sql", "SELECT blob FROM plans LIMIT 1", "--json").stdout)[0]["blob"]
    assert blob["$base64"] is True and blob["encoded"]
    listing = {t["name"]: t for t in json.loads(plancache(*d, "sql", "--json").stdout)}
    assert (
        listing["entries"]["kind"] == "view" and listing["entries"]["rows"] == 2 and "last_used" in listing["entries"]["columns"]
    )
    assert listing["plans"]["kind"] == "table" and "sqlite_sequence" not in listing
    before = (directory / "plans.db").read_bytes()
    # A pragma that changes the file passed query_only (journal_mode=DELETE left the store
    # out of WAL for good); VACUUM failed with sqlite-utils' own words.
    for statement in ("DELETE FROM plans", "CREATE VIEW v AS SELECT 1", "SELEC 1", "PRAGMA query_only = OFF; DELETE FROM plans",
                      "PRAGMA journal_mode=DELETE", "PRAGMA user_version=3", "PRAGMA wal_checkpoint", "VACUUM",
                      "ATTACH DATABASE 'x.db' AS x"):  # fmt: skip
        assert one_line_error(plancache(*d, "sql", statement)).startswith("plancache: error: the query failed: "), statement
    assert keys_in(directory) == sorted(keys) and (directory / "plans.db").read_bytes() == before
    assert json.loads(plancache(*d, "sql", "PRAGMA journal_mode", "--json").stdout) == [{"journal_mode": "wal"}]
    columns = json.loads(plancache(*d, "sql", "PRAGMA table_info(plans)", "--json").stdout)
    assert "blob_sha256" in [c["name"] for c in columns]
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("plans.db")) == ["plans.db"]  # no -wal, no -shm


def test_sql_reads_a_cache_not_created_yet_as_an_empty_one(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = plancache("--dir", str(missing), "sql", "SELECT count(*) AS n FROM entries", "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == [{"n": 0}]
    assert not missing.exists()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["table", "--json", "--csv"])
def test_sql_prints_a_large_result_as_it_reads_it(tmp_path: Path, form: str) -> None:
    """A result larger than memory is printed as it is read, as the sqlite3 shell prints
    one: 600,000 rows of 200 characters (about 1 GB as Python rows) in a process whose
    memory grows by well under 100 MB, in a fresh process with stdout to a file."""
    query = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 600000) SELECT x, printf('%200d', x) AS pad FROM c"
    )
    out = tmp_path / "out.txt"
    script = (
        "import resource, sys\n"
        "from plancache.cli import main\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "sys.stderr.write(f'grew {(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024} MB, exit {code}')\n"
    )
    extra = [] if form == "table" else [form]
    with out.open("w") as sink:
        done = subprocess.run([sys.executable, "-c", script, "--dir", str(tmp_path / "c"), "sql", query, *extra],
                              stdout=sink, stderr=subprocess.PIPE, text=True, timeout=600)  # fmt: skip
    grew, code = re.fullmatch(r"grew (\d+) MB, exit (\S+)", done.stderr.strip().splitlines()[-1]).groups()  # type: ignore[union-attr]
    assert code in ("0", "None"), done.stderr
    assert int(grew) < 100, done.stderr
    with out.open() as printed:
        lines = sum(1 for _ in printed)
    assert lines == {"table": 600_001, "--csv": 600_001, "--json": 600_000 * 4 + 2}[form]
