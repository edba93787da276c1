"""Small real ``cudnn.pygraph`` graphs for the CPU tests.

Each builder is a frozen dataclass: its fields are the graph's shapes, data types, uids
and flags, ``dataclasses.replace`` makes a variant, ``.graph()`` builds a fresh pygraph
(no GPU needed), ``.tensors()`` makes matching CPU torch tensors (inputs plus a zeroed
output, by uid) and ``.reference()`` computes the expected output with torch.

``prefix`` renames every tensor and node, which must not change the key.

Importing this module imports cuDNN Frontend but not torch, so a subprocess that only
computes keys starts quickly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import cudnn

DT = cudnn.data_type

#: cuDNN data type name -> torch dtype name.
TORCH_DTYPE_NAMES = {"FLOAT": "float32", "HALF": "float16", "BFLOAT16": "bfloat16", "DOUBLE": "float64"}


def row_major(dims: list[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def channels_last(dims: list[int]) -> list[int]:
    """Strides of an NCHW-dimensioned tensor stored NHWC, the layout cuDNN convs prefer."""
    _, c, h, w = dims
    return [c * h * w, 1, w * c, c]


def _torch() -> Any:
    import torch

    return torch


def _torch_dtype(name: str) -> Any:
    return getattr(_torch(), TORCH_DTYPE_NAMES[name])


def strided_tensor(dims: list[int], strides: list[int], dtype: str, generator: Any) -> Any:
    """A CPU tensor with exactly these dims and strides, filled with small random values."""
    torch = _torch()
    values = torch.randn(dims, generator=generator) * 0.5
    out = torch.empty_strided(dims, strides, dtype=_torch_dtype(dtype))
    out.copy_(values)
    return out


def zeros_strided(dims: list[int], strides: list[int], dtype: str) -> Any:
    """A zeroed CPU tensor with exactly these dims and strides (an output buffer)."""
    return _torch().empty_strided(dims, strides, dtype=_torch_dtype(dtype)).zero_()


@dataclass(frozen=True)
class ConvBiasRelu:
    """relu(conv_fprop(X, W) + B) (or tanh): X and W NCHW-dimensioned, channels-last in memory."""

    n: int = 2
    c: int = 8
    h: int = 6
    w: int = 6
    k: int = 4
    r: int = 3
    s: int = 3
    padding: int = 1
    conv_stride: int = 1
    dilation: int = 1
    act: str = "relu"  # the pointwise op after the bias: relu or tanh
    dtype: str = "FLOAT"
    compute: str = "FLOAT"
    layout: str = "nhwc"  # of X and W; "nchw" for row-major strides
    uids: tuple[int, int, int, int] = (1, 2, 3, 4)  # X, W, B, Y
    prefix: str = ""
    dynamic: bool = False

    names = ("X", "W", "B", "Y")

    def strides(self, dims: list[int]) -> list[int]:
        return channels_last(dims) if self.layout == "nhwc" else row_major(dims)

    @property
    def x_dims(self) -> list[int]:
        return [self.n, self.c, self.h, self.w]

    @property
    def w_dims(self) -> list[int]:
        return [self.k, self.c, self.r, self.s]

    @property
    def b_dims(self) -> list[int]:
        return [1, self.k, 1, 1]

    @property
    def y_dims(self) -> list[int]:
        def out(size: int, kernel: int) -> int:
            return (size + 2 * self.padding - (kernel - 1) * self.dilation - 1) // self.conv_stride + 1

        return [self.n, self.k, out(self.h, self.r), out(self.w, self.s)]

    def graph(self) -> cudnn.pygraph:
        p, io = self.prefix, getattr(DT, self.dtype)
        g = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=DT.FLOAT,
            compute_data_type=getattr(DT, self.compute),
            is_dynamic_shape_enabled=self.dynamic,
        )
        x = g.tensor(name=p + "X", dim=self.x_dims, stride=self.strides(self.x_dims), data_type=io, uid=self.uids[0])
        w = g.tensor(name=p + "W", dim=self.w_dims, stride=self.strides(self.w_dims), data_type=io, uid=self.uids[1])
        b = g.tensor(name=p + "B", dim=self.b_dims, stride=channels_last(self.b_dims), data_type=io, uid=self.uids[2])
        pad, stride, dil = [self.padding] * 2, [self.conv_stride] * 2, [self.dilation] * 2
        conv = g.conv_fprop(x, w, padding=pad, stride=stride, dilation=dil, name=p + "conv")
        biased = g.bias(conv, b, name=p + "bias")
        y = getattr(g, self.act)(biased, name=p + self.act)
        y.set_output(True).set_uid(self.uids[3]).set_name(p + "Y").set_data_type(io)
        y.set_dim(self.y_dims).set_stride(channels_last(self.y_dims))
        return g

    def tensors(self, seed: int = 0) -> dict[int, Any]:
        gen = _torch().Generator().manual_seed(seed)
        return {
            self.uids[0]: strided_tensor(self.x_dims, self.strides(self.x_dims), self.dtype, gen),
            self.uids[1]: strided_tensor(self.w_dims, self.strides(self.w_dims), self.dtype, gen),
            self.uids[2]: strided_tensor(self.b_dims, channels_last(self.b_dims), self.dtype, gen),
            self.uids[3]: zeros_strided(self.y_dims, channels_last(self.y_dims), self.dtype),
        }

    def reference(self, pack: dict[int, Any]) -> Any:
        torch = _torch()
        x, w, b = (pack[u].float() for u in self.uids[:3])
        y = torch.nn.functional.conv2d(x, w, padding=self.padding, stride=self.conv_stride, dilation=self.dilation)
        return getattr(torch, self.act)(y + b)


@dataclass(frozen=True)
class MatmulBiasRelu:
    """relu(A @ B + bias) with batched A [b, m, k], B [b, k, n] and bias [1, 1, n]."""

    batch: int = 2
    m: int = 8
    k: int = 16
    n: int = 4
    dtype: str = "FLOAT"
    compute: str = "FLOAT"
    b_layout: str = "row"  # "col" stores B column-major
    uids: tuple[int, int, int, int] = (11, 12, 13, 14)  # A, B, bias, C
    prefix: str = ""
    dynamic: bool = False

    names = ("A", "B", "bias", "C")

    @property
    def dims(self) -> tuple[list[int], list[int], list[int], list[int]]:
        return [self.batch, self.m, self.k], [self.batch, self.k, self.n], [1, 1, self.n], [self.batch, self.m, self.n]

    def b_strides(self) -> list[int]:
        if self.b_layout == "col":
            return [self.k * self.n, 1, self.k]
        return row_major(self.dims[1])

    def graph(self) -> cudnn.pygraph:
        p, io = self.prefix, getattr(DT, self.dtype)
        a_dims, b_dims, bias_dims, c_dims = self.dims
        g = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=DT.FLOAT,
            compute_data_type=getattr(DT, self.compute),
            is_dynamic_shape_enabled=self.dynamic,
        )
        a = g.tensor(name=p + "A", dim=a_dims, stride=row_major(a_dims), data_type=io, uid=self.uids[0])
        b = g.tensor(name=p + "B", dim=b_dims, stride=self.b_strides(), data_type=io, uid=self.uids[1])
        bias = g.tensor(name=p + "bias", dim=bias_dims, stride=row_major(bias_dims), data_type=io, uid=self.uids[2])
        product = g.matmul(a, b, name=p + "matmul")
        biased = g.bias(product, bias, name=p + "bias_add")
        c = g.relu(biased, name=p + "relu")
        c.set_output(True).set_uid(self.uids[3]).set_name(p + "C").set_data_type(io)
        c.set_dim(c_dims).set_stride(row_major(c_dims))
        return g

    def tensors(self, seed: int = 0) -> dict[int, Any]:
        gen = _torch().Generator().manual_seed(seed)
        a_dims, b_dims, bias_dims, c_dims = self.dims
        return {
            self.uids[0]: strided_tensor(a_dims, row_major(a_dims), self.dtype, gen),
            self.uids[1]: strided_tensor(b_dims, self.b_strides(), self.dtype, gen),
            self.uids[2]: strided_tensor(bias_dims, row_major(bias_dims), self.dtype, gen),
            self.uids[3]: zeros_strided(c_dims, row_major(c_dims), self.dtype),
        }

    def reference(self, pack: dict[int, Any]) -> Any:
        torch = _torch()
        a, b, bias = (pack[u].float() for u in self.uids[:3])
        return torch.relu(a @ b + bias)


@dataclass(frozen=True)
class CausalSdpa:
    """Scaled dot-product attention, causal by default, q/k/v/o of [b, h, s, d].

    ``scale_by_value``: the attention scale is a pass-by-value tensor (uid ``uids[3]``,
    given at execute time) instead of a float baked into the graph.
    """

    b: int = 1
    h: int = 2
    s: int = 8
    d: int = 16
    dtype: str = "HALF"
    compute: str = "FLOAT"
    causal: bool = True
    attn_scale: float = 0.25
    scale_by_value: bool = True
    uids: tuple[int, int, int, int, int] = (21, 22, 23, 24, 25)  # q, k, v, scale, o
    prefix: str = ""
    dynamic: bool = False

    names = ("q", "k", "v", "scale", "o")

    @property
    def qkv_dims(self) -> list[int]:
        return [self.b, self.h, self.s, self.d]

    def graph(self) -> cudnn.pygraph:
        p, io = self.prefix, getattr(DT, self.dtype)
        dims = self.qkv_dims
        g = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=DT.FLOAT,
            compute_data_type=getattr(DT, self.compute),
            is_dynamic_shape_enabled=self.dynamic,
        )
        q, k, v = (
            g.tensor(name=p + name, dim=dims, stride=row_major(dims), data_type=io, uid=uid)
            for name, uid in zip("qkv", self.uids[:3])
        )
        scale: Any = self.attn_scale
        if self.scale_by_value:
            scale = g.tensor(
                name=p + "scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.FLOAT,
                is_pass_by_value=True, uid=self.uids[3],
            )  # fmt: skip
        o, stats = g.sdpa(q, k, v, attn_scale=scale, use_causal_mask=self.causal, generate_stats=False, name=p + "sdpa")
        assert stats is None  # inference: no softmax stats output
        o.set_output(True).set_uid(self.uids[4]).set_name(p + "o").set_data_type(io)
        o.set_dim(dims).set_stride(row_major(dims))
        return g

    def tensors(self, seed: int = 0) -> dict[int, Any]:
        torch = _torch()
        gen = torch.Generator().manual_seed(seed)
        dims = self.qkv_dims
        pack = {uid: strided_tensor(dims, row_major(dims), self.dtype, gen) for uid in self.uids[:3]}
        if self.scale_by_value:
            pack[self.uids[3]] = torch.full((1, 1, 1, 1), self.attn_scale, dtype=torch.float32)
        pack[self.uids[4]] = zeros_strided(dims, row_major(dims), self.dtype)
        return pack

    def reference(self, pack: dict[int, Any]) -> Any:
        torch = _torch()
        q, k, v = (pack[u].float() for u in self.uids[:3])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.attn_scale)


def output_uid(spec: Any) -> int:
    """The uid of a builder's single output."""
    return spec.uids[-1]


#: One default instance of each builder, by name.
EXAMPLES: dict[str, Any] = {
    "conv_bias_relu": ConvBiasRelu(),
    "matmul_bias_relu": MatmulBiasRelu(),
    "causal_sdpa": CausalSdpa(),
    "causal_sdpa_float_scale": CausalSdpa(scale_by_value=False),
}


def conv_bias_relu(**fields: Any) -> cudnn.pygraph:
    return dataclasses.replace(EXAMPLES["conv_bias_relu"], **fields).graph()


def matmul_bias_relu(**fields: Any) -> cudnn.pygraph:
    return dataclasses.replace(EXAMPLES["matmul_bias_relu"], **fields).graph()


def causal_sdpa(**fields: Any) -> cudnn.pygraph:
    return dataclasses.replace(EXAMPLES["causal_sdpa"], **fields).graph()


def assert_runs_correctly(plan: Any, spec: Any, *, seed: int = 0, by_name: bool = False) -> None:
    """Execute ``plan`` on fresh tensors for ``spec`` and compare with the torch reference."""
    torch = _torch()
    pack = spec.tensors(seed)
    out = pack[output_uid(spec)]
    if by_name:
        names = dict(zip(spec.uids, (spec.prefix + n for n in spec.names)))
        plan.execute({names[uid]: tensor for uid, tensor in pack.items()})
    else:
        plan.execute(pack)
    expected = spec.reference(pack)
    tolerance = 1e-5 if spec.dtype == "FLOAT" else 1e-2
    assert float(expected.abs().max()) > 0, "a reference of all zeros proves nothing"
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
