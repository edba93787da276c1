"""Built-in graph templates for the common fused ops, with PyTorch references.

Each template builds a ``cudnn.pygraph`` with fixed uids from keyword parameters, lists
its tensors (so callers can allocate them), and computes the same result in PyTorch.
Manifests name templates (``plancache prewarm``), tests check plans against the
references, and the benchmark builds its suite from them.

Default layouts are the ones cuDNN is fastest with: convolutions NHWC (dims NCHW,
channels-last strides), attention BSHD (dims BHSD), matmuls row-major; ``layout=`` picks
another (``LAYOUTS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..config import StrEnum
from ..errors import ManifestError, NoGpuError
from ..guest.tensors import span

__all__ = ["LAYOUTS", "TEMPLATES", "Layout", "Template", "TensorLayout", "allocate", "build", "reference"]

ACTIVATIONS = ("relu", "gelu", "sigmoid", "tanh", "swish", None)
DTYPES = {"bfloat16": "BFLOAT16", "float16": "HALF", "float32": "FLOAT"}


@dataclass(frozen=True)
class TensorLayout:
    uid: int
    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    is_output: bool


def _cudnn() -> Any:
    from ..cudnn.backend import cudnn_module

    return cudnn_module()


def _nhwc(n: int, c: int, h: int, w: int) -> tuple[int, ...]:
    return (h * w * c, 1, w * c, c)


def _rows(*dims: int) -> tuple[int, ...]:
    return tuple(math.prod(dims[i + 1 :]) for i in range(len(dims)))


def _out_hw(size: int, kernel: int, padding: int, stride: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


# ---------------------------------------------------------------------- layouts


class Layout(StrEnum):
    """A template's memory layout (``layout=``)."""

    NHWC = "nhwc"
    NCHW = "nchw"
    NN = "nn"
    NT = "nt"  # t: that operand is stored transposed (column-major)
    TN = "tn"
    BSHD = "bshd"
    BHSD = "bhsd"


#: Memory layouts each template accepts (``layout=``); the first is the default.
LAYOUTS = {
    "conv_bias_act": (Layout.NHWC, Layout.NCHW),
    "matmul_bias_act": (Layout.NN, Layout.NT, Layout.TN),
    "sdpa": (Layout.BSHD, Layout.BHSD),
}


def _conv_layout(n: int, c: int, h: int, w: int, k: int, r: int = 3, s: int = 3, padding: int = 1, stride: int = 1,
                 dilation: int = 1, bias: bool = True, layout: str = Layout.NHWC, **_: Any) -> list[TensorLayout]:  # fmt: skip
    oh, ow = _out_hw(h, r, padding, stride, dilation), _out_hw(w, s, padding, stride, dilation)
    order = _nhwc if Layout(layout) is Layout.NHWC else _rows
    tensors = [
        TensorLayout(1, "X", (n, c, h, w), order(n, c, h, w), False),
        TensorLayout(2, "W", (k, c, r, s), order(k, c, r, s), False),
    ]
    if bias:
        tensors.append(TensorLayout(3, "B", (1, k, 1, 1), (k, 1, k, k), False))
    tensors.append(TensorLayout(4, "Y", (n, k, oh, ow), order(n, k, oh, ow), True))
    return tensors


def _cols(rows: int, cols: int) -> tuple[int, ...]:
    """Strides of a batched ``rows x cols`` matrix stored column-major."""
    return (rows * cols, 1, rows)


def _matmul_layout(b: int, m: int, n: int, k: int, bias: bool = True, layout: str = Layout.NN, **_: Any) -> list[TensorLayout]:
    a_strides = _cols(m, k) if Layout(layout) is Layout.TN else _rows(b, m, k)
    b_strides = _cols(k, n) if Layout(layout) is Layout.NT else _rows(b, k, n)
    layout_ = [TensorLayout(1, "A", (b, m, k), a_strides, False), TensorLayout(2, "B", (b, k, n), b_strides, False)]
    if bias:
        layout_.append(TensorLayout(3, "bias", (1, 1, n), (n, n, 1), False))
    layout_.append(TensorLayout(4, "C", (b, m, n), _rows(b, m, n), True))
    return layout_


def _bshd(b: int, h: int, s: int, d: int) -> tuple[int, ...]:
    return (s * h * d, d, h * d, 1)


def _sdpa_layout(b: int, h: int, s: int, d: int, h_kv: int | None = None, s_kv: int | None = None, layout: str = Layout.BSHD,
                 **_: Any) -> list[TensorLayout]:  # fmt: skip
    h_kv, s_kv = h_kv or h, s_kv or s
    order = _bshd if Layout(layout) is Layout.BSHD else _rows
    return [
        TensorLayout(1, "q", (b, h, s, d), order(b, h, s, d), False),
        TensorLayout(2, "k", (b, h_kv, s_kv, d), order(b, h_kv, s_kv, d), False),
        TensorLayout(3, "v", (b, h_kv, s_kv, d), order(b, h_kv, s_kv, d), False),
        TensorLayout(4, "o", (b, h, s, d), order(b, h, s, d), True),
    ]


# ---------------------------------------------------------------------- builders


def _build(layout_of: Callable[..., list[TensorLayout]], op: Callable[..., Any], dtype: str = "bfloat16",
           dynamic: bool = False, kernel_cache: Any = None, handle: Any = None, **params: Any) -> Any:  # fmt: skip
    """A template's graph: the tensors ``layout_of`` lists, ``op`` applied to its inputs giving
    its output. Each template's ``build`` is this with its two functions bound
    (``functools.partial``, which pickles by reference, as ``prewarm --devices`` sends it)."""
    layout = layout_of(**params)
    cudnn = _cudnn()
    io = getattr(cudnn.data_type, DTYPES[dtype])
    kwargs: dict[str, Any] = {"handle": handle} if handle is not None else {}
    if dynamic:
        kwargs["is_dynamic_shape_enabled"] = True
        if kernel_cache is not None:
            kwargs["kernel_cache"] = kernel_cache
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, **kwargs)  # fmt: skip
    inputs = {t.name: graph.tensor(name=t.name, dim=list(t.shape), stride=list(t.stride), data_type=io, uid=t.uid)
              for t in layout if not t.is_output}  # fmt: skip
    out, spec = op(graph, inputs, **params), layout[-1]
    out.set_output(True).set_uid(spec.uid).set_name(spec.name).set_dim(list(spec.shape)).set_stride(list(spec.stride))
    out.set_data_type(io)
    return graph


def _activate(graph: Any, value: Any, act: str | None) -> Any:
    if act is None:
        return value
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; choose from {ACTIVATIONS}")
    return getattr(graph, act)(input=value)


def _conv(graph: Any, t: Mapping[str, Any], act: str | None = "relu", padding: int = 1, stride: int = 1, dilation: int = 1,
          **_: Any) -> Any:  # fmt: skip
    y = graph.conv_fprop(image=t["X"], weight=t["W"], padding=[padding] * 2, stride=[stride] * 2, dilation=[dilation] * 2)
    return _activate(graph, graph.bias(input=y, bias=t["B"]) if "B" in t else y, act)


def _matmul(graph: Any, t: Mapping[str, Any], act: str | None = "relu", **_: Any) -> Any:
    c = graph.matmul(t["A"], t["B"], compute_data_type=_cudnn().data_type.FLOAT)
    return _activate(graph, graph.add(a=c, b=t["bias"]) if "bias" in t else c, act)


def _sdpa(graph: Any, t: Mapping[str, Any], d: int, causal: bool = True, **_: Any) -> Any:
    o, _stats = graph.sdpa(q=t["q"], k=t["k"], v=t["v"], is_inference=True, attn_scale=float(d) ** -0.5, use_causal_mask=causal)
    return o


# ---------------------------------------------------------------------- references


def _torch_act(torch: Any, value: Any, act: str | None) -> Any:
    functional = torch.nn.functional
    table = {None: lambda x: x, "relu": torch.relu, "gelu": functional.gelu, "sigmoid": torch.sigmoid,
             "tanh": torch.tanh, "swish": functional.silu}  # fmt: skip
    return table[act](value)


def _ref_conv(torch: Any, x: Mapping[int, Any], act: str | None = "relu", padding: int = 1, stride: int = 1,
              dilation: int = 1, bias: bool = True, **_: Any) -> Any:  # fmt: skip
    y = torch.nn.functional.conv2d(x[1].float(), x[2].float(), padding=padding, stride=stride, dilation=dilation)
    return _torch_act(torch, y + x[3].float() if bias else y, act)


def _ref_matmul(torch: Any, x: Mapping[int, Any], act: str | None = "relu", bias: bool = True, **_: Any) -> Any:
    c = torch.matmul(x[1].float(), x[2].float())
    return _torch_act(torch, c + x[3].float() if bias else c, act)


def _ref_sdpa(torch: Any, x: Mapping[int, Any], causal: bool = True, **params: Any) -> Any:
    q, k, v = x[1].float(), x[2].float(), x[3].float()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=float(params["d"]) ** -0.5)


@dataclass(frozen=True)
class Template:
    name: str
    required: tuple[str, ...]
    build: Callable[..., Any]
    layout: Callable[..., list[TensorLayout]]
    reference: Callable[..., Any]
    summary: str
    input_scale: float = 0.5  # of ``allocate``'s random inputs


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("conv_bias_act", ("n", "c", "h", "w", "k"), partial(_build, _conv_layout, _conv), _conv_layout, _ref_conv,
                 "2-D convolution (NHWC) + optional bias + optional activation"),
        Template("matmul_bias_act", ("b", "m", "n", "k"), partial(_build, _matmul_layout, _matmul), _matmul_layout, _ref_matmul,
                 "batched matmul + optional bias + optional activation"),
        Template("sdpa", ("b", "h", "s", "d"), partial(_build, _sdpa_layout, _sdpa), _sdpa_layout, _ref_sdpa,
                 "scaled dot-product attention forward (inference), optional causal mask and GQA", 1.0),
    )
}  # fmt: skip

_OPTIONAL = {"dtype", "act", "bias", "padding", "stride", "dilation", "r", "s", "causal", "h_kv", "s_kv", "dynamic", "layout"}


def _template(name: str, params: Mapping[str, Any]) -> Template:
    template = TEMPLATES.get(name)
    if template is None:
        raise ManifestError(f"unknown template {name!r}; known: {', '.join(TEMPLATES)}", path=None, entry=None)
    missing = [p for p in template.required if p not in params]
    unknown = [p for p in params if p not in template.required and p not in _OPTIONAL]
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ManifestError(f"template {name!r}: " + ", ".join(parts), path=None, entry=None)
    for p in template.required:
        if not isinstance(params[p], int) or isinstance(params[p], bool) or params[p] < 1:
            raise ManifestError(f"template {name!r}: {p} must be a positive integer, not {params[p]!r}", path=None, entry=None)
    if params.get("dtype", "bfloat16") not in DTYPES:
        raise ManifestError(f"template {name!r}: dtype must be one of {list(DTYPES)}", path=None, entry=None)
    if params.get("layout", LAYOUTS[name][0]) not in LAYOUTS[name]:
        raise ManifestError(f"template {name!r}: layout must be one of {[str(x) for x in LAYOUTS[name]]}", path=None, entry=None)
    return template


def build(name: str, kernel_cache: Any = None, handle: Any = None, **params: Any) -> Any:
    """Build template ``name`` as a ``cudnn.pygraph`` (no GPU needed). ``kernel_cache``
    applies to dynamic-shape graphs; ``handle`` is the cuDNN handle the graph builds with."""
    return _template(name, params).build(kernel_cache=kernel_cache, handle=handle, **params)


def layout(name: str, **params: Any) -> list[TensorLayout]:
    return _template(name, params).layout(**params)


def allocate(name: str, device: str = "cuda", seed: int = 0, **params: Any) -> dict[int, Any]:
    """Random inputs (never zero) and an empty output for template ``name``, by uid, on
    ``device`` (``"cpu"`` for the CPU test backend)."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():  # torch's own is a bare AssertionError
        raise NoGpuError(f"allocate({name!r}, device={device!r}): no CUDA device is visible; pass device='cpu' for the CPU "
                         "test backend")  # fmt: skip
    dtype = getattr(torch, params.get("dtype", "bfloat16"))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for t in layout(name, **params):
        size = span(t.shape, t.stride)
        if t.is_output:
            flat = torch.full((size,), float("nan"), dtype=dtype)
        else:
            flat = (torch.rand(size, generator=generator) * 0.75 + 0.25) * (
                torch.randint(0, 2, (size,), generator=generator) * 2 - 1
            )
            flat = (flat * TEMPLATES[name].input_scale).to(dtype)
        tensors[t.uid] = torch.as_strided(flat.to(device), t.shape, t.stride)
    return tensors


def reference(name: str, tensors: Mapping[int, Any], **params: Any) -> Any:
    """The template's result computed by PyTorch in float32."""
    import torch

    return _template(name, params).reference(torch, tensors, **params)
