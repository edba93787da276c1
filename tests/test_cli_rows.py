"""Read commands read a store row by row: one row that cannot be decoded is reported, with
the `verify --fix` hint, and left out; the rest is listed, inspected, counted and
exported. And `--env` takes a unique prefix everywhere, refusing an id no plan has."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from test_cli_first_hour import fill, one_line_error, plancache

from plancache.store import DB_NAME
from plancache.workflows.bundle import read_bundle

HINT = "plancache verify --fix"


def damage_text(directory: Path, key: str, column: str) -> None:
    """Invalid UTF-8 in one text column of one row (what a torn write or a bad disk leaves)."""
    conn = sqlite3.connect(directory / DB_NAME)
    conn.execute(f"UPDATE plans SET {column} = CAST(x'ff0a41fe' AS TEXT) WHERE key = ?", (key,))
    conn.commit()
    conn.close()


@pytest.mark.parametrize("column", ["label", "policy", "env_id"])
def test_one_undecodable_row_is_reported_and_left_out_by_every_read_command(tmp_path: Path, column: str) -> None:
    """ls, inspect, stats and export all exited 1 on one such row, printing its raw bytes,
    with no hint of verify --fix; export could not save the sound entries."""
    directory = tmp_path / "cache"
    bad, good = fill(directory)
    damage_text(directory, bad, column)
    warning = f"entry {bad[:12]} left out: its {column} column cannot be decoded (`{HINT}` quarantines it)"

    listed = plancache("--dir", str(directory), "--json", "ls")
    assert listed.returncode == 0 and warning in listed.stderr, listed
    assert [row["key"] for row in json.loads(listed.stdout)] == [good]

    inspected = plancache("--dir", str(directory), "--json", "inspect")
    assert inspected.returncode == 0 and warning in inspected.stderr
    assert [report["key"] for report in json.loads(inspected.stdout)] == [good]

    stats = plancache("--dir", str(directory), "--json", "stats")
    assert stats.returncode == 0 and warning in stats.stderr
    data = json.loads(stats.stdout)
    assert list(data["undecodable"]) == [bad] and all("\ufffd" not in policy for policy in data["by_policy"])
    assert f"undecodable   1 (`{HINT}` quarantines it)" in plancache("--dir", str(directory), "stats").stdout

    bundle = tmp_path / "sound.bundle"
    exported = plancache("--dir", str(directory), "export", str(bundle))
    assert exported.returncode == 0, exported
    assert "exported 1 plans" in exported.stdout and f"left out {bad[:12]}: its {column} column" in exported.stdout
    assert HINT in exported.stdout
    assert [member["key"] for member in read_bundle(bundle, allow_unsigned=True).header["entries"]] == [good]


def test_ls_and_inspect_take_an_environment_prefix_and_refuse_an_unknown_one(tmp_path: Path) -> None:
    """`ls --env` and `inspect --env` took no prefix and exited 0 for an unknown id (export
    and import did both)."""
    directory = tmp_path / "cache"
    keys = fill(directory)
    env_id = json.loads(plancache("--dir", str(directory), "--json", "ls").stdout)[0]["env_id"]
    for command in ("ls", "inspect"):
        found = plancache("--dir", str(directory), "--json", command, "--env", env_id[:4])
        assert found.returncode == 0 and sorted(row["key"] for row in json.loads(found.stdout)) == sorted(keys)
        line = one_line_error(plancache("--dir", str(directory), command, "--env", "nope"))
        assert "environment 'nope' names no environment of the plans in" in line and env_id in line
        absent = plancache("--dir", str(tmp_path / "absent"), command, "--env", "nope")
        assert absent.returncode == 1 and "error: environment 'nope' names no environment: nothing is stored yet" in absent.stderr
        assert not (tmp_path / "absent").exists()
