"""A judgement kept in the store: what the judge and the load's record reader found of a
stored plan, written once so later lookups of the row do not decode and judge its blob again.

The judge (``store.judge``) and the load's record reader (``guest.native.record``) are pure
functions of the blob, the row's graph (its key) and tensor table, and the code that runs
them. A kept judgement names each: the row's key, its blob's and metadata's checksums, and
the code's version (a digest of its source, from the caller), with a checksum of its own.
It is taken only where every one is the row's and the running code's; anything else
(another plancache, a row written again, damage) is none, and the blob is judged afresh.

What it never stands in for, at every lookup: the blob's and the metadata's checksums
against the row's bytes, the environment, the key, the tensor table against the graph
(``store.entry.judged``), and the gate the load holds the record to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

__all__ = ["Kept", "keep", "kept"]


@dataclass(frozen=True)
class Kept:
    """A kept judgement: the entry is sound, with ``unproven`` (``store.judge.Judgement``),
    and ``record`` is its load's record as the engines wrote it (read only by them)."""

    unproven: tuple[str, ...]
    record: Mapping[str, object]


def keep(key: str, blob_sha256: str, meta_sha256: str | None, version: str, unproven: Sequence[str],
         record: Mapping[str, object]) -> str:  # fmt: skip
    """The text kept in the row's ``judgement`` column."""
    body = orjson.dumps({"version": version, "unproven": list(unproven), "record": record}).decode()
    return f"{_digest(key, blob_sha256, meta_sha256, body)} {body}"


def kept(text: object, key: str, blob_sha256: str, meta_sha256: str | None, version: str | None) -> Kept | None:
    """The judgement ``text`` keeps of the row of ``key`` with these checksums, under the code
    of ``version``; None for none, or one of other bytes, other code, or damaged."""
    if version is None or not isinstance(text, str):
        return None
    digest, _, body = text.partition(" ")
    if digest != _digest(key, blob_sha256, meta_sha256, body):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("version") != version:
        return None
    unproven, record = data.get("unproven"), data.get("record")
    if not (isinstance(unproven, list) and all(isinstance(u, str) for u in unproven) and isinstance(record, dict)):
        return None
    return Kept(tuple(unproven), record)


def _digest(key: str, blob_sha256: str, meta_sha256: str | None, body: str) -> str:
    return hashlib.sha256(f"{key}\n{blob_sha256}\n{meta_sha256}\n{body}".encode()).hexdigest()
