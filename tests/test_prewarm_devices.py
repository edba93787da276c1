"""plancache prewarm across several devices on the CPU test backend: choosing devices,
the environment check, the report of a sharded run (the one-device report, plus devices),
resume, duplicates, failing entries, workers that die, and the CLI's --devices.

Tests that spawn workers cost a few seconds each (every worker imports torch): they are
few, marked slow, and the logic they rely on is tested as pure functions."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from plancache import PlanCache
from plancache.cli import cli
from plancache.config import ConfigError
from plancache.errors import NoGpuError
from plancache.testing import CpuTestBackend, TwoDeviceCpuTestBackend
from plancache.workflows.manifest import load_manifest
from plancache.workflows.prewarm import prewarm
from plancache.workflows.sharding import check_environments, parse_devices, resolve_devices, settle_duplicates

TWO = "plancache.testing:TwoDeviceCpuTestBackend"

CONV = {"template": "conv_bias_act", "params": {"n": [1, 2, 3, 4, 5, 6], "c": 8, "h": 6, "w": 6, "k": 4}}
MATMUL = {"template": "matmul_bias_act", "params": {"b": 2, "m": 4, "k": 16, "n": 8, "act": "gelu"}}
SDPA = {"template": "sdpa", "params": {"b": 1, "h": 2, "s": 8, "d": 16}}
BAD_AT_LOAD = {"template": "conv3d_zzz"}
BAD_AT_BUILD = {"builder": "plancache.workflows.templates:build", "args": ["matmul_bias_act"],
                "kwargs": {"b": 1, "m": 4, "k": 8, "n": 3, "act": "elu"}}  # fmt: skip


def manifest(tmp_path: Path, *entries: Any, name: str = "manifest.json") -> Path:
    body = ",\n".join(f"  {json.dumps(e)}" for e in entries)
    path = tmp_path / name
    path.write_text('{"version": 1,\n "entries": [\n' + body + "\n]}\n")
    return path


def outcome(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What must not depend on how many devices ran the manifest."""
    return [(r["index"], r["label"], r["key"], r["status"]) for r in report["entries"]]


def open_cache(directory: Path, backend: Any = None) -> PlanCache:
    return PlanCache(directory, backend=backend or TwoDeviceCpuTestBackend())


# Backends the workers build by name: importable from this module in a spawned process.


class DiesBuildingOnDeviceOne(TwoDeviceCpuTestBackend):
    """Device 1's worker dies (exit code 7) in the middle of its first build."""

    def __init__(self) -> None:
        super().__init__(candidates=2, build_delay=0.2)

    def plans(self, graph: Any, options: Any, description: Any = None) -> Any:
        if self.current_device() == 1:
            os._exit(7)
        return super().plans(graph, options, description)


class CannotUseDeviceOne(TwoDeviceCpuTestBackend):
    def use_device(self, index: int) -> None:
        if index == 1:
            raise RuntimeError("device 1 is broken")
        super().use_device(index)


class CannotReadDeviceOne(TwoDeviceCpuTestBackend):
    def environment(self, device: int | None = None) -> dict[str, Any]:
        if device == 1:
            raise RuntimeError("cannot read device 1")
        return super().environment(device)


class CannotUseAnyDevice(TwoDeviceCpuTestBackend):
    def use_device(self, index: int) -> None:
        raise RuntimeError(f"device {index} is broken")


class MismatchedDevices(CpuTestBackend):
    """Two devices of different GPU models, as on a mixed machine."""

    def __init__(self) -> None:
        super().__init__(devices=[{}, {"gpu_name": "CPU test device, other model", "sm_count": 7}])


# ---------------------------------------------------------------------------- choosing devices


def test_parse_devices_accepts_all_and_index_lists() -> None:
    assert parse_devices("all") == parse_devices(" ALL ") == "all"
    assert parse_devices("0,1") == [0, 1]
    assert parse_devices(" 1 , 0 ") == [1, 0]


@pytest.mark.parametrize(
    ("text", "message"),
    [("x", "'x' is not a device index"), ("0,,1", "'0,,1' has an empty device index"), ("", "has an empty device index"),
     ("-1", "'-1' is not a device index"), ("1.5", "'1.5' is not a device index"), ("0,0", "device 0 is listed twice")],
)  # fmt: skip
def test_parse_devices_names_the_bad_value(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_devices(text)


def test_resolve_devices_against_the_machine() -> None:
    assert resolve_devices("all", 2) == [0, 1]
    assert resolve_devices([1], 2) == [1]
    assert resolve_devices("1,0", 2) == [1, 0]
    with pytest.raises(ConfigError, match="no device 2: this machine has devices 0-1"):
        resolve_devices([0, 2], 2)
    with pytest.raises(ConfigError, match="no device 1: this machine has device 0"):
        resolve_devices([1], 1)
    with pytest.raises(ConfigError, match="listed twice"):
        resolve_devices([1, 1], 2)
    with pytest.raises(ConfigError, match="no device chosen"):
        resolve_devices([], 2)
    with pytest.raises(ConfigError, match="no device True"):
        resolve_devices([True], 2)
    with pytest.raises(NoGpuError, match="no device is visible"):
        resolve_devices("all", 0)


@pytest.mark.slow
def test_devices_of_different_environments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    same = {"gpu_name": "H200", "driver_version": "580"}
    assert check_environments({0: same, 1: dict(same)}) == check_environments({0: same})
    with pytest.raises(ConfigError) as caught:
        check_environments({0: same, 1: same, 2: {**same, "gpu_name": "A100"}})
    message = caught.value.message
    assert message.startswith("devices 0,1,2 have different environments (devices 0,1: H200 [")
    assert "device 2: A100 [" in message and "they differ in gpu_name)" in message and "\n" not in message

    cache = open_cache(tmp_path / "cache", MismatchedDevices())
    with pytest.raises(ConfigError, match="differ in gpu_name, sm_count"):
        prewarm(cache, manifest(tmp_path, MATMUL), devices=[0, 1], progress=False)
    assert cache.store.keys() == []
    cache.close()


# ---------------------------------------------------------------------------- the report


def test_settle_duplicates_reports_the_later_entry_as_the_duplicate(tmp_path: Path) -> None:
    todo, _ = load_manifest(manifest(tmp_path, MATMUL, SDPA, MATMUL, MATMUL, SDPA))

    def record(status: str, key: str | None, device: int, **extra: Any) -> dict[str, Any]:
        return {"status": status, "key": key, "seconds": 1.0 if status == "built" else 0.0, "device": device, **extra}

    # Entry 3 reached key "a" first (device 1 built it); entries 0 and 2 were told duplicate.
    # Key "b": entry 4 asked first and its build failed; entry 1 was told duplicate.
    records = [record("duplicate", "a", 0), record("duplicate", "b", 0), record("duplicate", "a", 0),
               record("built", "a", 1), record("failed", None, 1, error="BuildError: no plan")]  # fmt: skip
    settle_duplicates(records, {3: "a", 0: "a", 4: "b", 2: "a", 1: "b"}, todo)
    assert [(r["status"], r["key"], r["device"]) for r in records] == [
        ("built", "a", 1), ("failed", None, 1), ("duplicate", "a", 0), ("duplicate", "a", 0), ("failed", None, 0)]  # fmt: skip
    assert records[0]["seconds"] == 1.0 and "error" not in records[0] and "error" not in records[3]
    assert records[1]["error"] == "BuildError: no plan"
    assert records[4]["error"].endswith("entry 4: not built: entry 1 has the same key and failed")


def test_one_device_runs_in_this_process_with_the_same_keys(tmp_path: Path) -> None:
    path = manifest(tmp_path, CONV, MATMUL, BAD_AT_LOAD)
    plain = prewarm(open_cache(tmp_path / "plain", CpuTestBackend()), path, progress=False)

    backend = TwoDeviceCpuTestBackend()
    cache = open_cache(tmp_path / "one", backend)
    report = prewarm(cache, path, devices=[1], progress=False)
    assert outcome(report) == outcome(plain)
    assert report["devices"] == [1] and report["environment"] == plain["environment"]
    assert [r["device"] for r in report["entries"]] == [None] + [1] * 7
    assert backend.current_device() == 0, "the caller's device is given back"

    dry = prewarm(cache, path, devices="all", dry_run=True, progress=False)  # a dry run needs no workers
    assert [r["status"] for r in dry["entries"]] == ["failed"] + ["hit"] * 7 and dry["devices"] == [0, 1]
    cache.close()


# ---------------------------------------------------------------------------- worker processes


@pytest.mark.slow
def test_sharded_prewarm_reports_what_one_device_reports_then_resumes(tmp_path: Path) -> None:
    path = manifest(
        tmp_path, CONV, MATMUL, BAD_AT_LOAD, SDPA, MATMUL, BAD_AT_BUILD, {**CONV, "params": {**CONV["params"], "n": 2}}
    )
    plain = prewarm(open_cache(tmp_path / "plain", CpuTestBackend()), path, progress=False)
    assert [r["status"] for r in plain["entries"]].count("duplicate") == 2 and plain["failed"] == 2

    cache = open_cache(tmp_path / "sharded")
    slow = functools.partial(TwoDeviceCpuTestBackend, build_delay=0.05)
    report = prewarm(cache, path, devices=[0, 1], progress=False, backend_factory=slow)
    assert outcome(report) == outcome(plain)
    assert {k: report[k] for k in ("total", "built", "hits", "failed", "duplicates", "environment")} == {
        k: plain[k] for k in ("total", "built", "hits", "failed", "duplicates", "environment")}  # fmt: skip
    assert report["devices"] == [0, 1]
    ran = [r for r in report["entries"] if r["status"] in ("built", "duplicate")]
    assert {r["device"] for r in ran} == {0, 1}, "both devices got work"
    assert next(r for r in report["entries"] if r["status"] == "failed")["device"] is None  # not even loaded
    assert "elu" in next(r["error"] for r in report["entries"] if r["status"] == "failed" and r["device"] is not None)
    assert sorted(cache.store.keys()) == sorted({r["key"] for r in plain["entries"] if r["key"]})

    again = prewarm(cache, path, devices=[0, 1], progress=False)
    assert [r["status"] for r in again["entries"]] == [
        "hit" if s == "built" else s for s in (r["status"] for r in plain["entries"])]  # fmt: skip
    assert again["built"] == 0 and again["hits"] == plain["built"]
    cache.close()


@pytest.mark.slow
def test_a_worker_that_dies_mid_build_fails_its_entry_and_the_others_finish(tmp_path: Path) -> None:
    path = manifest(tmp_path, {**CONV, "params": {**CONV["params"], "n": [1, 2, 3, 4]}})
    cache = open_cache(tmp_path / "cache", DiesBuildingOnDeviceOne())
    started = time.perf_counter()
    report = prewarm(cache, path, devices=[0, 1], progress=False)
    assert time.perf_counter() - started < 60
    failed = [r for r in report["entries"] if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["device"] == 1
    assert "the worker of device 1 died while building this entry (exit code 7)" in failed[0]["error"]
    assert [r["device"] for r in report["entries"] if r["status"] == "built"] == [0, 0, 0]
    cache.close()


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "why"), [(CannotUseDeviceOne, "device 1 is broken"),
                                              (CannotReadDeviceOne, "cannot read device 1")])  # fmt: skip
def test_a_worker_that_cannot_start_leaves_its_entries_to_the_others(
    tmp_path: Path, backend: type[TwoDeviceCpuTestBackend], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """And the warning says why (a device whose environment could not be read once ended
    its worker with a raw traceback, and the warning gave only the exit code)."""
    path = manifest(tmp_path, MATMUL, SDPA, {**MATMUL, "params": {**MATMUL["params"], "n": 16}})
    cache = open_cache(tmp_path / "cache", backend())
    with caplog.at_level("WARNING", logger="plancache"):
        report = prewarm(cache, path, devices=[0, 1], progress=False)
    assert [(r["status"], r["device"]) for r in report["entries"]] == [("built", 0)] * 3
    assert any(f"RuntimeError: {why}" in r.getMessage() for r in caplog.records), caplog.text
    cache.close()


@pytest.mark.slow
def test_a_builder_of_an_interactive_main_fails_its_entries_with_a_reason_and_kills_no_worker(tmp_path: Path) -> None:
    """A builder defined in ``python -c`` (or a notebook) pickled by reference to a
    ``__main__`` that a spawned worker cannot import: every worker died unpickling it."""
    import subprocess
    import sys

    path = manifest(tmp_path, *({"builder": "__main__:my_graph", "args": [n]} for n in (8, 16)))
    program = f"""
import json
from plancache import PlanCache
from plancache.testing import TwoDeviceCpuTestBackend
from plancache.workflows import templates
from plancache.workflows.prewarm import prewarm

def my_graph(n):
    return templates.build("matmul_bias_act", b=1, m=4, k=8, n=n, act="relu")

cache = PlanCache({str(tmp_path / "cache")!r}, backend=TwoDeviceCpuTestBackend(), auto_prime=False)
report = prewarm(cache, {str(path)!r}, devices=[0, 1], progress=False)
cache.close()
print(json.dumps([(r["status"], r.get("error") or "") for r in report["entries"]]))
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.splitlines()[-1])
    assert [status for status, _ in rows] == ["failed", "failed"], rows
    assert all("my_graph" in error and "no worker left" not in error for _, error in rows), rows
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_no_worker_left_fails_every_entry_without_hanging(tmp_path: Path) -> None:
    path = manifest(tmp_path, MATMUL, SDPA)
    cache = open_cache(tmp_path / "cache", CannotUseAnyDevice())
    report = prewarm(cache, path, devices=[0, 1], progress=False)
    assert report["failed"] == 2 and all(r["device"] is None for r in report["entries"])
    error = report["entries"][0]["error"]
    assert "not built: no worker left (device 0: RuntimeError: device 0 is broken; " in error
    assert "device 1: RuntimeError: device 1 is broken)" in error
    cache.close()


@pytest.mark.slow
@pytest.mark.redis
def test_the_workers_publish_to_the_callers_own_redis_tier(tmp_path: Path, redis_server: Any) -> None:
    """A tier passed to ``PlanCache(remote=)`` reaches the workers: each built one from the
    environment only, so a sharded prewarm published nothing and took no fleet lock."""
    from plancache.tiers.remote import RemoteTier

    namespace = f"shard{time.monotonic_ns()}"
    tier = RemoteTier(redis_server.url, secret=b"shard-secret-0123456789abcdef-32", namespace=namespace)
    cache = PlanCache(tmp_path / "cache", backend=TwoDeviceCpuTestBackend(), remote=tier, auto_prime=False)
    report = prewarm(cache, manifest(tmp_path, CONV), devices=[0, 1], progress=False)
    cache.close()
    assert report["built"] == 6 and {r["device"] for r in report["entries"]} == {0, 1}
    with redis_server.client() as client:
        published = [k for k in client.keys(f"{namespace}:v*") if not k.endswith(b":lock")]
    assert len(published) == 6, published


# ---------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_prewarm_devices_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_BACKEND", TWO)
    path = manifest(tmp_path, CONV, MATMUL, MATMUL)
    result = CliRunner().invoke(cli, ["prewarm", str(path), "--devices", "all", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["devices"] == [0, 1] and (report["built"], report["duplicates"], report["failed"]) == (7, 1, 0)
    assert [r["status"] for r in report["entries"]][-2:] == ["built", "duplicate"]
    assert all(r["device"] in (0, 1) for r in report["entries"])

    result = CliRunner().invoke(cli, ["prewarm", str(path), "--devices", "1,0", "--dry-run"])  # in this process
    assert result.exit_code == 0 and "7 already stored" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("backend", "devices", "message"),
    [(TWO, "x", "'x' is not a device index"), (TWO, "0,0", "device 0 is listed twice"),
     (TWO, "0,2", "no device 2: this machine has devices 0-1")],
)  # fmt: skip
def test_cli_bad_devices_are_usage_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, devices: str,
                                          message: str) -> None:  # fmt: skip
    monkeypatch.setenv("PLANCACHE_BACKEND", backend)
    result = CliRunner().invoke(cli, ["prewarm", str(manifest(tmp_path, MATMUL)), "--devices", devices])
    assert result.exit_code == 2
    assert f"Error: Invalid value for '--devices': {message}" in result.output


def test_cli_refuses_devices_of_different_environments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       cache_dir: Path) -> None:  # fmt: skip
    """Before any worker starts and anything is created (an empty plans.db was left behind)."""
    monkeypatch.setenv("PLANCACHE_BACKEND", f"{__name__}:MismatchedDevices")
    result = CliRunner().invoke(cli, ["prewarm", str(manifest(tmp_path, MATMUL)), "--devices", "all"])
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith("plancache: error: devices 0,1 have different environments (device 0: CPU test device [")
    assert not cache_dir.exists()
