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


# The reader works over (bytes, position). Plain containers (all the frontend writes) are
# read by one loop with a stack of the containers it is in (``_nested``), the markers a plan
# is made of (keys, short strings, small integers, booleans, null) inline: a store hit decodes
# every plan blob before its plan loads, and a call per value cost a third of the decode.
# Optimized containers (a ``$`` type, a ``#`` count) and the rarer markers go through
# ``_optimized`` and ``_value``. Running off the end raises IndexError or struct.error,
# which ``decode`` turns into UbjsonError; only a slice, which never raises, is checked by hand.
_NUMBERS = {**_INTEGERS, **_FLOATS}
_STRING, _ARRAY, _OBJECT, _ARRAY_END, _OBJECT_END = (ord(c) for c in "S[{]}")
_HIGH_PRECISION, _CHAR, _TYPE, _COUNT = (ord(c) for c in "HC$#")
_INT8, _UINT8, _INT32 = (ord(c) for c in "iUl")
_INT32_FORMAT = _INTEGERS[_INT32]
_OPTIMIZED = (_TYPE, _COUNT)
_CONTAINERS = (_OBJECT, _ARRAY)


def _length(data: bytes, pos: int) -> tuple[int, int]:
    """A length (an integer marker, no-ops before it skipped) and the position after it."""
    marker = data[pos]
    if (marker == _INT8 and data[pos + 1] < 128) or marker == _UINT8:  # most lengths: 0..255
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
    """The value of ``marker`` whose payload starts at ``pos`` (``depth``: of its container)."""
    if marker in _CONTAINERS:
        return _nested(data, pos, marker, depth + 1)
    if marker == _STRING:
        return _text(data, pos)
    if marker in _NO_VALUE:
        return _NO_VALUE[marker], pos
    fmt = _NUMBERS.get(marker)
    if fmt is not None:
        return fmt.unpack_from(data, pos)[0], pos + fmt.size
    if marker == _HIGH_PRECISION:  # a number too large for the integer types, as digits
        digits, pos = _text(data, pos)
        if not _DIGITS.fullmatch(digits):
            raise UbjsonError(f"a high-precision number must be an integer's digits, not {digits[:20]!r}")
        return int(digits), pos
    if marker == _CHAR:
        return chr(data[pos]), pos + 1
    raise UbjsonError(f"unknown UBJSON marker {chr(marker)!r} at byte {pos - 1}")


def _nested(data: bytes, pos: int, marker: int, depth: int) -> tuple[Any, int]:
    """The container whose opening ``marker`` ends before ``pos``, at ``depth``, with every
    plain container inside it, and the position after it."""
    if depth > MAX_DEPTH:
        raise UbjsonError(f"containers nested deeper than {MAX_DEPTH}, at byte {pos - 1}")
    if data[pos] in _OPTIMIZED:
        return _optimized(data, pos, marker, depth)
    root: Any = {} if marker == _OBJECT else []
    current, is_object = root, marker == _OBJECT
    stack: list[tuple[Any, bool]] = []  # the containers around ``current``
    value: Any
    while True:
        marker = data[pos]
        pos += 1
        if marker == (_OBJECT_END if is_object else _ARRAY_END):
            if not stack:
                return root, pos
            current, is_object = stack.pop()
            continue
        if is_object:
            # The key: a length and its bytes. A one-byte length is 0..255; a slice past the
            # end is short, and the read after it (there is always one in a container: its
            # end at least) raises IndexError: "ends early". Wider lengths are checked.
            size = data[pos]
            if (marker == _INT8 and size < 128) or marker == _UINT8:
                pos += 1
            else:
                size, pos = _length(data, pos - 1)
                if size < 0 or pos + size > len(data):
                    raise UbjsonError(f"UBJSON ends early: {size} bytes wanted at byte {pos}")
            key = data[pos : pos + size].decode("utf-8")
            pos += size
            marker = data[pos]
            pos += 1
            while marker == _NOOP:
                marker = data[pos]
                pos += 1
            if marker == _STRING:  # most values are short names
                size = data[pos + 1]
                if data[pos] == _INT8 and size < 128:  # a slice past the end: as for keys
                    pos += 2
                    current[key] = data[pos : pos + size].decode("utf-8")
                    pos += size
                else:
                    current[key], pos = _text(data, pos)
                continue
        elif marker == _NOOP:
            continue
        plain = False
        if marker == _INT8:  # the dims and strides of a plan's tensors, mostly
            value = data[pos]
            value = value - 256 if value > 127 else value
            pos += 1
        elif marker == _INT32:
            value = _INT32_FORMAT.unpack_from(data, pos)[0]
            pos += 4
        elif marker in _NO_VALUE:
            value = _NO_VALUE[marker]
        elif marker != _OBJECT and marker != _ARRAY:
            value, pos = _value(data, pos, marker, depth)
        else:  # a container inside ``current``: plain ones are read by this loop, in turn
            inner = depth + len(stack) + 1
            if inner > MAX_DEPTH:
                raise UbjsonError(f"containers nested deeper than {MAX_DEPTH}, at byte {pos - 1}")
            plain = data[pos] not in _OPTIMIZED
            if plain:
                value = {} if marker == _OBJECT else []
            else:
                value, pos = _optimized(data, pos, marker, inner)
        if is_object:
            current[key] = value
        else:
            current.append(value)
        if plain:
            stack.append((current, is_object))
            current, is_object = value, marker == _OBJECT


def _optimized(data: bytes, pos: int, marker: int, depth: int) -> tuple[Any, int]:
    """A container with a ``$`` type and a ``#`` count, or a ``#`` count alone (the
    specification's optimized form), whose count starts at ``pos``."""
    kind = None
    if data[pos] == _TYPE:
        kind = data[pos + 1]
        if data[pos + 2] != _COUNT:
            raise UbjsonError(f"a typed container needs a count, at byte {pos + 2}")
        count, pos = _length(data, pos + 3)
        if kind in _NO_VALUE or kind == _NOOP:  # no byte per element: a count alone could ask for 2**62 of them
            raise UbjsonError(f"a typed container of {chr(kind)!r} values, at byte {pos - 1}")
    else:
        count, pos = _length(data, pos + 1)
    if not 0 <= count <= len(data) - pos:  # every element takes a byte at least
        raise UbjsonError(f"a container of {count} elements in {len(data) - pos} bytes, at byte {pos}")
    fmt = _NUMBERS.get(kind) if kind is not None and marker == _ARRAY else None
    if fmt is not None:  # a block of numbers: one unpack
        end = pos + fmt.size * count
        if end > len(data):
            raise UbjsonError(f"UBJSON ends early: {count} numbers wanted at byte {pos}")
        return [v for (v,) in fmt.iter_unpack(data[pos:end])], end
    found: Any = {} if marker == _OBJECT else []
    for _ in range(count):
        if marker == _OBJECT:
            name, pos = _text(data, pos)
        element = kind
        if element is None:
            element = data[pos]
            pos += 1
            while element == _NOOP:
                element = data[pos]
                pos += 1
        value, pos = _value(data, pos, element, depth)
        if marker == _OBJECT:
            found[name] = value
        else:
            found.append(value)
    return found, pos


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
