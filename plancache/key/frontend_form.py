"""What cuDNN Frontend serializes for a described graph: its normalized form.

A plan blob carries the graph the frontend built it from (``formats.plan_graph``), not as
the pygraph was declared but as the frontend normalized it while lowering and building:

* names: a pointwise node the pygraph calls ``relu`` is mode ``RELU_FWD``; ops have tags
  (``LAYERNORM`` is ``LAYER_NORM``); ports have the C++ attribute names (a convolution's
  ``image`` is ``X``); enums lose their Python class (``norm_forward_phase.TRAINING`` is
  ``TRAINING``); floats are written as the hex of their 32 bits;
* settings: the pygraph's keyword arguments become the C++ node's attributes
  (``padding`` sets ``pre_padding`` and ``post_padding``; attention's ``use_causal_mask``
  sets ``right_bound`` 0 with ``diagonal_alignment`` ``TOP_LEFT``; ``is_inference`` is
  ``generate_stats`` negated), and an attribute the caller left alone has its default;
* layouts: attention promotes a 1-D sequence length or ragged offset ``[n]`` to
  ``[n, 1, 1, 1]``, and hands cuDNN K (and V in the backward pass) transposed; a float
  attention scale becomes a by-value tensor of the frontend's own.

``frontend_form(description)`` derives all of that from the description the key is
hashed from, so the store's judge (``store.judge``) compares a blob with its key field by
field, and ``frontend_graph`` writes the same form as a blob's graph (the CPU test
backend's blobs). Every rule here is read from cuDNN Frontend 1.32's own sources (the
pygraph's ``_lower_to_cpp``, the pybind signatures, ``graph_properties.h``'s attribute
JSON and the nodes' ``promote_index_tensors_to_4d`` and K transposition) and held against
blobs recorded on a GPU (``tests/data/plans``). What a rule does not cover is not guessed:
a parameter no rule expresses is listed in ``FormNode.unproven``, and the judge says so.

Pure: no cuDNN, no torch; a description is JSON (``describe``'s, or a stored one decoded).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .description import used_tensors
from .lowering import row_major

__all__ = ["DATA_TYPES", "F32", "NODE_TAGS", "FormNode", "FormTensor", "FrontendForm", "TensorKind", "frontend_form",
           "frontend_graph"]  # fmt: skip

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


class F32(int):
    """An attribute the frontend writes as a 32-bit float (the hex of its bits): compared
    bit for bit, whatever case the hex is in."""

    @classmethod
    def of(cls, value: Any) -> F32:
        return cls(struct.unpack("<I", struct.pack("<f", float(value)))[0])

    def hex(self) -> str:  # the frontend's spelling of the bits
        return f"{int(self):08X}"


#: A tensor's possible layouts by description id: ``[(dims, strides), ...]``.
#: Strides None: the description leaves them to the build (an op's output whose dims alone
#: the caller set), so only the dims are known.
Layouts = dict[str, list[tuple[tuple[int, ...], tuple[int, ...] | None]]]


class TensorKind(enum.Enum):
    """What a tensor of a frontend form is."""

    CALLER = "caller"  # a uid the caller binds
    VIRTUAL = "virtual"
    SCALAR = "scalar"  # a value the graph holds


class FormTensor(NamedTuple):
    """A tensor as the frontend writes it, of its ``kind``. ``dims``/``strides``: None where
    the description leaves them to the build (an op output's inferred shape)."""

    tid: str
    kind: TensorKind
    uid: int | None
    dims: tuple[int, ...] | None
    strides: tuple[int, ...] | None
    data_type: str | None
    by_value: bool
    ragged_offset: str | None = None
    reordering: str = "NONE"  # reordering_type as the frontend writes it
    multiplier: Any = 1  # ragged_offset_multiplier
    value: F32 | None = None  # a held float scalar's value
    #: The tensor as the blob must write it (``formats.plan_graph.written``: dims and
    #: strides as lists, or both None where the description leaves the shape to the
    #: build), where the description alone says all of that: its data type set, a layout
    #: no implementation changes, and no ragged offset but a caller's. None otherwise.
    written: tuple[Any, ...] | None = None


class Port(NamedTuple):
    """A port of a node: the tensor (description id) there, and the port's name in the
    blob, when plancache knows it (``exact``); otherwise the judge looks for a port of the
    same spelling, then for the tensor anywhere among the node's ports of that side."""

    name: str
    tid: str
    exact: bool


class FormNode(NamedTuple):
    """An op as the frontend writes it."""

    position: int  # its place among the graph's ops
    tag: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    #: Attribute -> the value the frontend writes (``F32`` for floats, enum member names).
    attributes: Mapping[str, Any]
    #: Ports of the frontend's own that may appear beside the described ones (a float
    #: attention scale becomes a by-value tensor at ``Attn_scale``).
    extras: frozenset[str] = frozenset()
    #: Input ports whose tensor the frontend transposes (last two dims swapped), with the
    #: ``implementation`` attribute under which it does (None: always; "*": under some
    #: implementation plancache cannot tell from the blob).
    transposed: tuple[tuple[str, str | None], ...] = ()
    #: What the description says of this node that no rule expresses: the judge cannot
    #: hold the blob to it.
    unproven: tuple[str, ...] = ()
    #: The names of ``inputs`` and of ``outputs``: a blob's node with exactly these ports
    #: holds each where it is named, and nothing else.
    names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())

    def turned(self) -> Iterator[tuple[Port, str | None]]:
        """The input ports ``transposed`` names, each with the implementation it is under."""
        for name, under in self.transposed:
            for port in self.inputs:
                if port.name == name:
                    yield port, under


@dataclass(frozen=True)
class FrontendForm:
    """A described graph as the frontend writes it into a plan blob."""

    context: Mapping[str, Any]
    nodes: tuple[FormNode, ...]
    tensors: Mapping[str, FormTensor]
    #: The tensors some node reads or writes (``description.used_tensors``): a tensor no
    #: node uses is in no plan.
    used: frozenset[str] = frozenset()
    #: What no rule expresses, node by node (``FormNode.unproven``, each named with its node).
    unproven: tuple[str, ...] = ()
    #: The uid of every caller's tensor, by description id.
    uids: Mapping[str, int] = field(default_factory=dict)
    #: ``layouts`` by the implementations they were worked out for (a hit of a key lays out
    #: the same tensors every time).
    _laid_out: dict[tuple[Any, ...], Layouts] = field(default_factory=dict, compare=False, repr=False)

    def layouts(self, implementations: tuple[Any, ...]) -> Layouts:
        """Each tensor's layouts the frontend may write, given each node's ``implementation``
        attribute (None where it has none): one layout, or two where plancache cannot tell
        whether a node transposed it. The frontend transposes in place: a tensor that two
        attention nodes read as K is swapped twice."""
        kept = self._laid_out.get(implementations)
        if kept is not None:
            return kept
        found: Layouts = {tid: [(t.dims, t.strides)] for tid, t in self.tensors.items() if t.dims is not None}
        for node in self.nodes:
            for port, under in node.turned():
                if port.tid not in found:
                    continue
                current = found[port.tid]
                turned = [(swapped(d), None if s is None else swapped(s)) for d, s in current]
                if under == "*":
                    found[port.tid] = current + [t for t in turned if t not in current]
                elif under is None or implementations[node.position] == under:
                    found[port.tid] = turned
        self._laid_out[implementations] = found
        return found


# ---------------------------------------------------------------------------- values


def _member(value: Any) -> Any:
    """An enum as the frontend writes it: the member's name (``TRAINING`` for the
    description's ``norm_forward_phase.TRAINING``)."""
    return value.rsplit(".", 1)[-1] if isinstance(value, str) else value


def _float(value: Any) -> F32 | None:
    return F32.of(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _number(value: Any) -> Any:
    """A double attribute (matmul's padding value): written as a JSON number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


# ---------------------------------------------------------------------------- node rules

#: A parameter's rule: its value (and the node's other parameters) -> the attributes it
#: sets, or None when this value is one the rule cannot express.
ParamRule = Callable[[Any, Mapping[str, Any]], "Mapping[str, Any] | None"]


def _sets(attribute: str, convert: Callable[[Any], Any] = lambda v: v) -> ParamRule:
    return lambda value, _params: {attribute: convert(value)}


def _sets_float(attribute: str) -> ParamRule:
    return lambda value, _params: None if _float(value) is None else {attribute: _float(value)}


def _flag(attributes: Mapping[str, Any]) -> ParamRule:
    """A boolean parameter that, when true, sets ``attributes`` (the pybind's mask flags)."""
    return lambda value, _params: dict(attributes) if value is True else {} if value is False else None


def _by_ports(_value: Any, _params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A parameter that only says which ports exist (a list port's length, whether a
    gradient is made): the ports are compared, and that proves it, once ``_ports_say``
    has held the parameter to the described ports."""
    return {}


def _ports_say(name: str, node: Mapping[str, Any]) -> Any:
    """What a ``_by_ports`` parameter must be, given the node's described ports: whether
    RMSNorm's backward makes ``DBias``, how many tensors a list port ``_n_<port>`` holds
    (``<port>_0``...), how many elements attention's dropout tuple has (``dropout_0``...,
    tensors or values). A description whose parameter says otherwise is one no pygraph
    makes, and a blob's ports cannot prove it."""
    inputs, params = node.get("inputs") or {}, node.get("params") or {}
    if name == "has_dbias":
        return "DBias" in (node.get("outputs") or {})
    prefix = "dropout" if name == "_dropout_n" else name[3:]
    return sum(1 for i in range(len(inputs) + len(params)) if f"{prefix}_{i}" in inputs or f"{prefix}_{i}" in params)


def _implementation(value: Any, _params: Mapping[str, Any]) -> Mapping[str, Any]:
    member = _member(value)
    return {} if member == "AUTO" else {"implementation": member}  # AUTO is resolved while building


@dataclass(frozen=True)
class _Rule:
    """How the frontend writes one op: its ports' C++ names, its parameters' attributes
    (applied in this order, later ones winning, as the pybind applies them), its
    attributes' defaults, whether it carries a compute data type, and its layouts."""

    ports: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, ParamRule] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    compute: bool = True
    extras: frozenset[str] = frozenset()
    transposed: tuple[tuple[str, str | None], ...] = ()
    attention: bool = False  # promotes 1-D sequence lengths and ragged offsets to 4-D


_ACTIVATIONS = ("relu", "tanh", "sigmoid", "elu", "gelu", "softplus", "swish", "gelu_approx_tanh")
#: The pygraph's pointwise ``mode`` (the pybind method it calls) -> the mode it writes.
POINTWISE_MODES: dict[str, str] = {
    **{m: m.upper() for m in ("add", "mul", "sqrt", "max", "min", "erf", "identity", "exp", "log", "neg", "mod", "pow",
                              "abs", "ceil", "cos", "floor", "rsqrt", "sin", "logical_not", "tan", "sub", "add_square",
                              "div", "cmp_eq", "cmp_neq", "cmp_gt", "cmp_ge", "cmp_lt", "cmp_le", "logical_and",
                              "logical_or", "reciprocal", "gen_index", "binary_select")},
    "bias": "ADD", "scale": "MUL",
    **{m: f"{m.upper()}_FWD" for m in _ACTIVATIONS},
    **{f"{m}_backward": f"{m.upper()}_BWD" for m in _ACTIVATIONS},
    "leaky_relu": "RELU_FWD", "leaky_relu_backward": "RELU_BWD",
}  # fmt: skip


def _pointwise_mode(value: Any, _params: Mapping[str, Any]) -> Mapping[str, Any] | None:
    mode = POINTWISE_MODES.get(value) if isinstance(value, str) else None
    return None if mode is None else {"mode": mode}


_POINTWISE = _Rule(
    params={
        "mode": _pointwise_mode,
        "negative_slope": _sets_float("relu_lower_clip_slope"),
        "lower_clip": _sets_float("relu_lower_clip"),
        "upper_clip": _sets_float("relu_upper_clip"),
        "swish_beta": _sets_float("swish_beta"),
        "axis": _sets("axis"),
    },
    defaults=dict.fromkeys(
        ("axis", "relu_lower_clip", "relu_upper_clip", "relu_lower_clip_slope", "swish_beta", "elu_alpha", "softplus_beta")
    ),
)

_CONV_PARAMS: dict[str, ParamRule] = {
    "padding": lambda value, _params: {"pre_padding": list(value), "post_padding": list(value)},
    "pre_padding": _sets("pre_padding", list),
    "post_padding": _sets("post_padding", list),
    "stride": _sets("stride", list),
    "dilation": _sets("dilation", list),
    "convolution_mode": _sets("math_mode", _member),
}
_CONV_DEFAULTS = {"math_mode": "CROSS_CORRELATION"}

_MASKS: dict[str, ParamRule] = {
    # the pybind's order: an explicit alignment and bounds first, the causal flags over them
    "diagonal_alignment": _sets("diagonal_alignment", _member),
    "diagonal_band_left_bound": _sets("left_bound"),
    "sliding_window_length": _sets("left_bound"),
    "sliding_window": _sets("left_bound"),
    "diagonal_band_right_bound": _sets("right_bound"),
    "use_causal_mask": _flag({"diagonal_alignment": "TOP_LEFT", "right_bound": 0}),
    "use_causal_mask_bottom_right": _flag({"diagonal_alignment": "BOTTOM_RIGHT", "right_bound": 0}),
    "use_alibi_mask": _sets("alibi_mask", bool),
    "use_padding_mask": _sets("padding_mask", bool),
    "attn_scale": _sets_float("attn_scale_value"),
    # dropout=(probability, seed, offset) keeps a float first; dropout=(mask, scale) a tensor
    "dropout_0": _sets_float("dropout_probability"),
    "_dropout_n": _by_ports,
}
_MASK_DEFAULTS = {"alibi_mask": False, "padding_mask": False, "left_bound": None, "right_bound": None,
                  "diagonal_alignment": "TOP_LEFT", "attn_scale_value": None, "dropout_probability": None}  # fmt: skip

_ATTENTION_PORTS = {
    "q": "Q", "k": "K", "v": "V", "o": "O", "attn_scale": "Attn_scale", "bias": "Bias", "block_mask": "Block_mask",
    "seq_len_q": "SEQ_LEN_Q", "seq_len_kv": "SEQ_LEN_KV", "cu_seq_len_q": "CU_SEQ_LEN_Q", "cu_seq_len_kv": "CU_SEQ_LEN_KV",
    "paged_attention_k_table": "Page_table_K", "paged_attention_v_table": "Page_table_V", "sink_token": "SINK_TOKEN",
    "dSink_token": "DSINK_TOKEN", "stats": "Stats", "score_max": "Max", "score_sum_exp": "Sum_exp", "rng_dump": "RNG_DUMP",
    "descale_q": "Descale_Q", "descale_k": "Descale_K", "descale_v": "Descale_V", "descale_s": "Descale_S",
    "scale_s": "Scale_S", "scale_o": "Scale_O",
}  # fmt: skip

_SDPA = _Rule(
    ports=_ATTENTION_PORTS,
    params={
        **_MASKS,
        "is_inference": lambda value, _p: {"generate_stats": not value} if isinstance(value, bool) else None,
        "generate_stats": lambda value, _p: {"generate_stats": value} if isinstance(value, bool) else None,
        "paged_attention_max_seq_len_kv": _sets("max_seq_len_kv"),
        "max_total_seq_len_q": _sets("max_total_seq_len_q"),
        "max_total_seq_len_kv": _sets("max_total_seq_len_kv"),
        "implementation": _implementation,
        "unfuse_fma": _sets("unfuse_fma", bool),
        "stats_use_log2": _sets("stats_use_log2", bool),
    },
    defaults={
        **_MASK_DEFAULTS,
        **dict.fromkeys(("max_seq_len_kv", "max_total_seq_len_q", "max_total_seq_len_kv")),
        "unfuse_fma": False,
        "stats_use_log2": False,
    },
    extras=frozenset({"Attn_scale"}),
    transposed=(("K", "COMPOSITE"),),  # the unified engine reads K as the caller laid it out
    attention=True,
)

_SDPA_BWD = _Rule(
    ports=_ATTENTION_PORTS,
    params={
        **_MASKS,
        "max_total_seq_len_q": _sets("max_total_seq_len_q"),
        "max_total_seq_len_kv": _sets("max_total_seq_len_kv"),
        "use_deterministic_algorithm": _sets("is_deterministic_algorithm", bool),
    },
    defaults={**_MASK_DEFAULTS, "max_total_seq_len_q": None, "max_total_seq_len_kv": None, "is_deterministic_algorithm": False},
    compute=False,
    extras=frozenset({"Attn_scale"}),
    transposed=(("K", None), ("V", None)),
    attention=True,
)

_NORM_PORTS = {
    "input": "X", "grad": "DY", "scale": "SCALE", "bias": "BIAS", "epsilon": "EPSILON", "mean": "MEAN",
    "inv_var": "INV_VARIANCE", "inv_variance": "INV_VARIANCE", "DScale": "DSCALE", "DBias": "DBIAS",
    "in_running_mean": "PREV_RUNNING_MEAN", "in_running_var": "PREV_RUNNING_VAR", "momentum": "MOMENTUM",
    "next_running_mean": "NEXT_RUNNING_MEAN", "next_running_var": "NEXT_RUNNING_VAR",
}  # fmt: skip
_NORMS = ("LAYERNORM", "RMSNORM", "INSTANCENORM", "ADALAYERNORM")
_NORM = _Rule(ports=_NORM_PORTS, params={"norm_forward_phase": _sets("forward_phase", _member)})
_NORM_BWD = _Rule(ports=_NORM_PORTS, params={"has_dbias": _by_ports, "_n_peer_stats": _by_ports})

_RULES: dict[str, _Rule] = {
    "POINTWISE": _POINTWISE,
    "CONV_FPROP": _Rule(ports={"image": "X", "weight": "W"}, params=_CONV_PARAMS, defaults=_CONV_DEFAULTS),
    "CONV_DGRAD": _Rule(ports={"loss": "DY", "filter": "W"}, params=_CONV_PARAMS, defaults=_CONV_DEFAULTS),
    "CONV_WGRAD": _Rule(ports={"image": "X", "loss": "DY"}, params=_CONV_PARAMS, defaults=_CONV_DEFAULTS),
    "MATMUL": _Rule(params={"padding": _sets("padding_value", _number)}, defaults={"padding_value": 0.0}),
    "SDPA": _SDPA,
    "SDPA_BWD": _SDPA_BWD,
    **dict.fromkeys(_NORMS, _NORM),
    **dict.fromkeys((*(f"{n}_BWD" for n in _NORMS), "BATCHNORM_BWD", "BATCHNORM", "BATCHNORM_INFERENCE"), _NORM_BWD),
    "GENSTATS": _Rule(ports={"input": "X"}),
    "REDUCTION": _Rule(
        ports={"input": "X", "group_offset": "Group_offset", "OUT_0": "Y"}, params={"mode": _sets("mode", _member)}
    ),
    "MOE_GROUPED_MATMUL": _Rule(
        ports={
            "token": "Token",
            "weight": "Weight",
            "first_token_offset": "FirstTokenOffset",
            "token_index": "TokenIndex",
            "token_ks": "TokenKs",
            "top_k_scores": "TopKScores",
            "OUT_0": "Output",
        },
        params={"mode": _sets("mode", _member), "top_k": _sets("top_k")},
        compute=False,
    ),
    "BLOCK_SCALE_DEQUANTIZE": _Rule(
        ports={"input": "X", "descale": "scale", "OUT_0": "Y"},
        params={"block_size": _sets("block_size"), "is_negative_scale": _sets("is_negative_scale")},
    ),
    "BLOCK_SCALE_QUANTIZE": _Rule(ports={"input": "X"}, params={"block_size": _sets("block_size"), "axis": _sets("axis")}),
}

#: Node types whose rules are not written: their tag, ports and tensors are compared and
#: every parameter is reported unproven. Attention in FP8 transposes K as the BF16 path
#: does under one implementation and not under another, which the blob may not say.
_UNRULED = _Rule()
_LOOSE_ATTENTION = _Rule(ports=_ATTENTION_PORTS, compute=False, extras=frozenset({"Attn_scale"}),
                         transposed=(("K", "*"), ("V", "*")), attention=True)  # fmt: skip
_RULES.update(dict.fromkeys(("SDPA_FP8", "SDPA_MXFP8", "SDPA_FP8_BWD", "SDPA_MXFP8_BWD"), _LOOSE_ATTENTION))

#: Ports of an attention node whose 1-D tensor the frontend makes 4-D
#: (``SDPANodeBase::promote_index_tensors_to_4d``), as it does every ragged offset there.
_PROMOTED_PORTS = frozenset({"SEQ_LEN_Q", "SEQ_LEN_KV", "CU_SEQ_LEN_Q", "CU_SEQ_LEN_KV"})

#: Attention's page tables, and the port each makes a container of pages.
_PAGED = {"paged_attention_k_table": "K", "paged_attention_v_table": "V"}

#: Description ports of attention's dropout, by how many elements its tuple had.
_DROPOUT_PORTS = {3: {"dropout_1": "Seed", "dropout_2": "Offset"}, 2: {"dropout_0": "Dropout_mask", "dropout_1": "Dropout_scale"}}


# ---------------------------------------------------------------------------- the form


def frontend_form(description: Mapping[str, Any]) -> FrontendForm:
    """The graph the frontend writes into a plan of ``description``: its context, its ops
    (tags, ports, attributes) and its tensors (layouts as normalized). ``KeyError``,
    ``TypeError`` or ``ValueError`` for a description of the wrong shape."""
    context = description.get("context") or {}
    compute = context.get("compute_data_type") or "data_type.FLOAT"  # _lower_to_cpp's default
    nodes = tuple(_node(i, node, compute) for i, node in enumerate(description.get("nodes") or []))
    tensors = _tensors(description.get("tensors") or {}, nodes)
    unproven = tuple(f"node {n.position} ({n.tag}): {what}" for n in nodes for what in n.unproven)
    uids = {tid: t.uid for tid, t in tensors.items() if t.uid is not None}
    return FrontendForm(_context(description), nodes, tensors, used_tensors(description), unproven, uids)


def _context(description: Mapping[str, Any]) -> dict[str, Any]:
    context, flags = description.get("context") or {}, description.get("flags") or {}
    io = context.get("io_data_type")
    sm_count = flags.get("sm_count")
    return {
        "io_data_type": DATA_TYPES.get(io) if io is not None else None,
        "intermediate_data_type": DATA_TYPES.get(context.get("intermediate_data_type") or "data_type.FLOAT"),
        "compute_data_type": DATA_TYPES.get(context.get("compute_data_type") or "data_type.FLOAT"),
        "is_dynamic_shape_enabled": bool(flags.get("dynamic_shape")),
        "is_override_shape_enabled": bool(flags.get("override_shape")),
        "sm_count": -1 if sm_count is None else sm_count,
    }


def _node(index: int, node: Mapping[str, Any], compute: str) -> FormNode:
    kind = node["type"]
    tag = NODE_TAGS.get(kind, "")
    rule = _RULES.get(kind, _UNRULED)
    params = node.get("params") or {}
    ports = rule.ports
    dropout = params.get("_dropout_n")
    if dropout in _DROPOUT_PORTS:
        ports = {**ports, **_DROPOUT_PORTS[dropout]}
    attributes: dict[str, Any] = dict(rule.defaults)
    unproven = []
    if rule.compute:
        attributes["compute_data_type"] = DATA_TYPES.get(node.get("compute_data_type") or compute)
    elif node.get("compute_data_type") is not None:
        unproven.append("its compute data type (the frontend does not write it for this op)")
    # in the rule's order (the pybind's: a causal flag wins over an explicit bound), then the rest
    names = [p for p in rule.params if p in params]
    if len(names) < len(params):
        names += [p for p in params if p not in rule.params]
    for name in names:
        set_by = rule.params.get(name)
        if set_by is _by_ports and params[name] != _ports_say(name, node):
            raise ValueError(f"node {index} ({kind}): its parameter {name} {params[name]!r} is not what its ports say")
        found = set_by(params[name], params) if set_by is not None else None
        if found is None:
            unproven.append(f"parameter {name}")
        else:
            attributes.update(found)
    inputs = node.get("inputs") or {}
    # A paged K (or V) is a container of pages that the frontend reads through a page table
    # into a tensor of its own; the container itself is never transposed.
    transposed = rule.transposed
    if transposed and rule.attention:
        paged = {port for table, port in _PAGED.items() if inputs.get(table) is not None}
        transposed = tuple((port, under) for port, under in transposed if port not in paged)
    (ins, in_names), (outs, out_names) = _ports(inputs, ports), _ports(node.get("outputs"), ports)
    # positional: a form is made on a key's first hit, and keywords cost a NamedTuple more
    return FormNode(index, tag, ins, outs, attributes, rule.extras, transposed, tuple(unproven), (in_names, out_names))


def _ports(ports: Any, names: Mapping[str, str]) -> tuple[tuple[Port, ...], frozenset[str]]:
    """The described ports with a tensor, and their names in the blob."""
    out = tuple(Port(names.get(port, port), tid, port in names) for port, tid in (ports or {}).items() if type(tid) is str)
    return out, frozenset(p.name for p in out)


def _tensors(described: Mapping[str, Any], nodes: tuple[FormNode, ...]) -> dict[str, FormTensor]:
    promoted = _promoted(described, nodes)
    turned = {port.tid for node in nodes for port, _ in node.turned()}  # laid out by the implementation
    tensors = {}
    for tid, tensor in described.items():
        if tid[:1] == "c":
            scalar_type = tensor.get("scalar_type")
            tensors[tid] = FormTensor(tid, TensorKind.SCALAR, None, None, None,
                                      DATA_TYPES.get(scalar_type) if isinstance(scalar_type, str) else None, True,
                                      value=_float(tensor.get("scalar")) if scalar_type is not None else None)  # fmt: skip
            continue
        dims, strides = tensor.get("dim"), tensor.get("stride")
        dims = tuple(dims) if dims is not None else None
        strides = tuple(strides) if strides is not None else None
        if tid in promoted and dims is not None and len(dims) == 1:  # [n] -> [n, 1, 1, 1], stride [s, 1, 1, 1]
            dims, strides = (dims[0], 1, 1, 1), ((strides[0] if strides else 1), 1, 1, 1)
        data_type = DATA_TYPES.get(tensor.get("dtype"))
        virtual = bool(tensor.get("is_virtual"))
        by_value = bool(tensor.get("is_pass_by_value"))
        ragged = tensor.get("ragged_offset")
        reordering = _member(tensor.get("reordering_type")) if tensor.get("reordering_type") else "NONE"
        multiplier = tensor.get("ragged_offset_multiplier", 1)  # written only when set; 1 otherwise
        written = None
        # Not for dims set with strides left to the build: those the judge compares by their dims alone.
        if (data_type is not None and tid not in turned and (ragged is None or ragged[:1] == "u")
                and (dims is None or strides is not None)):  # fmt: skip
            shape = (None, None) if dims is None else (list(dims), list(strides or ()))
            written = (*shape, data_type, virtual, by_value, None if ragged is None else int(ragged[1:]), reordering, multiplier)
        tensors[tid] = FormTensor(
            tid=tid,
            kind=TensorKind.VIRTUAL if virtual else TensorKind.CALLER,
            uid=int(tid[1:]) if tid[:1] == "u" else None,
            dims=dims,
            strides=strides,
            data_type=data_type,
            by_value=by_value,
            ragged_offset=ragged,
            reordering=reordering,
            multiplier=multiplier,
            written=written,
        )
    return tensors


def _promoted(described: Mapping[str, Any], nodes: Iterable[FormNode]) -> set[str]:
    """The tensors an attention node makes 4-D: its sequence lengths, and the ragged
    offsets of every tensor at its ports."""
    found: set[str] = set()
    for node in nodes:
        if not _RULES.get(_KINDS.get(node.tag, node.tag), _UNRULED).attention:
            continue
        for port in (*node.inputs, *node.outputs):
            if port.name in _PROMOTED_PORTS:
                found.add(port.tid)
            ragged = (described.get(port.tid) or {}).get("ragged_offset")
            if isinstance(ragged, str):
                found.add(ragged)
    return found


_KINDS = {tag: kind for kind, tag in NODE_TAGS.items()}


# ---------------------------------------------------------------------------- layouts


def swapped(values: tuple[int, ...]) -> tuple[int, ...]:
    """``values`` with the last two swapped: the same memory, transposed."""
    return (*values[:-2], values[-1], values[-2]) if len(values) >= 2 else values


# ---------------------------------------------------------------------------- writing the form


def frontend_graph(form: FrontendForm, names: Mapping[str, str] | None = None,
                   shapes: Mapping[str, tuple[list[int], list[int]]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The graph fields of a plan blob as the frontend writes them for ``form`` (``context``,
    ``tensors``, ``nodes``): what the CPU test backend puts into its blobs. Virtual tensors
    and held scalars get uids after the largest caller uid, in order of appearance; their
    dims and strides come from ``shapes`` (description id -> (dims, strides)) where given.
    Attention is written as its composite implementation writes it; a tensor no node uses
    is left out, as the frontend leaves it out. ``names``: tensor names by description id."""
    names = names or {}
    shapes = shapes or {}
    uids = dict(form.uids)
    next_uid = max(uids.values(), default=0) + 1
    for tid in form.tensors:
        if tid not in uids:
            uids[tid], next_uid = next_uid, next_uid + 1
    implementations = tuple("COMPOSITE" if n.tag == "SDPA" else None for n in form.nodes)
    laid_out = form.layouts(implementations)
    tensors = []
    for tid, tensor in form.tensors.items():
        if tid not in form.used:
            continue
        dims, strides = laid_out.get(tid, [(None, None)])[0]
        if dims is None:
            dims, strides = (tuple(x) for x in shapes.get(tid, ([], [])))
        elif strides is None and tid in shapes:  # dims set by the caller, strides left to the build
            strides = tuple(shapes[tid][1])
        written = {
            "data_type": tensor.data_type,
            "dim": list(dims),
            "stride": list(strides or row_major(list(dims))),
            "is_virtual": tensor.kind is TensorKind.VIRTUAL,
            "is_pass_by_value": tensor.by_value,
            "pass_by_value": {"index": 3, "value": tensor.value.hex()} if tensor.value is not None else None,
            "uid": uids[tid],
            "name": names.get(tid, tid),
            "reordering_type": tensor.reordering,
            **({"ragged_offset_multiplier": tensor.multiplier} if tensor.multiplier != 1 else {}),  # the default is left out
        }
        if tensor.ragged_offset is not None and tensor.ragged_offset in uids:
            written["ragged_offset_uid"] = uids[tensor.ragged_offset]
        tensors.append(written)
    nodes = []
    for node in form.nodes:
        attributes = {k: (v.hex() if isinstance(v, F32) else v) for k, v in node.attributes.items()}
        if implementations[node.position] is not None:
            attributes["implementation"] = attributes.get("implementation", implementations[node.position])
        inputs = {p.name: uids[p.tid] for p in node.inputs if p.tid in uids}
        scale = node.attributes.get("attn_scale_value")
        if isinstance(scale, F32) and "Attn_scale" in node.extras:  # the frontend's own by-value scale
            uid, next_uid = next_uid, next_uid + 1
            inputs["Attn_scale"] = uid
            tensors.append({"data_type": "FLOAT", "dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "is_virtual": False,
                            "is_pass_by_value": True, "pass_by_value": {"index": 3, "value": scale.hex()}, "uid": uid,
                            "name": "attn_scale::IN_1", "reordering_type": "NONE"})  # fmt: skip
        nodes.append({**attributes, "tag": node.tag, "name": f"node{node.position}", "inputs": inputs,
                      "outputs": {p.name: uids[p.tid] for p in node.outputs if p.tid in uids}})  # fmt: skip
    return {"context": dict(form.context), "tensors": tensors, "nodes": nodes}
