"""Reference kernels of the CPU test backend, and the faults a GPU kernel would take.

``evaluate`` runs a canonical description (``plancache.key.describe``) on the CPU in
float32: convolution, matmul, pointwise ops (with their slopes and clips), SDPA (causal,
with sequence lengths, ragged offsets read as the dense layout they equal, and paged K/V
gathered through their page tables) and the MoE grouped matmul. A parameter or input it
does not compute with (``_MODELLED``, ``_READ``) is refused as unsupported, as a GPU
without an engine for it refuses it, never computed as if it were not there.

``fault`` is what makes the test device behave like a GPU where it matters most: it reads
every value that steers addressing (ragged offsets, sequence lengths, page tables, MoE token
offsets and indices) and says how a kernel would fault on it (a misaligned or out-of-range
address). The backend then poisons itself, as a sticky CUDA error kills a process's CUDA
context. It is written apart from ``plancache.autotuning.inputs`` on purpose: it checks the
values that module makes instead of trusting them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..guest.tensors import DTYPE_BYTES, span
from ..key import TensorSpec

__all__ = ["Behaviour", "evaluate", "fault", "scratch_bytes", "stage_outputs"]


def _pointwise(torch: Any, mode: str, a: Any, b: Any, params: Mapping[str, Any]) -> Any:
    functional = torch.nn.functional
    binary = {"add": torch.add, "bias": torch.add, "sub": torch.sub, "mul": torch.mul, "scale": torch.mul,
              "div": torch.div, "max": torch.maximum, "min": torch.minimum, "pow": torch.pow}  # fmt: skip
    unary = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp,
             "log": torch.log, "neg": torch.neg, "abs": torch.abs, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
             "identity": lambda x: x, "gelu": functional.gelu,
             "swish": lambda x: x * torch.sigmoid(float(params.get("swish_beta", 1.0)) * x),
             "gelu_approx_tanh": lambda x: functional.gelu(x, approximate="tanh"), "erf": torch.erf}  # fmt: skip
    if mode in binary:
        return binary[mode](a, b)
    if mode in unary:
        return unary[mode](a)
    if mode in ("relu", "leaky_relu"):
        # cuDNN's RELU_FWD as its engines compute it (H200, cuDNN 9.19): the larger of the
        # input capped at the upper clip and the slope's line through the lower clip (0 by
        # default).
        slope = params.get("negative_slope")
        slope = float(slope) if slope is not None else (0.01 if mode == "leaky_relu" else 0.0)  # a slope of 0 is 0
        lower = float(params.get("lower_clip") or 0.0)
        upper = params.get("upper_clip")
        capped = a if upper is None else a.clamp(max=float(upper))
        return torch.maximum(capped, lower + slope * (a - lower))
    raise NotImplementedError(f"pointwise mode {mode!r}")


def evaluate(description: Mapping[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a canonical description on CPU in float32; ``values`` maps tensor ids to
    tensors (inputs in, every node's outputs added)."""
    import torch

    for tid, spec in description["tensors"].items():  # scalars the graph holds itself
        if tid.startswith("c"):
            scalar = spec["scalar"]
            values[tid] = float(scalar["float"]) if isinstance(scalar, dict) else scalar

    def get(ref: str | None) -> Any:
        if ref is None:
            return None
        value = values[ref]
        if isinstance(value, (int, float)):
            return torch.tensor(float(value))
        return value.float()

    for node in description["nodes"]:
        kind, params, ins = node["type"], node["params"], node["inputs"]
        _refuse_unmodelled(node)
        if kind == "CONV_FPROP":
            x, w = get(ins["image"]), get(ins["weight"])
            conv = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[x.dim()]
            out = conv(x, w, padding=params["padding"], stride=params["stride"], dilation=params["dilation"],
                       groups=x.shape[1] // w.shape[1])  # fmt: skip
        elif kind == "POINTWISE":
            out = _pointwise(torch, str(params.get("mode")), get(ins.get("IN_0")), get(ins.get("IN_1")), params)
        elif kind == "MATMUL":
            out = torch.matmul(get(ins["A"]), get(ins["B"]))
        elif kind == "SDPA":
            out = _sdpa(torch, description, ins, params, get)
        elif kind == "MOE_GROUPED_MATMUL":
            out = _moe(torch, ins, params, get)
        else:
            raise NotImplementedError(f"node type {kind}")
        first_port = next(iter(node["outputs"]))
        values[node["outputs"][first_port]] = out
    return values


#: The parameters each node's kernel here computes with. A graph that sets another one
#: (a sliding window, a bottom-right causal mask, a convolution in CONVOLUTION mode) is one
#: the test device does not support, as a GPU without an engine for it: computing it
#: without that parameter would be a result cuDNN never gives, and a test would pass on it.
_MODELLED = {
    "CONV_FPROP": {"padding", "stride", "dilation"},
    "POINTWISE": {"mode", "negative_slope", "lower_clip", "upper_clip", "swish_beta"},
    "MATMUL": {"padding"},
    "SDPA": {
        "attn_scale",
        "is_inference",
        "generate_stats",
        "use_causal_mask",
        "causal_mask",
        "use_padding_mask",
        "paged_attention_max_seq_len_kv",
    },
    "MOE_GROUPED_MATMUL": {"mode"},  # NONE, or GATHER through token_index (below)
}
#: Inputs each kernel reads; another (an ALiBi slope, a bias, a dropout mask) is refused too.
_READ = {
    "CONV_FPROP": {"image", "weight"},
    "POINTWISE": {"IN_0", "IN_1"},
    "MATMUL": {"A", "B"},
    "SDPA": {"q", "k", "v", "attn_scale", "seq_len_q", "seq_len_kv", "paged_attention_k_table", "paged_attention_v_table"},
    "MOE_GROUPED_MATMUL": {"token", "weight", "first_token_offset", "token_index"},
}


def _refuse_unmodelled(node: Mapping[str, Any]) -> None:
    """``NotImplementedError`` for what this module would not compute as cuDNN does."""
    kind = node["type"]
    if kind not in _MODELLED:
        raise NotImplementedError(f"node type {kind}")
    params = node["params"]
    unmodelled = sorted(set(params) - _MODELLED[kind]) + sorted(set(node["inputs"]) - _READ[kind])
    if kind == "MATMUL" and params.get("padding") not in (None, 0, 0.0):
        unmodelled.append("padding")
    if kind == "MOE_GROUPED_MATMUL" and str(params.get("mode", "NONE")).rsplit(".", 1)[-1] not in ("NONE", "GATHER"):
        unmodelled.append(f"mode {params['mode']}")
    if unmodelled:
        raise NotImplementedError(f"{kind} with {', '.join(unmodelled)}")
    later = list(node["outputs"].items())[1:]  # only the first output is computed here
    if any(not str(ref).startswith("v") for _, ref in later):
        raise NotImplementedError(f"{kind} returning its {', '.join(port for port, _ in later)} output")


def _sdpa(torch: Any, description: Mapping[str, Any], ins: Mapping[str, str], params: Mapping[str, Any], get: Any) -> Any:
    q, k, v = get(ins["q"]), get(ins["k"]), get(ins["v"])
    if "paged_attention_k_table" in ins:  # gather each sequence's pages from the pool
        k, v = (_gather_pages(torch, pool, get(ins[f"paged_attention_{n}_table"]), params) for n, pool in (("k", k), ("v", v)))
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = get(ins.get("attn_scale")) if ins.get("attn_scale") else params.get("attn_scale")
    # cuDNN lowers an omitted attn_scale as no scaling (1.0), not 1/sqrt(d).
    scores = torch.matmul(q, k.transpose(-1, -2)) * (float(scale) if scale is not None else 1.0)
    b, _, s_q, s_kv = scores.shape
    keep = torch.ones(b, 1, s_q, s_kv, dtype=torch.bool)
    if params.get("use_causal_mask") or params.get("causal_mask"):
        keep &= torch.ones(s_q, s_kv, dtype=torch.bool).tril()
    rows = torch.full((b,), s_q)
    if ins.get("seq_len_kv"):
        lengths = get(ins["seq_len_kv"]).reshape(-1).long()
        keep &= torch.arange(s_kv).view(1, 1, 1, -1) < lengths.view(-1, 1, 1, 1)
    if ins.get("seq_len_q"):
        rows = get(ins["seq_len_q"]).reshape(-1).long()
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    out = torch.matmul(weights, v)
    return out * (torch.arange(s_q).view(1, 1, -1, 1) < rows.view(-1, 1, 1, 1))


def _gather_pages(torch: Any, pool: Any, table: Any, params: Mapping[str, Any]) -> Any:
    pages = table.reshape(table.shape[0], -1).long()  # [b, pages per sequence]
    gathered = pool[pages]  # [b, pages, h, block, d]
    b, n, h, block, d = gathered.shape
    longest = int(params.get("paged_attention_max_seq_len_kv") or n * block)
    return gathered.permute(0, 2, 1, 3, 4).reshape(b, h, n * block, d)[:, :, :longest]


def _moe(torch: Any, ins: Mapping[str, str], params: Mapping[str, Any], get: Any) -> Any:
    token, weight = get(ins["token"]), get(ins["weight"])  # [1, T, H], [E, H, N]
    rows = token[0]
    if "token_index" in ins:
        rows = rows[get(ins["token_index"]).reshape(-1).long()]
    offsets = [int(o) for o in get(ins["first_token_offset"]).reshape(-1).tolist()] + [rows.shape[0]]
    out = torch.zeros(rows.shape[0], weight.shape[-1])
    for expert in range(weight.shape[0]):
        start, end = offsets[expert], offsets[expert + 1]
        if end > start:
            out[start:end] = rows[start:end] @ weight[expert]
    return out.unsqueeze(0)


def fault(description: Mapping[str, Any], specs: Sequence[TensorSpec], pack: Mapping[int, Any]) -> str | None:
    """How a GPU kernel would fault reading ``pack`` (tensors by uid) through this graph's
    steering values, or None when every address stays aligned and in range."""
    tensors = description.get("tensors") or {}
    by_uid = {spec.uid: spec for spec in specs}

    def ints(tid: str) -> list[int] | None:
        tensor = pack.get(int(tid[1:])) if tid.startswith("u") else None
        return None if tensor is None else [int(x) for x in tensor.reshape(-1).tolist()]

    for tid, tensor in tensors.items():  # ragged offsets: aligned, non-decreasing, inside the tensor
        ref = tensor.get("ragged_offset") if isinstance(tensor, Mapping) else None
        offsets = ints(ref) if isinstance(ref, str) else None
        user = by_uid.get(int(tid[1:])) if tid.startswith("u") else None
        if offsets is None or user is None:
            continue
        size = DTYPE_BYTES.get(user.dtype or "", 4) * int(tensor.get("ragged_offset_multiplier") or 1)
        extent = span(user.dims, user.strides)
        if any(o * size % 16 for o in offsets):
            return f"misaligned address: ragged offsets of uid {user.uid} are not 16-byte aligned ({offsets[:4]}...)"
        if any(b < a for a, b in itertools.pairwise(offsets)) or min(offsets) < 0 or max(offsets) > extent:
            return f"illegal memory access: ragged offsets of uid {user.uid} leave the tensor ({offsets[:4]}...)"
    for node in description.get("nodes") or []:
        reason = _node_fault(node, by_uid, ints)
        if reason is not None:
            return reason
    return None


def _node_fault(node: Mapping[str, Any], by_uid: Mapping[int, TensorSpec], ints: Any) -> str | None:
    kind, ins, params = node.get("type"), node.get("inputs") or {}, node.get("params") or {}

    def dim(port: str, axis: int) -> int:
        spec = by_uid.get(int(ins[port][1:]))
        return int(spec.dims[axis]) if spec is not None and spec.dims else 0

    if kind in ("SDPA", "SDPA_BWD"):
        if "paged_attention_k_table" in ins:
            for name in ("k", "v"):
                table = ints(ins[f"paged_attention_{name}_table"]) or []
                if any(not 0 <= p < dim(name, 0) for p in table):
                    return f"illegal memory access: a {name} page table entry is outside the pool of {dim(name, 0)} pages"
            longest = int(params.get("paged_attention_max_seq_len_kv") or 0)
        else:
            longest = dim("k", 2)
        for port, limit in (("seq_len_q", dim("q", 2)), ("seq_len_kv", longest)):
            if port in ins and any(not 0 <= n <= limit for n in ints(ins[port]) or []):
                return f"illegal memory access: {port} holds a length outside 0..{limit}"
    if kind == "MOE_GROUPED_MATMUL":
        rows = dim("token_index", -2) if "token_index" in ins else dim("token", -2)
        offsets = ints(ins["first_token_offset"]) or []
        if any(b < a for a, b in itertools.pairwise(offsets)) or any(not 0 <= o <= rows for o in offsets):
            return f"illegal memory access: MoE token offsets {offsets[:4]}... are not ordered offsets within {rows} rows"
        if "token_index" in ins and any(not 0 <= i < dim("token", -2) for i in ints(ins["token_index"]) or []):
            return "illegal memory access: a MoE token index is outside the tokens"
    return None


def scratch_bytes(tensors: Sequence[TensorSpec]) -> int:
    """Workspace a test plan stages its outputs in: float32 of every output."""
    return sum(4 * math.prod(int(d) for d in spec.dims) for spec in tensors if spec.is_output)


@dataclass(frozen=True)
class Behaviour:
    """How one engine's results differ from the float32 reference, as cuDNN engines' do.

    Right engines differ by rounding: one that ``nudges`` rounds every third element one
    ulp of the output's type the other way. Wrong ones come in two kinds seen on GPUs: off
    everywhere (``scale``), or wrong only on a band of values (``band``: 0 is written
    wherever the right result lies strictly inside ``(low, high)``, as an engine that
    ignores a clip moves only the outputs the clip would have changed)."""

    scale: float = 1.0
    band: tuple[float, float] | None = None
    nudges: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "band": list(self.band) if self.band else None, "nudges": self.nudges}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Behaviour:
        data = data or {}
        band = data.get("band")
        return cls(float(data.get("scale", 1.0)), (float(band[0]), float(band[1])) if band else None, bool(data.get("nudges")))

    def apply(self, torch: Any, result: Any) -> Any:
        """The engine's float32 result from the reference's."""
        if self.scale != 1.0:
            result = result * self.scale
        if self.band is not None:
            low, high = self.band
            result = torch.where((result > low) & (result < high), torch.zeros_like(result), result)
        return result

    def round_other_way(self, torch: Any, out: Any) -> None:
        """One ulp of ``out``'s type on every third element, in place."""
        widths = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
        if not self.nudges or out.dtype not in widths:
            return
        bits = out.view(widths[out.dtype])
        every_third = (torch.arange(out.numel()).reshape(out.shape) % 3) == 0
        bits[every_third & (out != 0) & out.isfinite()] += 1  # away from zero, in either sign


def stage_outputs(torch: Any, tensors: Sequence[TensorSpec], values: Mapping[str, Any], pack: Mapping[int, Any],
                  workspace: Any, behaviour: Behaviour) -> None:  # fmt: skip
    """Write each output through the workspace, as kernels stage partial results in theirs:
    a launch that shares its workspace with a concurrent one reads the other's values.
    ``behaviour``: how this engine's results differ from the reference's."""
    import time

    offset = 0
    for spec in tensors:
        if not spec.is_output:
            continue
        result = behaviour.apply(torch, values[f"u{spec.uid}"].float()).reshape(-1)
        size = 4 * result.numel()
        if workspace.numel() < offset + size:
            raise RuntimeError(f"workspace of {workspace.numel()} bytes is too small for this plan")
        scratch = workspace[offset : offset + size].view(torch.float32)
        scratch.copy_(result)
        time.sleep(0)  # let a concurrent launch run here, as concurrent kernels would
        out = pack[spec.uid]
        out.copy_(scratch.view(values[f"u{spec.uid}"].shape))
        behaviour.round_other_way(torch, out)
        offset += size
