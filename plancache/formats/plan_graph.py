"""The graph a cuDNN Frontend plan blob carries at its top level, read as the frontend wrote it.

Every plan the frontend serializes holds, beside the backend's plan, the graph it was
built from, after the frontend normalized it: ``context`` (the graph's data types and
flags), ``tensors`` (uid, dims, strides, data type, virtual or not, by value or not, ragged
offset) and ``nodes`` (the ops, in the order the graph was lowered, each with its ``tag``,
its ports ``inputs`` and ``outputs`` naming tensors by uid, and its attributes: a pointwise
``mode``, a convolution's ``pre_padding``, attention's ``attn_scale_value``...). The store
compares that graph with what the key's description says the frontend writes
(``key.frontend_form``), so that a row holding another graph's blob is refused before the
blob reaches cuDNN. This module only reads: what the names mean is the form's.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

from .plan_blob import PlanBlob

__all__ = ["BlobNode", "BlobTensor", "PlanGraph", "PlanGraphError", "float_bits", "int_list", "read_graph", "written"]

_GRAPH_KEYS = frozenset({"tensors", "nodes"})
_HEX_FLOAT = re.compile(r"[0-9A-Fa-f]{1,8}")


def float_bits(value: Any) -> int:
    """The 32 bits of a float as the frontend writes one: the hex digits of its bits
    (``"3E000000"`` is 0.125, kept bit for bit, NaN payloads included), or a number.
    ``ValueError`` for anything else."""
    if isinstance(value, str):
        if not _HEX_FLOAT.fullmatch(value):
            raise ValueError(f"a float's bits must be 8 hex digits, not {value[:20]!r}")
        return int(value, 16)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a float must be its bits in hex or a number, not {type(value).__name__}")
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


class PlanGraphError(ValueError):
    """The blob carries no graph, or one of the wrong shape."""


class BlobTensor(NamedTuple):
    """One tensor of a blob's graph, as the frontend wrote it (a tuple: a hit reads one per
    tensor of its plan, and a tuple is made several times faster than a frozen dataclass).
    Its first eight fields, in this order, are ``written``'s."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    data_type: str | None  # the frontend's name; None: NOT_SET
    is_virtual: bool
    is_pass_by_value: bool
    ragged_offset: int | None = None  # the uid of its ragged offset tensor
    reordering: Any = "NONE"  # reordering_type; the frontend writes NONE when there is none
    multiplier: Any = 1  # ragged_offset_multiplier; written only when it is not 1
    fields: Mapping[str, Any] = {}  # every field as written (a held scalar's value...)


class BlobNode(NamedTuple):
    """One op of a blob's graph: its tag, its ports (port name -> uid, or a list of uids for
    a list port) and its attributes, as written: ``attributes`` is the node's whole record
    (its tag, name and ports among the fields), read by attribute name only."""

    tag: str
    inputs: Mapping[str, Any]
    outputs: Mapping[str, Any]
    attributes: Mapping[str, Any]


@dataclass(frozen=True)
class PlanGraph:
    """The graph of a blob: its tensors' records by uid, as written, its ops in order, its
    context. A tensor's record is checked when it is read as a ``BlobTensor`` (``tensor``):
    a judge that finds a record exactly as it expects (``written``) need not read it so."""

    records: dict[int, Mapping[str, Any]]
    nodes: tuple[BlobNode, ...]
    context: Mapping[str, Any]

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(node.tag for node in self.nodes)

    def tensor(self, uid: int) -> BlobTensor | None:
        """Tensor ``uid`` (None: the blob has none); ``PlanGraphError`` for fields of the wrong types."""
        record = self.records.get(uid)
        return None if record is None else _tensor(record, uid)


def written(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """A tensor's record as ``BlobTensor``'s first eight fields, unchecked (dims and
    strides the lists they are written as)."""
    get = record.get
    return (get("dim"), get("stride"), get("data_type"), get("is_virtual"), get("is_pass_by_value"),
            get("ragged_offset_uid"), get("reordering_type", "NONE"), get("ragged_offset_multiplier", 1))  # fmt: skip


def read_graph(blob: PlanBlob) -> PlanGraph:
    """The graph ``blob`` carries; ``PlanGraphError`` (or ``ubjson.UbjsonError``, both
    ``ValueError``) for a blob that is no frontend plan or carries no graph of this shape."""
    found = blob.fields
    if not isinstance(found, dict) or not found.keys() >= _GRAPH_KEYS:
        raise PlanGraphError("the blob carries no graph (no tensors and nodes at its top level)")
    tensors, nodes, context = found["tensors"], found["nodes"], found.get("context") or {}
    if not isinstance(tensors, list) or not isinstance(nodes, list) or not isinstance(context, dict):
        raise PlanGraphError("the blob's tensors and nodes are not lists")
    records: dict[int, Mapping[str, Any]] = {}
    for tensor in tensors:
        uid = tensor.get("uid") if type(tensor) is dict else None
        if type(uid) is not int or uid in records:
            raise PlanGraphError(f"a tensor of the blob has a missing or repeated uid ({uid!r})")
        records[uid] = tensor
    return PlanGraph(records, tuple(_node(node, i) for i, node in enumerate(nodes)), context)


def _tensor(tensor: Mapping[str, Any], uid: int) -> BlobTensor:
    dims, strides, data_type, virtual, by_value, ragged, reordering, multiplier = written(tensor)
    if not (int_list(dims) and int_list(strides) and (data_type is None or isinstance(data_type, str))
            and type(virtual) is bool and type(by_value) is bool and (ragged is None or type(ragged) is int)):  # fmt: skip
        raise PlanGraphError(f"tensor {uid} of the blob has fields of the wrong types")
    return BlobTensor(tuple(dims), tuple(strides), data_type, virtual, by_value, ragged, reordering, multiplier, tensor)


def _node(node: Any, index: int) -> BlobNode:
    if not isinstance(node, dict) or not isinstance(node.get("tag"), str):
        raise PlanGraphError(f"node {index} of the blob has no tag")
    inputs, outputs = node.get("inputs") or {}, node.get("outputs") or {}
    if not (type(inputs) is dict and type(outputs) is dict and _ports(inputs) and _ports(outputs)):
        raise PlanGraphError(f"node {index} of the blob has ports of the wrong types")
    return BlobNode(node["tag"], inputs, outputs, node)


def _ports(ports: dict[str, Any]) -> bool:
    """Each port holds a uid, a list of uids (concatenation, peer stats), or nothing."""
    return {*map(type, ports.values())} <= _UID_TYPES or all(
        uid is None or type(uid) is int or int_list(uid) for uid in ports.values()
    )


_UID_TYPES = {int, type(None)}
_INT = {int}


def int_list(values: Any) -> TypeGuard[list[int]]:
    """Whether ``values`` is a list of ints and nothing else (no bool, no subclass), checked in C."""
    return type(values) is list and {*map(type, values)} <= _INT
