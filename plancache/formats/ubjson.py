"""A small UBJSON decoder (and encoder): the format cuDNN Frontend serializes plans in.

The frontend writes plans with nlohmann::json's ``to_ubjson``: big-endian integers in the
smallest type that holds them, doubles, length-prefixed strings, ``[...]`` arrays and
``{...}`` objects whose keys are length-prefixed strings without a marker. Optimized
containers (a ``$`` type and a ``#`` count after the opening marker) are read too, as the
specification has them. No PyPI package for UBJSON is maintained today (py-ubjson's last
release was in 2020), and the subset is small, so it is decoded here and tested against
real plans recorded on a GPU (``tests/data/plans``).

``decode`` reads the whole value: a store hit's judge reads a plan's graph, its load the
rest (``formats.plan_blob``). ``encode`` writes what the frontend writes; the CPU test backend
makes its plan blobs with it, so they go through the same reading as a GPU's.
"""

from __future__ import annotations

import re
import struct
from typing import Any

__all__ = ["UbjsonError", "decode", "encode"]

_INTEGERS = {
    ord("i"): struct.Struct(">b"), ord("U"): struct.Struct(">B"), ord("I"): struct.Struct(">h"),
    ord("l"): struct.Struct(">i"), ord("L"): struct.Struct(">q"), ord("M"): struct.Struct(">Q"),
    ord("u"): struct.Struct(">H"), ord("m"): struct.Struct(">I"),
}  # fmt: skip
_FLOATS = {ord("d"): struct.Struct(">f"), ord("D"): struct.Struct(">d")}
_NO_VALUE = {ord("Z"): None, ord("T"): True, ord("F"): False}
_NOOP = ord("N")
#: Containers nested deeper than this are refused (a plan nests a few levels; Python's own
#: recursion limit would end a deeper one with RecursionError instead of UbjsonError).
MAX_DEPTH = 64
#: A high-precision number: an integer as digits (all the frontend writes: it has no decimals).
_DIGITS = re.compile(r"[+-]?\d{1,40}")


class UbjsonError(ValueError):
    """The bytes are not UBJSON (or use a part of it this decoder does not read)."""


# The reader is a handful of functions over (bytes, position), each returning the value and
# the position after it: a store hit decodes every plan blob before the plan is loaded. The
# markers a plan is made of (object keys, strings, small integers, booleans, containers) are
# read inline in the container loops; everything else goes through ``_other``. Running off
# the end raises IndexError or struct.error, which ``decode`` turns into UbjsonError; only a
# slice, which never raises, is checked by hand.
_NUMBERS = {**_INTEGERS, **_FLOATS}
_STRING, _ARRAY, _OBJECT, _ARRAY_END, _OBJECT_END = (ord(c) for c in "S[{]}")
_HIGH_PRECISION, _CHAR, _TYPE, _COUNT = (ord(c) for c in "HC$#")
_INT8, _UINT8, _TRUE, _FALSE, _NULL = (ord(c) for c in "iUTFZ")
_OPTIMIZED = (_TYPE, _COUNT)


def _length(data: bytes, pos: int) -> tuple[int, int]:
    """A length (an integer marker, no-ops before it skipped) and the position after it."""
    marker = data[pos]
    if marker == _INT8 and data[pos + 1] < 128:  # most lengths: 0..127
        return data[pos + 1], pos + 2
    if marker == _UINT8:
        return data[pos + 1], pos + 2
    while marker == _NOOP:
        pos += 1
        marker = data[pos]
    fmt = _INTEGERS.get(marker)
    if fmt is None:
        raise UbjsonError(f"a length must be an integer, not {chr(marker)!r} at byte {pos}")
    return int(fmt.unpack_from(data, pos + 1)[0]), pos + 1 + fmt.size


def _text(data: bytes, pos: int) -> tuple[str, int]:
    """A length and that many bytes of UTF-8."""
    size, pos = _length(data, pos)
    end = pos + size
    if size < 0 or end > len(data):
        raise UbjsonError(f"UBJSON ends early: {size} bytes wanted at byte {pos}")
    return data[pos:end].decode("utf-8"), end


def _value(data: bytes, pos: int, marker: int, depth: int) -> tuple[Any, int]:
    """The value of ``marker`` whose payload starts at ``pos``."""
    if marker == _STRING:
        return _text(data, pos)
    if marker == _INT8:
        value = data[pos]
        return (value - 256 if value > 127 else value), pos + 1
    if marker == _UINT8:
        return data[pos], pos + 1
    if marker == _OBJECT:
        return _object(data, pos, depth + 1)
    if marker == _ARRAY:
        return _array(data, pos, depth + 1)
    if marker == _TRUE:
        return True, pos
    if marker == _FALSE:
        return False, pos
    return _other(data, pos, marker)


def _other(data: bytes, pos: int, marker: int) -> tuple[Any, int]:
    """A value of the markers plans rarely hold: wider numbers, null, digits, a char."""
    fmt = _NUMBERS.get(marker)
    if fmt is not None:
        return fmt.unpack_from(data, pos)[0], pos + fmt.size
    if marker == _NULL:
        return None, pos
    if marker == _HIGH_PRECISION:  # a number too large for the integer types, as digits
        digits, pos = _text(data, pos)
        if not _DIGITS.fullmatch(digits):
            raise UbjsonError(f"a high-precision number must be an integer's digits, not {digits[:20]!r}")
        return int(digits), pos
    if marker == _CHAR:
        return chr(data[pos]), pos + 1
    raise UbjsonError(f"unknown UBJSON marker {chr(marker)!r} at byte {pos - 1}")


def _container(data: bytes, pos: int, depth: int) -> tuple[int | None, int | None, int]:
    """The ``$`` type and ``#`` count of an optimized container, where present, and the
    position of its first element."""
    if depth > MAX_DEPTH:
        raise UbjsonError(f"containers nested deeper than {MAX_DEPTH}, at byte {pos - 1}")
    if pos >= len(data) or data[pos] not in _OPTIMIZED:
        return None, None, pos
    kind = count = None
    if data[pos] == _TYPE:
        kind = data[pos + 1]
        if data[pos + 2] != _COUNT:
            raise UbjsonError(f"a typed container needs a count, at byte {pos + 2}")
        count, pos = _length(data, pos + 3)
        if kind in _NO_VALUE or kind == _NOOP:  # no byte per element: a count alone could ask for 2**62 of them
            raise UbjsonError(f"a typed container of {chr(kind)!r} values, at byte {pos - 1}")
    else:
        count, pos = _length(data, pos + 1)
    if count is not None and not 0 <= count <= len(data) - pos:  # every element takes a byte at least
        raise UbjsonError(f"a container of {count} elements in {len(data) - pos} bytes, at byte {pos}")
    return kind, count, pos


def _array(data: bytes, pos: int, depth: int) -> tuple[list[Any], int]:
    kind, count, pos = _container(data, pos, depth)
    items: list[Any] = []
    append = items.append
    if count is None:
        while True:
            marker = data[pos]
            pos += 1
            if marker == _INT8:  # the dims and strides of a plan's tensors, mostly
                value = data[pos]
                append(value - 256 if value > 127 else value)
                pos += 1
            elif marker == _ARRAY_END:
                return items, pos
            elif marker != _NOOP:
                value, pos = _value(data, pos, marker, depth)
                append(value)
    fmt = _NUMBERS.get(kind) if kind is not None else None
    if fmt is not None:  # a block of numbers: one unpack
        end = pos + fmt.size * count
        if end > len(data):
            raise UbjsonError(f"UBJSON ends early: {count} numbers wanted at byte {pos}")
        return [v for (v,) in fmt.iter_unpack(data[pos:end])], end
    for _ in range(count):
        if kind is None:
            marker = data[pos]
            pos += 1
            while marker == _NOOP:
                marker = data[pos]
                pos += 1
        else:
            marker = kind
        value, pos = _value(data, pos, marker, depth)
        append(value)
    return items, pos


def _object(data: bytes, pos: int, depth: int) -> tuple[dict[str, Any], int]:
    kind, remaining, pos = _container(data, pos, depth)
    found: dict[str, Any] = {}
    end = len(data)
    while True:
        if remaining is None:
            if data[pos] == _OBJECT_END:
                return found, pos + 1
        elif remaining == 0:
            return found, pos
        else:
            remaining -= 1
        # The key: a length and its bytes (keys are most of a plan's tokens: read here).
        marker = data[pos]
        if (marker == _INT8 and data[pos + 1] < 128) or marker == _UINT8:
            size = data[pos + 1]
            pos += 2
        else:
            size, pos = _length(data, pos)
        if size < 0 or pos + size > end:
            raise UbjsonError(f"UBJSON ends early: {size} bytes wanted at byte {pos}")
        key = data[pos : pos + size].decode("utf-8")
        pos += size
        if kind is None:
            marker = data[pos]
            pos += 1
            while marker == _NOOP:
                marker = data[pos]
                pos += 1
        else:
            marker = kind
        if marker == _STRING:
            found[key], pos = _text(data, pos)
        elif marker == _INT8:
            value = data[pos]
            found[key] = value - 256 if value > 127 else value
            pos += 1
        else:
            found[key], pos = _value(data, pos, marker, depth)


def decode(data: bytes) -> Any:
    """The value ``data`` holds. Raises ``UbjsonError`` for anything that is not
    well-formed UBJSON, or has bytes after it."""
    data = bytes(data)
    try:
        pos = 0
        marker = data[pos]
        while marker == _NOOP:
            pos += 1
            marker = data[pos]
        value, pos = _value(data, pos + 1, marker, 0)
    except (IndexError, struct.error) as exc:
        raise UbjsonError(f"UBJSON ends early ({exc})") from None
    if pos != len(data):
        raise UbjsonError(f"{len(data) - pos} bytes after the UBJSON value")
    return value


_ENCODED_INTEGERS = ((b"i", ">b", -(2**7), 2**7 - 1), (b"U", ">B", 0, 2**8 - 1), (b"I", ">h", -(2**15), 2**15 - 1),
                     (b"l", ">i", -(2**31), 2**31 - 1), (b"L", ">q", -(2**63), 2**63 - 1))  # fmt: skip


def encode(value: Any) -> bytes:
    """``value`` as nlohmann::json's ``to_ubjson`` writes it: integers in the smallest type
    that holds them, doubles, length-prefixed strings, unsized containers."""
    if value is None:
        return b"Z"
    if value is True or value is False:
        return b"T" if value else b"F"
    if isinstance(value, int):
        for marker, fmt, low, high in _ENCODED_INTEGERS:
            if low <= value <= high:
                return marker + struct.pack(fmt, value)
        raise UbjsonError(f"integer {value} does not fit in 64 bits")
    if isinstance(value, float):
        return b"D" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode()
        return b"S" + encode(len(data)) + data
    if isinstance(value, (list, tuple)):
        return b"[" + b"".join(encode(v) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b"".join(encode(len(k.encode())) + k.encode() + encode(v) for k, v in value.items()) + b"}"
    raise UbjsonError(f"cannot encode a {type(value).__name__}")
