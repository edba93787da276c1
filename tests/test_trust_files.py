"""Files plancache reads or writes beside its store (issue #34): bundles are signed and
imported only when their signature proves their sender, or when told ``--allow-unsigned``;
a bundle, a secret file or a recording is a regular file of bounded size, never read
through a link, never waited on (a FIFO); a recording keeps its file's mode and leaves no
lock file beside it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_bundle import split  # a bundle's header and payload

from plancache import BundleError, ConfigError, PlanCache, Store
from plancache.cache.recording import record_to
from plancache.cli import cli
from plancache.store import DB_NAME
from plancache.store.codec import decode_entry, encode_entry
from plancache.testing import CpuTestBackend
from plancache.workflows import templates
from plancache.workflows.bundle import BUNDLE_MAGIC, export_bundle, import_bundle

MakeCache = Callable[..., PlanCache]

SECRET = "the-fleet-secret-0123456789abcdef"
OTHER_SECRET = "another-fleet-secret-0123456789ab"
#: Generous: each of these returns in well under a second; a FIFO waited on never returns.
NO_HANG_S = 60
ROOT = Path(__file__).resolve().parent.parent


def fill(directory: Path) -> list[str]:
    cache = PlanCache(directory, backend=CpuTestBackend())
    try:
        return [cache.get(templates.build("conv_bias_act", n=1, c=8, h=6, w=6, k=4, stride=s)).key for s in (1, 2)]
    finally:
        cache.close()


def export(directory: Path, path: Path, monkeypatch: pytest.MonkeyPatch, secret: str | None) -> Path:
    """Export ``directory``'s plans to ``path``, signed with ``secret`` (None: unsigned)."""
    with monkeypatch.context() as env:
        env.delenv("PLANCACHE_REDIS_SECRET_FILE", raising=False)
        if secret is None:
            env.delenv("PLANCACHE_REDIS_SECRET", raising=False)
        else:
            env.setenv("PLANCACHE_REDIS_SECRET", secret)
        store = Store(directory)
        try:
            report = export_bundle(store, path)
        finally:
            store.close()
    assert report["entries"] == 2
    return path


def forge(path: Path, change: Callable[[list[Any]], None], *, keep_signature: bool) -> None:
    """Rewrite the bundle as a forger would: ``change`` edits the decoded entries, then every
    checksum (blob, metadata, member, header) and offset is computed again. The forger has
    no secret: the old signature is kept (now wrong) or dropped."""
    header, payload = split(path)
    entries = [decode_entry(payload[m["offset"] : m["offset"] + m["size"]]) for m in header["entries"]]
    change(entries)
    payload, offset = b"", 0
    for member, entry in zip(header["entries"], entries):
        entry.blob_sha256 = hashlib.sha256(entry.blob).hexdigest()
        with contextlib.suppress(OverflowError):  # an infinite size has no digest: the old one stays
            entry.meta_sha256 = entry.meta_digest()
        data = encode_entry(entry)
        member.update(offset=offset, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        payload, offset = payload + data, offset + len(data)
    header["payload_size"] = offset
    if not keep_signature:
        header.pop("signature", None)
    raw = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(BUNDLE_MAGIC + struct.pack(">Q", len(raw)) + hashlib.sha256(raw).digest() + raw + payload)


def swap_blobs(entries: list[Any]) -> None:
    """Each entry gets the other graph's plan: a wrong plan under a sound key."""
    entries[0].blob, entries[1].blob = entries[1].blob, entries[0].blob


def db_state(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob(DB_NAME + "*")) if p.is_file()}


def cli_import(target: Path, bundle: Path, *flags: str, secret: str | None = SECRET) -> Any:
    env = {"PLANCACHE_REDIS_SECRET": secret, "PLANCACHE_REDIS_SECRET_FILE": None}
    return CliRunner().invoke(cli, ["--dir", str(target), "import", str(bundle), *flags], env=env)


def assert_one_line(result: Any, code: int, *words: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plancache: error: "), result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return str(lines[0])


def run_plancache(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m plancache ARGS`` in a child process: what would hang there cannot hang the tests."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    child.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "plancache", *args], capture_output=True, text=True, env=child,
                          timeout=NO_HANG_S, check=False)  # fmt: skip


@pytest.fixture
def source(tmp_path: Path) -> Path:
    directory = tmp_path / "source"
    fill(directory)
    return directory


# ---------------------------------------------------------------------------- signatures


@pytest.mark.parametrize("signature", ["none", "kept but wrong", "another secret's"])
def test_a_forged_bundle_with_recomputed_checksums_is_refused_by_its_signature(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch, signature: str
) -> None:
    """Every checksum of a bundle is the sender's to compute: a forger who swaps two plans
    and fixes them all is stopped by the signature only, and nothing reaches the store."""
    bundle = export(source, tmp_path / "plans.bundle", monkeypatch, OTHER_SECRET if signature == "another secret's" else SECRET)
    if signature != "another secret's":
        forge(bundle, swap_blobs, keep_signature=signature == "kept but wrong")
    target = tmp_path / "target"
    fill(target)  # a store with the same two keys, whose rows a replace would overwrite
    before = db_state(target)
    why = {"none": "unsigned", "kept but wrong": "signature does not match", "another secret's": "signed with a secret of key id"}
    line = assert_one_line(cli_import(target, bundle, "--replace"), 3, why[signature])
    assert "--allow-unsigned" in line or signature == "kept but wrong"
    assert db_state(target) == before
    store = Store(target)
    try:
        with pytest.raises(BundleError) as refused:
            import_bundle(store, bundle, replace=True, secret=SECRET.encode())
    finally:
        store.close()
    assert refused.value.fields["reason"] in ("unsigned", "signature", "other secret")


def test_a_signature_that_does_not_match_is_refused_even_when_unsigned_bundles_are_allowed(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--allow-unsigned accepts a bundle nothing vouches for, not one proven altered."""
    bundle = export(source, tmp_path / "plans.bundle", monkeypatch, SECRET)
    forge(bundle, swap_blobs, keep_signature=True)
    assert_one_line(cli_import(tmp_path / "fresh", bundle, "--allow-unsigned"), 3, "altered after it was signed")
    assert not (tmp_path / "fresh").exists()


def test_a_signed_bundle_is_verified_and_a_sound_unsigned_one_needs_allow_unsigned(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signed = export(source, tmp_path / "signed.bundle", monkeypatch, SECRET)
    result = cli_import(tmp_path / "a", signed)
    assert result.exit_code == 0, result.output
    assert "imported 2 plans" in result.stdout and "signature verified" in result.stdout

    unsigned = export(source, tmp_path / "unsigned.bundle", monkeypatch, None)
    for secret in (SECRET, None):  # refused with a secret here or without one
        assert_one_line(cli_import(tmp_path / "b", unsigned, secret=secret), 3, "unsigned", "--allow-unsigned")
        assert not (tmp_path / "b").exists()
    result = cli_import(tmp_path / "b", unsigned, "--allow-unsigned", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["imported"]) == 2 and report["signature"] == "unsigned"
    cache = PlanCache(tmp_path / "b", backend=CpuTestBackend())
    try:
        plan = cache.get(templates.build("conv_bias_act", n=1, c=8, h=6, w=6, k=4, stride=1))
        assert plan.source == "loaded" and cache.counters["builds"] == 0
    finally:
        cache.close()


# ---------------------------------------------------------------------------- regular files only


def test_a_fifo_a_link_or_a_directory_as_bundle_is_refused_at_once_with_exit_3(tmp_path: Path, source: Path) -> None:
    fifo = tmp_path / "fifo.bundle"
    os.mkfifo(fifo)
    link = tmp_path / "link.bundle"
    link.symlink_to(source / DB_NAME)
    env = {"PLANCACHE_REDIS_SECRET": SECRET}
    for path, kind in ((fifo, "a FIFO"), (link, "a symbolic link"), (tmp_path, "a directory")):
        result = run_plancache("--dir", str(tmp_path / "target"), "import", str(path), env=env)
        assert result.returncode == 3, (result.returncode, result.stderr)
        assert result.stderr.startswith(f"plancache: error: cannot read bundle {path}: it is {kind}"), result.stderr
        assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "target").exists()


@pytest.mark.parametrize("kind", ["FIFO", "1 GiB file", "link to a FIFO"])
def test_a_secret_file_that_is_no_small_regular_file_is_one_clear_error_never_a_hang(tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "secret"
    if kind == "FIFO":
        os.mkfifo(secret)
    elif kind == "1 GiB file":
        with open(secret, "wb") as f:
            f.truncate(1 << 30)  # sparse: no disk is used
    else:  # a link is followed (secrets are mounted as links), to what must still be a regular file
        os.mkfifo(tmp_path / "fifo")
        secret.symlink_to(tmp_path / "fifo")
    why = {
        "FIFO": "is a FIFO, not a regular file",
        "1 GiB file": "is larger than 64.0 KiB",
        "link to a FIFO": "is a FIFO, not a regular file",
    }
    for command in (["ls"], ["export", str(tmp_path / "out.bundle")]):
        env = {
            "PLANCACHE_REDIS_SECRET_FILE": str(secret),
            "PLANCACHE_REDIS_URL": "redis://127.0.0.1:1/0",
        }  # the tier's own secret
        result = run_plancache("--dir", str(tmp_path / "cache"), *command, env=env)
        assert result.returncode == 2, (command, result.returncode, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "PLANCACHE_REDIS_SECRET_FILE" in lines[0] and why[kind] in lines[0], result.stderr
    assert not (tmp_path / "out.bundle").exists()


def test_a_secret_file_mounted_through_a_link_is_read(tmp_path: Path) -> None:
    """As a Kubernetes secret volume mounts it: ``secret -> ..data/secret``. The secret it
    reads signs the bundle: the same secret, named directly, verifies it."""
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "secret").write_text(SECRET + "\n")
    (tmp_path / "secret").symlink_to(tmp_path / "..data" / "secret")
    fill(tmp_path / "cache")
    linked = run_plancache("--dir", str(tmp_path / "cache"), "export", str(tmp_path / "out.bundle"),
                           env={"PLANCACHE_REDIS_SECRET_FILE": str(tmp_path / "secret")})  # fmt: skip
    assert linked.returncode == 0, linked.stderr
    imported = run_plancache("--dir", str(tmp_path / "other"), "import", str(tmp_path / "out.bundle"),
                             env={"PLANCACHE_REDIS_SECRET": SECRET})  # fmt: skip
    assert imported.returncode == 0 and "verified" in imported.stdout, (imported.stdout, imported.stderr)


# ---------------------------------------------------------------------------- recordings

GRAPH = {"n": 1, "c": 8, "h": 6, "w": 6, "k": 4}


def test_a_recording_into_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "someone-elses.json"
    target.write_text('{"version": 1, "entries": []}\n')
    target.chmod(0o600)
    before = (target.read_bytes(), stat.S_IMODE(target.stat().st_mode))
    link = tmp_path / "recorded.json"
    link.symlink_to(target)
    monkeypatch.setenv("PLANCACHE_RECORD", str(link))
    with pytest.raises(ConfigError, match=r"PLANCACHE_RECORD=.* is a symbolic link"):
        make_cache()
    monkeypatch.delenv("PLANCACHE_RECORD")

    # A link that appears after the recorder was made: refused when it writes, one warning.
    later = tmp_path / "later.json"
    cache = make_cache()
    cache.add_recorder(record_to(later))
    later.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="plancache"):
        plan = cache.get(templates.build("conv_bias_act", **GRAPH))
    assert plan.source == "built"  # the lookup goes on
    assert any("could not record graph" in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records)
    assert (target.read_bytes(), stat.S_IMODE(target.stat().st_mode)) == before
    assert later.is_symlink()


def test_a_recording_keeps_its_mode_is_created_0600_and_leaves_no_lock_file(tmp_path: Path, make_cache: MakeCache) -> None:
    kept = tmp_path / "kept" / "recorded.json"
    kept.parent.mkdir()
    kept.write_text('{"version": 1, "entries": []}\n')
    kept.chmod(0o600)
    new = tmp_path / "new" / "recorded.json"
    new.parent.mkdir()
    cache = make_cache()
    cache.add_recorder(record_to(kept))
    cache.add_recorder(record_to(new))
    cache.get(templates.build("conv_bias_act", **GRAPH))
    for path in (kept, new):
        assert len(json.loads(path.read_text())["entries"]) == 1
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert [p.name for p in path.parent.iterdir()] == ["recorded.json"]  # no <file>.lock, no temporary file


def test_a_recording_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path, make_cache: MakeCache) -> None:
    fifo = tmp_path / "recorded.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO"):
        record_to(fifo)


# ---------------------------------------------------------------------------- absurd fields


@pytest.mark.parametrize("value", [2**62, -1, 2**64, float("inf")], ids=["2^62", "negative", "2^64", "infinite"])
def test_a_bundle_with_an_absurd_workspace_size_is_one_line_exit_3_never_a_traceback(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch, value: float
) -> None:
    """Checksums anyone can compute: the sizes are the forger's (a member's own size, offset
    and checksum were already refused as malformed)."""
    bundle = export(source, tmp_path / "plans.bundle", monkeypatch, None)

    def absurd(entries: list[Any]) -> None:
        entries[0].workspace_size = value

    forge(bundle, absurd, keep_signature=False)
    assert_one_line(cli_import(tmp_path / "fresh", bundle, "--allow-unsigned"), 3, "refused")
    assert not (tmp_path / "fresh").exists()
