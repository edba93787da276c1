"""What determines a plan: the canonical description of a graph.

``describe(graph)`` turns a ``cudnn.pygraph`` into a canonical, JSON-serializable
description without touching the GPU. It covers what the pygraph hands to cuDNN *by
construction*: every field of every tensor (``dataclasses.fields(Tensor)``), every
attribute of every node, every graph-level keyword argument and data type, and the graph
attributes that steer planning. What cannot change a plan is on explicit deny lists below,
each with its reason; a field or value plancache does not know how to key exactly is
refused with ``InvalidGraphError`` instead of being dropped. ``make_key`` hashes that
description together with the environment fingerprint and the build options.

docs/key.md describes what the key covers and what plancache refuses.

Pure: imports neither cuDNN nor torch (it reads the modules a pygraph's caller already
imported, from ``sys.modules``, when it needs them). Never uses Python's ``hash()``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import InvalidGraphError, UntaggedCallableError
from .key import TensorSpec
from .lowering import Lowering, Mode, inferred_shapes, lowering, row_major

__all__ = [
    "GRAPH_KWARGS_DENIED",
    "NODE_ATTRS_DENIED",
    "NODE_ATTRS_KEYED",
    "TENSOR_FIELDS_DENIED",
    "TENSOR_FIELDS_KEYED",
    "describe",
    "mark_shared_kernel_cache",
    "tensor_table",
    "used_tensors",
]

# ---------------------------------------------------------------------------- what is keyed

#: Fields of ``cudnn.graph_types.Tensor`` that enter the description. ``dim``/``stride``
#: enter as cuDNN receives them: a graph input's always; an op output's when the
#: pygraph pushes them at lowering (user-assigned ones, which ``dim_assigned`` /
#: ``stride_assigned`` record, and the ones captured and shape-ambiguous ops always
#: push). ``uid`` names a caller tensor (``u<uid>``); ``uid_assigned`` must hold for it.
TENSOR_FIELDS_KEYED = frozenset({
    "data_type", "dim", "stride", "dim_assigned", "stride_assigned", "is_virtual", "is_pass_by_value",
    "pass_by_value", "uid", "uid_assigned", "reordering_type", "ragged_offset", "ragged_offset_multiplier",
    "alignment_value", "scalar_type",
})  # fmt: skip

#: Fields of a tensor that cannot change a plan, and why. (Also denied, per tensor kind:
#: the raw uid number of a virtual tensor or a graph-held scalar, which the pygraph
#: allocates in creation order and which the caller never binds: those tensors are
#: numbered by first appearance in the node walk instead.)
TENSOR_FIELDS_DENIED: dict[str, str] = {
    "name": "a label: plans bind tensors by uid, and renaming changes no computation",
    "owner": "a weak reference to the owning pygraph, not a property of the tensor",
}

#: Attributes of ``cudnn.nodes.Node`` that enter the description (any attribute a later
#: cuDNN Frontend adds is keyed too, exactly, or refused).
NODE_ATTRS_KEYED = frozenset({"node_type", "compute_data_type", "inputs", "outputs", "params"})

NODE_ATTRS_DENIED: dict[str, str] = {"name": "a label: node names change no computation"}

#: Keyword arguments the pygraph forwards to the backend graph that cannot change a plan.
GRAPH_KWARGS_DENIED: dict[str, str] = {
    "name": "a label of the graph",
    "kernel_cache": "an object whose identity is per process: only whether the caller attached one is keyed",
    "handle": "a cuDNN handle binds a device and stream, not a plan (the environment keys the device)",
}

# Graph attributes that are keyed by name (below) or are planning state plancache owns.
_GRAPH_KWARGS_KNOWN = frozenset({
    "is_dynamic_shape_enabled", "is_override_shape_enabled", "sm_count", "sm_version", "device_property",
    "cuda_graph_retention", *GRAPH_KWARGS_DENIED,
})  # fmt: skip
_GRAPH_PUBLIC_KNOWN = frozenset({"is_cuda_graph_replay_expected"})
_NODE_ATTRS_KNOWN = NODE_ATTRS_KEYED | frozenset(NODE_ATTRS_DENIED)
_TENSOR_FIELDS_KNOWN = TENSOR_FIELDS_KEYED | frozenset(TENSOR_FIELDS_DENIED)
_CONTEXT_DTYPES = ("io_data_type", "intermediate_data_type", "compute_data_type")

# Attention nodes whose softmax Stats validate() makes FLOAT when the caller left it unset.
_FLOAT_STATS_NODES = frozenset({"SDPA", "SDPA_FP8", "SDPA_MXFP8"})

# A string that reads like describe's enum spelling ("Type.MEMBER") is wrapped, so a
# string and an enum never describe alike.
_ENUM_LIKE = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*")

# Tensor-valued attributes are keyed by their bytes; past this size they are refused
# rather than bloating every key (cuDNN takes scalars there).
_MAX_ARRAY_BYTES = 1 << 16

# Kernel caches a plancache backend attached (kept alive here, so ids stay unique).
_SHARED_KERNEL_CACHES: dict[int, Any] = {}


def mark_shared_kernel_cache(cache: Any) -> None:
    """Record a kernel cache that plancache itself attaches to graphs it builds.

    Attaching it happens after the graph was keyed (``BuildOptions.kernel_cache`` keys that
    choice), so the graph must key alike before and after: describe treats this cache as
    no caller-attached cache.
    """
    _SHARED_KERNEL_CACHES[id(cache)] = cache


def _refuse(message: str, node: str | None = None, reason: str = "unkeyable attribute") -> InvalidGraphError:
    return InvalidGraphError(message, node=node, reason=reason)


#: Where a value sits, formatted only when something is refused (describe runs on every
#: lookup): ``(kind, name, label, field)``, e.g. ``("node", "sdpa", "param", "score_mod")``.
Where = tuple[str, Any, str, Any]


def _text(where: Where) -> str:
    kind, name, label, name2 = where
    head = f"{kind} {name!r}" if name is not None else kind
    tail = f" {label} {name2!r}" if name2 is not None else f" {label}" if label else ""
    return head + tail


# ---------------------------------------------------------------------------- values


@functools.lru_cache(maxsize=256)
def _string(value: str) -> Any:
    return {"str": value} if _ENUM_LIKE.fullmatch(value) else value


def _array(value: Any, where: Where) -> dict[str, Any]:
    """A torch tensor or numpy value, exactly: library, dtype, shape and raw bytes."""
    module = type(value).__module__.split(".")[0]
    if module == "torch":
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(sys.modules["torch"].uint8).numpy().tobytes()
        shape, dtype = list(value.shape), str(value.dtype)
    else:  # numpy array or numpy scalar
        array = sys.modules["numpy"].asarray(value)
        data, shape, dtype = array.tobytes(), list(array.shape), array.dtype.str
    if len(data) > _MAX_ARRAY_BYTES:
        raise _refuse(f"{_text(where)} is a {len(data)}-byte array; plancache keys only small arrays exactly")
    return {"array": {"lib": module, "dtype": dtype, "shape": shape, "hex": data.hex()}}


def _dtype(value: Any, where: Where) -> str | None:
    """A data type as the cuDNN enum name: torch dtypes are mapped as cuDNN Frontend maps
    them at lowering (``datatypes._library_type``), so both spellings key alike."""
    # By id: enum members and torch dtypes are immortal singletons (only those are
    # memoized), and an id hashes much faster than an Enum member does.
    name = _DTYPES.get(id(value), _MISSING)
    return _dtype_slow(value, where) if name is _MISSING else name


def _dtype_slow(value: Any, where: Where) -> str | None:
    if isinstance(value, enum.Enum):
        name = f"{type(value).__name__}.{value.name}"
    elif type(value).__module__ == "torch":
        # The frontend's own mapping, from the module the caller's graph was made with.
        library_type = getattr(sys.modules.get("cudnn.datatypes"), "_library_type", None)
        try:
            if library_type is None:
                raise LookupError("cuDNN Frontend is not imported")
            converted = library_type(value)
        except Exception as exc:
            raise _refuse(
                f"{_text(where)} has data type {value}, which cuDNN has no type for", reason="unsupported dtype"
            ) from exc
        name = f"{type(converted).__name__}.{converted.name}"
    else:
        raise _refuse(f"{_text(where)} has data type {value!r} of type {type(value).__name__}; plancache cannot key it")
    if len(_DTYPES) < 256:
        _DTYPES[id(value)] = name
        _DTYPE_OBJECTS.append(value)  # keeps the id taken
    return name


_MISSING: Any = object()
_DTYPES: dict[int, str | None] = {id(None): None}
_DTYPE_OBJECTS: list[Any] = []


def _ints(values: Iterable[Any] | None, where: Where) -> list[int]:
    out = list(values or ())
    for i, v in enumerate(out):
        if type(v) is not int:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise _refuse(f"{_text(where)} holds {v!r}, not an integer")
            out[i] = int(v)
    return out


# ---------------------------------------------------------------------------- describe


class _Describer:
    """One walk over a pygraph: names its tensors canonically, encodes attribute values
    exactly, and describes its nodes, tensors, data types and flags."""

    def __init__(self, graph: Any, tag: str | None, *, keying: bool = True, auto_uids: bool = False) -> None:
        if not isinstance(getattr(graph, "tensors", None), Mapping) or not hasattr(graph, "nodes"):
            raise _refuse(
                f"expected a cudnn.pygraph, got {type(graph).__name__}: it has no 'tensors' mapping", reason="not a pygraph"
            )
        self.graph = graph
        self.tag = tag
        self.keying = keying  # tensor_table walks the graph without keying node parameters
        self.auto_uids = auto_uids  # a uid the frontend numbered (no set_uid) names the tensor too
        self.ids: dict[int, str] = {}  # id(tensor) -> canonical id
        self.order: list[Any] = []  # tensors in order of first appearance
        self.counts = {"v": 0, "c": 0}
        self.uid_names: dict[int, str] = {}
        self.tensor_type = getattr(sys.modules.get("cudnn.graph_types"), "Tensor", None)
        self.node_name: str | None = None  # the node being described, for error messages
        self.context = getattr(graph, "context", None) or _NO_CONTEXT
        self.roles: dict[int, tuple[str, Lowering]] = {}  # id(op output) -> (port, how it lowers)
        self.produced: set[int] = set()  # ids of every tensor some node outputs
        self.float_stats: set[int] = set()  # attention Stats outputs: validate() makes them FLOAT
        self.shapes: dict[int, tuple[list[int], list[int]]] | None = None

    # ------------------------------------------------------------------ naming
    def ref(self, t: Any) -> str:
        tid = self.ids.get(id(t))
        return tid if tid is not None else self._name(t)

    def _name(self, t: Any) -> str:
        if t.pass_by_value is not None and t.scalar_type is not None:
            # A scalar the graph holds itself (graph.tensor_scalar): lowered by value, its
            # auto uid never binds anything, so it is named by position like a virtual.
            tid = f"c{self.counts['c']}"
            self.counts["c"] += 1
        elif t.is_virtual:
            tid = f"v{self.counts['v']}"
            self.counts["v"] += 1
        else:
            if not t.uid_assigned and not self.auto_uids:
                raise _refuse(
                    f"tensor {t.name!r} has no uid: call set_uid() (or pass uid=) on every input and output tensor, "
                    "since stored plans execute by uid",
                    node=self.node_name,
                    reason="missing uid",
                )
            uid = int(t.uid)
            other = self.uid_names.get(uid)
            if other is not None:
                raise _refuse(f"tensors {other!r} and {t.name!r} share uid {uid}", reason="duplicate uid")
            self.uid_names[uid] = t.name
            tid = f"u{uid}"
        self.ids[id(t)] = tid
        self.order.append(t)
        return tid

    # ------------------------------------------------------------------ values
    def value(self, v: Any, where: Where) -> Any:
        """An exact, canonical JSON form of an attribute value, or a refusal."""
        t = type(v)
        if v is None or t is bool or t is int:
            return v
        if t is float:
            return v if math.isfinite(v) else {"float": repr(v)}
        if t is str:
            return _string(v)
        if t is list or t is tuple:
            out = list(v)
            for i, x in enumerate(out):
                tx = type(x)
                if not (tx is int or tx is bool or x is None):
                    out[i] = self.value(x, where)
            return out
        if t is self.tensor_type:
            return {"tensor": self.ref(v)}
        return self._value_slow(v, where)

    def _value_slow(self, v: Any, where: Where) -> Any:
        if isinstance(v, enum.Enum):
            return f"{type(v).__name__}.{v.name}"
        if self.tensor_type is None and hasattr(v, "is_virtual") and hasattr(v, "uid"):  # (a Tensor's is value()'s)
            return {"tensor": self.ref(v)}
        if type(v).__module__.split(".")[0] in ("torch", "numpy") and hasattr(v, "dtype"):
            return _array(v, where)
        if isinstance(v, slice):
            return {"slice": [self.value(v.start, where), self.value(v.stop, where), self.value(v.step, where)]}
        if isinstance(v, bool):
            return bool(v)
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return self.value(float(v), where)
        if isinstance(v, str):
            return _string(str(v))
        if isinstance(v, Mapping):
            if not all(isinstance(k, str) for k in v):
                raise _refuse(f"{_text(where)} is a mapping with non-string keys; plancache cannot key it")
            return {"dict": {k: self.value(x, where) for k, x in v.items()}}
        if isinstance(v, (list, tuple)):
            return [self.value(x, where) for x in v]
        if callable(v):
            if self.tag is not None:
                return {"callable": True}  # the caller's tag, in the description, stands for it
            raise UntaggedCallableError(
                f"{_text(where)} is a callable ({getattr(v, '__qualname__', type(v).__name__)}): its behaviour cannot be keyed; "
                "pass describe(graph, tag=...) with a tag that changes whenever the callable does",
                node=self.node_name,
                reason="callable without tag",
            )
        raise _refuse(f"{_text(where)} is a {type(v).__name__}, which plancache cannot key exactly", node=self.node_name)

    def extras(self, obj: Any, known: frozenset[str], kind: str, name: Any, label: str) -> dict[str, Any]:
        """Attributes a later cuDNN Frontend may add: keyed exactly, never dropped."""
        attrs = vars(obj)
        if attrs.keys() <= known:
            return {}
        return {f"x:{k}": self.value(attrs[k], (kind, name, label, k)) for k in sorted(attrs.keys() - known)}

    def tensor_extras(self, t: Any) -> dict[str, Any]:
        # Checked per class once (dataclasses.fields), then per instance by count only:
        # an instance gains an attribute only when someone sets one that is not a field.
        cls = type(t)
        fields = _FIELD_COUNT.get(cls)
        if fields is None:
            fields = _FIELD_COUNT[cls] = _field_count(cls)
        if fields < 0 or len(vars(t)) > fields:
            return self.extras(t, _TENSOR_FIELDS_KNOWN, "tensor", t.name, "field")
        return {}

    # ------------------------------------------------------------------ nodes
    def node(self, node: Any) -> dict[str, Any]:
        name = self.node_name = node.name
        kind = node.node_type
        if not isinstance(kind, enum.Enum):
            raise _refuse(f"node {name!r} has node type {kind!r}, which is not a NodeType", node=name)
        kind_name = kind._name_  # Enum.name is a slow descriptor; this runs per node per lookup
        low = lowering(kind)
        ref = self.ref
        inputs = {port: (ref(t) if t is not None else None) for port, t in node.inputs.items()}
        outputs: dict[str, str | None] = {}
        for port, t in node.outputs.items():
            if t is None:
                outputs[port] = None
                continue
            outputs[port] = ref(t)
            self.produced.add(id(t))
            # An output the caller passes in (attention's out_kwargs) lowers like an input.
            if id(t) not in self.roles and port not in low.direct:
                self.roles[id(t)] = (port, low)
            if port == "Stats" and kind_name in _FLOAT_STATS_NODES:
                self.float_stats.add(id(t))
        value = self.value
        compute = node.compute_data_type
        description = {
            "type": kind_name,
            "compute_data_type": _dtype(compute, ("node", name, "compute_data_type", None)),
            "inputs": inputs,
            "outputs": outputs,
            # (the tensor table needs no parameters: it neither encodes nor refuses them)
            "params": {k: value(v, ("node", name, "param", k)) for k, v in node.params.items()} if self.keying else {},
        }
        if not vars(node).keys() <= _NODE_ATTRS_KNOWN:
            description.update(self.extras(node, _NODE_ATTRS_KNOWN, "node", name, "attribute"))
        self.node_name = None
        return description

    # ------------------------------------------------------------------ tensors
    def effective_dtype(self, t: Any) -> str | None:
        """The data type cuDNN gets: the tensor's, or the one validate() fills in."""
        data_type = t.data_type
        if data_type is None:
            if id(t) in self.float_stats:
                return "data_type.FLOAT"
            data_type = self.context.intermediate_data_type if t.is_virtual else self.context.io_data_type
        return _dtype(data_type, ("tensor", t.name, "", None))

    def shape(self, t: Any, low: Lowering, port: str) -> tuple[list[int], list[int]]:
        """The dims and strides validate() leaves on a pushed output (inferred if unset)."""
        if not t.dim or (port in low.reinfer and not t.dim_assigned):
            if self.shapes is None:
                self.shapes = inferred_shapes(list(self.graph.nodes)) or {}
            if id(t) in self.shapes:
                return self.shapes[id(t)]
        dims = _ints(t.dim, ("tensor", t.name, "dim", None))
        strides = _ints(t.stride, ("tensor", t.name, "stride", None))
        return dims, strides or row_major(dims)

    def tensor(self, t: Any) -> dict[str, Any]:
        tid = self.ids[id(t)]
        if tid[0] == "c":  # lowered as graph.tensor_scalar(value, scalar_type): nothing else
            entry: dict[str, Any] = {
                "scalar": self.value(t.pass_by_value, ("tensor", t.name, "value", None)),
                "scalar_type": self.value(t.scalar_type, ("tensor", t.name, "scalar_type", None)),
                "is_virtual": False,
                "is_output": False,
            }
            entry.update(self.tensor_extras(t))
            return entry
        port, low = self.roles.get(id(t), _CALLER)
        mode = low.mode
        dim: list[int] | None
        strides: list[int] | None
        if mode is Mode.CALLER or mode is Mode.RAW:  # lowered as a tensor of its own (_make_tensor), or unknown: all of it
            dim = _ints(t.dim, ("tensor", t.name, "dim", None))
            strides = _ints(t.stride, ("tensor", t.name, "stride", None))
            if mode is Mode.CALLER and not t.stride_assigned and dim and sorted(strides) == sorted(row_major(dim)):
                # An implicit stride is lowered as the row-major one the pygraph filled in;
                # the backend may rewrite it while it builds (fp8 attention transposes K's),
                # and the key of the same graph object must not change with it. A stride
                # that is no reordering of the row-major one is not such a rewrite: the
                # tensor was made with other dims and set_dim changed them, and the stride
                # filled in for the old dims is what is lowered (a padded layout).
                strides = row_major(dim)
        elif mode is Mode.PUSH_ALL:
            dims, inferred = self.shape(t, low, port)
            dim, strides = dims or None, inferred or None
        else:  # the dims pushed (PUSH_DIMS) or as assigned (ATTRS); the strides as assigned
            if mode is Mode.ATTRS:
                dim = _ints(t.dim, ("tensor", t.name, "dim", None)) if t.dim_assigned and t.dim else None
            else:
                dim = self.shape(t, low, port)[0] or None
            strides = _ints(t.stride, ("tensor", t.name, "stride", None)) if t.stride_assigned and t.stride else None
        entry = {
            "dim": dim,
            "stride": strides,
            "dtype": self.effective_dtype(t),
            "is_virtual": bool(t.is_virtual),
            "is_output": id(t) in self.produced and not t.is_virtual,
        }
        if mode is Mode.RAW:
            entry["dim_assigned"], entry["stride_assigned"] = bool(t.dim_assigned), bool(t.stride_assigned)
        # The rest only when set: a fixed default is as exact as the value, and shorter.
        if t.is_pass_by_value:
            entry["is_pass_by_value"] = True
        for name in ("pass_by_value", "scalar_type", "reordering_type"):
            if getattr(t, name) is not None:
                entry[name] = self.value(getattr(t, name), ("tensor", t.name, name, None))
        if t.ragged_offset is not None:
            entry["ragged_offset"] = self.ref(t.ragged_offset)
        for name in ("ragged_offset_multiplier", "alignment_value"):
            if getattr(t, name) != 1:
                entry[name] = self.value(getattr(t, name), ("tensor", t.name, name, None))
        entry.update(self.tensor_extras(t))
        return entry

    # ------------------------------------------------------------------ graph
    def walk(self) -> list[dict[str, Any]]:
        """Name every tensor (nodes first, in order) and describe the nodes."""
        nodes = [self.node(n) for n in self.graph.nodes]
        if not nodes:
            raise _refuse("the graph has no operations", reason="empty graph")
        # Caller tensors no node touches still take part in the variant pack: name them
        # too. Untouched virtual tensors are never lowered, nor are untouched graph-held
        # scalars, except into a callable (an attention score_mod) that captured them: its
        # tag names what it does, and these values (a softcap of 30 or 50) are what it
        # does it with, so a tagged graph keys them.
        registered = getattr(self.graph, "_tensor_by_uid", None)
        for t in (registered if isinstance(registered, Mapping) else self.graph.tensors).values():
            held = t.pass_by_value is not None and t.scalar_type is not None
            if id(t) not in self.ids and not t.is_virtual and (not held or self.tag is not None):
                self.ref(t)
        for t in self.order:  # ragged offsets hang off tensors, not ports; they bind too (and are walked in turn)
            if t.ragged_offset is not None:
                self.ref(t.ragged_offset)
        return nodes

    def flags(self) -> dict[str, Any]:
        graph = self.graph
        kwargs = getattr(graph, "_cpp_graph_kwargs", None) or {}
        value = self.value
        device_property = kwargs.get("device_property")
        kernel_cache = kwargs.get("kernel_cache")
        shared = kernel_cache is not None and _SHARED_KERNEL_CACHES.get(id(kernel_cache)) is kernel_cache
        flags = {
            "dynamic_shape": bool(kwargs.get("is_dynamic_shape_enabled", False)),
            "override_shape": bool(kwargs.get("is_override_shape_enabled", False)),
            "sm_count": value(kwargs.get("sm_count"), ("graph", None, "sm_count", None)),
            "sm_version": value(kwargs.get("sm_version"), ("graph", None, "sm_version", None)),
            "device_property": _device_property(device_property) if device_property is not None else None,
            "cuda_graph_retention": value(kwargs.get("cuda_graph_retention"), ("graph", None, "cuda_graph_retention", None)),
            # whether the caller brought a kernel cache (plancache's own shared one is keyed
            # by BuildOptions.kernel_cache)
            "kernel_cache": kernel_cache is not None and not shared,
            # python engines' heuristics may lead with another plan when replay is expected
            "cuda_graph_replay": bool(getattr(graph, "is_cuda_graph_replay_expected", False)),
        }
        for k in sorted(kwargs.keys() - _GRAPH_KWARGS_KNOWN):  # forwarded to the backend graph as they are
            flags[f"kw:{k}"] = value(kwargs[k], ("graph", None, "keyword argument", k))
        for k in _public_attributes(graph):
            flags[f"attr:{k}"] = value(getattr(graph, k), ("graph", None, "attribute", k))
        # Engine and note filters set on the graph before planning restrict the candidates.
        # (Its workspace limit is not keyed: plancache sets it from BuildOptions.workspace_limit.)
        barred = getattr(graph, "_barred_names", None)
        if barred:
            flags["deselected_engines"] = sorted(value(list(barred), ("graph", None, "deselect_engines", None)))
        notes = getattr(graph, "_note_filters", None)
        if notes:
            flags["note_filters"] = [value(list(n), ("graph", None, "note filter", None)) for n in notes]
        return flags

    def context_description(self) -> dict[str, Any]:
        context = self.context
        out = {}
        for name in _CONTEXT_DTYPES:
            out[name] = _dtype(getattr(context, name, None), ("graph", None, name, None))
        if not vars(context).keys() <= _CONTEXT_KNOWN:
            out.update(self.extras(context, _CONTEXT_KNOWN, "graph", None, "context field"))
        return out

    def describe(self) -> dict[str, Any]:
        nodes = self.walk()
        tensors = {self.ids[id(t)]: self.tensor(t) for t in self.order}
        description = {"context": self.context_description(), "flags": self.flags(), "nodes": nodes, "tensors": tensors}
        if self.tag is not None:
            description["tag"] = self.tag
        return description


_CALLER = ("", Lowering(Mode.CALLER))
_CONTEXT_KNOWN = frozenset(_CONTEXT_DTYPES)
_FIELD_COUNT: dict[type, int] = {}


def _field_count(cls: type) -> int:
    """How many attributes an instance of a tensor class may carry, or -1 when its class
    has a field plancache does not know (then every instance is checked attribute by
    attribute, and the unknown field keyed exactly)."""
    if not dataclasses.is_dataclass(cls):
        return -1
    names = {f.name for f in dataclasses.fields(cls)}
    return len(names) if names <= _TENSOR_FIELDS_KNOWN else -1


_PUBLIC_ATTRIBUTES: dict[tuple[str, ...], list[str]] = {}


def _public_attributes(graph: Any) -> list[str]:
    """A graph's public attributes beyond the known ones (keyed exactly if any appear);
    memoized by attribute layout, since describe runs on every lookup."""
    names = tuple(vars(graph))
    found = _PUBLIC_ATTRIBUTES.get(names)
    if found is None:
        found = sorted(k for k in names if not k.startswith("_") and k not in _GRAPH_PUBLIC_KNOWN)
        if len(_PUBLIC_ATTRIBUTES) < 64:
            _PUBLIC_ATTRIBUTES[names] = found
    return found


_NO_CONTEXT = types.SimpleNamespace(io_data_type=None, intermediate_data_type=None, compute_data_type=None)


def _device_property(device_property: Any) -> str:
    data = device_property.serialize()
    if isinstance(data, str):
        return data
    if isinstance(data, (bytes, bytearray)) or (isinstance(data, list) and all(type(b) is int and 0 <= b < 256 for b in data)):
        return bytes(data).hex()
    raise _refuse(f"graph device_property serializes to a {type(data).__name__}; plancache cannot key it")


def describe(graph: Any, tag: str | None = None, *, auto_uids: bool = False) -> dict[str, Any]:
    """The canonical description of a ``cudnn.pygraph``: needs no GPU.

    Every node's type, compute type, ports, parameters (exactly: floats to the bit,
    tensors by dtype, shape and bytes) and any other attribute; every tensor's fields as
    cuDNN receives them; the graph's data types, keyword arguments and planning flags.
    Tensors and nodes are named by uid (virtual tensors and graph-held scalars by order of
    appearance), so renaming or creating tensors in another order changes nothing, while
    any change that can alter the plan changes the result. The description of a graph is
    the same before and after ``validate()`` (inferred dims are computed, not read).

    ``tag``: a graph holding a callable (an attention ``score_mod``, say) is refused,
    since nothing about a function's behaviour can be keyed; pass a tag naming what the
    callable does (``"softcap=30/v2"``) and it enters the description in the callable's
    stead. The tag must change whenever the callable's behaviour does, or a stored plan
    of the old behaviour is served; the values of graph-held scalars it captured
    (``graph.tensor_scalar``) are keyed with the tag, so a softcap of 30 and of 50 need not
    be told apart by it.

    ``auto_uids``: name a caller tensor left without ``set_uid`` by the uid the frontend
    numbered it with (what ``t.get_uid()`` returns, and what the graph executes with), as
    if it had been set, instead of refusing it. The description is the one the same graph
    with those uids set would have, and the graph is not changed. For callers that run the
    graph through the frontend itself (``integrations.frontend``): a plan stored under
    numbered uids binds them only in a graph built in the same order.

    Raises ``InvalidGraphError`` for a caller tensor without a uid (unless ``auto_uids``),
    two tensors sharing a uid, an empty graph, a callable without a tag, or a value
    plancache cannot key exactly.
    """
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"tag must be a string, not {type(tag).__name__}")
    return _Describer(graph, tag, auto_uids=auto_uids).describe()


def tensor_table(graph: Any) -> list[TensorSpec]:
    """The non-virtual tensors of a graph, by uid: what a plan's variant pack holds.

    Graph-held scalars (``graph.tensor_scalar``) are not listed: the graph embeds their
    value and fills their slot itself, so the caller passes nothing for them.
    """
    describer = _Describer(graph, None, keying=False)
    describer.walk()  # names (and checks) every tensor, records which are outputs
    table = []
    for t in describer.order:
        tid = describer.ids[id(t)]
        if tid[0] != "u":
            continue
        # an unset data type takes the graph's io data type
        data_type = t.data_type if t.data_type is not None else describer.context.io_data_type
        table.append(
            TensorSpec(
                uid=int(t.uid),
                name=str(t.name),
                dims=tuple(int(d) for d in (t.dim or ())),
                strides=tuple(int(s) for s in (t.stride or ())),
                dtype=_dtype(data_type, ("tensor", t.name, "", None)),
                is_output=id(t) in describer.produced,
                is_pass_by_value=bool(t.is_pass_by_value),
            )
        )
    return sorted(table, key=lambda spec: spec.uid)


def used_tensors(description: Mapping[str, Any]) -> frozenset[str]:
    """The ids of the tensors ``description``'s nodes read or write: at their ports, in
    their parameters (as ``{"tensor": id}``), and the ragged offsets of those. A graph may
    hold a tensor no node uses (cuDNN Frontend's instance-norm test makes an epsilon its
    backward pass never takes): cuDNN's plan of that graph has no such tensor, so nothing
    asks a plan for one. A description is JSON's dicts and lists (``describe``'s, or a
    stored one decoded): anything else in it names no tensor."""
    used: set[str] = set()
    params: list[Any] = []
    for node in description.get("nodes") or []:
        for ports in (node.get("inputs"), node.get("outputs")):
            for ref in ports.values() if type(ports) is dict else ():
                if type(ref) is str:
                    used.add(ref)
                elif type(ref) is list:
                    used.update(r for r in ref if type(r) is str)
        params.append(node.get("params"))
    while params:  # a walk without recursion: stored descriptions are read by it too
        value = params.pop()
        if type(value) is dict:
            if type(value.get("tensor")) is str:
                used.add(value["tensor"])
            else:
                params.extend(v for v in value.values() if type(v) is dict or type(v) is list)
        elif type(value) is list:
            params.extend(v for v in value if type(v) is dict or type(v) is list)
    tensors = description.get("tensors") or {}
    for tid in list(used):
        tensor = tensors.get(tid)
        if type(tensor) is dict and type(tensor.get("ragged_offset")) is str:
            used.add(tensor["ragged_offset"])
    return frozenset(used)
