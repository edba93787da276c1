"""UBJSON as cuDNN Frontend writes plan blobs, for tests that make blobs of their own."""

from __future__ import annotations

import struct
from typing import Any


def ubjson(value: Any) -> bytes:
    """UBJSON the way nlohmann::json's to_ubjson writes it: the smallest integer type,
    doubles, length-prefixed strings, unsized containers."""
    if value is None:
        return b"Z"
    if value is True or value is False:
        return b"T" if value else b"F"
    if isinstance(value, int):
        for marker, fmt, low, high in ((b"i", ">b", -128, 127), (b"U", ">B", 0, 255), (b"I", ">h", -(2**15), 2**15 - 1),
                                       (b"l", ">i", -(2**31), 2**31 - 1)):  # fmt: skip
            if low <= value <= high:
                return marker + struct.pack(fmt, value)
        return b"L" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"D" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode()
        return b"S" + ubjson(len(data)) + data
    if isinstance(value, list):
        return b"[" + b"".join(ubjson(v) for v in value) + b"]"
    body = b"".join(ubjson(len(k.encode()))[0:] + k.encode() + ubjson(v) for k, v in value.items())
    return b"{" + body + b"}"
