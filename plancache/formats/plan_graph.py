"""The graph a cuDNN Frontend plan blob carries at its top level, read and written.

Every plan the frontend serializes holds, beside the backend's plan, the graph it was
built from: ``tensors`` (uid, dims, strides, data type, virtual or not, by value or not)
and ``nodes`` (the ops, in the order the graph was lowered, each with its ``tag``). The
store compares that graph with the description an entry's key is derived from, so that a
row holding another graph's blob is refused before the blob reaches cuDNN.

The frontend's names are not the description's: a description names a data type by the
Python enum (``data_type.HALF``) and an op by the pygraph's ``NodeType`` (``LAYERNORM``),
where the blob has the C++ frontend's JSON names (``HALF``, ``LAYER_NORM``). Both tables
below map them exactly, from the frontend 1.32 headers (``DataType_t``'s JSON names, each
node's ``tag``) and the blobs recorded on an H200 (``tests/data/plans``); a name with no
entry maps to nothing, and the store refuses it rather than guess.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

from .ubjson import decode

__all__ = ["DATA_TYPES", "NODE_TAGS", "BlobTensor", "PlanGraph", "PlanGraphError", "blob_fields", "frontend_node",
           "frontend_tensor", "read_graph"]  # fmt: skip

#: A description's data type -> the frontend's JSON name for it. The Python enum and the
#: C++ one share their member names; NOT_SET is null in a blob and never a described type.
DATA_TYPES: dict[str, str] = {
    f"data_type.{name}": name
    for name in ("FLOAT", "DOUBLE", "HALF", "INT8", "INT32", "INT8x4", "UINT8", "UINT8x4", "INT8x32", "BFLOAT16", "INT64",
                 "BOOLEAN", "FP8_E4M3", "FP8_E5M2", "FAST_FLOAT_FOR_FP8", "FP8_E8M0", "FP8_E5M3", "FP4_E2M1", "INT4")
}  # fmt: skip

#: A description's node type (the pygraph's ``NodeType``) -> the ``tag`` of the node the
#: frontend lowers it to. Only node types that lower to a cuDNN graph node are here.
NODE_TAGS: dict[str, str] = {
    **{name: name for name in ("CONV_FPROP", "CONV_DGRAD", "CONV_WGRAD", "GENSTATS", "RESHAPE", "SLICE", "CONCATENATE",
                               "TRANSPOSE", "ROPE", "ROPE_BWD", "MATMUL", "MATMUL_FP8", "POINTWISE", "REDUCTION",
                               "BATCHNORM", "BATCHNORM_INFERENCE", "SDPA", "SDPA_BWD", "SDPA_FP8_BWD", "SDPA_MXFP8_BWD",
                               "MOE_GROUPED_MATMUL", "MOE_GROUPED_MATMUL_BWD", "BLOCK_SCALE_QUANTIZE",
                               "BLOCK_SCALE_DEQUANTIZE")},
    "RMSNORM": "RMS_NORM", "RMSNORM_BWD": "RMS_NORM_BPROP", "LAYERNORM": "LAYER_NORM", "LAYERNORM_BWD": "LAYER_NORM_BPROP",
    "ADALAYERNORM": "ADA_LAYER_NORM", "ADALAYERNORM_BWD": "ADA_LAYER_NORM_BPROP", "INSTANCENORM": "INSTANCE_NORM",
    "INSTANCENORM_BWD": "INSTANCE_NORM_BPROP", "BATCHNORM_BWD": "DBN", "SDPA_FP8": "SDPA_FP8_FWD",
    "SDPA_MXFP8": "SDPA_MXFP8_FWD",
}  # fmt: skip

_GRAPH_KEYS = frozenset({"tensors", "nodes"})

#: The fields of the blobs read last, with the blobs themselves (so that an identity test
#: is sound: a blob held here cannot be freed and its id reused).
_RECENT: collections.deque[tuple[bytes, Any]] = collections.deque(maxlen=4)


def blob_fields(blob: bytes) -> Any:
    """What ``blob`` holds, decoded whole (``ubjson.UbjsonError`` for bytes that are not
    UBJSON): for a frontend plan, a dict of its top-level fields, which callers only read.

    A hit reads each blob twice, the store checking the graph it carries and the load then
    reading what a launch needs, and most of either read is walking the same tokens. So the
    fields of the last few blobs are kept, found again by the identity of the bytes object
    (the entry's blob is the object the load is handed): the second read costs nothing,
    and bytes that are merely equal are decoded again, which is never wrong."""
    for held, fields in tuple(_RECENT):  # a copy: other threads append as this one looks
        if held is blob:
            return fields
    fields = decode(blob)
    if isinstance(blob, bytes):  # immutable: the fields stay what it holds
        _RECENT.append((blob, fields))
    return fields


class PlanGraphError(ValueError):
    """The blob carries no graph, or one of the wrong shape."""


class BlobTensor(NamedTuple):
    """One tensor of a blob's graph, as the frontend wrote it (a tuple: a hit reads one per
    tensor of its plan, and a tuple is made several times faster than a frozen dataclass)."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    data_type: str | None  # the frontend's name; None: NOT_SET
    is_virtual: bool
    is_pass_by_value: bool


@dataclass(frozen=True)
class PlanGraph:
    """The graph of a blob: its tensors by uid and its ops' tags, in order."""

    tensors: dict[int, BlobTensor]
    tags: tuple[str, ...]


def read_graph(blob: bytes) -> PlanGraph:
    """The graph ``blob`` carries; ``PlanGraphError`` (or ``ubjson.UbjsonError``, both
    ``ValueError``) for a blob that is no frontend plan or carries no graph of this shape."""
    found = blob_fields(blob)
    if not isinstance(found, dict) or not found.keys() >= _GRAPH_KEYS:
        raise PlanGraphError("the blob carries no graph (no tensors and nodes at its top level)")
    tensors, nodes = found["tensors"], found["nodes"]
    if not isinstance(tensors, list) or not isinstance(nodes, list):
        raise PlanGraphError("the blob's tensors and nodes are not lists")
    read: dict[int, BlobTensor] = {}
    for tensor in tensors:
        uid = tensor.get("uid") if isinstance(tensor, dict) else None
        if type(uid) is not int or uid in read:
            raise PlanGraphError(f"a tensor of the blob has a missing or repeated uid ({uid!r})")
        read[uid] = _tensor(tensor, uid)
    tags = tuple(node.get("tag") if isinstance(node, dict) else None for node in nodes)
    if not all(isinstance(tag, str) for tag in tags):
        raise PlanGraphError("a node of the blob has no tag")
    return PlanGraph(read, tags)  # type: ignore[arg-type]  # every tag checked a str just above


def _tensor(tensor: Mapping[str, Any], uid: int) -> BlobTensor:
    dims, strides, data_type = tensor.get("dim"), tensor.get("stride"), tensor.get("data_type")
    virtual, by_value = tensor.get("is_virtual"), tensor.get("is_pass_by_value")
    if not (_ints(dims) and _ints(strides) and (data_type is None or isinstance(data_type, str))
            and type(virtual) is bool and type(by_value) is bool):  # fmt: skip
        raise PlanGraphError(f"tensor {uid} of the blob has fields of the wrong types")
    return BlobTensor(tuple(dims), tuple(strides), data_type, virtual, by_value)


def _ints(values: Any) -> TypeGuard[list[int]]:
    return isinstance(values, list) and all(type(v) is int for v in values)


def frontend_tensor(uid: int, dims: Sequence[int], strides: Sequence[int], dtype: str | None, *, virtual: bool,
                    by_value: bool, name: str) -> dict[str, Any]:  # fmt: skip
    """A tensor of a blob's graph as the frontend writes one, from a description's fields
    (``dtype``: the description's name, ``data_type.HALF``); of the frontend's fields, those
    that say what the tensor is (a by-value tensor's value and a reordering are left out)."""
    return {
        "data_type": DATA_TYPES[dtype] if dtype is not None else None,
        "dim": list(dims),
        "is_pass_by_value": by_value,
        "is_virtual": virtual,
        "name": name,
        "stride": list(strides),
        "uid": uid,
    }


def frontend_node(node_type: str, name: str) -> dict[str, Any]:
    """A node of a blob's graph as the frontend writes one (its tag and name; the CPU
    test backend writes no op attributes, which no check reads)."""
    return {"name": name, "tag": NODE_TAGS.get(node_type, node_type)}
