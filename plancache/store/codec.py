"""One portable byte form of a stored entry, shared by bundles and the Redis tier.

Layout: ``ENTRY_MAGIC``, an 8-byte big-endian header length, the header (the entry's fields
but the blob, as JSON), then the blob. ``decode_entry`` refuses anything truncated, of
another format, with a field of the wrong type, range or depth (``Entry.validated``, as a
row), or that ``entry.problem`` refuses (a blob not matching its SHA-256, or of another graph).
"""

from __future__ import annotations

import json
import struct

from .entry import Entry, load_json, problem

__all__ = ["ENTRY_MAGIC", "decode_entry", "encode_entry"]

ENTRY_MAGIC = b"PLANCACHE-ENTRY/1\n"
_LENGTH = struct.Struct(">Q")
_MAX_HEADER = 64 << 20


def encode_entry(entry: Entry) -> bytes:
    raw = json.dumps(entry.header(), sort_keys=True).encode()
    return ENTRY_MAGIC + _LENGTH.pack(len(raw)) + raw + entry.blob


def decode_entry(data: bytes) -> Entry:
    """The entry encoded in ``data``; raises ``ValueError`` saying what is wrong."""
    if not data.startswith(ENTRY_MAGIC):
        raise ValueError("not a plancache entry (bad magic or newer format)")
    offset = len(ENTRY_MAGIC)
    if len(data) < offset + _LENGTH.size:
        raise ValueError("entry is truncated (no header length)")
    (length,) = _LENGTH.unpack_from(data, offset)
    offset += _LENGTH.size
    if length > _MAX_HEADER or len(data) < offset + length:
        raise ValueError("entry is truncated (header)")
    try:
        header = load_json(data[offset : offset + length], "the entry header")
        if not isinstance(header, dict):
            raise ValueError(f"the entry header is a {type(header).__name__}")
        entry = Entry.validated({**header, "blob": bytes(data[offset + length :])})  # every field, as a row's
    except ValueError as exc:  # JSON, UTF-8 and every field's type and range
        raise ValueError(f"malformed entry ({str(exc)[:300]})") from exc
    reason = problem(entry)  # the one check of a stored entry, for bundles and the fleet alike
    if reason is not None:
        raise ValueError(f"entry {entry.key[:12]}: {reason}")
    return entry
