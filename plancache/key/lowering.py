"""How cuDNN Frontend's pygraph hands op outputs to cuDNN, for ``key.describe``.

``pygraph._lower_to_cpp`` gives cuDNN a graph input's every attribute, but an op output's
dims and strides only in some cases: user-assigned ones always (``push_output_attrs``),
the dims of shape-ambiguous ops (``push_output_dims``: dgrad, wgrad, reduction,
reshape...) and the dims and strides of the captured attention ops whether inferred or
set. ``lowering(node_type)`` says which case a node type is in, read from cuDNN
Frontend's own op tables. ``inferred_shapes`` runs validate()'s shape inference on
shadows, so an output whose dims validate() would fill in keys alike before and after.

Pure: reads the cuDNN Frontend modules a pygraph's caller already imported, from
``sys.modules``; imports nothing itself.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Lowering", "inferred_shapes", "lowering", "row_major"]


def row_major(dims: list[int]) -> list[int]:
    """Dense strides, last dimension fastest (what the pygraph assumes when unset)."""
    strides, step = [0] * len(dims), 1
    for i in range(len(dims) - 1, -1, -1):
        strides[i] = step
        step *= dims[i]
    return strides


class Mode(enum.Enum):
    """Which dims and strides of a tensor reach cuDNN."""

    ATTRS = "attrs"  # only user-assigned dims/strides
    PUSH_DIMS = "push_dims"  # dims always, strides when user-assigned
    PUSH_ALL = "push_all"  # dims and strides always
    RAW = "raw"  # unknown to plancache: everything as it is, plus the assigned flags
    CALLER = "caller"  # not an op output: a tensor lowered whole, like a graph input


@dataclass(frozen=True)
class Lowering:
    """How the pygraph lowers one node type's outputs (``pygraph._lower_to_cpp``): its
    ``mode``. ``direct``: output ports lowered as caller tensors (the captured ops' ``out_kwargs``).
    """

    mode: Mode
    direct: frozenset[str] = frozenset()
    reinfer: frozenset[str] = frozenset()
    infer: Mapping[str, Any] | None = None


def lowering(node_type: Any) -> Lowering:
    """How a node type's outputs reach cuDNN. Memoized by id: NodeType members are immortal
    (and kept alive here), and an Enum member hashes slowly for a per-lookup path."""
    low = _LOWERINGS.get(id(node_type))
    if low is None:
        low = _LOWERINGS[id(node_type)] = _lowering_of(node_type)
        _LOWERING_TYPES.append(node_type)  # keeps the id taken
    return low


_LOWERINGS: dict[int, Lowering] = {}
_LOWERING_TYPES: list[Any] = []


def _lowering_of(node_type: Any) -> Lowering:
    name = getattr(node_type, "name", None)
    if name in ("MATMUL", "POINTWISE"):
        return Lowering(Mode.ATTRS)
    fe = sys.modules.get("cudnn._pygraph")
    captured = getattr(fe, "_CAPTURED_BY_TYPE", {}).get(node_type)
    if captured is not None:
        spec = captured[1]
        direct = frozenset(spec.get("out_kwargs", ())) - frozenset(spec.get("outputs", ()))
        return Lowering(Mode.PUSH_ALL, direct, frozenset(spec.get("reinfer", ())), spec.get("infer", {}))
    structured = getattr(fe, "_STRUCTURED_BY_TYPE", {}).get(node_type)
    if structured is not None:
        spec = structured[1]
        # A python-only op never lowers: the python engines that serve it read the IR's
        # inferred dims and strides, so those are keyed like the captured ops' outputs.
        mode = Mode.PUSH_ALL if spec.get("python_only") else Mode.PUSH_DIMS if spec.get("push_output_dims") else Mode.ATTRS
        return Lowering(mode, frozenset(), frozenset(spec.get("reinfer", ())), spec.get("infer", {}))
    return Lowering(Mode.RAW)


class _Shadow:
    """A tensor's dims and strides during a dry run of validate()'s shape inference; every
    other attribute reads through to the real tensor, which is never written."""

    __slots__ = ("dim", "real", "stride")

    def __init__(self, real: Any) -> None:
        self.real = real
        self.dim = list(real.dim or ())
        self.stride = list(real.stride or ())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _ShadowNode:
    __slots__ = ("compute_data_type", "inputs", "name", "node_type", "outputs", "params")

    def __init__(self, node: Any, shadow: Callable[[Any], _Shadow]) -> None:
        self.name, self.node_type, self.params = node.name, node.node_type, node.params
        self.compute_data_type = node.compute_data_type
        self.inputs = {p: shadow(t) for p, t in node.inputs.items() if t is not None}
        self.outputs = {p: shadow(t) for p, t in node.outputs.items() if t is not None}


def inferred_shapes(nodes: list[Any]) -> dict[int, tuple[list[int], list[int]]] | None:
    """The dims and strides validate() will give every tensor, computed on shadows with
    cuDNN Frontend's own inference (so the key of a graph is the same before and after
    validate()). None when inference fails: validate() would raise, nothing gets planned."""
    node_class = getattr(sys.modules.get("cudnn.nodes"), "Node", None)
    shadows: dict[int, _Shadow] = {}

    def shadow(t: Any) -> _Shadow:
        s = shadows.get(id(t))
        if s is None:
            s = shadows[id(t)] = _Shadow(t)
        return s

    try:
        for node in nodes:
            sn = _ShadowNode(node, shadow)
            kind = getattr(node.node_type, "name", None)
            if kind == "MATMUL" and node_class is not None:
                node_class._infer_matmul(sn)
            elif kind == "POINTWISE" and node_class is not None:
                node_class._infer_pointwise(sn)
            low = lowering(node.node_type)
            for port, out in sn.outputs.items():
                if low.infer is None or (out.dim and (port not in low.reinfer or out.dim_assigned)):
                    continue
                rule = low.infer.get(port)
                try:  # as validate(): an inference rule that fails leaves the dims unset
                    dims = rule(sn) if rule is not None else None
                except Exception:
                    dims = None
                if dims:
                    reinferred = bool(out.dim)
                    out.dim = list(dims)
                    if not (reinferred and out.stride_assigned):
                        out.stride = row_major(out.dim)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    for s in shadows.values():
        if s.dim and not s.stride:
            s.stride = row_major(s.dim)
    return {key: (s.dim, s.stride) for key, s in shadows.items()}
