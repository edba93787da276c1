"""Bundles: one portable file of stored plans, for container images or other machines.

Layout (all lengths big-endian)::

    b"PLANCACHE-BUNDLE\\n"            magic (the same in every format version)
    8 bytes                          header length H
    32 bytes                         SHA-256 of the header
    H bytes                          header: UTF-8 JSON, see below
    payload                          the entries, each in codec.encode_entry form, back to back

The header: ``{"format": 1, "key_format": N, "created_at": t, "plancache_version": v,
"environments": {env_id: fingerprint}, "payload_size": n, "entries": [{"key", "env_id",
"label", "offset", "size", "sha256"}]}``. Entries tile the payload in order, with no gap
or overlap, and the file ends where the payload ends.

``import_bundle`` checks everything before it writes anything: magic, format version
(newer is refused), header checksum, exact length, every entry's checksum, the codec
form (whose blob has its own checksum), each key against the parts it hashes, each
environment against its id; member names must be plain 64-hex keys. Then all entries go
in one transaction: a refused bundle leaves the database as it was.

Checksums catch damage, not a forger who rewrites them, so bundles are signed: with a
secret configured (the Redis tier's ``PLANCACHE_REDIS_SECRET`` or ``_SECRET_FILE``), the
header holds ``"signature": {"algorithm": "hmac-sha256", "key_id", "tag"}``, an HMAC-SHA256
of the rest of the header (canonical JSON: every entry's key, offset, size and checksum, in
order) and of the whole payload. ``import`` refuses a bundle that is unsigned, or signed
with another secret, unless told ``allow_unsigned``; one whose tag does not match was
altered after it was signed and is refused always. HMAC, not a public-key signature: it
needs no new dependency, and a fleet that shares plans already shares that secret. Its
cost: whoever can verify a bundle can also sign one; an ed25519 sender key would let
receivers verify without that power.

The file is read only when it is a regular one (never through a link, never a FIFO or a
device), of at most ``MAX_BUNDLE`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sqlite3
import stat
import struct
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import REDIS_SECRET, REDIS_SECRET_FILE, Refused, StrEnum, file_kind, format_size
from ..errors import BundleError, BundleTargetError, DamagedEntryError, EntryNotFoundError, StoreError
from ..key import KEY_FORMAT, canonical_json, environment_id
from ..store import Entry, Store, maintenance, problem
from ..store.codec import decode_entry, encode_entry
from ..store.files import read_regular
from ..tiers.remote import configured_secret, secret_id

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_MAGIC",
    "MAX_BUNDLE",
    "Bundle",
    "Signature",
    "bundle_environment",
    "export_bundle",
    "import_bundle",
    "read_bundle",
]

BUNDLE_MAGIC = b"PLANCACHE-BUNDLE\n"
BUNDLE_FORMAT = 1
_LENGTH = struct.Struct(">Q")
_PRELUDE = len(BUNDLE_MAGIC) + _LENGTH.size + 32
_MAX_HEADER = 256 << 20
_KEY = re.compile(r"^[0-9a-f]{64}$")  # a plan key, and a signature's tag
_ENV_ID = re.compile(r"^[0-9a-f]{16}$")  # an environment id, and a secret's key id
#: The largest bundle import reads (whole, into memory) and export writes: 2 GiB is tens of
#: thousands of plans, more than any fleet's graphs; a larger store ships as several
#: bundles (``--env``, ``--key``), so no setting is needed.
MAX_BUNDLE = 2 << 30
#: MACed before what a bundle's tag covers, so a tag made for a Redis value never verifies here.
_SIGNED = b"PLANCACHE-BUNDLE-SIGNED/1\n"
_SIGNATURE = "hmac-sha256"
_UNSIGNED_HINT = (f"export it with the same {REDIS_SECRET_FILE.name} or {REDIS_SECRET.name} set on both machines, or pass "
                  "--allow-unsigned (allow_unsigned=True) if you trust where it came from")  # fmt: skip


class Signature(StrEnum):
    """What a reader found of a bundle's signature (``Bundle.signature``)."""

    VERIFIED = "verified"
    UNSIGNED = "unsigned"  # allowed by the reader (allow_unsigned)
    NOT_VERIFIED = "not verified"  # signed with a secret the reader has not; allowed by it


@dataclass(frozen=True)
class Bundle:
    """A bundle read and verified whole by ``read_bundle``: where it was read from, its
    header, its entries, and its signature."""

    path: str
    header: dict[str, Any]
    entries: list[Entry]
    signature: Signature


def _env_summary(environment: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{k}={environment[k]}" for k in ("gpu_name", "compute_capability", "cudnn_backend_version") if k in environment
    )


def _select(
    store: Store | None, env_id: str | None, keys: Iterable[str] | None, undecodable: dict[str, str]
) -> tuple[list[str], str | None]:
    """The keys to export, and the environment id ``env_id`` (a unique prefix) names; rows
    that cannot be decoded go to ``undecodable``."""
    listed = (maintenance.list_entries(store, undecodable=undecodable)
              if store is not None and (keys is None or env_id is not None) else [])  # fmt: skip
    if store is not None and env_id is not None:
        env_id = maintenance.environment_named(env_id, {row["env_id"] for row in listed}, str(store.path))
    if keys is None:
        return [row["key"] for row in listed if env_id is None or row["env_id"] == env_id], env_id
    selected = []
    for prefix in keys:
        if store is None:
            raise EntryNotFoundError(f"{prefix!r} names no entry: nothing is stored yet", key=prefix)
        selected.append(store.key_named(prefix))
    return selected, env_id


def bundle_environment(bundle: Bundle, prefix: str) -> str:
    """The environment id of ``bundle``'s plans that ``prefix`` begins, or
    ``EntryNotFoundError`` (checked before a command creates the cache it imports into)."""
    return maintenance.environment_named(prefix, set(bundle.header["environments"]), f"bundle {bundle.path}")


def _check_target(target: Path) -> None:
    """Refuse an export target that exists and is not a regular file: a symlink, FIFO,
    device node, socket or directory is never replaced (the rename would replace the link
    or the node itself, not write through it)."""
    try:
        mode = target.lstat().st_mode
    except FileNotFoundError:
        if not target.parent.is_dir():  # as cp and tar: a typo in the path makes no directory
            raise BundleTargetError(f"cannot export to {target}: {target.parent} is not a directory; create it first (an "
                                    "export creates none)", path=str(target), reason="unwritable") from None  # fmt: skip
        return
    except OSError as exc:  # a component is a file (ENOTDIR), a directory cannot be searched (EACCES)...
        raise _cannot_write(target, exc) from exc
    if not stat.S_ISREG(mode):
        raise BundleTargetError(f"cannot export to {target}: it exists and is {file_kind(mode)}, not a regular file; "
                                "plancache only replaces regular files", path=str(target), reason="not a regular file")  # fmt: skip


def _exists(target: Path) -> BundleTargetError:
    return BundleTargetError(f"refused: {target} exists and is not replaced without --force (replace=True)",
                             path=str(target), reason="exists")  # fmt: skip


def _link_new(tmp: str, target: Path) -> None:
    """Put the finished bundle at ``target`` only if nothing is there: a hard link fails on
    an existing name, so a file that appeared meanwhile is never replaced."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise _exists(target) from None
    except OSError:  # a filesystem without hard links: check, then rename
        if os.path.lexists(target):
            raise _exists(target) from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def _cannot_write(target: Path, exc: OSError) -> BundleTargetError:
    where = f" ({exc.filename})" if exc.filename and os.fspath(exc.filename) != str(target) else ""
    return BundleTargetError(f"cannot write bundle {target}: {exc.strerror or exc}{where}", path=str(target), reason="unwritable")


def export_bundle(
    store: Store | None,
    path: str | os.PathLike[str],
    *,
    env_id: str | None = None,
    keys: Iterable[str] | None = None,
    replace: bool = True,
    secret: bytes | None = None,
) -> dict[str, Any]:
    """Write the entries of ``store`` (those of ``env_id``, or the given ``keys`` or key
    prefixes; default all; None: a cache with nothing stored yet, an empty bundle) to one
    bundle file at ``path``, atomically: a temporary file in the same directory, renamed
    over ``path``. ``BundleError`` refuses a ``path`` that is a symlink, FIFO, device node
    or other special file (never replaced), an existing regular file with ``replace=False``
    (reason ``exists``, even one that appears while exporting), a missing parent directory
    (reason ``unwritable``, never created), and a bundle larger than ``MAX_BUNDLE`` (reason
    ``too large``: no import would read it). Signed with ``secret``, by default the one
    configured (``PLANCACHE_REDIS_SECRET`` or ``_SECRET_FILE``); with none, unsigned.

    Entries whose blob fails its checksum are left out and reported under ``skipped``.
    Returns ``{"path", "entries", "keys", "bytes", "environments", "skipped", "key_id"}``
    (``key_id``: the signing secret's fingerprint, None for an unsigned bundle).
    """
    from .. import __version__

    started = time.perf_counter()
    target = Path(path)
    _check_target(target)  # before any work; again just before the rename
    if not replace and os.path.lexists(target):
        raise _exists(target)
    undecodable: dict[str, str] = {}
    chosen, env_id = _select(store, env_id, keys, undecodable)
    payload = bytearray()
    members: list[dict[str, Any]] = []
    environments: dict[str, dict[str, Any]] = {}
    skipped = {key: f"{why} (damaged entry: {maintenance.UNDECODABLE_HINT})" for key, why in undecodable.items()}
    for key in dict.fromkeys(chosen):
        assert store is not None  # chosen is empty without a store
        try:
            entry = store.get(key)
        except DamagedEntryError as exc:  # one row that cannot be decoded: the others still ship
            skipped[key] = f"{exc} (damaged entry: {maintenance.UNDECODABLE_HINT})"
            continue
        if entry is None:
            skipped[key] = "removed while exporting"
            continue
        if (reason := problem(entry)) is not None:
            skipped[key] = f"{reason} (damaged entry)"
            continue
        if env_id is not None and entry.env_id != env_id:
            skipped[key] = f"belongs to environment {entry.env_id}"
            continue
        data = encode_entry(entry)
        members.append({"key": entry.key, "env_id": entry.env_id, "label": entry.label, "offset": len(payload),
                        "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip
        environments[entry.env_id] = entry.environment
        payload += data
    fields: dict[str, Any] = {"format": BUNDLE_FORMAT, "key_format": KEY_FORMAT, "created_at": time.time(),
                              "plancache_version": __version__, "environments": environments, "payload_size": len(payload),
                              "entries": members}  # fmt: skip
    secret = configured_secret() if secret is None else secret
    key_id = None if secret is None else secret_id(secret).hex()
    if secret is not None:
        fields["signature"] = {"algorithm": _SIGNATURE, "key_id": key_id, "tag": _tag(secret, fields, payload)}
    header = json.dumps(fields, sort_keys=True).encode()
    size = _PRELUDE + len(header) + len(payload)
    if size > MAX_BUNDLE:
        raise BundleTargetError(f"cannot export to {target}: the bundle would be {format_size(size)}, more than the "
                                f"{format_size(MAX_BUNDLE)} an import reads; export fewer plans at a time (--env, --key)",
                                path=str(target), reason="too large")  # fmt: skip
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _cannot_write(target, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(BUNDLE_MAGIC + _LENGTH.pack(len(header)) + hashlib.sha256(header).digest())
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        _check_target(target)  # again: a link or FIFO may have appeared at the target while the bundle was written
        if replace:
            os.replace(tmp, target)  # a reader sees the old file or the whole new one
        else:
            _link_new(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _cannot_write(target, exc) from exc
        raise
    return {
        "path": str(target),
        "entries": len(members),
        "keys": [m["key"] for m in members],
        "bytes": size,  # not stat() of the target: whatever is there now is never followed
        "environments": {e: _env_summary(env) for e, env in environments.items()},
        "skipped": skipped,
        "key_id": key_id,
        "seconds": time.perf_counter() - started,
    }


def _tag(secret: bytes, header: Mapping[str, Any], payload: bytes | bytearray | memoryview) -> str:
    """The HMAC-SHA256 of a bundle: its header but the signature (canonical JSON, length
    first, so no byte of it can pass for payload) and its whole payload."""
    signed = canonical_json(
        {name: value for name, value in header.items() if name not in ("signature", "_payload_start")}
    ).encode()
    mac = hmac.new(secret, _SIGNED + _LENGTH.pack(len(signed)) + signed, hashlib.sha256)
    mac.update(payload)
    return mac.hexdigest()


def _signature(data: bytes, header: Mapping[str, Any], where: str, secret: bytes | None, allow_unsigned: bool) -> Signature:
    """What ``Bundle.signature`` says of a bundle, or the ``BundleError`` that refuses it:
    unsigned, or signed with another secret (unless ``allow_unsigned``), or altered after
    it was signed (always). ``secret`` None: the configured one, read only for a signed bundle."""
    signature = header.get("signature")
    if signature is None:
        if allow_unsigned:
            return Signature.UNSIGNED
        raise _refuse(where, f"it is unsigned, so nothing proves who made it: {_UNSIGNED_HINT}", reason="unsigned")
    if (not isinstance(signature, dict) or signature.get("algorithm") != _SIGNATURE
            or not _ENV_ID.match(str(signature.get("key_id"))) or not _KEY.match(str(signature.get("tag")))):  # fmt: skip
        raise _refuse(where, "its signature is malformed", reason="malformed")
    secret = configured_secret() if secret is None else secret
    mine = None if secret is None else secret_id(secret).hex()
    if mine != signature["key_id"]:
        if allow_unsigned:
            return Signature.NOT_VERIFIED
        why = "no secret is configured here to verify it" if mine is None else f"this machine's secret is key id {mine}"
        raise _refuse(where, f"it is signed with a secret of key id {signature['key_id']}, but {why}: {_UNSIGNED_HINT}",
                      reason="other secret")  # fmt: skip
    assert secret is not None  # mine is None without one
    try:
        tag = _tag(secret, header, memoryview(data)[header["_payload_start"] :])
    except ValueError as exc:  # a value canonical JSON refuses (NaN): no signer wrote it
        raise _refuse(where, f"malformed header: {exc}", reason="malformed") from exc
    if not hmac.compare_digest(tag, signature["tag"]):
        raise _refuse(where, "its signature does not match: it was altered after it was signed", reason="signature")
    return Signature.VERIFIED


def _refuse(path: str, message: str, **fields: Any) -> BundleError:
    return BundleError(f"bundle {path} refused: {message}", path=path, **fields)


def _header(data: bytes, where: str) -> dict[str, Any]:
    if not data.startswith(BUNDLE_MAGIC):
        raise _refuse(where, "not a plancache bundle (bad magic)", reason="magic")
    if len(data) < _PRELUDE:
        raise _refuse(where, "truncated (incomplete prelude)", reason="truncated")
    (length,) = _LENGTH.unpack_from(data, len(BUNDLE_MAGIC))
    digest = data[len(BUNDLE_MAGIC) + _LENGTH.size : _PRELUDE]
    if length > _MAX_HEADER or len(data) < _PRELUDE + length:
        raise _refuse(where, "truncated (incomplete header)", reason="truncated")
    raw = data[_PRELUDE : _PRELUDE + length]
    # The format version is read before the checksum so a newer bundle is named as such.
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested beyond what a header holds
        header = None
    if isinstance(header, dict) and isinstance(header.get("format"), int) and header["format"] > BUNDLE_FORMAT:
        raise _refuse(where, f"format {header['format']} is newer than this plancache supports ({BUNDLE_FORMAT}); upgrade plancache",
                      reason="newer format", found=header["format"], supported=BUNDLE_FORMAT)  # fmt: skip
    if hashlib.sha256(raw).digest() != digest:
        raise _refuse(where, "header checksum mismatch (damaged or tampered)", reason="checksum")
    if not isinstance(header, dict) or header.get("format") != BUNDLE_FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise _refuse(where, f"malformed header (format {found!r})", reason="malformed")
    for name, kind in (("environments", dict), ("entries", list), ("payload_size", int), ("key_format", int)):
        if not isinstance(header.get(name), kind):
            raise _refuse(where, f"malformed header: {name!r} is missing or not a {kind.__name__}", reason="malformed")
    if header["key_format"] != KEY_FORMAT:
        raise _refuse(where, f"its plans were keyed with key format {header['key_format']}, this plancache uses {KEY_FORMAT}: "
                      "they could never be hit", reason="key format")  # fmt: skip
    end = _PRELUDE + length + header["payload_size"]
    if len(data) != end:
        state = "truncated" if len(data) < end else "has trailing bytes"
        raise _refuse(where, f"{state} ({len(data)} bytes, expected {end})", reason="truncated")
    header["_payload_start"] = _PRELUDE + length
    return header


def _member(data: bytes, header: Mapping[str, Any], index: int, member: Any, offset: int, where: str) -> Entry:
    if not isinstance(member, dict):
        raise _refuse(where, f"entry {index} is not an object", reason="malformed")
    key, env_id = member.get("key"), member.get("env_id")
    # Names are keys, never paths: anything else (a/b, ../x, /etc) is refused outright.
    if not isinstance(key, str) or not _KEY.match(key):
        raise _refuse(
            where, f"entry {index} has an unsafe or malformed name {key!r} (expected a 64-hex key)", reason="unsafe name"
        )
    if not isinstance(env_id, str) or not _ENV_ID.match(env_id) or env_id not in header["environments"]:
        raise _refuse(where, f"entry {key[:12]} has a malformed or unlisted environment id {env_id!r}", reason="malformed")
    size, sha = member.get("size"), member.get("sha256")
    if member.get("offset") != offset or not isinstance(size, int) or size <= 0 or not isinstance(sha, str):
        raise _refuse(where, f"entry {key[:12]} has a malformed offset, size or checksum", reason="malformed")
    start = header["_payload_start"] + offset
    blob = data[start : start + size]
    if len(blob) != size or offset + size > header["payload_size"]:
        raise _refuse(where, f"entry {key[:12]} runs past the end of the payload", reason="truncated")
    if hashlib.sha256(blob).hexdigest() != sha:
        raise _refuse(where, f"entry {key[:12]} does not match its checksum (damaged or tampered)", reason="checksum", key=key)
    try:
        entry = decode_entry(blob)
    except ValueError as exc:
        raise _refuse(where, f"entry {key[:12]}: {exc}", reason="malformed", key=key) from exc
    parts = {"format": KEY_FORMAT, "graph": entry.description, "environment": entry.environment, "options": entry.options}
    if entry.key != key or hashlib.sha256(canonical_json(parts).encode()).hexdigest() != key:
        raise _refuse(where, f"entry {key[:12]}: its key does not match the graph, environment and options it holds",
                      reason="key mismatch", key=key)  # fmt: skip
    if (
        entry.env_id != env_id
        or environment_id(entry.environment) != env_id
        or header["environments"][env_id] != entry.environment
    ):
        raise _refuse(
            where, f"entry {key[:12]}: its environment does not match environment id {env_id}", reason="environment", key=key
        )
    return entry


def read_bundle(path: str | os.PathLike[str], *, secret: bytes | None = None, allow_unsigned: bool = False) -> Bundle:
    """Read and verify a bundle completely: its file (a regular one, never through a link,
    at most ``MAX_BUNDLE`` bytes), its header, its signature (under ``secret``, by default
    the configured one; an unsigned or foreign-signed bundle only with ``allow_unsigned``)
    and every entry, or ``BundleError``. The signature is checked before any entry is
    decoded: an unsigned bundle's entries are never read unless the caller allows them."""
    where = os.fspath(path)
    try:
        data = read_regular(path, MAX_BUNDLE)[0]
    except (OSError, Refused) as exc:
        why = f"it {exc}" if isinstance(exc, Refused) else exc.strerror or str(exc)
        raise BundleError(f"cannot read bundle {where}: {why}", path=where, reason="unreadable") from exc
    header = _header(data, where)
    signature = _signature(data, header, where, secret, allow_unsigned)
    entries: dict[str, Entry] = {}
    offset = 0
    for index, member in enumerate(header["entries"]):
        entry = _member(data, header, index, member, offset, where)
        if entry.key in entries:
            raise _refuse(where, f"entry {entry.key[:12]} appears twice", reason="malformed")
        entries[entry.key] = entry
        offset += member["size"]
    if offset != header["payload_size"]:
        raise _refuse(where, "the payload holds bytes no entry accounts for", reason="malformed")
    return Bundle(where, header, list(entries.values()), signature)


def _sound(row: Mapping[str, Any]) -> bool:
    """Whether a stored row would be served: one that would not (damaged, never checked)
    gives way to the bundle's sound entry of the same key, which would otherwise be dropped
    while the next lookup quarantines the row and autotunes."""
    try:
        return problem(Entry.from_row(row)) is None
    except (ValueError, KeyError, TypeError):  # a column that cannot be decoded
        return False


def import_bundle(
    store: Store,
    bundle: str | os.PathLike[str] | Bundle,
    *,
    replace: bool = False,
    env_id: str | None = None,
    secret: bytes | None = None,
    allow_unsigned: bool = False,
) -> dict[str, Any]:
    """Merge a bundle into ``store``: verify all of it, then insert in one transaction.
    ``bundle``: its path (read by ``read_bundle`` with ``secret`` and ``allow_unsigned``),
    or what ``read_bundle`` returned (so a caller can refuse a bad bundle before it creates
    a store).

    Existing keys are kept unless ``replace``, or unless the stored row would not be served
    (damaged, or never checked): the bundle's sound entry replaces it. ``env_id`` imports
    only that environment's entries. Imported entries start with no hits and count as used
    now (so size-based eviction does not drop them first). Raises ``BundleError`` (database
    untouched) for a truncated, tampered, malformed, newer-format, unsafe, unsigned or
    foreign-signed bundle. Returns ``{"path", "format", "entries", "imported", "replaced",
    "kept", "skipped", "environments", "signature", "seconds"}``.
    """
    started = time.perf_counter()
    if not isinstance(bundle, Bundle):
        bundle = read_bundle(bundle, secret=secret, allow_unsigned=allow_unsigned)
    header = bundle.header
    chosen = None if env_id is None else bundle_environment(bundle, env_id)
    entries = [e for e in bundle.entries if chosen in (None, e.env_id)]
    skipped = [e.key for e in bundle.entries if chosen not in (None, e.env_id)]
    imported: list[str] = []
    replaced: list[str] = []
    kept: list[str] = []
    try:
        with store.transaction() as tx:
            now = time.time()
            for entry in entries:
                entry.hit_count, entry.last_used_at = 0, now
                stored = tx.execute("SELECT * FROM plans WHERE key = ?", (entry.key,)).fetchone()
                if stored is not None and not replace and _sound(stored):
                    kept.append(entry.key)
                    continue
                row = entry.row()  # the store's own row mapping, so new columns follow
                tx.execute(f"INSERT OR REPLACE INTO plans ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})", row)
                (imported if stored is None else replaced).append(entry.key)
    except sqlite3.Error as exc:  # rolled back by transaction(): nothing was written
        raise StoreError(f"cannot import into {store.path}: {exc}", path=str(store.path)) from exc
    return {
        "path": bundle.path,
        "format": header["format"],
        "entries": len(header["entries"]),
        "imported": imported,
        "replaced": replaced,
        "kept": kept,
        "skipped": skipped,
        "environments": {e: _env_summary(env) for e, env in header["environments"].items()},
        "signature": bundle.signature,
        "seconds": time.perf_counter() - started,
    }
