"""Families of cuDNN Frontend graphs, for plancache's key property tests and cuDNN's key oracle.

A ``Family`` is one graph builder parametrized by the attributes that can change its
computation or plan. ``Family.variants()`` gives:

* the base graph;
* ``change`` variants: each changes one attribute (with whatever must change alongside for
  the graph to stay well formed, e.g. a dgrad's output size with its stride). plancache
  must key every one of them apart from the base and from each other;
* ``same`` variants: the same graph spelled differently (tensors and nodes renamed,
  tensors created in another order, rebuilt from scratch, a torch dtype for a cuDNN one,
  ``out_dims=`` for ``set_dim``). plancache must key them like the base.

``Variant.comparable`` marks variants with the base's names, uids and tensor creation
order: for those, cuDNN's own key (``graph.key()``) may be compared with plancache's.
tests/test_key_properties.py checks plancache's keys on the CPU; scripts/key_oracle.py
builds the same variants on a GPU and checks that plancache separates every pair cuDNN
separates.

Everything here builds without a GPU. Imports cuDNN Frontend; torch and numpy only inside
the builders that put their values into a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import cudnn

# fmt: off
# (the family tables read better dense, one row of variants per line)

DT = cudnn.data_type
SCALAR = cudnn.scalar_type
_CONVOLUTION_MODE = cudnn._compiled_module.convolution_mode  # not re-exported by cudnn

#: (kind, label) of the variants every family gets that must key like its base.
RESTYLES = (("renamed", "renamed"), ("reordered", "tensors created in reverse order"), ("rebuilt", "rebuilt"))


def row_major(dims: Sequence[int]) -> list[int]:
    strides, step = [0] * len(dims), 1
    for i in range(len(dims) - 1, -1, -1):
        strides[i] = step
        step *= dims[i]
    return strides


def channels_last(dims: Sequence[int]) -> list[int]:
    """Strides of an N,C,spatial...-dimensioned tensor stored channels-last."""
    c = dims[1]
    strides = [0] * len(dims)
    strides[1] = 1
    step = c
    for i in range(len(dims) - 1, 1, -1):
        strides[i] = step
        step *= dims[i]
    strides[0] = step
    return strides


def column_major_last2(dims: Sequence[int]) -> list[int]:
    """A batched matrix stored transposed (the last two dimensions swapped in memory)."""
    *batch, rows, cols = dims
    strides = row_major([*batch, cols, rows])
    return [*strides[:-2], strides[-1], strides[-2]]


@dataclass(frozen=True)
class Style:
    """How a graph is spelled: none of it may change the key."""

    prefix: str = ""  # prepended to every tensor and node name
    reverse: bool = False  # create the input tensors in reverse order


class G:
    """A ``cudnn.pygraph`` under construction in a given style."""

    def __init__(self, style: Style, p: SimpleNamespace) -> None:
        self.style = style
        self.p = p
        kwargs: dict[str, Any] = {
            "io_data_type": dtype(p.io), "intermediate_data_type": dtype(p.intermediate), "compute_data_type": dtype(p.compute),
        }
        kwargs.update(p.graph_kwargs)
        self.graph = cudnn.pygraph(name=style.prefix + "graph", **kwargs)

    def name(self, name: str) -> str:
        return self.style.prefix + name

    def inputs(self, specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Caller tensors ``name -> tensor(**spec)``, created in the style's order; a spec
        without ``stride`` gets an explicit row-major one (``stride=None``: left to the
        pygraph, which makes it row-major but unassigned)."""
        items = list(specs.items())
        if self.style.reverse:
            items.reverse()
        made = {}
        for name, spec in items:
            spec = dict(spec)
            spec.setdefault("stride", row_major(spec["dim"]))
            if spec["stride"] is None:
                del spec["stride"]
            made[name] = self.graph.tensor(name=self.name(name), **spec)
        return made

    def scalar(self, value: Any, scalar_type: Any, name: str) -> Any:
        return self.graph.tensor_scalar(value, scalar_type, name=self.name(name))

    def output(self, t: Any, uid: int, name: str, **setters: Any) -> Any:
        """Mark ``t`` as an output with ``uid``; ``dim=``, ``stride=``, ``data_type=`` set them."""
        t.set_output(True).set_uid(uid).set_name(self.name(name))
        if setters.get("dim") is not None:
            t.set_dim(list(setters["dim"]))
        if setters.get("stride") is not None:
            t.set_stride(list(setters["stride"]))
        if setters.get("data_type") is not None:
            t.set_data_type(dtype(setters["data_type"]))
        return t


def dtype(name: Any) -> Any:
    """``"HALF"`` -> ``cudnn.data_type.HALF``; ``"torch.bfloat16"`` -> the torch dtype."""
    if name is None or not isinstance(name, str):
        return name
    if name.startswith("torch."):
        import torch

        return getattr(torch, name[len("torch.") :])
    return getattr(DT, name)


def pbv(dims: Sequence[int] = (1, 1, 1, 1), data_type: str = "FLOAT", **more: Any) -> dict[str, Any]:
    """The spec of a pass-by-value scalar the caller binds at execute time."""
    return {"dim": list(dims), "data_type": dtype(data_type), "is_pass_by_value": True, **more}


@dataclass(frozen=True)
class Variant:
    family: str
    label: str
    kind: str  # "base", "change" (must key apart) or "same" (must key like the base)
    params: Mapping[str, Any]
    style: Style
    builder: Callable[[G, SimpleNamespace], None] = field(repr=False)

    renumbers: bool = False  # renumbers what the key deliberately ignores (a graph-held scalar's uid)

    @property
    def comparable(self) -> bool:
        """Same names, uids and creation order as the base: cuDNN's key may be compared."""
        return self.style == Style() and not self.renumbers

    @property
    def tag(self) -> str | None:
        return self.params.get("tag")

    def build(self) -> Any:
        p = SimpleNamespace(**self.params)
        g = G(self.style, p)
        self.builder(g, p)
        return g.graph

    @property
    def id(self) -> str:
        return f"{self.family}[{self.label}]"


_COMMON = {"io": "HALF", "intermediate": "FLOAT", "compute": "FLOAT", "graph_kwargs": {}, "tag": None}


@dataclass(frozen=True)
class Family:
    name: str
    builder: Callable[[G, SimpleNamespace], None]
    base: Mapping[str, Any]
    changes: Sequence[Mapping[str, Any]]  # each: parameter overrides that change the graph
    same: Sequence[Mapping[str, Any]] = ()  # each: overrides that spell the same graph otherwise
    # overrides that spell the same graph with other automatic uids, which plancache denies
    # on purpose (cuDNN's key sees them, so the oracle does not compare these)
    renumbered: Sequence[Mapping[str, Any]] = ()

    def params(self, overrides: Mapping[str, Any] = {}) -> dict[str, Any]:
        return {**_COMMON, **self.base, **overrides}

    def variants(self) -> list[Variant]:
        def make(label: str, kind: str, overrides: Mapping[str, Any], style: Style = Style(), renumbers: bool = False) -> Variant:
            return Variant(self.name, label, kind, self.params(overrides), style, self.builder, renumbers)

        out = [make("base", "base", {})]
        out += [make(_label(c), "change", c) for c in self.changes]
        out += [make(_label(c), "same", c) for c in self.same]
        out += [make(_label(c), "same", c, renumbers=True) for c in self.renumbered]
        out.append(make("renamed", "same", {}, Style(prefix="renamed/")))
        out.append(make("reordered", "same", {}, Style(reverse=True)))
        out.append(make("rebuilt", "same", {}))
        labels = [v.label for v in out]
        assert len(labels) == len(set(labels)), f"{self.name}: duplicate variant labels"
        return out


def _label(overrides: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={_short(v)}" for k, v in overrides.items())


def _short(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__name__", "fn")
    return repr(value)


# ---------------------------------------------------------------------------- convolution


def _conv_out(size: int, kernel: int, pad: int, stride: int, dil: int) -> int:
    return (size + 2 * pad - (kernel - 1) * dil - 1) // stride + 1


def conv_fprop(g: G, p: SimpleNamespace) -> None:
    """act(conv_fprop(X, W) + B), NCHW-dimensioned, ``layout`` in memory."""
    layout = channels_last if p.layout == "nhwc" else row_major
    x_dims, w_dims = [p.n, p.c, p.h, p.w], [p.k, p.c, p.r, p.r]
    specs = {"X": {"dim": x_dims, "stride": layout(x_dims), "uid": 1}, "W": {"dim": w_dims, "stride": layout(w_dims), "uid": 2}}
    if p.bias:
        specs["B"] = {"dim": [1, p.k, 1, 1], "stride": channels_last([1, p.k, 1, 1]), "uid": 3}
    t = g.inputs(specs)
    padding = {"pre_padding": [p.pad, p.pad], "post_padding": [0, 0]} if p.asym else {"padding": [p.pad, p.pad]}
    extra = {"convolution_mode": getattr(_CONVOLUTION_MODE, p.mode)} if p.mode else {}
    y = g.graph.conv_fprop(t["X"], t["W"], stride=[p.stride] * 2, dilation=[p.dil] * 2, name=g.name("conv"), **padding, **extra)
    if p.bias:
        y = g.graph.bias(y, t["B"], name=g.name("bias"))
    if p.act:
        y = getattr(g.graph, p.act)(y, name=g.name("act"))
    pad_post = 0 if p.asym else p.pad
    hw = [(s + p.pad + pad_post - (p.r - 1) * p.dil - 1) // p.stride + 1 for s in (p.h, p.w)]
    y_dims = [p.n, p.k, *hw]
    g.output(y, 4, "Y", dim=y_dims if p.y_set else None, stride=channels_last(y_dims) if p.y_set else None, data_type=p.y_dtype)


def conv_dgrad(g: G, p: SimpleNamespace) -> None:
    """dX of a strided convolution: ambiguous, so dX's size is the caller's to give."""
    dy_dims, w_dims = [p.n, p.k, p.dy, p.dy], [p.k, p.c, p.r, p.r]
    t = g.inputs(
        {
            "dY": {"dim": dy_dims, "stride": channels_last(dy_dims), "uid": 1},
            "W": {"dim": w_dims, "stride": channels_last(w_dims), "uid": 2},
        }
    )
    loss = t["dY"]
    if p.chain:  # the loss is an intermediate: its dims are known only after validate()
        loss = g.graph.scale(loss, g.inputs({"s": pbv(uid=5)})["s"], name=g.name("prescale"))
    dx_dims = [p.n, p.c, p.dx, p.dx]
    kwargs = {"out_dims": dx_dims} if p.via == "out_dims" else {}
    dx = g.graph.conv_dgrad(
        loss, t["W"], padding=[p.pad] * 2, stride=[p.stride] * 2, dilation=[p.dil] * 2, name=g.name("dgrad"), **kwargs
    )
    g.output(dx, 3, "dX", dim=dx_dims if p.via == "set_dim" else None, stride=channels_last(dx_dims) if p.dx_stride else None)


def conv_wgrad(g: G, p: SimpleNamespace) -> None:
    """dW: the filter size is the caller's to give (out_dims)."""
    x_dims = [p.n, p.c, p.hw, p.hw]
    out = _conv_out(p.hw, p.r, p.pad, p.stride, p.dil)
    dy_dims = [p.n, p.k, out, out]
    t = g.inputs(
        {
            "X": {"dim": x_dims, "stride": channels_last(x_dims), "uid": 1},
            "dY": {"dim": dy_dims, "stride": channels_last(dy_dims), "uid": 2},
        }
    )
    dw_dims = [p.k, p.c, p.r, p.r]
    dw = g.graph.conv_wgrad(
        t["X"], t["dY"], padding=[p.pad] * 2, stride=[p.stride] * 2, dilation=[p.dil] * 2, name=g.name("wgrad"), out_dims=dw_dims
    )
    g.output(dw, 3, "dW", stride=channels_last(dw_dims) if p.dw_stride else None, data_type=p.dw_dtype)


def conv_reduction(g: G, p: SimpleNamespace) -> None:
    """A convolution reduced over channels or over H, W: only the output dims say which."""
    x_dims, w_dims = [2, 8, 8, 8], [16, 8, 3, 3]
    t = g.inputs(
        {
            "X": {"dim": x_dims, "stride": channels_last(x_dims), "uid": 1},
            "W": {"dim": w_dims, "stride": channels_last(w_dims), "uid": 2},
        }
    )
    y = g.graph.conv_fprop(t["X"], t["W"], padding=[1, 1], stride=[1, 1], dilation=[1, 1], name=g.name("conv"))
    r = g.graph.reduction(y, mode=getattr(cudnn.reduction_mode, p.mode), name=g.name("reduce"), out_dims=p.out)
    g.output(r, 3, "R", data_type="FLOAT")


CONV_FAMILIES = [
    Family(
        "conv_fprop", conv_fprop,
        {
            "n": 2, "c": 8, "h": 8, "w": 8, "k": 16, "r": 3, "pad": 1, "stride": 1, "dil": 1, "layout": "nhwc", "bias": True,
            "act": "relu", "mode": None, "asym": False, "y_set": True, "y_dtype": None,
        },
        [
            {"n": 4}, {"c": 16}, {"h": 12}, {"w": 12}, {"k": 32}, {"r": 1, "pad": 0}, {"pad": 0}, {"pad": 2}, {"stride": 2},
            {"dil": 2}, {"layout": "nchw"}, {"io": "BFLOAT16"}, {"io": "FLOAT"}, {"compute": "HALF"}, {"intermediate": "HALF"},
            {"act": "gelu"}, {"act": "swish"}, {"act": "tanh"}, {"act": "sigmoid"}, {"act": None}, {"bias": False},
            {"mode": "CONVOLUTION"}, {"asym": True}, {"y_set": False}, {"y_dtype": "FLOAT"},
            {"mode": "CROSS_CORRELATION"},  # cuDNN's default, spelled out: keyed apart all the same
        ],
    ),
    Family(
        "conv_dgrad", conv_dgrad,
        {
            "n": 2, "k": 8, "c": 4, "dy": 8, "r": 3, "pad": 1, "stride": 2, "dil": 1, "dx": 16, "via": "out_dims",
            "dx_stride": False, "chain": False,
        },
        [
            {"dx": 15}, {"stride": 1, "dx": 8}, {"pad": 0, "dx": 17}, {"r": 1, "pad": 0, "dx": 15}, {"dil": 2, "dx": 17},
            {"n": 4}, {"k": 16}, {"c": 8}, {"dy": 4, "dx": 8}, {"dx_stride": True}, {"io": "BFLOAT16"}, {"compute": "HALF"},
            {"chain": True}, {"chain": True, "via": "infer"},
        ],
        [{"via": "set_dim"}],  # out_dims= and set_dim() hand cuDNN the same dims
    ),
    Family(
        "conv_wgrad", conv_wgrad,
        {"n": 2, "c": 4, "k": 8, "hw": 16, "r": 3, "pad": 1, "stride": 2, "dil": 1, "dw_stride": False, "dw_dtype": None},
        [
            {"r": 4}, {"r": 5, "pad": 2}, {"r": 1, "pad": 0}, {"stride": 1}, {"dil": 2}, {"n": 4}, {"c": 8}, {"k": 16},
            {"hw": 32}, {"dw_stride": True}, {"dw_dtype": "FLOAT"}, {"io": "BFLOAT16"},
        ],
    ),
    Family(
        "conv_reduction", conv_reduction,
        {"mode": "ADD", "out": [2, 1, 8, 8]},  # over channels
        [{"out": [2, 16, 1, 1]}, {"out": [1, 16, 1, 1]}, {"out": [1, 1, 1, 1]}, {"mode": "MAX"}, {"io": "FLOAT"}],
    ),
]


# ---------------------------------------------------------------------------- matmul


def matmul(g: G, p: SimpleNamespace) -> None:
    """C = act(A @ B + bias), A [b, m, k] and B [b|1, k, n] in the given layouts."""
    a_dims, b_dims = [p.b, p.m, p.k], [p.b_batch or p.b, p.k, p.n]
    specs = {
        "A": {"dim": a_dims, "stride": column_major_last2(a_dims) if p.a_col else row_major(a_dims), "uid": 1},
        "B": {"dim": b_dims, "stride": column_major_last2(b_dims) if p.b_col else row_major(b_dims), "uid": 2},
    }
    if p.bias:
        specs["bias"] = {"dim": [1, 1, p.n], "uid": 3}
    t = g.inputs(specs)
    kwargs = {"padding": p.padding} if p.padding is not None else {}
    mm_compute = {"compute_data_type": dtype(p.mm_compute)} if p.mm_compute else {}
    c = g.graph.matmul(t["A"], t["B"], name=g.name("matmul"), **kwargs, **mm_compute)
    if p.bias:
        c = g.graph.bias(c, t["bias"], name=g.name("bias"))
    if p.act:
        c = getattr(g.graph, p.act)(c, name=g.name("act"))
    c_dims = [p.b, p.m, p.n]
    g.output(c, 4, "C", dim=c_dims if p.c_set else None, stride=row_major(c_dims) if p.c_set else None, data_type=p.c_dtype)


MATMUL_FAMILIES = [
    Family(
        "matmul", matmul,
        {
            "b": 2, "m": 32, "n": 64, "k": 16, "b_batch": None, "a_col": False, "b_col": False, "bias": False, "act": None,
            "padding": None, "mm_compute": None, "c_set": True, "c_dtype": None,
        },
        [
            {"b": 4}, {"m": 64}, {"n": 32}, {"k": 32}, {"b_batch": 1}, {"a_col": True}, {"b_col": True}, {"bias": True},
            {"act": "relu"}, {"act": "gelu"}, {"bias": True, "act": "relu"}, {"padding": 1.0}, {"mm_compute": "HALF"},
            {"io": "BFLOAT16"}, {"io": "FLOAT"}, {"compute": "HALF"}, {"c_set": False}, {"c_dtype": "FLOAT"},
        ],
        [{"padding": 0.0}, {"mm_compute": "FLOAT"}],  # the defaults, spelled out
    ),
]


# ---------------------------------------------------------------------------- pointwise


def _torch_scalar(value: float, dtype_name: str = "float32") -> Any:
    import torch

    return torch.tensor(value, dtype=getattr(torch, dtype_name))


def _numpy_scalar(value: float, dtype_name: str = "float32") -> Any:
    import numpy

    return getattr(numpy, dtype_name)(value)


def _scalar_value(spec: Any) -> Any:
    """A scalar attribute as the family spells it: a number, or ("torch"|"numpy", value, dtype)."""
    if isinstance(spec, tuple):
        lib, value, dtype_name = spec
        return _torch_scalar(value, dtype_name) if lib == "torch" else _numpy_scalar(value, dtype_name)
    return spec


UNARY = ("abs", "ceil", "cos", "elu", "erf", "exp", "floor", "gelu", "gelu_approx_tanh", "identity", "log", "neg",
         "reciprocal", "rsqrt", "sigmoid", "sin", "softplus", "sqrt", "tan", "tanh", "relu", "swish")  # fmt: skip
BINARY = ("add", "add_square", "div", "mul", "sub", "max", "min", "mod", "pow", "bias", "scale",
          "cmp_eq", "cmp_ge", "cmp_gt", "cmp_le", "cmp_lt", "cmp_neq")  # fmt: skip
BACKWARD = ("relu_backward", "elu_backward", "gelu_approx_tanh_backward", "gelu_backward", "sigmoid_backward",
            "softplus_backward", "tanh_backward", "swish_backward")  # fmt: skip


def pointwise(g: G, p: SimpleNamespace) -> None:
    """One pointwise op (unary, binary, or backward) on [4, 64] tensors after a matmul."""
    t = g.inputs({
        "A": {"dim": [1, 4, 16], "uid": 1}, "B": {"dim": [1, 16, 64], "uid": 2}, "other": {"dim": p.other_dims, "uid": 3},
    })  # fmt: skip
    x = g.graph.matmul(t["A"], t["B"], name=g.name("matmul"))
    kwargs = {k: _scalar_value(v) for k, v in p.scalars.items()}
    op = getattr(g.graph, p.op)
    if p.op in BINARY:
        y = op(x, t["other"], name=g.name("pw"), **kwargs)
    elif p.op in BACKWARD or p.op == "leaky_relu_backward":
        y = op(t["other"], x, name=g.name("pw"), **kwargs)
    else:
        y = op(x, name=g.name("pw"), **kwargs)
    if p.pw_compute:
        g.graph.nodes[-1].compute_data_type = dtype(p.pw_compute)
    g.output(y, 4, "Y", dim=[1, 4, 64], stride=row_major([1, 4, 64]), data_type=p.y_dtype)


def pointwise_scalars(g: G, p: SimpleNamespace) -> None:
    """A pointwise op whose scalar attribute is a float, a torch or a numpy value."""
    t = g.inputs({"X": {"dim": [1, 4, 64], "uid": 1}, "dY": {"dim": [1, 4, 64], "uid": 2}})
    kwargs = {k: _scalar_value(v) for k, v in p.scalars.items()}
    if p.op.endswith("_backward"):
        y = getattr(g.graph, p.op)(t["dY"], t["X"], name=g.name("pw"), **kwargs)
    else:
        y = getattr(g.graph, p.op)(t["X"], name=g.name("pw"), **kwargs)
    g.output(y, 3, "Y", dim=[1, 4, 64], stride=row_major([1, 4, 64]))


def graph_scalar(g: G, p: SimpleNamespace) -> None:
    """Y = X op s with s a scalar: held by the graph (tensor_scalar) or bound by the caller."""
    made = {}
    if p.scalar == "caller":
        specs = {"X": {"dim": [2, 64], "uid": 1}, "s": pbv([1, 1], uid=5)}
    else:
        specs = {"X": {"dim": [2, 64], "uid": 1}}
        if p.scalar_first != g.style.reverse:  # creation order must not matter
            made["s"] = g.scalar(p.value, getattr(SCALAR, p.scalar_type), "s")
    made.update(g.inputs(specs))
    if "s" not in made:
        made["s"] = g.scalar(p.value, getattr(SCALAR, p.scalar_type), "s")
    if p.scalar_uid is not None:
        made["s"].set_uid(p.scalar_uid)
    y = getattr(g.graph, p.op)(made["X"], made["s"], name=g.name("op"))
    g.output(y, 2, "Y", dim=[2, 64], stride=[64, 1])


POINTWISE_FAMILIES = [
    Family(
        "pointwise", pointwise, {"op": "relu", "scalars": {}, "other_dims": [1, 4, 64], "pw_compute": None, "y_dtype": None},
        [{"op": op} for op in UNARY + BINARY + BACKWARD if op != "relu"]
        + [
            {"op": "add", "other_dims": [1, 1, 64]}, {"op": "mul", "other_dims": [1, 4, 1]}, {"pw_compute": "HALF"},
            {"y_dtype": "FLOAT"}, {"io": "FLOAT"},
        ],
    ),
    Family(
        "pointwise_scalars", pointwise_scalars, {"op": "relu", "scalars": {}},
        [
            {"scalars": {"negative_slope": 0.1}}, {"scalars": {"negative_slope": 0.10004}},
            {"scalars": {"negative_slope": ("torch", 0.1, "float32")}},
            {"scalars": {"negative_slope": ("torch", 0.10004, "float32")}},
            {"scalars": {"negative_slope": ("torch", 0.1, "float64")}},
            {"scalars": {"negative_slope": ("numpy", 0.1, "float32")}}, {"scalars": {"lower_clip": 0.0}},
            {"scalars": {"upper_clip": 6.0}}, {"scalars": {"upper_clip": 6.000001}},
            {"scalars": {"lower_clip": -1.0, "upper_clip": 6.0}}, {"op": "leaky_relu", "scalars": {"negative_slope": 0.01}},
            {"op": "leaky_relu", "scalars": {"negative_slope": 0.2}},
            {"op": "leaky_relu", "scalars": {"negative_slope": ("torch", 0.01, "float32")}},
            {"op": "swish", "scalars": {"swish_beta": 1.0}}, {"op": "swish", "scalars": {"swish_beta": 1.5}},
            {"op": "gen_index", "scalars": {"axis": 1}}, {"op": "gen_index", "scalars": {"axis": 2}},
            {"op": "relu_backward", "scalars": {}}, {"op": "relu_backward", "scalars": {"negative_slope": 0.1}},
            {"op": "leaky_relu_backward", "scalars": {"negative_slope": 0.1}},
            {"op": "swish_backward", "scalars": {"swish_beta": 1.5}},
        ],
    ),
    Family(
        "graph_scalar", graph_scalar,
        {
            "op": "mul", "value": 0.5, "scalar_type": "COMPILE_TIME_CONST", "scalar": "graph", "scalar_first": False,
            "scalar_uid": None,
        },
        [
            {"value": 0.25}, {"value": 0.5000001}, {"value": 2.0}, {"value": 2}, {"value": -0.0}, {"value": 0.0},
            {"scalar_type": "RUNTIME_PARAM"}, {"op": "add"}, {"op": "div"}, {"scalar": "caller"}, {"io": "FLOAT"},
        ],
        renumbered=[{"scalar_first": True}, {"scalar_uid": 77}],  # a graph-held scalar's uid binds nothing
    ),
]


# ---------------------------------------------------------------------------- reduction


def reduction(g: G, p: SimpleNamespace) -> None:
    t = g.inputs({"X": {"dim": p.x, "uid": 1}})
    x = t["X"]
    if p.chain:
        x = g.graph.relu(x, name=g.name("relu"))
    kwargs = {"out_dims": p.out} if p.via == "out_dims" else {}
    r = g.graph.reduction(x, mode=getattr(cudnn.reduction_mode, p.mode), name=g.name("reduce"), **kwargs)
    g.output(
        r, 2, "R", dim=p.out if p.via == "set_dim" else None, stride=row_major(p.out) if p.r_stride else None, data_type=p.r_dtype
    )


REDUCTION_FAMILIES = [
    Family(
        "reduction", reduction,
        {
            "x": [2, 32, 64], "out": [2, 32, 1], "mode": "ADD", "via": "out_dims", "chain": False, "r_stride": False,
            "r_dtype": "FLOAT",
        },
        [
            {"out": [2, 1, 64]}, {"out": [1, 1, 1]}, {"out": [2, 1, 1]}, {"out": [1, 32, 64]},
            {"x": [4, 32, 64], "out": [4, 32, 1]},
            *({"mode": m} for m in ("MAX", "MIN", "AMAX", "AVG", "MUL", "MUL_NO_ZEROS", "NORM1", "NORM2")), {"chain": True},
            {"r_stride": True}, {"r_dtype": "HALF"}, {"compute": "HALF"}, {"io": "FLOAT"},
        ],
        [{"via": "set_dim"}],
    ),
]


# ---------------------------------------------------------------------------- normalization


def _norm_inputs(g: G, p: SimpleNamespace, *names: str) -> dict[str, Any]:
    """x [n, c, h, w] channels-last, per-channel (or per-element) parameters, epsilon."""
    x_dims = [p.n, p.c, p.hw, p.hw]
    param_dims = [1, p.c, 1, 1] if p.per_channel else [1, p.c, p.hw, p.hw]
    known = {
        "x": {"dim": x_dims, "stride": channels_last(x_dims), "uid": 1},
        "dy": {"dim": x_dims, "stride": channels_last(x_dims), "uid": 2},
        "scale": {"dim": param_dims, "stride": channels_last(param_dims), "data_type": DT.FLOAT, "uid": 3},
        "bias": {"dim": param_dims, "stride": channels_last(param_dims), "data_type": DT.FLOAT, "uid": 4},
        "mean": {"dim": [p.n, 1, 1, 1], "data_type": DT.FLOAT, "uid": 5},
        "inv_var": {"dim": [p.n, 1, 1, 1], "data_type": DT.FLOAT, "uid": 6},
        "bn_mean": {"dim": [1, p.c, 1, 1], "stride": channels_last([1, p.c, 1, 1]), "data_type": DT.FLOAT, "uid": 5},
        "bn_inv_var": {"dim": [1, p.c, 1, 1], "stride": channels_last([1, p.c, 1, 1]), "data_type": DT.FLOAT, "uid": 6},
        "running_mean": {"dim": [1, p.c, 1, 1], "stride": channels_last([1, p.c, 1, 1]), "data_type": DT.FLOAT, "uid": 7},
        "running_var": {"dim": [1, p.c, 1, 1], "stride": channels_last([1, p.c, 1, 1]), "data_type": DT.FLOAT, "uid": 8},
        "epsilon": pbv(uid=9), "momentum": pbv(uid=10),
    }
    t = g.inputs({n: known[n] for n in names if n != "epsilon" or p.eps == "caller"})
    if "epsilon" in names and p.eps != "caller":
        t["epsilon"] = g.scalar(p.eps, SCALAR.COMPILE_TIME_CONST, "epsilon")
    return t


def _phase(p: SimpleNamespace) -> Any:
    return getattr(cudnn.norm_forward_phase, p.phase)


def layernorm(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "x", "scale", "bias", "epsilon")
    outs = g.graph.layernorm(
        norm_forward_phase=_phase(p), input=t["x"], scale=t["scale"], bias=t["bias"], epsilon=t["epsilon"], name=g.name("ln")
    )
    y, mean, inv_var = outs
    g.output(y, 11, "y")
    if mean is not None and p.stats_out:
        g.output(mean, 12, "mean", data_type="FLOAT")
        g.output(inv_var, 13, "inv_var", data_type="FLOAT")


def layernorm_backward(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "dy", "x", "scale", "mean", "inv_var")
    dx, dscale, dbias = g.graph.layernorm_backward(
        grad=t["dy"], input=t["x"], scale=t["scale"], mean=t["mean"], inv_variance=t["inv_var"], name=g.name("dln")
    )
    g.output(dx, 11, "dx")
    g.output(dscale, 12, "dscale", data_type="FLOAT")
    g.output(dbias, 13, "dbias", data_type="FLOAT")


def rmsnorm(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "x", "scale", "bias", "epsilon")
    y, inv_var = g.graph.rmsnorm(
        norm_forward_phase=_phase(p), input=t["x"], scale=t["scale"], bias=t["bias"] if p.with_bias else None,
        epsilon=t["epsilon"], name=g.name("rms"),
    )
    g.output(y, 11, "y")
    if inv_var is not None and p.stats_out:
        g.output(inv_var, 13, "inv_var", data_type="FLOAT")


def rmsnorm_backward(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "dy", "x", "scale", "inv_var")
    dx, dscale, dbias = g.graph.rmsnorm_backward(
        grad=t["dy"], input=t["x"], scale=t["scale"], inv_variance=t["inv_var"], has_dbias=p.has_dbias, name=g.name("drms")
    )
    g.output(dx, 11, "dx")
    g.output(dscale, 12, "dscale", data_type="FLOAT")
    if dbias is not None:
        g.output(dbias, 13, "dbias", data_type="FLOAT")


def batchnorm(g: G, p: SimpleNamespace) -> None:
    names = ["x", "scale", "bias", "epsilon"] + (["running_mean", "running_var", "momentum"] if p.running else [])
    t = _norm_inputs(g, p, *names)
    outs = g.graph.batchnorm(
        input=t["x"], scale=t["scale"], bias=t["bias"], in_running_mean=t.get("running_mean"), in_running_var=t.get("running_var"),
        epsilon=t["epsilon"], momentum=t.get("momentum"), name=g.name("bn"),
    )  # fmt: skip
    for uid, (name, out) in enumerate(zip(("y", "mean", "inv_var", "next_mean", "next_var"), outs), start=11):
        if out is not None:
            g.output(out, uid, name, data_type=None if name == "y" else "FLOAT")


def batchnorm_backward(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "dy", "x", "scale", "bn_mean", "bn_inv_var")
    dx, dscale, dbias = g.graph.batchnorm_backward(
        grad=t["dy"], input=t["x"], scale=t["scale"], mean=t["bn_mean"], inv_variance=t["bn_inv_var"], name=g.name("dbn")
    )
    g.output(dx, 11, "dx")
    g.output(dscale, 12, "dscale", data_type="FLOAT")
    g.output(dbias, 13, "dbias", data_type="FLOAT")


def batchnorm_inference(g: G, p: SimpleNamespace) -> None:
    t = _norm_inputs(g, p, "x", "bn_mean", "bn_inv_var", "scale", "bias")
    y = g.graph.batchnorm_inference(
        input=t["x"], mean=t["bn_mean"], inv_variance=t["bn_inv_var"], scale=t["scale"], bias=t["bias"], name=g.name("bni")
    )
    g.output(y, 11, "y")


_NORM_BASE = {"n": 4, "c": 32, "hw": 4, "per_channel": False, "eps": "caller", "phase": "TRAINING", "stats_out": True}
_NORM_CHANGES: list[Mapping[str, Any]] = [
    {"n": 8},
    {"c": 64},
    {"hw": 8},
    {"io": "BFLOAT16"},
    {"io": "FLOAT"},
    {"compute": "HALF"},
]
_BN_BASE = {**_NORM_BASE, "per_channel": True}

NORM_FAMILIES = [
    Family("layernorm", layernorm, _NORM_BASE,
           [*_NORM_CHANGES, {"phase": "INFERENCE"}, {"stats_out": False}, {"eps": 1e-5}, {"eps": 1e-6}]),
    Family("layernorm_backward", layernorm_backward, _NORM_BASE, _NORM_CHANGES),
    Family("rmsnorm", rmsnorm, {**_NORM_BASE, "with_bias": False},
           [*_NORM_CHANGES, {"phase": "INFERENCE"}, {"with_bias": True}, {"eps": 1e-5}, {"stats_out": False}]),
    Family("rmsnorm_backward", rmsnorm_backward, {**_NORM_BASE, "has_dbias": False}, [*_NORM_CHANGES, {"has_dbias": True}]),
    Family("batchnorm", batchnorm, {**_BN_BASE, "running": True}, [*_NORM_CHANGES, {"running": False}, {"eps": 1e-5}]),
    Family("batchnorm_backward", batchnorm_backward, _BN_BASE, _NORM_CHANGES),
    Family("batchnorm_inference", batchnorm_inference, _BN_BASE, _NORM_CHANGES),
]  # fmt: skip


# ---------------------------------------------------------------------------- attention


def _qkv_specs(p: SimpleNamespace, names: Sequence[str] = ("q", "k", "v"), first_uid: int = 1) -> dict[str, dict[str, Any]]:
    """q/k/v-shaped tensors in BHSD dims, laid out BHSD or BSHD in memory."""
    shapes = {
        "q": [p.b, p.h, p.s_q, p.d], "k": [p.b, p.h_kv, p.s_kv, p.d], "v": [p.b, p.h_kv, p.s_kv, p.d_v],
        "o": [p.b, p.h, p.s_q, p.d_v], "dO": [p.b, p.h, p.s_q, p.d_v], "stats": [p.b, p.h, p.s_q, 1],
    }  # fmt: skip
    out = {}
    for uid, name in enumerate(names, start=first_uid):
        dims = shapes[name]
        stride = None if p.implicit_strides and p.layout == "bhsd" else _attention_strides(dims, p.layout)
        spec: dict[str, Any] = {"dim": dims, "stride": stride, "uid": uid}
        if name == "stats":
            spec.update(stride=row_major(dims), data_type=DT.FLOAT)
        if p.fp8 and name in ("q", "k", "v", "o", "dO"):
            spec["data_type"] = dtype(p.fp8)
        out[name] = spec
    return out


def _attention_strides(dims: Sequence[int], layout: str) -> list[int]:
    _, h, s, d = dims
    return row_major(dims) if layout == "bhsd" else [s * h * d, d, h * d, 1]


def _attention_kwargs(g: G, p: SimpleNamespace, made: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments shared by the attention builders, from the family's params."""
    kwargs: dict[str, Any] = {k: v for k, v in p.flags.items()}
    extra: dict[str, dict[str, Any]] = {}
    if p.scale == "tensor":
        extra["attn_scale"] = pbv(uid=40)
    elif p.scale is not None:
        kwargs["attn_scale"] = p.scale
    if p.padding_mask:
        kwargs["use_padding_mask"] = True
        extra["seq_len_q"] = {"dim": [p.b, 1, 1, 1], "data_type": DT.INT32, "uid": 41}
        extra["seq_len_kv"] = {"dim": [p.b, 1, 1, 1], "data_type": DT.INT32, "uid": 42}
    if p.bias_tensor:
        extra["bias"] = {"dim": [1, p.h, p.s_q, p.s_kv], "uid": 43}
    if p.dropout is not None:
        extra["seed"] = {"dim": [1, 1, 1, 1], "data_type": DT.INT64, "uid": 44}
        extra["offset"] = {"dim": [1, 1, 1, 1], "data_type": DT.INT64, "uid": 45}
    made.update(g.inputs(extra))
    for name in ("attn_scale", "seq_len_q", "seq_len_kv", "bias"):
        if name in made:
            kwargs[name] = made[name]
    if p.dropout is not None:
        kwargs["dropout"] = (p.dropout, made["seed"], made["offset"])
    if p.score_mod is not None:
        kwargs["score_mod"] = p.score_mod
    return kwargs


def softcap(cap: float) -> Callable[[Any, Any], Any]:
    """A score_mod: cap * tanh(score / cap). Its repr shows nothing of ``cap``."""

    def score_mod(graph: Any, score: Any) -> Any:
        scaled = graph.mul(score, graph.tensor_scalar(1.0 / cap, SCALAR.COMPILE_TIME_CONST))
        return graph.mul(graph.tanh(scaled), graph.tensor_scalar(cap, SCALAR.COMPILE_TIME_CONST))

    return score_mod


def sdpa(g: G, p: SimpleNamespace) -> None:
    made = g.inputs(_qkv_specs(p))
    kwargs = _attention_kwargs(g, p, made)
    o, stats = g.graph.sdpa(made["q"], made["k"], made["v"], generate_stats=p.stats, name=g.name("sdpa"), **kwargs)
    o_dims = [p.b, p.h, p.s_q, p.d_v]
    g.output(o, 20, "o", dim=o_dims, stride=_attention_strides(o_dims, p.layout))
    if stats is not None:
        g.output(stats, 21, "stats", data_type="FLOAT")


def sdpa_backward(g: G, p: SimpleNamespace) -> None:
    made = g.inputs(_qkv_specs(p, ("q", "k", "v", "o", "dO", "stats")))
    kwargs = _attention_kwargs(g, p, made)
    if p.deterministic:
        kwargs["use_deterministic_algorithm"] = True
    dq, dk, dv = g.graph.sdpa_backward(
        made["q"], made["k"], made["v"], made["o"], made["dO"], made["stats"], name=g.name("sdpa_bwd"), **kwargs
    )
    for uid, (name, t, src) in enumerate(zip(("dq", "dk", "dv"), (dq, dk, dv), ("q", "k", "v")), start=20):
        dims = made[src].dim
        g.output(t, uid, name, dim=dims, stride=_attention_strides(dims, p.layout))


def sdpa_fp8(g: G, p: SimpleNamespace) -> None:
    made = g.inputs(_qkv_specs(p))
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scales = g.inputs({n: {"dim": [1, 1, 1, 1], "data_type": DT.FLOAT, "uid": uid} for uid, n in enumerate(names, start=30)})
    kwargs = _attention_kwargs(g, p, made)
    o, stats, amax_s, amax_o = g.graph.sdpa_fp8(
        made["q"], made["k"], made["v"], *(scales[n] for n in names), generate_stats=p.stats, name=g.name("sdpa_fp8"), **kwargs
    )
    o_dims = [p.b, p.h, p.s_q, p.d_v]
    g.output(o, 20, "o", dim=o_dims, stride=_attention_strides(o_dims, p.layout), data_type=p.fp8)
    if stats is not None:
        g.output(stats, 21, "stats", data_type="FLOAT")
    g.output(amax_s, 22, "amax_s", data_type="FLOAT")
    g.output(amax_o, 23, "amax_o", data_type="FLOAT")


def sdpa_ragged(g: G, p: SimpleNamespace) -> None:
    """Packed (THD) q/k/v/o addressed through ragged offsets, with padding masks."""
    offsets = {
        n: {"dim": [p.b + 1, 1, 1, 1], "data_type": DT.INT32, "uid": uid}
        for uid, n in enumerate(("q_off", "kv_off", "o_off"), start=50)
    }
    made = g.inputs(offsets)
    specs = _qkv_specs(p)
    for name, off in (("q", "q_off"), ("k", "kv_off"), ("v", "kv_off")):
        specs[name].update(ragged_offset=made[off], ragged_offset_multiplier=p.multiplier)
    made.update(g.inputs(specs))
    kwargs = _attention_kwargs(g, p, made)
    o, _ = g.graph.sdpa(made["q"], made["k"], made["v"], generate_stats=False, name=g.name("sdpa"), **kwargs)
    o_dims = [p.b, p.h, p.s_q, p.d_v]
    g.output(o, 20, "o", dim=o_dims, stride=_attention_strides(o_dims, p.layout))
    o.set_ragged_offset(made["o_off"])
    if p.o_multiplier != 1:
        o.set_ragged_offset_multiplier(p.o_multiplier)


_ATTENTION_BASE = {
    "b": 2, "h": 4, "h_kv": 4, "s_q": 64, "s_kv": 64, "d": 64, "d_v": 64, "layout": "bhsd", "scale": 0.125, "stats": False,
    "flags": {}, "padding_mask": False, "bias_tensor": False, "dropout": None, "score_mod": None, "fp8": None,
    "implicit_strides": False,
}  # fmt: skip
_ATTENTION_SHAPES: list[Mapping[str, Any]] = [
    {"b": 4},
    {"h": 8, "h_kv": 8},
    {"h_kv": 2},
    {"h_kv": 1},
    {"s_q": 128},
    {"s_kv": 128},
    {"d": 128, "d_v": 128},
    {"d_v": 32},
    {"layout": "bshd"},
]
_ATTENTION_MASKS: list[Mapping[str, Any]] = [
    {"flags": {"use_causal_mask": True}},
    {"flags": {"use_causal_mask_bottom_right": True}},
    {"flags": {"use_causal_mask": True, "sliding_window_length": 16}},
    {"flags": {"use_causal_mask": True, "sliding_window_length": 32}},
    {"flags": {"use_alibi_mask": True, "use_causal_mask": True}},
    {"padding_mask": True},
    {"flags": {"diagonal_band_right_bound": 8}},
    {"flags": {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}},
]
_ATTENTION_SCALES: list[Mapping[str, Any]] = [{"scale": 0.25}, {"scale": 0.1250001}, {"scale": "tensor"}, {"scale": None}]

ATTENTION_FAMILIES = [
    Family(
        "sdpa", sdpa, _ATTENTION_BASE,
        [
            *_ATTENTION_SHAPES, *_ATTENTION_MASKS, *_ATTENTION_SCALES, {"stats": True}, {"bias_tensor": True}, {"dropout": 0.1},
            {"dropout": 0.2}, {"io": "BFLOAT16"}, {"compute": "HALF"},
            {"flags": {"implementation": cudnn.attention_implementation.UNIFIED}}, {"flags": {"use_causal_mask": False}},
        ],
        [{"io": "torch.float16", "intermediate": "torch.float32", "compute": "torch.float32"}, {"implicit_strides": True}],
    ),
    Family(
        "sdpa_score_mod", sdpa, {**_ATTENTION_BASE, "score_mod": softcap(30.0), "tag": "softcap=30"},
        [{"score_mod": softcap(50.0), "tag": "softcap=50"}, {"score_mod": None, "tag": None}],
    ),
    Family(
        "sdpa_backward", sdpa_backward, {**_ATTENTION_BASE, "deterministic": False},
        [
            {"b": 4}, {"h_kv": 2}, {"s_kv": 128}, {"d": 128, "d_v": 128}, {"layout": "bshd"}, *_ATTENTION_MASKS[:5],
            *_ATTENTION_SCALES[:3], {"dropout": 0.1}, {"deterministic": True}, {"bias_tensor": True}, {"io": "BFLOAT16"},
        ],
    ),
    Family(
        "sdpa_fp8", sdpa_fp8, {**_ATTENTION_BASE, "fp8": "FP8_E4M3", "d": 128, "d_v": 128},
        [
            {"b": 4}, {"h_kv": 2}, {"s_kv": 128}, {"layout": "bshd"}, {"fp8": "FP8_E5M2"}, {"stats": True},
            {"flags": {"use_causal_mask": True}}, {"scale": 0.25}, {"padding_mask": True},
        ],
        # row-major strides left to the pygraph: the same graph; on a GPU, the backend
        # reports its own view of K back into an unassigned stride (the oracle's stability check)
        [{"implicit_strides": True}],
    ),
    Family(
        "sdpa_ragged", sdpa_ragged,
        {**_ATTENTION_BASE, "layout": "bshd", "padding_mask": True, "multiplier": 1, "o_multiplier": 1},
        [{"multiplier": 2}, {"o_multiplier": 2}, {"s_kv": 128}, {"flags": {"use_causal_mask": True}}],
    ),
]


# ---------------------------------------------------------------------------- structure


def slice_op(g: G, p: SimpleNamespace) -> None:
    t = g.inputs({"X": {"dim": [4, 32, 16], "uid": 1}})
    y = g.graph.slice(t["X"], slices=[slice(*s) for s in p.slices], name=g.name("slice"))
    g.output(y, 2, "Y")


def concatenate(g: G, p: SimpleNamespace) -> None:
    specs = {f"X{i}": {"dim": [4, 8, 16], "uid": 1 + i} for i in range(p.count)}
    t = g.inputs(specs)
    kwargs = {"in_place_index": p.in_place} if p.in_place is not None else {}
    y = g.graph.concatenate(inputs=[t[f"X{i}"] for i in range(p.count)], axis=p.axis, name=g.name("concat"), **kwargs)
    out = [4, 8, 16]
    out[p.axis] *= p.count
    g.output(y, 9, "Y", dim=out, stride=row_major(out))


def reshape(g: G, p: SimpleNamespace) -> None:
    t = g.inputs({"X": {"dim": [4, 64], "uid": 1}})
    kwargs = {"reshape_mode": getattr(cudnn.reshape_mode, p.mode)} if p.mode else {}
    y = g.graph.reshape(t["X"], name=g.name("reshape"), out_dims=p.out if p.via == "out_dims" else None, **kwargs)
    g.output(y, 2, "Y", dim=p.out if p.via == "set_dim" else None)


def transpose(g: G, p: SimpleNamespace) -> None:
    t = g.inputs({"X": {"dim": [2, 4, 8], "uid": 1}})
    y = g.graph.transpose(t["X"], permutation=list(p.perm), name=g.name("transpose"))
    g.output(y, 2, "Y")


def rope(g: G, p: SimpleNamespace) -> None:
    dims = [p.b, p.h, p.s, p.d]
    t = g.inputs({"X": {"dim": dims, "uid": 1}, "freqs": {"dim": [1, 1, p.s, p.d], "data_type": DT.FLOAT, "uid": 2}})
    y = getattr(g.graph, p.op)(t["X"], t["freqs"], output_scale=p.output_scale, rope_dim=p.rope_dim, name=g.name("rope"))
    g.output(y, 3, "Y", dim=dims, stride=row_major(dims))


STRUCTURE_FAMILIES = [
    Family("slice", slice_op, {"slices": [(0, 2), (0, 32), (0, 16)]},
           [{"slices": [(0, 3), (0, 32), (0, 16)]}, {"slices": [(1, 3), (0, 32), (0, 16)]}, {"slices": [(0, 2), (0, 32, 2), (0, 16)]},
            {"slices": [(0, 2), (0, 32), (8, 16)]}, {"io": "FLOAT"}]),
    Family("concatenate", concatenate, {"count": 2, "axis": 1, "in_place": None},
           [{"count": 3}, {"axis": 0}, {"axis": 2}, {"in_place": 0}, {"in_place": 1}, {"io": "FLOAT"}]),
    Family("reshape", reshape, {"out": [2, 128], "via": "out_dims", "mode": None},
           [{"out": [16, 16]}, {"out": [256]}, {"out": [4, 8, 8]}, {"mode": "LOGICAL"}, {"mode": "VIEW_ONLY"}, {"io": "FLOAT"}],
           [{"via": "set_dim"}]),
    Family("transpose", transpose, {"perm": (0, 2, 1)}, [{"perm": (1, 0, 2)}, {"perm": (2, 1, 0)}, {"io": "FLOAT"}]),
    Family("rope", rope, {"op": "rope", "b": 2, "h": 4, "s": 32, "d": 64, "output_scale": 1.0, "rope_dim": 64},
           [{"op": "rope_backward"}, {"b": 4}, {"s": 64}, {"d": 128, "rope_dim": 128}, {"rope_dim": 32}, {"output_scale": 0.5},
            {"output_scale": 1.0000001}, {"io": "BFLOAT16"}]),
]  # fmt: skip


# ---------------------------------------------------------------------------- quantization, MoE


def block_scale_quantize(g: G, p: SimpleNamespace) -> None:
    t = g.inputs({"X": {"dim": [1, 128, 128], "uid": 1}})
    kwargs = {"axis": p.axis} if p.axis is not None else {}
    y, scale = g.graph.block_scale_quantize(t["X"], block_size=p.block, transpose=p.transpose, name=g.name("quantize"), **kwargs)
    g.output(y, 2, "Y", data_type=p.y_dtype)
    g.output(scale, 3, "scale", data_type=p.scale_dtype)
    if p.reorder:
        scale.set_reordering_type(cudnn.tensor_reordering.F8_128x4)


def block_scale_dequantize(g: G, p: SimpleNamespace) -> None:
    blocks = 128 // p.block
    t = g.inputs({
        "X": {"dim": [1, 128, 128], "data_type": dtype(p.x_dtype), "uid": 1},
        "descale": {"dim": [1, 128, blocks], "data_type": dtype(p.scale_dtype), "uid": 2},
    })  # fmt: skip
    y = g.graph.block_scale_dequantize(t["X"], t["descale"], block_size=[1, 1, p.block], name=g.name("dequantize"))
    g.output(y, 3, "Y", data_type="FLOAT")


def moe_grouped_matmul(g: G, p: SimpleNamespace) -> None:
    specs: dict[str, dict[str, Any]] = {
        "token": {"dim": [1, p.tokens, p.hidden], "uid": 1}, "weight": {"dim": [p.experts, p.hidden, p.out], "uid": 2},
        "first_token_offset": {"dim": [p.experts, 1, 1], "data_type": DT.INT32, "uid": 3, "alignment_value": p.align},
    }
    if p.mode in ("GATHER", "SCATTER"):
        specs["token_index"] = {"dim": [1, p.tokens, 1], "data_type": DT.INT32, "uid": 4}
    t = g.inputs(specs)
    y = g.graph.moe_grouped_matmul(
        t["token"], t["weight"], t["first_token_offset"], token_index=t.get("token_index"),
        mode=getattr(cudnn.moe_grouped_matmul_mode, p.mode), top_k=p.top_k, name=g.name("moe"),
    )  # fmt: skip
    g.output(y, 9, "Y")


QUANT_FAMILIES = [
    Family("block_scale_quantize", block_scale_quantize,
           {"block": 32, "axis": None, "transpose": False, "y_dtype": "FP8_E4M3", "scale_dtype": "FP8_E8M0", "reorder": False},
           [{"block": 16}, {"axis": 1}, {"transpose": True}, {"y_dtype": "FP4_E2M1", "block": 16, "scale_dtype": "FP8_E4M3"},
            {"reorder": True}, {"io": "BFLOAT16"}]),
    Family("block_scale_dequantize", block_scale_dequantize, {"block": 32, "x_dtype": "FP8_E4M3", "scale_dtype": "FP8_E8M0"},
           [{"block": 16}, {"x_dtype": "FP8_E5M2"}, {"x_dtype": "FP4_E2M1", "block": 16, "scale_dtype": "FP8_E4M3"}]),
    Family("moe_grouped_matmul", moe_grouped_matmul,
           {"tokens": 64, "hidden": 128, "out": 64, "experts": 4, "mode": "NONE", "top_k": 1, "align": 1},
           [{"tokens": 128}, {"hidden": 256}, {"out": 128}, {"experts": 8}, {"mode": "GATHER"}, {"mode": "SCATTER"},
            {"mode": "GATHER", "top_k": 2}, {"align": 8}, {"io": "BFLOAT16"}]),
]  # fmt: skip


# ---------------------------------------------------------------------------- graph flags


class FakeDeviceProperties:
    """Stands in for ``cudnn.create_device_properties`` (which needs a GPU) on the CPU."""

    def __init__(self, sm_count: int) -> None:
        self.sm_count = sm_count

    def serialize(self) -> list[int]:
        return list(f'{{"sm_count":{self.sm_count}}}'.encode())


def graph_flags(g: G, p: SimpleNamespace) -> None:
    """A matmul + bias + relu graph whose graph-level flags vary."""
    matmul(g, p)
    for name in p.deselect:
        g.graph.deselect_engines([name])


_FLAG_BASE = {**MATMUL_FAMILIES[0].base, "bias": True, "act": "relu", "deselect": ()}

FLAG_FAMILIES = [
    Family(
        "graph_flags", graph_flags, _FLAG_BASE,
        [
            {"graph_kwargs": {"is_dynamic_shape_enabled": True}}, {"graph_kwargs": {"is_override_shape_enabled": True}},
            {"graph_kwargs": {"sm_count": 64}}, {"graph_kwargs": {"sm_count": 132}}, {"graph_kwargs": {"sm_version": 90}},
            {"graph_kwargs": {"sm_version": 100}}, {"graph_kwargs": {"is_cuda_graph_replay_expected": True}},
            {"graph_kwargs": {"cuda_graph_retention": cudnn.cuda_graph_retention.NONE}}, {"deselect": ("eng0",)},
            {"io": "BFLOAT16"}, {"intermediate": "HALF"}, {"compute": "HALF"},
        ],
        [
            {"io": "torch.float16", "intermediate": "torch.float32", "compute": "torch.float32"},
            {"graph_kwargs": {"is_dynamic_shape_enabled": False, "is_override_shape_enabled": False}},
        ],
    ),
]

#: Every family, by name.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (*CONV_FAMILIES, *MATMUL_FAMILIES, *POINTWISE_FAMILIES, *REDUCTION_FAMILIES, *NORM_FAMILIES, *ATTENTION_FAMILIES,
              *STRUCTURE_FAMILIES, *QUANT_FAMILIES, *FLAG_FAMILIES)
}  # fmt: skip


def all_variants(names: Sequence[str] | None = None) -> list[Variant]:
    return [v for name, f in FAMILIES.items() if names is None or name in names for v in f.variants()]


def with_params(variant: Variant, **overrides: Any) -> Variant:
    return dataclasses.replace(variant, params={**variant.params, **overrides})
