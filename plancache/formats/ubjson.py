"""A small UBJSON decoder (and encoder): the format cuDNN Frontend serializes plans in.

The frontend writes plans with nlohmann::json's ``to_ubjson``: big-endian integers in the
smallest type that holds them, doubles, length-prefixed strings, ``[...]`` arrays and
``{...}`` objects whose keys are length-prefixed strings without a marker. Optimized
containers (a ``$`` type and a ``#`` count after the opening marker) are read too, as the
specification has them. No PyPI package for UBJSON is maintained today (py-ubjson's last
release was in 2020), and the subset is small, so it is decoded here and tested against
real plans recorded on a GPU (``tests/data/plans``).

``decode(data, keep=...)`` builds Python objects only for the top-level keys it is asked
for and steps over the others (a plan's graph description can be tens of kilobytes that a
load does not need). ``encode`` writes what the frontend writes; the CPU test backend
makes its plan blobs with it, so they go through the same reading as a GPU's.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Collection
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


class _Reader:
    __slots__ = ("data", "depth", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.depth = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise UbjsonError(f"UBJSON ends early, at byte {self.pos}")
        marker = self.data[self.pos]
        self.pos += 1
        return marker

    def marker(self) -> int:
        marker = self.byte()
        while marker == _NOOP:
            marker = self.byte()
        return marker

    def take(self, size: int) -> bytes:
        end = self.pos + size
        if size < 0 or end > len(self.data):
            raise UbjsonError(f"UBJSON ends early: {size} bytes wanted at byte {self.pos}")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def number(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack(self.take(fmt.size))
        return value

    def length(self) -> int:
        marker = self.marker()
        fmt = _INTEGERS.get(marker)
        if fmt is None:
            raise UbjsonError(f"a length must be an integer, not {chr(marker)!r} at byte {self.pos - 1}")
        return int(self.number(fmt))

    def string(self) -> str:
        return self.take(self.length()).decode("utf-8")

    def value(self, marker: int, build: bool = True) -> Any:
        if marker in _INTEGERS:
            return self.number(_INTEGERS[marker])
        if marker in _FLOATS:
            return self.number(_FLOATS[marker])
        if marker in _NO_VALUE:
            return _NO_VALUE[marker]
        if marker == ord("S"):
            size = self.length()
            return self.take(size).decode("utf-8") if build else self.take(size)
        if marker == ord("H"):  # a number too large for the integer types, as digits
            digits = self.string()
            if not _DIGITS.fullmatch(digits):
                raise UbjsonError(f"a high-precision number must be an integer's digits, not {digits[:20]!r}")
            return int(digits)
        if marker == ord("C"):
            return chr(self.byte())
        if marker in (ord("["), ord("{")):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise UbjsonError(f"containers nested deeper than {MAX_DEPTH}, at byte {self.pos - 1}")
            try:
                return self.array(build) if marker == ord("[") else self.object(build)
            finally:
                self.depth -= 1
        raise UbjsonError(f"unknown UBJSON marker {chr(marker)!r} at byte {self.pos - 1}")

    def _container(self) -> tuple[int | None, int | None]:
        """The ``$`` type and ``#`` count of an optimized container, where present."""
        kind = count = None
        if self.pos < len(self.data) and self.data[self.pos] == ord("$"):
            self.pos += 1
            kind = self.byte()
            if self.byte() != ord("#"):
                raise UbjsonError(f"a typed container needs a count, at byte {self.pos - 1}")
            count = self.length()
            if kind in _NO_VALUE or kind == _NOOP:  # no byte per element: a count alone could ask for 2**62 of them
                raise UbjsonError(f"a typed container of {chr(kind)!r} values, at byte {self.pos - 1}")
        elif self.pos < len(self.data) and self.data[self.pos] == ord("#"):
            self.pos += 1
            count = self.length()
        if count is not None and not 0 <= count <= len(self.data) - self.pos:  # every element takes a byte at least
            raise UbjsonError(f"a container of {count} elements in {len(self.data) - self.pos} bytes, at byte {self.pos}")
        return kind, count

    def array(self, build: bool) -> list[Any] | None:
        kind, count = self._container()
        items: list[Any] = []
        if count is not None:
            if kind in _INTEGERS or kind in _FLOATS:  # a block of numbers: one unpack
                fmt = _INTEGERS.get(kind) or _FLOATS[kind]
                block = self.take(fmt.size * count)
                return [v for (v,) in fmt.iter_unpack(block)] if build else None
            for _ in range(count):
                items.append(self.value(kind if kind is not None else self.marker(), build))
            return items if build else None
        while True:
            marker = self.marker()
            if marker == ord("]"):
                return items if build else None
            items.append(self.value(marker, build))

    def object(self, build: bool, keep: Collection[str] | None = None, keys: list[str] | None = None) -> dict[str, Any] | None:
        kind, count = self._container()
        found: dict[str, Any] = {}
        remaining = count
        while True:
            if remaining is None:
                if self.pos < len(self.data) and self.data[self.pos] == ord("}"):
                    self.pos += 1
                    return found if build else None
            elif remaining == 0:
                return found if build else None
            key = self.string()
            if keys is not None:
                keys.append(key)
            wanted = build and (keep is None or key in keep)
            value = self.value(kind if kind is not None else self.marker(), wanted)
            if wanted:
                found[key] = value
            if remaining is not None:
                remaining -= 1


def decode(data: bytes, keep: Collection[str] | None = None, keys: list[str] | None = None) -> Any:
    """The value ``data`` holds. For an object at the top, ``keep`` (when given) names the
    keys to build; the values of the others are read past without being built; ``keys``
    (when given) receives every top-level key. Raises ``UbjsonError`` for anything that is
    not well-formed UBJSON, or has bytes after it."""
    reader = _Reader(bytes(data))
    marker = reader.marker()
    value = reader.object(True, keep, keys) if marker == ord("{") else reader.value(marker)
    if reader.pos != len(reader.data):
        raise UbjsonError(f"{len(reader.data) - reader.pos} bytes after the UBJSON value")
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
