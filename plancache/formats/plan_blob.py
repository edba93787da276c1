"""A plan blob: its bytes and what they hold, decoded at most once.

A store hit reads a blob twice over: the judge holds the graph it carries against the key
(``formats.plan_graph``), and the load reads the plan's record (``guest.native.record``).
Both read the same decoding, made the first time either asks and kept by the one
``PlanBlob`` the hit hands from the judge to the load; what is read from the decoding (the
load's record) is kept the same way (``read``). A blob nobody asks about is never
decoded (the frontend's own deserialize reads its bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from .ubjson import decode

__all__ = ["PlanBlob"]

_UNREAD = object()
T = TypeVar("T")


class _Raised:
    """What a reader raised, kept to be raised again."""

    __slots__ = ("error",)

    def __init__(self, error: ValueError) -> None:
        self.error = error


class PlanBlob:
    """The bytes of one serialized plan, and (``fields``) what they hold."""

    __slots__ = ("_fields", "_read", "data")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = bytes(data)  # the same object when it is bytes already
        self._fields: Any = _UNREAD
        self._read: dict[Callable[[PlanBlob], Any], Any] = {}

    @classmethod
    def of(cls, blob: PlanBlob | bytes | bytearray | memoryview) -> PlanBlob:
        """``blob`` itself when it is a ``PlanBlob`` (its decoding kept), else its bytes as one."""
        return blob if isinstance(blob, PlanBlob) else cls(blob)

    @property
    def fields(self) -> Any:
        """What the bytes hold, decoded whole the first time it is asked (for a frontend plan,
        a dict of its top-level fields, which callers only read). Bytes that are not UBJSON
        raise ``ubjson.UbjsonError`` (a ``ValueError``) every time they are asked. Two threads
        asking at once may both decode: the same value, kept once."""
        fields = self._fields
        if fields is _UNREAD:
            try:
                fields = decode(self.data)
            except ValueError as exc:
                fields = exc
            self._fields = fields
        if isinstance(fields, ValueError):
            raise fields
        return fields

    def read(self, reader: Callable[[PlanBlob], T]) -> T:
        """``reader(self)``, worked out the first time it is asked (a load's record of the
        plan, say, which the primer reads ahead of the device): the same value, or the same
        ``ValueError`` raised again, every later time. ``reader`` must read only the bytes."""
        found = self._read.get(reader, _UNREAD)
        if found is _UNREAD:
            try:
                found = reader(self)
            except ValueError as exc:
                found = _Raised(exc)
            self._read[reader] = found
        if isinstance(found, _Raised):
            raise found.error
        return cast(T, found)

    def know(self, reader: Callable[[PlanBlob], T], value: T) -> None:
        """Take ``value`` as what ``reader`` would find (a store's kept judgement carries a
        load's record): a later ``read(reader)`` returns it without reading the bytes."""
        self._read[reader] = value

    def known(self, reader: Callable[[PlanBlob], T]) -> T | None:
        """What ``read(reader)`` found already, or None where it was not asked or raised."""
        found = self._read.get(reader)
        return None if found is None or isinstance(found, _Raised) else cast(T, found)

    def __repr__(self) -> str:
        return f"PlanBlob({len(self.data)} bytes)"
