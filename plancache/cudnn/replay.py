"""Rebuild a ``cudnn.pygraph`` from its canonical description (``key.describe``).

A recorded manifest stores descriptions, not the model code that built them, so replay
must recreate a graph whose description, and hence whose key, is identical (filters and
kernel cache included: they decide which candidates a graph has). Nodes are
rebuilt with the public pygraph builders: ``matmul``, the pointwise builders (named by the
node's ``mode``), and the builder named after the node type for the rest (``conv_fprop``,
``sdpa``, ``layernorm``...). After rebuilding, ``describe(rebuilt)`` must equal the
description, else ``InvalidGraphError`` (reason ``"inexact replay"``): an inexact replay would prewarm a key nobody asks for.

Needs cuDNN Frontend's Python package (no GPU).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidGraphError
from ..key import canonical_json, describe

__all__ = ["rebuild_graph"]

# Outputs of the attention builders that the caller passes in as keyword arguments
# (the builder only creates these); any other output port of an SDPA node is a kwarg.
# cuDNN Frontend's own table is used when it has one.
_BUILDER_OUTPUTS = {"SDPA": {"O", "Stats"}, "SDPA_FP8": {"O", "Stats", "Amax_S", "Amax_O"}}


def _cudnn() -> Any:
    from .backend import cudnn_module  # only when replaying: building pygraphs needs no GPU

    return cudnn_module()


def _op_table(cudnn: Any, kind: str) -> tuple[str, Mapping[str, Any]] | None:
    """cuDNN Frontend's (builder name, spec) of a node type, when it has a table entry."""
    fe = getattr(cudnn, "_pygraph", None)
    node_type = getattr(getattr(cudnn, "graph_types", None), "NodeType", None)
    member = getattr(node_type, kind, None) if node_type is not None else None
    if member is None:
        return None
    entry = getattr(fe, "_CAPTURED_BY_TYPE", {}).get(member) or getattr(fe, "_STRUCTURED_BY_TYPE", {}).get(member)
    return entry if isinstance(entry, tuple) else None


def _builder_name(cudnn: Any, kind: str) -> str:
    """The pygraph builder of a node type: ``LAYERNORM_BWD`` is built by ``layernorm_backward``."""
    entry = _op_table(cudnn, kind)
    return str(entry[0]) if entry is not None else kind.lower()


def _builder_outputs(cudnn: Any, kind: str) -> set[str] | None:
    """The output ports a builder creates itself (None: all of them)."""
    entry = _op_table(cudnn, kind)
    if entry is not None and "out_kwargs" in entry[1]:
        return set(entry[1].get("outputs", ()))
    return _BUILDER_OUTPUTS.get(kind)


def _array(data: Mapping[str, Any]) -> Any:
    """The torch tensor or numpy value ``describe`` keyed by its bytes."""
    raw = bytes.fromhex(data["hex"])
    if data["lib"] == "torch":
        import torch

        dtype = getattr(torch, str(data["dtype"]).removeprefix("torch."))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(data["shape"]).clone()
    import numpy

    values = numpy.frombuffer(raw, dtype=numpy.dtype(data["dtype"])).reshape(data["shape"])
    return values[()] if not data["shape"] else values.copy()


class Form(enum.Enum):
    """The tag of a value ``describe`` wrote as a one-key object."""

    TENSOR = "tensor"
    STR = "str"
    FLOAT = "float"
    SLICE = "slice"
    ARRAY = "array"
    DICT = "dict"
    CALLABLE = "callable"


def _form(tag: str) -> Form | None:
    try:
        return Form(tag)
    except ValueError:
        return None


def _decode(value: Any, cudnn: Any, tensors: Mapping[str, Any]) -> Any:
    """Undo ``describe``'s encoding of a value: tensor references, enum names, and the
    tagged forms of strings, non-finite floats, slices, arrays and mappings."""
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, inner),) = value.items()
            form = _form(tag)
            if form is Form.TENSOR:
                return tensors[inner]
            if form is Form.STR:
                return inner
            if form is Form.FLOAT:
                return float(inner)
            if form is Form.SLICE:
                return slice(*(_decode(v, cudnn, tensors) for v in inner))
            if form is Form.ARRAY:
                return _array(inner)
            if form is Form.DICT:
                return {k: _decode(v, cudnn, tensors) for k, v in inner.items()}
            if form is Form.CALLABLE:
                raise InvalidGraphError(
                    "the recorded graph holds a callable, which cannot be replayed", node=None, reason="callable"
                )
        raise InvalidGraphError(f"the recorded description holds an unknown value {value!r}", node=None, reason="malformed")
    if isinstance(value, list):
        return [_decode(v, cudnn, tensors) for v in value]
    if isinstance(value, str) and value.count(".") == 1:
        # describe writes enums as "TypeName.MEMBER"; only names cuDNN defines decode.
        type_name, member = value.split(".")
        # some enums (convolution_mode) live only in the compiled module
        enum_type = getattr(cudnn, type_name, None) or getattr(getattr(cudnn, "_compiled_module", None), type_name, None)
        if isinstance(enum_type, type) and hasattr(enum_type, member):
            return getattr(enum_type, member)
    return value


#: The pygraph methods that set each recorded note filter: (kind, keep) -> method.
_NOTE_FILTERS = {
    ("behavior", False): "deselect_behavior_notes", ("behavior", True): "select_behavior_notes",
    ("numerical", False): "deselect_numeric_notes", ("numerical", True): "select_numeric_notes",
}  # fmt: skip


def _new_kernel_cache(cudnn: Any) -> Any:
    try:
        return cudnn.create_kernel_cache()
    except Exception as exc:  # no cuDNN library to make one with
        raise InvalidGraphError(
            f"the recorded graph builds against a kernel cache, and none can be made here ({type(exc).__name__}: {exc})",
            node=None,
            reason="kernel cache",
        ) from exc


class _Replayer:
    def __init__(self, description: Mapping[str, Any], kernel_cache: Any = None) -> None:
        self.description = description
        self.cudnn = _cudnn()
        self.specs: Mapping[str, Any] = description["tensors"]
        self.tensors: dict[str, Any] = {}
        context = {k: _decode(v, self.cudnn, {}) for k, v in description.get("context", {}).items()}
        flags = description.get("flags", {})
        optional = {k: self.dec(flags.get(k)) for k in ("sm_count", "sm_version", "cuda_graph_retention")}
        if flags.get("kernel_cache"):  # the caller's graph brought a kernel cache of its own
            optional["kernel_cache"] = kernel_cache if kernel_cache is not None else _new_kernel_cache(self.cudnn)
        self.graph = self.cudnn.pygraph(
            io_data_type=context.get("io_data_type"),
            intermediate_data_type=context.get("intermediate_data_type"),
            compute_data_type=context.get("compute_data_type"),
            is_dynamic_shape_enabled=bool(flags.get("dynamic_shape")),
            is_override_shape_enabled=bool(flags.get("override_shape")),
            is_cuda_graph_replay_expected=bool(flags.get("cuda_graph_replay")),
            **{k: v for k, v in optional.items() if v is not None},
        )
        self.filters(flags)
        self.produced = {tid for node in description["nodes"] for tid in node["outputs"].values() if tid is not None}

    def filters(self, flags: Mapping[str, Any]) -> None:
        """The caller's engine and note filters, set as the caller set them (in order, one
        note at a time, as the graph records them): they decide which candidates the
        frontend offers, so the rebuilt graph's candidates are the caller's."""
        if flags.get("deselected_engines"):
            self.graph.deselect_engines(list(flags["deselected_engines"]))
        for recorded in flags.get("note_filters") or ():
            kind, note, keep = self.dec(recorded)
            method = _NOTE_FILTERS.get((kind, bool(keep)))
            if method is None:
                raise InvalidGraphError(f"the recorded graph has a note filter of unknown kind {kind!r}", node=None,
                                        reason="malformed")  # fmt: skip
            getattr(self.graph, method)([note])

    def dec(self, value: Any) -> Any:
        return _decode(value, self.cudnn, self.tensors)

    def tensor(self, tid: str) -> Any:
        """A graph input (or pre-made output argument) created from its recorded spec."""
        if tid in self.tensors:
            return self.tensors[tid]
        spec = self.specs[tid]
        if tid.startswith("c"):  # a graph-held scalar
            t = self.graph.tensor_scalar(self.dec(spec["scalar"]), self.dec(spec["scalar_type"]), name=tid)
            self.tensors[tid] = t
            return t
        kwargs: dict[str, Any] = {}
        if spec.get("ragged_offset") is not None:
            kwargs["ragged_offset"] = self.tensor(spec["ragged_offset"])
        for name in ("pass_by_value", "scalar_type", "reordering_type"):
            if spec.get(name) is not None:
                kwargs[name] = self.dec(spec[name])
        t = self.graph.tensor(
            dim=list(spec["dim"] or []),
            stride=list(spec["stride"] or []) or None,
            data_type=self.dec(spec.get("dtype")),
            is_virtual=bool(spec["is_virtual"]),
            is_pass_by_value=bool(spec.get("is_pass_by_value")),
            name=tid,
            uid=int(tid[1:]) if tid.startswith("u") else None,
            alignment_value=int(spec.get("alignment_value", 1)),
            ragged_offset_multiplier=int(spec.get("ragged_offset_multiplier", 1)),
            **kwargs,
        )
        self.tensors[tid] = t
        return t

    def finish_output(self, tid: str, port: str, t: Any) -> None:
        """Give a builder-made output the recorded uid, output flag, dims and type.

        ``describe`` reports an output's dims and strides when cuDNN receives them (set by
        the caller, or pushed by the op), so recorded ones are set, even if inferred alike,
        and absent ones are left to inference.
        """
        spec = self.specs[tid]
        if not spec["is_virtual"]:
            t.set_output(True).set_uid(int(tid[1:])).set_name(tid)
        if spec.get("dim"):
            t.set_dim(list(spec["dim"]))
        if spec.get("stride"):
            t.set_stride(list(spec["stride"]))
        dtype = self.dec(spec.get("dtype"))
        current = t.get_data_type()
        if current is None:  # describe reports the type validate() will fill in
            context = self.graph.context
            current = context.intermediate_data_type if t.is_virtual else context.io_data_type
            if port == "Stats":
                current = self.cudnn.data_type.FLOAT
        if dtype is not None and dtype != current:
            t.set_data_type(dtype)
        if spec.get("alignment_value", 1) != t.alignment_value:
            t.set_alignment_value(int(spec["alignment_value"]))
        if spec.get("reordering_type") is not None:
            t.set_reordering_type(self.dec(spec["reordering_type"]))
        if spec.get("ragged_offset") is not None:
            t.set_ragged_offset(self.tensor(spec["ragged_offset"]))
        if spec.get("ragged_offset_multiplier", 1) != 1:
            t.set_ragged_offset_multiplier(int(spec["ragged_offset_multiplier"]))
        self.tensors[tid] = t

    def node(self, index: int, node: Mapping[str, Any]) -> None:
        kind = str(node["type"])
        params = dict(node.get("params") or {})
        inputs = {port: self.tensor(tid) for port, tid in node["inputs"].items() if tid is not None}
        cdt = self.dec(node.get("compute_data_type"))
        kwargs: dict[str, Any] = {"compute_data_type": cdt}
        if kind == "POINTWISE":
            mode = params.pop("mode", None)
            method = getattr(self.graph, str(mode), None)
            args: list[Any] = [inputs[f"IN_{i}"] for i in range(len(inputs))]
        elif kind == "MATMUL":
            method, args = self.graph.matmul, [inputs["A"], inputs["B"]]
        else:
            method, args = getattr(self.graph, _builder_name(self.cudnn, kind), None), []
            kwargs.update(self._gather_lists(inputs, params))
            kwargs.update(inputs)
            made = _builder_outputs(self.cudnn, kind)
            for port, tid in node["outputs"].items():
                if made is not None and port not in made and tid is not None:
                    kwargs[port] = self.tensor(tid)  # an output the caller passes in
        if not callable(method):
            message = f"node {index}: cannot replay a {kind} node (mode {params.get('mode')!r}): no pygraph builder for it"
            raise InvalidGraphError(message, node=index, reason="unknown op")
        kwargs.update({k: self.dec(v) for k, v in params.items()})
        try:
            method(*args, **kwargs)
        except (TypeError, ValueError, KeyError, RuntimeError) as exc:
            message = f"node {index} ({kind}): the pygraph builder refused the recorded parameters: {exc}"
            raise InvalidGraphError(message, node=index, reason="builder refused") from exc
        built = self.graph.nodes[-1]
        for port, tid in node["outputs"].items():
            t = built.outputs.get(port)
            if tid is None or t is None:
                continue
            if tid in self.tensors and self.tensors[tid] is not t:
                raise InvalidGraphError(f"node {index} ({kind}): output {port} could not be bound", node=index, reason="output")
            self.finish_output(tid, port, t)

    def _gather_lists(self, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """Builders take list ports (``_n_<port>``) and dropout tuples as one argument."""
        out: dict[str, Any] = {}
        for name in [p for p in params if p.startswith("_n_")]:
            port, count = name[3:], int(params.pop(name))
            out[port] = [inputs.pop(f"{port}_{i}") for i in range(count)]
        if "_dropout_n" in params:
            count = int(params.pop("_dropout_n"))
            out["dropout"] = tuple(
                inputs.pop(f"dropout_{i}") if f"dropout_{i}" in inputs else self.dec(params.pop(f"dropout_{i}"))
                for i in range(count)
            )
        return out

    def run(self) -> Any:
        for index, node in enumerate(self.description["nodes"]):
            self.node(index, node)
        for tid in self.specs:  # tensors no node touches still belong to the graph
            if tid not in self.tensors and tid not in self.produced:
                self.tensor(tid)
        return self.graph


def rebuild_graph(description: Mapping[str, Any], *, kernel_cache: Any = None) -> Any:
    """A new ``cudnn.pygraph`` whose ``describe()`` equals ``description``, with the
    caller's engine and note filters set as the caller set them.

    ``kernel_cache``: for a graph that brought a kernel cache of its own (dynamic shapes with
    ``kernel_cache=``), the one the rebuilt graph builds against, so that the kernels its
    builds compile land where the caller's graph would put them (the frontend shares one
    kernel cache across a program's builds); None makes a new one.

    Raises ``InvalidGraphError`` for a node type or mode that has no pygraph builder, or when
    the rebuilt graph would describe (and so key) differently.
    """
    try:
        graph = _Replayer(description, kernel_cache).run()
    except InvalidGraphError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidGraphError(
            f"the recorded description is malformed: {type(exc).__name__}: {exc}", node=None, reason="malformed"
        ) from exc
    rebuilt = describe(graph, tag=description.get("tag"))
    if canonical_json(rebuilt) != canonical_json(dict(description)):
        where = _first_difference(rebuilt, dict(description))
        raise InvalidGraphError(f"the rebuilt graph differs from the recorded one at {where}", node=None, reason="inexact replay")
    return graph


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path or '<root>'} ({_short(a)} != {_short(b)})"


def _short(value: Any) -> str:
    text = canonical_json(value) if value is not None else "null"
    return text if len(text) <= 80 else text[:77] + "..."
