"""Bundles: export and import between cache directories, merging, and refusal of
truncated, tampered, newer-format, unsafe or inconsistent bundles with the database left
exactly as it was. Also ``plancache inspect``."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from plancache import BundleError, EntryNotFoundError, PlanCache, Store
from plancache.cli import cli
from plancache.key import KEY_FORMAT, canonical_json, environment_id
from plancache.store import DB_NAME, Entry
from plancache.store.codec import decode_entry, encode_entry
from plancache.testing import CpuTestBackend
from plancache.workflows import templates
from plancache.workflows.bundle import BUNDLE_MAGIC, export_bundle, import_bundle, read_bundle
from plancache.workflows.prewarm import prewarm
from plancache.workflows.report import entry_report, speedup

MakeCache = Callable[..., PlanCache]

GRAPHS: list[tuple[str, dict[str, Any]]] = [
    ("conv_bias_act", {"n": 2, "c": 8, "h": 6, "w": 6, "k": 4}),
    ("matmul_bias_act", {"b": 2, "m": 4, "k": 16, "n": 8}),
    ("sdpa", {"b": 1, "h": 2, "s": 8, "d": 16}),
]


#: The fleet's secret: bundles are exported signed and imported verified under it.
SECRET = "bundle-test-secret-0123456789abcdef"


@pytest.fixture(autouse=True)
def fleet_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_REDIS_SECRET", SECRET)


def fill(make_cache: MakeCache, directory: Path, graphs: list[tuple[str, dict[str, Any]]] = GRAPHS, **kwargs: Any) -> list[str]:
    cache = make_cache(directory=directory, **kwargs)
    keys = [cache.get(templates.build(name, **params)).key for name, params in graphs]
    cache.close()
    return keys


def db_state(directory: Path) -> dict[str, str]:
    """The bytes of the database and its WAL, hashed: equal means untouched."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob(DB_NAME + "*")) if p.is_file()}


@pytest.fixture
def source(tmp_path: Path, make_cache: MakeCache) -> Iterator[tuple[Path, list[str]]]:
    directory = tmp_path / "source"
    yield directory, fill(make_cache, directory)


@pytest.fixture
def bundle(tmp_path: Path, source: tuple[Path, list[str]]) -> Path:
    store = Store(source[0])
    path = tmp_path / "plans.bundle"
    export_bundle(store, path)
    store.close()
    return path


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack_from(">Q", data, len(BUNDLE_MAGIC))
    start = len(BUNDLE_MAGIC) + 8 + 32
    return json.loads(data[start : start + length]), data[start + length :]


def rewrite(path: Path, header: dict[str, Any], payload: bytes) -> None:
    """Write a bundle with consistent header checksum: a forger's or a newer writer's file
    (unsigned: the forger has no secret; ``assert_refused`` allows unsigned bundles, so what
    it shows is refused by the checks after the signature's)."""
    header = {name: value for name, value in header.items() if name != "signature"}
    raw = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(BUNDLE_MAGIC + struct.pack(">Q", len(raw)) + hashlib.sha256(raw).digest() + raw + payload)


def forge_first_entry(path: Path, change: Callable[[Entry], object]) -> None:
    """Change the bundle's first entry as a forger would, fixing every checksum (and the
    member's key, when ``change`` sets the entry's) and the offsets after it."""
    header, payload = split(path)
    first = header["entries"][0]
    entry = decode_entry(payload[first["offset"] : first["offset"] + first["size"]])
    change(entry)
    data = encode_entry(entry)
    first.update(key=entry.key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    rest = payload[header["entries"][1]["offset"] :]
    offset = len(data)
    for member in header["entries"][1:]:
        member["offset"] = offset
        offset += member["size"]
    header["payload_size"] = offset
    rewrite(path, header, data + rest)


def target_with_one_plan(tmp_path: Path, make_cache: MakeCache) -> Path:
    directory = tmp_path / "target"
    fill(make_cache, directory, [("matmul_bias_act", {"b": 1, "m": 4, "k": 8, "n": 4})])
    return directory


def assert_refused(target: Path, path: Path, match: str) -> BundleError:
    before = db_state(target)
    store = Store(target)
    try:
        with pytest.raises(BundleError, match=match) as info:
            import_bundle(store, path, allow_unsigned=True)
    finally:
        store.close()
    assert db_state(target) == before
    return info.value


# ---------------------------------------------------------------------------- round trip


def test_export_import_round_trip_gives_hits_with_zero_builds(
    tmp_path: Path, make_cache: MakeCache, bundle: Path, source: tuple[Path, list[str]]
) -> None:
    target = tmp_path / "target"
    store = Store(target)
    report = import_bundle(store, bundle)
    store.close()
    assert sorted(report["imported"]) == sorted(source[1]) and report["kept"] == [] and report["entries"] == 3
    cache = make_cache(directory=target)
    plans = [cache.get(templates.build(name, **params)) for name, params in GRAPHS]
    assert [p.source for p in plans] == ["loaded"] * 3
    assert cache.counters["builds"] == 0 and cache.counters["misses"] == 0
    imported = cache.store.get(source[1][0])
    assert imported is not None and imported.hit_count == 0


def test_export_report_filters_and_atomic_write(tmp_path: Path, make_cache: MakeCache, source: tuple[Path, list[str]]) -> None:
    directory, keys = source
    other = fill(make_cache, directory, GRAPHS[:1], backend=CpuTestBackend(environment={"gpu_name": "Other GPU"}))
    store = Store(directory)
    path = tmp_path / "b.bundle"
    full = export_bundle(store, path)
    assert full["entries"] == 4 and len(full["environments"]) == 2
    env_id = store.get(keys[0]).env_id  # type: ignore[union-attr]
    only_env = export_bundle(store, path, env_id=env_id)
    assert sorted(only_env["keys"]) == sorted(keys)
    one = export_bundle(store, path, keys=[other[0][:10]])
    assert one["keys"] == other and one["environments"] == {
        environment_id(
            store.get(other[0]).environment
        ): "gpu_name=Other GPU, compute_capability=0.0, cudnn_backend_version=cpu-test"
    }  # type: ignore[union-attr]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.bundle")] == []  # no temp file left
    with pytest.raises(Exception, match="no entry"):
        export_bundle(store, path, keys=["ffff"])
    assert sorted(export_bundle(store, tmp_path / "env.bundle", env_id=env_id[:6])["keys"]) == sorted(keys)  # a prefix, as keys
    with pytest.raises(EntryNotFoundError, match=r"'nope' names no environment of the plans in .*plans\.db"):
        export_bundle(store, tmp_path / "typo.bundle", env_id="nope")  # a typo once exported an empty bundle, exit 0
    store.close()
    entries = read_bundle(path).entries
    assert [e.key for e in entries] == other


def test_import_merge_keeps_existing_unless_replace(
    tmp_path: Path, make_cache: MakeCache, bundle: Path, source: tuple[Path, list[str]]
) -> None:
    target = tmp_path / "target"
    fill(make_cache, target, GRAPHS[:1], backend=CpuTestBackend(candidates=2))  # same key, another plan
    store = Store(target)
    mine = store.get(source[1][0])
    assert mine is not None
    report = import_bundle(store, bundle)
    assert report["kept"] == [source[1][0]] and sorted(report["imported"]) == sorted(source[1][1:])
    assert store.get(source[1][0]).candidates == mine.candidates  # type: ignore[union-attr]
    report = import_bundle(store, bundle, replace=True)
    assert sorted(report["replaced"]) == sorted(source[1]) and report["imported"] == []
    assert len(store.get(source[1][0]).candidates) == 4  # type: ignore[union-attr]
    store.close()


def test_import_replaces_a_local_entry_that_would_not_be_served(
    tmp_path: Path, make_cache: MakeCache, bundle: Path, source: tuple[Path, list[str]]
) -> None:
    """Keeping a damaged row of the same key would drop the bundle's sound plan and leave
    the next lookup to quarantine the row and autotune: what the bundle was shipped to spare."""
    target = tmp_path / "target"
    fill(make_cache, target, GRAPHS[:1])
    store = Store(target)
    key = source[1][0]
    store.connection().execute("UPDATE plans SET blob = zeroblob(length(blob)) WHERE key = ?", (key,))
    report = import_bundle(store, bundle)
    assert report["replaced"] == [key] and report["kept"] == []
    cache = make_cache(directory=target)
    assert cache.get(templates.build(GRAPHS[0][0], **GRAPHS[0][1])).source == "loaded"
    assert cache.counters["corrupt"] == 0 and cache.counters["builds"] == 0
    store.close()


def test_export_leaves_out_a_row_it_cannot_decode_and_ships_the_rest(tmp_path: Path, source: tuple[Path, list[str]]) -> None:
    directory, keys = source
    store = Store(directory)
    store.connection().execute("UPDATE plans SET timing_json = '{not json' WHERE key = ?", (keys[1],))
    report = export_bundle(store, tmp_path / "b.bundle")
    assert sorted(report["keys"]) == sorted([keys[0], keys[2]]) and list(report["skipped"]) == [keys[1]]
    assert "damaged entry" in report["skipped"][keys[1]]
    store.close()


def test_an_entry_of_the_wrong_shapes_is_refused_as_malformed(tmp_path: Path, make_cache: MakeCache, bundle: Path) -> None:
    """Checksums anyone can compute: an entry whose description is a list (not a mapping)
    is a refused bundle (exit code 3 from the command), not an AttributeError."""
    target = target_with_one_plan(tmp_path, make_cache)

    def not_a_mapping(entry: Entry) -> None:
        entry.description = ["not", "a", "mapping"]  # type: ignore[assignment]
        parts = {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}
        entry.key = hashlib.sha256(canonical_json(parts).encode()).hexdigest()  # the forger's key follows

    forge_first_entry(bundle, not_a_mapping)
    error = assert_refused(target, bundle, "malformed entry")
    assert error.fields["reason"] == "malformed"


def test_import_only_one_environment(tmp_path: Path, make_cache: MakeCache, source: tuple[Path, list[str]]) -> None:
    directory, keys = source
    other = fill(make_cache, directory, GRAPHS[:1], backend=CpuTestBackend(environment={"gpu_name": "Other GPU"}))
    store = Store(directory)
    env_id = store.get(keys[0]).env_id  # type: ignore[union-attr]
    export_bundle(store, tmp_path / "all.bundle")
    store.close()
    target = Store(tmp_path / "target")
    with pytest.raises(EntryNotFoundError, match="'nope' names no environment of the plans in bundle"):
        import_bundle(target, tmp_path / "all.bundle", env_id="nope")  # a typo imported nothing, without a word
    assert target.keys() == []
    report = import_bundle(target, tmp_path / "all.bundle", env_id=env_id[:6])  # a unique prefix, as export takes
    assert sorted(report["imported"]) == sorted(keys) and report["skipped"] == other
    target.close()


# ---------------------------------------------------------------------------- refusals


def test_truncated_bundle_is_refused_and_the_database_untouched(tmp_path: Path, make_cache: MakeCache, bundle: Path) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    data = bundle.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 10, 0):
        bundle.write_bytes(data[:cut])
        error = assert_refused(target, bundle, "refused|not a plancache bundle")
        assert error.fields["path"] == str(bundle)
    bundle.write_bytes(data + b"x")
    assert_refused(target, bundle, "trailing bytes")


@pytest.mark.parametrize("where", ["header", "payload-start", "payload-middle", "payload-end"])
def test_flipped_byte_is_refused_and_the_database_untouched(
    tmp_path: Path, make_cache: MakeCache, bundle: Path, where: str
) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    data = bytearray(bundle.read_bytes())
    _, payload = split(bundle)
    payload_start = len(data) - len(payload)
    position = {
        "header": len(BUNDLE_MAGIC) + 8 + 32 + 5,
        "payload-start": payload_start + 3,
        "payload-middle": payload_start + len(payload) // 2,
        "payload-end": len(data) - 1,
    }[where]
    data[position] ^= 0x01
    bundle.write_bytes(bytes(data))
    assert_refused(target, bundle, "checksum|magic|malformed|signature does not match")


def test_tampered_entry_with_recomputed_checksums_is_refused_by_its_key(
    tmp_path: Path, make_cache: MakeCache, bundle: Path
) -> None:
    """A forger who fixes every checksum still cannot change what a key names."""
    target = target_with_one_plan(tmp_path, make_cache)
    forge_first_entry(bundle, lambda entry: entry.description["nodes"][0]["params"].update(padding=[2, 2]))
    # Refused while decoding: the codec asks the one check of a stored entry (entry.problem).
    error = assert_refused(target, bundle, "key does not match")
    assert error.fields["reason"] == "malformed"


def test_newer_format_is_refused_by_name(tmp_path: Path, make_cache: MakeCache, bundle: Path) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    header, payload = split(bundle)
    rewrite(bundle, {**header, "format": 2, "something_new": True}, payload)
    error = assert_refused(target, bundle, "format 2 is newer than this plancache supports")
    assert error.fields["found"] == 2 and error.fields["supported"] == 1


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/tmp/evil", "plans/../x", "a" * 63 + "/", "A" * 64])
def test_path_like_member_names_are_refused(tmp_path: Path, make_cache: MakeCache, bundle: Path, name: str) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    header, payload = split(bundle)
    header["entries"][1]["key"] = name
    rewrite(bundle, header, payload)
    files = sorted(str(p) for p in tmp_path.rglob("*") if not p.name.startswith(DB_NAME))
    error = assert_refused(target, bundle, "unsafe or malformed name")
    assert error.fields["reason"] == "unsafe name"
    assert sorted(str(p) for p in tmp_path.rglob("*") if not p.name.startswith(DB_NAME)) == files


def test_inconsistent_headers_are_refused(tmp_path: Path, make_cache: MakeCache, bundle: Path) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    header, payload = split(bundle)
    cases = [
        ({**header, "entries": "x"}, "malformed header"),
        ({**header, "key_format": 0}, "key format 0"),
        ({**header, "payload_size": len(payload) + 5}, "truncated"),
        ({**header, "entries": [header["entries"][1], header["entries"][0], *header["entries"][2:]]}, "malformed offset"),
        ({**header, "entries": header["entries"][:-1]}, "no entry accounts for"),
        ({**header, "environments": {}}, "unlisted environment"),
        ({**header, "entries": [{**header["entries"][0], "env_id": "0" * 16}, *header["entries"][1:]]}, "unlisted environment"),
    ]
    for bad, match in cases:
        rewrite(bundle, bad, payload)
        assert_refused(target, bundle, match)
    bundle.write_bytes(b"PK\x03\x04 a zip file")
    assert_refused(target, bundle, "bad magic")


def test_cli_import_refusal_exits_3_with_one_line_and_creates_nothing(
    tmp_path: Path, make_cache: MakeCache, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = target_with_one_plan(tmp_path, make_cache)
    data = bytearray(bundle.read_bytes())
    data[-2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    before = db_state(target)
    result = CliRunner().invoke(cli, ["--dir", str(target), "import", str(bundle)])
    assert result.exit_code == 3  # the input has problems
    assert result.stderr.startswith("plancache: error: bundle ") and "refused" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert db_state(target) == before
    fresh = tmp_path / "fresh"
    for refused in (bundle, tmp_path / "missing.bundle"):
        result = CliRunner().invoke(cli, ["--dir", str(fresh), "import", str(refused)])
        assert result.exit_code == 3 and len(result.stderr.splitlines()) == 1, result.stderr
        assert not fresh.exists()  # a refused import leaves no new, empty store


# ---------------------------------------------------------------------------- CLI and inspect


def test_cli_export_import_inspect(
    tmp_path: Path, source: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch, make_cache: MakeCache
) -> None:
    directory, keys = source
    runner = CliRunner()
    path = tmp_path / "cli.bundle"
    result = runner.invoke(cli, ["--dir", str(directory), "export", str(path), "--key", keys[0][:12], "--key", keys[1], "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.stdout)["keys"]) == sorted(keys[:2])
    target = tmp_path / "cli-target"
    result = runner.invoke(cli, ["--dir", str(target), "import", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("imported 2 plans, replaced 0, kept 0 existing")
    result = runner.invoke(cli, ["--dir", str(target), "import", str(path), "--json"])
    assert sorted(json.loads(result.stdout)["kept"]) == sorted(keys[:2])

    result = runner.invoke(cli, ["--dir", str(target), "inspect"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "CONV_FPROP+POINTWISE(bias)+POINTWISE(relu)" in text and "MATMUL+POINTWISE(add)+POINTWISE(relu)" in text
    assert "engine     test_engine_" in text and "speed-up" in text and "MEDIAN_MS" in text and "hits 0, age" in text
    assert "in  uid 1" in text and "bfloat16" in text and "dims [2, 8, 6, 6]" in text

    result = runner.invoke(cli, ["--dir", str(target), "inspect", keys[0][:8], "--json"])
    (report,) = json.loads(result.stdout)
    assert report["key"] == keys[0] and report["ops"].startswith("CONV_FPROP")
    assert report["heuristic_choice"] == 0 and report["speedup"] >= 1.0
    assert [c["index"] for c in report["candidates"]] == [0, 1, 2, 3]
    assert runner.invoke(cli, ["--dir", str(target), "inspect", "ffff"]).exit_code == 1


def test_inspect_plans_script_wraps_the_command(source: tuple[Path, list[str]]) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "inspect_plans.py"
    result = subprocess.run(
        [sys.executable, str(script), "--dir", str(source[0]), "--json"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert sorted(r["key"] for r in json.loads(result.stdout)) == sorted(source[1])


def test_speedup_over_the_heuristics_first_choice() -> None:
    def c(index: int, status: str, median: float | None, first: float | None = None) -> dict[str, Any]:
        return {"index": index, "status": status, "median_ms": median, "first_ms": first}

    assert speedup([c(0, "failed", None), c(1, "timed", 2.0, 2.1), c(2, "chosen", 1.0, 1.1)]) == (2.0, 1, "median")
    assert speedup([c(0, "pruned", None, 9.0), c(1, "chosen", 1.0, 3.0)]) == (3.0, 0, "first run")
    assert speedup([c(0, "chosen", None), c(1, "not_built", None)]) == (None, 0, None)
    assert speedup([]) == (None, None, None)


def test_entry_report_of_a_prewarmed_plan(tmp_path: Path, make_cache: MakeCache) -> None:
    cache = make_cache()
    (path := tmp_path / "m.json").write_text(
        json.dumps({"version": 1, "entries": [{"template": "sdpa", "params": GRAPHS[2][1]}]})
    )
    prewarm(cache, path, progress=False)
    entry = cache.store.get(cache.store.keys()[0])
    assert entry is not None
    report = entry_report(entry, now=entry.created_at + 7200)
    assert report["ops"] == "SDPA" and report["age_s"] == 7200
    assert report["dtypes"] == {"io": ["bfloat16"], "compute": "float"}
    assert [t["io"] for t in report["tensors"]] == ["in", "in", "in", "out"]
