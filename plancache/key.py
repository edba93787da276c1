"""What determines a plan, and the key that names it.

``describe(graph)`` turns a ``cudnn.pygraph`` into a canonical, JSON-serializable
description without touching the GPU: it reads the graph's public structure (``context``,
``nodes``, ``tensors``), never calls into cuDNN, and drops everything that cannot change
the plan (tensor and node names). ``make_key`` hashes that description together with the
environment fingerprint and the build options.

Pure: no cuDNN, torch or CUDA import. Never uses Python's ``hash()``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import InvalidGraphError

__all__ = [
    "KEY_FORMAT",
    "BuildOptions",
    "CacheKey",
    "TensorSpec",
    "canonical_json",
    "describe",
    "environment_id",
    "make_key",
    "tensor_table",
]

#: Bumped whenever the description or key layout changes, so old entries become misses.
KEY_FORMAT = 2

POLICIES = ("heuristic", "topk", "exhaustive")
HEURISTIC_MODES = ("A", "B", "FALLBACK")

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


@dataclass(frozen=True)
class BuildOptions:
    """Everything the caller chooses that can change which plan is built.

    ``policy``: ``"heuristic"`` takes the heuristics' first buildable plan without timing;
    ``"topk"`` times the first ``top_k`` candidates; ``"exhaustive"`` times all of them.
    ``workspace_limit`` (bytes) excludes plans that need more workspace.
    ``kernel_cache``: dynamic-shape graphs build against the one kernel cache the
    backend shares per device (False: each builds its own). Static graphs ignore it.
    """

    policy: str = "topk"
    # 4: on an H200 (cuDNN 9.19), the best of the first 4 candidates was within 1.8% of the
    # exhaustive best for all seven benchmark graphs; 3 missed by up to 6.6%.
    top_k: int = 4
    heuristic_modes: tuple[str, ...] = HEURISTIC_MODES
    workspace_limit: int | None = None
    kernel_cache: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, not {self.top_k}")
        bad = [m for m in self.heuristic_modes if m not in HEURISTIC_MODES]
        if bad or not self.heuristic_modes:
            raise ValueError(f"heuristic_modes must be a non-empty subset of {HEURISTIC_MODES}, not {bad}")
        if self.workspace_limit is not None and self.workspace_limit < 0:
            raise ValueError("workspace_limit must be >= 0 bytes")

    def to_dict(self) -> dict[str, Any]:
        """The options as they enter the key (top_k only matters for the topk policy)."""
        return dict(_options_dict(self))  # a copy: callers may change theirs


@functools.lru_cache(maxsize=64)
def _options_dict(options: BuildOptions) -> dict[str, Any]:
    # Every lookup keys its options; asdict() deep-copies, so do it once per options value.
    data = asdict(options)
    data["heuristic_modes"] = list(options.heuristic_modes)
    if options.policy != "topk":
        data["top_k"] = None
    return data


@dataclass(frozen=True)
class TensorSpec:
    """One non-virtual tensor of a plan: what ``Plan.execute`` checks before launching."""

    uid: int
    name: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str | None
    is_output: bool
    is_pass_by_value: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["dims"] = list(self.dims)
        data["strides"] = list(self.strides)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(
            uid=int(data["uid"]),
            name=str(data["name"]),
            dims=tuple(int(d) for d in data["dims"]),
            strides=tuple(int(s) for s in data["strides"]),
            dtype=data.get("dtype"),
            is_output=bool(data["is_output"]),
            is_pass_by_value=bool(data.get("is_pass_by_value", False)),
        )


@dataclass(frozen=True)
class CacheKey:
    """The SHA-256 key of a plan and the parts it was computed from."""

    digest: str
    parts: dict[str, Any] = field(compare=False, repr=False)

    def explain(self) -> dict[str, dict[str, Any]]:
        """Each part with its own hash: two keys that differ show which part differs."""
        return {name: {"sha256": _sha256(value)[:16], "value": value} for name, value in self.parts.items()}


def canonical_json(value: Any) -> str:
    """Sorted, compact JSON: the one serialization every hash in plancache uses."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _sha256(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def environment_id(environment: Mapping[str, Any]) -> str:
    """A short id of an environment fingerprint; entries of one environment share it."""
    return _sha256(dict(environment))[:16]


def make_key(description: Mapping[str, Any], environment: Mapping[str, Any], options: BuildOptions) -> CacheKey:
    """Hash a canonical description, an environment fingerprint and build options."""
    parts = {
        "format": KEY_FORMAT,
        "graph": dict(description),
        "environment": dict(environment),
        "options": options.to_dict(),
    }
    return CacheKey(digest=_sha256(parts), parts=parts)


# ---------------------------------------------------------------------------- describe


def _tensors_of(graph: Any) -> list[Any]:
    """Every tensor of the graph, each once (by identity).

    ``graph.tensors`` is keyed by name, and pygraph drops a name that two tensors share
    from it (names are labels; duplicates are legal). Such tensors would then be missing
    from the key and the variant pack, so the nodes' ports are walked as well.
    """
    tensors = getattr(graph, "tensors", None)
    if not isinstance(tensors, Mapping):
        raise InvalidGraphError(
            f"expected a cudnn.pygraph, got {type(graph).__name__}: it has no 'tensors' mapping",
            node=None,
            reason="not a pygraph",
        )
    found: dict[int, Any] = {}
    pending = list(tensors.values())
    for node in getattr(graph, "nodes", []):
        pending += [t for t in node.inputs.values() if t is not None]
        pending += [t for t in node.outputs.values() if t is not None]
    while pending:
        t = pending.pop(0)
        if id(t) in found:
            continue
        found[id(t)] = t
        ragged = getattr(t, "ragged_offset", None)
        if ragged is not None:
            pending.append(ragged)
    return list(found.values())


def _data_type(tensor: Any) -> Any:
    # A tensor may hold a torch dtype; get_data_type() gives the cuDNN enum, so both
    # spellings key alike and Plan can check the caller's dtype.
    getter = getattr(tensor, "get_data_type", None)
    return getter() if callable(getter) else tensor.data_type


def _graph_flags(graph: Any) -> dict[str, Any]:
    # These are constructor arguments that the pygraph keeps only in the keyword arguments
    # it forwards to the backend graph; each can change which plans cuDNN proposes.
    kwargs = getattr(graph, "_cpp_graph_kwargs", None) or {}
    device_property = kwargs.get("device_property")
    return {
        "dynamic_shape": bool(kwargs.get("is_dynamic_shape_enabled", False)),
        "override_shape": bool(kwargs.get("is_override_shape_enabled", False)),
        "sm_count": _scalar(kwargs.get("sm_count"), "graph sm_count"),
        "sm_version": _scalar(kwargs.get("sm_version"), "graph sm_version"),
        # A device-property object has no stable text; its serialized JSON does.
        "device_property": str(device_property.serialize()) if device_property is not None else None,
    }


def _scalar(value: Any, where: str) -> Any:
    """A canonical JSON scalar for an attribute value; refuses what is not stable."""
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and _ADDRESS.search(value):
            raise InvalidGraphError(f"{where} holds a memory address ({value!r}); it cannot be keyed", node=None, reason="unstable attribute")
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return repr(value)
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    text = str(value)
    if _ADDRESS.search(text):
        raise InvalidGraphError(
            f"{where} is a {type(value).__name__} whose text holds a memory address; plancache cannot key it",
            node=None,
            reason="unstable attribute",
        )
    return text


class _Describer:
    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.tensors = _tensors_of(graph)
        self.ids: dict[int, str] = {}  # id(tensor object) -> canonical id
        self.virtual_count = 0
        self.produced: set[int] = set()
        self.float_stats: set[int] = set()  # SDPA Stats outputs: validate() makes them FLOAT

    def tensor_id(self, tensor: Any) -> str:
        key = id(tensor)
        if key not in self.ids:
            if tensor.is_virtual:
                self.ids[key] = f"v{self.virtual_count}"
                self.virtual_count += 1
            else:
                if not getattr(tensor, "uid_assigned", True):
                    raise InvalidGraphError(
                        f"tensor {tensor.name!r} has no uid: call set_uid() (or pass uid=) on every "
                        "input and output tensor, since stored plans execute by uid",
                        node=None,
                        reason="missing uid",
                    )
                self.ids[key] = f"u{int(tensor.uid)}"
        return self.ids[key]

    def value(self, value: Any, where: str) -> Any:
        if hasattr(value, "is_virtual") and hasattr(value, "uid"):
            return {"tensor": self.tensor_id(value)}
        if isinstance(value, Mapping):
            return {str(k): self.value(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return _scalar(value, where)

    def node(self, node: Any) -> dict[str, Any]:
        where = f"node {node.name!r}"
        try:
            outputs = {port: (self.tensor_id(t) if t is not None else None) for port, t in node.outputs.items()}
            inputs = {port: (self.tensor_id(t) if t is not None else None) for port, t in node.inputs.items()}
            params = self.value(dict(node.params), f"{where} param")
        except InvalidGraphError as exc:
            raise InvalidGraphError(f"{where}: {exc.message}", node=node.name, reason=exc.fields.get("reason")) from exc
        for t in node.outputs.values():
            if t is not None:
                self.produced.add(id(t))
        node_type = getattr(node, "node_type", None)
        stats = node.outputs.get("Stats")
        if stats is not None and getattr(node_type, "name", None) in ("SDPA", "SDPA_FP8", "SDPA_MXFP8"):
            self.float_stats.add(id(stats))
        return {
            "type": node_type.name if isinstance(node_type, enum.Enum) else str(node_type),
            "compute_data_type": _scalar(getattr(node, "compute_data_type", None), where),
            "inputs": inputs,
            "outputs": outputs,
            "params": params,
        }

    def tensor(self, tensor: Any) -> dict[str, Any]:
        ragged = getattr(tensor, "ragged_offset", None)
        # validate() and build_operation_graph() fill in what the caller left unset on op
        # outputs (dims, strides, data types), and the backend plans the graph after it was
        # keyed: describe only what the caller set, so the same graph object keys alike
        # before and after. What inference adds follows from the rest of the description.
        produced = id(tensor) in self.produced
        dims = tensor.dim if not produced or getattr(tensor, "dim_assigned", True) else None
        strides = tensor.stride if not produced or getattr(tensor, "stride_assigned", True) else None
        data_type = _data_type(tensor)
        if data_type is None:  # as validate() fills it in
            context = getattr(self.graph, "context", None)
            if id(tensor) in self.float_stats:
                data_type = "data_type.FLOAT"
            else:
                fill = "intermediate_data_type" if tensor.is_virtual else "io_data_type"
                data_type = getattr(context, fill, None)
        return {
            "dim": [int(d) for d in (dims or [])],
            "stride": [int(s) for s in (strides or [])],
            "dtype": _scalar(data_type, f"tensor {tensor.name!r}"),
            "is_virtual": bool(tensor.is_virtual),
            "is_pass_by_value": bool(getattr(tensor, "is_pass_by_value", False)),
            "is_output": (not tensor.is_virtual) and id(tensor) in self.produced,
            "value": self.value(getattr(tensor, "pass_by_value", None), f"tensor {tensor.name!r}"),
            "ragged_offset": self.tensor_id(ragged) if ragged is not None else None,
            "reordering_type": _scalar(getattr(tensor, "reordering_type", None), f"tensor {tensor.name!r}"),
            "alignment": _scalar(getattr(tensor, "alignment_value", None), f"tensor {tensor.name!r}"),
        }

    def describe(self) -> dict[str, Any]:
        context = getattr(self.graph, "context", None)
        nodes = [self.node(n) for n in getattr(self.graph, "nodes", [])]
        if not nodes:
            raise InvalidGraphError("the graph has no operations", node=None, reason="empty graph")
        # Tensors that no node touches still take part in the variant pack; name them too.
        for t in self.tensors:
            self.tensor_id(t)
        uids: dict[str, str] = {}
        for t in self.tensors:
            tid = self.ids[id(t)]
            if tid.startswith("u") and tid in uids:
                message = f"tensors {uids[tid]!r} and {t.name!r} share uid {tid[1:]}"
                raise InvalidGraphError(message, node=None, reason="duplicate uid")
            uids[tid] = t.name
        tensors = {self.ids[id(t)]: self.tensor(t) for t in self.tensors}
        return {
            "context": {
                "io_data_type": _scalar(getattr(context, "io_data_type", None), "context"),
                "intermediate_data_type": _scalar(getattr(context, "intermediate_data_type", None), "context"),
                "compute_data_type": _scalar(getattr(context, "compute_data_type", None), "context"),
            },
            "flags": _graph_flags(self.graph),
            "nodes": nodes,
            "tensors": tensors,
        }


def describe(graph: Any) -> dict[str, Any]:
    """The canonical description of a ``cudnn.pygraph``: needs no GPU.

    Every node's type, compute type, ports and parameters; every tensor's uid, dims,
    strides, data type and flags; the graph's data types and dynamic-shape flag. Tensors
    and nodes are named by uid (virtual tensors by order of appearance), so renaming
    changes nothing while any change that can alter the plan changes the result.

    Raises ``InvalidGraphError`` for a tensor without a uid, two tensors sharing a uid,
    an empty graph, or an attribute that has no stable text form.
    """
    return _Describer(graph).describe()


def tensor_table(graph: Any) -> list[TensorSpec]:
    """The non-virtual tensors of a graph, by uid: what a plan's variant pack holds."""
    describer = _Describer(graph)
    describer.describe()  # validates uids and fills describer.produced
    # An output whose data type was never set takes the graph's io data type.
    io_type = _scalar(getattr(getattr(graph, "context", None), "io_data_type", None), "context")
    table = []
    for t in describer.tensors:
        if t.is_virtual:
            continue
        data_type = _data_type(t)
        table.append(
            TensorSpec(
                uid=int(t.uid),
                name=str(t.name),
                dims=tuple(int(d) for d in (t.dim or [])),
                strides=tuple(int(s) for s in (t.stride or [])),
                dtype=_scalar(data_type, t.name) if data_type is not None else io_type,
                is_output=id(t) in describer.produced,
                is_pass_by_value=bool(getattr(t, "is_pass_by_value", False)),
            )
        )
    return sorted(table, key=lambda spec: spec.uid)
