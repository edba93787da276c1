"""Inputs that cannot fault: the tensors autotuning launches candidates on.

A candidate is launched on synthetic tensors unless the caller passed its own. Values that
only feed arithmetic are random; values that steer addressing or control flow (ragged
offsets, sequence lengths, page tables, MoE token offsets and indices, dropout seeds) get
values valid by construction for the role the graph gives the tensor. A kernel that reads
through a bad offset faults with a sticky CUDA error, and the caller's whole CUDA context is
gone; so a tensor whose role plancache does not know makes ``plan_inputs`` refuse, and then
nothing is launched (the heuristics' order is taken, recorded as "not timed: <why>").

The roles come from the graph's canonical description (``key.describe``): which node port
a tensor feeds, and which tensors name it as their ragged offset. Pure: ``plan_inputs``
imports nothing of torch or cuDNN; ``materialize`` takes the torch module it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import MemoryBudget, StrEnum, format_size
from ..guest.tensors import DTYPE_BYTES, TORCH_DTYPES, span, storage_geometry
from ..key import TensorSpec

__all__ = ["OUTPUT_COPIES", "Fill", "FillKind", "InputPlan", "Refusal", "TimingInputs", "materialize", "plan_inputs",
           "timing_inputs"]  # fmt: skip

_INTEGERS = frozenset({"data_type.INT8", "data_type.UINT8", "data_type.INT32", "data_type.INT64", "data_type.INT4"})
_ATTENTION = frozenset({"SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8", "SDPA_MXFP8_BWD"})
#: Node ports whose integer or boolean values are arithmetic data, never addresses.
_DATA_PORTS = {"POINTWISE": ("IN_0", "IN_1", "IN_2"), "MATMUL": ("A", "B"), "CONV_FPROP": ("image", "weight")}
#: Tokens per expert group the MoE offsets are rounded to: every alignment an engine asks
#: for (8 or 16 rows) divides it, and 0 is always valid.
_MOE_ROW_ALIGNMENT = 64
_CHUNK = 1 << 23  # elements generated at once: bounds the float32 staging to 32 MiB


class FillKind(StrEnum):
    """How a tensor is filled: a statistic (``MEAN``, ``INV_STD``, ``INV_RMS``) is of the
    input uid ``Fill.source`` over the axes the tensor broadcasts."""

    RANDOM = "random"  # ±[0.25, 1)
    POSITIVE = "positive"  # [0.25, 1)
    BOOL = "bool"
    SMALL_INT = "small_int"  # 1..3
    VALUES = "values"  # ``Fill.values``, in row-major order of the dims
    MEAN = "mean"
    INV_STD = "inv_std"  # 1/sqrt(var + 1e-5)
    INV_RMS = "inv_rms"  # 1/sqrt(mean(x^2) + 1e-5)


@dataclass(frozen=True)
class Fill:
    """How to fill one tensor (``FillKind``)."""

    spec: TensorSpec
    kind: FillKind
    role: str
    values: tuple[float, ...] = ()
    source: int = 0


@dataclass
class InputPlan:
    """What a timing run allocates: the fills of the inputs, the outputs it writes."""

    fills: dict[int, Fill]
    outputs: list[TensorSpec]
    given: dict[int, Any] = field(default_factory=dict)  # the caller's own tensors, by uid

    def device_bytes(self, output_copies: int = 0, float32_copies: int = 0) -> int:
        """Device memory the inputs and outputs take, plus ``output_copies`` copies of the
        outputs (what comparing candidates keeps) and ``float32_copies`` float32 tensors of
        each output's size (the magnitudes its bound is computed from)."""
        inputs = sum(_bytes(f.spec) for uid, f in self.fills.items() if not f.spec.is_pass_by_value and uid not in self.given)
        outputs = sum(_bytes(s) for s in self.outputs)
        elements = sum(_bytes(s) // DTYPE_BYTES.get(s.dtype or "", 4) for s in self.outputs)
        return inputs + outputs * (1 + output_copies) + 4 * elements * float32_copies


@dataclass(frozen=True)
class Refusal:
    """Why no candidate may be launched."""

    why: str


def _layout(spec: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    geometry = storage_geometry(spec.dtype, tuple(spec.dims), tuple(spec.strides))
    return geometry if geometry is not None else (tuple(spec.dims), tuple(spec.strides))


def _bytes(spec: TensorSpec) -> int:
    return span(*_layout(spec)) * DTYPE_BYTES.get(spec.dtype or "", 4)


def plan_inputs(
    description: Mapping[str, Any], specs: Sequence[TensorSpec], given: Mapping[int, Any] | None = None
) -> InputPlan | Refusal:
    """The fill of every input of the graph, or the ``Refusal`` that says why no synthetic
    input can be safe (then nothing may be launched). ``given``: tensors the caller passed,
    by uid (not filled)."""
    given = dict(given or {})
    by_uid = {spec.uid: spec for spec in specs}
    outputs = [spec for spec in specs if spec.is_output]
    for spec in outputs:
        if not spec.dims or len(spec.strides) != len(spec.dims):
            return Refusal(f"output uid {spec.uid} has no known shape")
    roles = _Roles(description, by_uid)
    fills: dict[int, Fill] = {}
    for spec in specs:
        if spec.is_output:
            continue
        if not spec.is_pass_by_value and (not spec.dims or len(spec.strides) != len(spec.dims)):
            return Refusal(f"input uid {spec.uid} has no known shape")
        fill = roles.fill(spec)
        if isinstance(fill, Refusal):
            if spec.uid in given:
                continue  # the caller's own values: valid for the role by the caller's word
            return fill
        fills[spec.uid] = fill
    return InputPlan(
        fills=fills, outputs=outputs, given={u: t for u, t in given.items() if u in by_uid and not by_uid[u].is_output}
    )


class _Roles:
    """Which role each input plays in the graph, and the values that are valid for it."""

    def __init__(self, description: Mapping[str, Any], by_uid: Mapping[int, TensorSpec]) -> None:
        self.by_uid = by_uid
        self.ports: dict[str, list[tuple[Mapping[str, Any], str]]] = {}  # tensor id -> [(node, port)]
        for node in description.get("nodes") or []:
            for port, tid in (node.get("inputs") or {}).items():
                self.ports.setdefault(tid, []).append((node, port))
        self.tensors = description.get("tensors") or {}
        self.ragged_users: dict[str, list[int]] = {}  # offset tensor id -> uids of the tensors it offsets
        for tid, tensor in self.tensors.items():
            ref = tensor.get("ragged_offset")
            if isinstance(ref, str) and tid.startswith("u"):
                self.ragged_users.setdefault(ref, []).append(int(tid[1:]))

    def fill(self, spec: TensorSpec) -> Fill | Refusal:
        tid = f"u{spec.uid}"
        if spec.is_pass_by_value:
            kind = FillKind.POSITIVE if spec.dtype not in _INTEGERS else FillKind.VALUES
            return Fill(spec, kind, "a scalar passed by value", (1.0,))
        if tid in self.ragged_users:
            return self._ragged(spec, tid)
        uses = self.ports.get(tid, [])
        for node, port in uses:
            role = self._steering(spec, node, port)
            if role is not None:
                return role
        if spec.dtype not in _INTEGERS and spec.dtype != "data_type.BOOLEAN":
            return Fill(spec, FillKind.POSITIVE if math.prod(spec.dims) == 1 else FillKind.RANDOM, "data")
        if uses and all(port in _DATA_PORTS.get(str(node.get("type")), ()) for node, port in uses):
            return Fill(spec, FillKind.BOOL if spec.dtype == "data_type.BOOLEAN" else FillKind.SMALL_INT, "integer data")
        where = ", ".join(f"{node.get('type')}.{port}" for node, port in uses) or "no node"
        return Refusal(f"plancache does not know the role of tensor uid {spec.uid} ({spec.dtype}, input of {where})")

    def _steering(self, spec: TensorSpec, node: Mapping[str, Any], port: str) -> Fill | Refusal | None:
        """The fill of a tensor that steers ``node`` through ``port``; None when the port
        carries data."""
        kind, inputs, params = str(node.get("type")), node.get("inputs") or {}, node.get("params") or {}
        count = math.prod(spec.dims)
        if kind in _ATTENTION:
            if port == "seq_len_q":
                return self._lengths(spec, self._dim(inputs.get("q"), 2), "query sequence lengths")
            if port == "seq_len_kv":
                paged = "paged_attention_k_table" in inputs
                longest = params.get("paged_attention_max_seq_len_kv") if paged else self._dim(inputs.get("k"), 2)
                if paged and longest is None:
                    return Refusal("a paged SDPA without paged_attention_max_seq_len_kv: its key lengths are unknown")
                return self._lengths(spec, longest, "key sequence lengths")
            if port in ("paged_attention_k_table", "paged_attention_v_table"):
                pool = self._dim(inputs.get("k" if port.endswith("k_table") else "v"), 0)
                if pool is None or pool < 1:
                    return Refusal(f"page table uid {spec.uid}: the page pool's size is unknown")
                return Fill(spec, FillKind.VALUES, f"page table over {pool} pages", tuple(float(i % pool) for i in range(count)))
            if port.startswith("dropout_"):
                if spec.dtype in _INTEGERS:  # sdpa(dropout=(probability, seed, offset))
                    return Fill(spec, FillKind.VALUES, "dropout seed or offset", tuple(float(7 + i) for i in range(count)))
                # sdpa(dropout=(mask, scale)): a mask of zeros and ones, and a scale of 1, keep
                # the output within the magnitudes the bound models (seeds of 7 and up made a
                # mask that scaled it 1e5 times, and right engines were judged apart)
                if count > 1:
                    return Fill(spec, FillKind.BOOL, "dropout mask")
                return Fill(spec, FillKind.VALUES, "dropout scale", (1.0,))
            return None
        if kind in ("MOE_GROUPED_MATMUL", "MOE_GROUPED_MATMUL_BWD"):
            return self._moe(spec, node, port)
        if kind.endswith("NORM_BWD") and port in ("mean", "inv_variance"):
            return self._statistic(spec, kind, inputs, port)
        return None

    def _statistic(self, spec: TensorSpec, kind: str, inputs: Mapping[str, Any], port: str) -> Fill | Refusal:
        """A norm backward's saved statistics, as its forward computed them from the input:
        random ones (negative inverse variances, a mean unrelated to the input) lie outside
        what the backward is defined for, and right engines that rely on their identities
        (the deviations from the mean summing to zero) compute different results."""
        source = inputs.get("input") or inputs.get("x")
        x = self.by_uid.get(int(source[1:])) if isinstance(source, str) and source.startswith("u") else None
        if x is None or x.is_output or len(x.dims) != len(spec.dims) or any(s not in (1, d) for s, d in zip(spec.dims, x.dims)):
            return Refusal(f"{kind} statistic uid {spec.uid}: the input it was computed from is unknown")
        what = (FillKind.INV_RMS if port == "inv_variance" and "RMS" in kind
                else FillKind.MEAN if port == "mean" else FillKind.INV_STD)  # fmt: skip
        return Fill(spec, what, f"{kind} {port} of input uid {x.uid}", source=x.uid)

    def _moe(self, spec: TensorSpec, node: Mapping[str, Any], port: str) -> Fill | Refusal | None:
        inputs, params = node.get("inputs") or {}, node.get("params") or {}
        mode = str(params.get("mode") or "moe_grouped_matmul_mode.NONE")
        count = math.prod(spec.dims)
        if port == "first_token_offset":
            if mode not in ("moe_grouped_matmul_mode.NONE", "moe_grouped_matmul_mode.GATHER"):
                return Refusal(f"MoE token offsets in {mode} mode: their valid values are unknown to plancache")
            rows = self._dim(inputs.get("token_index" if "token_index" in inputs else "token"), -2)
            if rows is None:
                return Refusal("MoE token offsets: the number of token rows is unknown")
            # Groups of equal size, each starting on a multiple of the alignment (0 is
            # always valid): monotone, in range, aligned.
            step = rows // max(count, 1) // _MOE_ROW_ALIGNMENT * _MOE_ROW_ALIGNMENT
            return Fill(spec, FillKind.VALUES, f"MoE token offsets over {rows} rows", tuple(float(i * step) for i in range(count)))  # fmt: skip
        if port == "token_index" and mode == "moe_grouped_matmul_mode.GATHER":
            tokens = self._dim(inputs.get("token"), -2)
            if tokens is None or tokens < 1:
                return Refusal("MoE token indices: the number of tokens is unknown")
            return Fill(spec, FillKind.VALUES, f"MoE token indices below {tokens}", tuple(float(i % tokens) for i in range(count)))  # fmt: skip
        if port in ("token", "weight", "doutput", "top_k_scores"):
            return None
        return Refusal(f"MoE input {port!r} (uid {spec.uid}): its valid values are unknown to plancache")

    def _ragged(self, spec: TensorSpec, tid: str) -> Fill | Refusal:
        """Offsets that lay the ragged batches out exactly as the dense layout would:
        batch ``i`` at ``i`` times the batch stride (with full sequence lengths, the
        exclusive prefix sums of the lengths times the row size)."""
        units = set()
        for uid in self.ragged_users[tid]:
            user = self.by_uid.get(uid)
            if user is None or not user.strides:
                return Refusal(f"ragged offsets uid {spec.uid}: the tensor they offset is unknown")
            multiplier = int((self.tensors.get(f"u{uid}") or {}).get("ragged_offset_multiplier") or 1)
            stride = user.strides[0]
            aligned = stride * DTYPE_BYTES.get(user.dtype or "", 4) % max(1, user.alignment) == 0
            if stride % multiplier or not aligned:
                return Refusal(f"ragged offsets uid {spec.uid}: no dense layout of uid {uid} is aligned")
            units.add(stride // multiplier)
        if len(units) != 1:
            return Refusal(f"ragged offsets uid {spec.uid} are shared by tensors of different batch strides")
        unit = units.pop()
        return Fill(spec, FillKind.VALUES, "ragged offsets", tuple(float(i * unit) for i in range(math.prod(spec.dims))))

    def _lengths(self, spec: TensorSpec, longest: Any, what: str) -> Fill | Refusal:
        if not isinstance(longest, int) or longest < 1:
            return Refusal(f"{what} uid {spec.uid}: their maximum is unknown")
        return Fill(spec, FillKind.VALUES, f"{what} (all {longest})", (float(longest),) * math.prod(spec.dims))

    def _dim(self, tid: Any, axis: int) -> int | None:
        spec = self.by_uid.get(int(tid[1:])) if isinstance(tid, str) and tid.startswith("u") else None
        if spec is None or not spec.dims or not -len(spec.dims) <= axis < len(spec.dims):
            return None
        return int(spec.dims[axis])


def materialize(plan: InputPlan, torch: Any, device: Any, generator: Any) -> dict[int, Any]:
    """The tensors of ``plan`` on ``device`` (the caller's own where given), filled with
    ``generator``'s numbers; pass-by-value scalars on the host. Builds a fresh dict, so a
    failed allocation leaves nothing half made."""
    pack: dict[int, Any] = dict(plan.given)
    for uid, fill in plan.fills.items():
        if uid not in pack and fill.kind not in _STATISTICS:
            pack[uid] = _filled(fill, torch, device, generator)
    for uid, fill in plan.fills.items():  # statistics of the inputs just made
        if uid not in pack:
            pack[uid] = _statistic(fill, pack[fill.source], torch)
    for spec in plan.outputs:
        pack[spec.uid] = _empty(spec, torch, device)
    return pack


_STATISTICS = frozenset({FillKind.MEAN, FillKind.INV_STD, FillKind.INV_RMS})
_NORM_EPSILON = 1e-5


def _statistic(fill: Fill, x: Any, torch: Any) -> Any:
    spec = fill.spec
    axes = [i for i, (s, d) in enumerate(zip(spec.dims, x.shape)) if s == 1 and d > 1]
    x = x.float()
    if fill.kind is FillKind.MEAN:
        value = x.mean(dim=axes, keepdim=True) if axes else x
    elif fill.kind is FillKind.INV_RMS:
        value = torch.rsqrt((x * x).mean(dim=axes, keepdim=True) + _NORM_EPSILON) if axes else torch.rsqrt(x * x + _NORM_EPSILON)
    else:
        variance = x.var(dim=axes, keepdim=True, unbiased=False) if axes else torch.zeros_like(x)
        value = torch.rsqrt(variance + _NORM_EPSILON)
    out = _empty(spec, torch, x.device)
    return out.copy_(value.expand(tuple(spec.dims)))


def _torch_dtype(torch: Any, spec: TensorSpec) -> Any:
    names = TORCH_DTYPES.get(spec.dtype or "") or ("float32",)
    return getattr(torch, names[-1] if spec.dtype in ("data_type.FP4_E2M1", "data_type.INT4") else names[0])


def _empty(spec: TensorSpec, torch: Any, device: Any) -> Any:
    dims, strides = _layout(spec)
    return torch.empty_strided(dims, strides, dtype=_torch_dtype(torch, spec), device=device)


def _filled(fill: Fill, torch: Any, device: Any, generator: Any) -> Any:
    spec = fill.spec
    dtype = _torch_dtype(torch, spec)
    if spec.is_pass_by_value:
        return torch.full(tuple(spec.dims) or (1,), fill.values[0] if fill.values else 0.5, dtype=dtype)
    dims, strides = _layout(spec)
    if fill.kind is FillKind.VALUES:
        dense = torch.tensor(fill.values, dtype=torch.float64).reshape(dims).to(dtype)
        out = torch.empty_strided(dims, strides, dtype=dtype, device=device)
        return out.copy_(dense)
    flat = torch.empty(span(dims, strides), dtype=dtype, device=device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK]
        if fill.kind is FillKind.BOOL:
            part.copy_(torch.randint(0, 2, part.shape, device=device, generator=generator).bool())
        elif spec.dtype in _BYTE_CODED:
            part.copy_(_byte_codes(spec.dtype, fill.kind is FillKind.RANDOM, part.shape, torch, device, generator))
        elif fill.kind is FillKind.SMALL_INT:
            part.copy_(torch.randint(1, 4, part.shape, device=device, generator=generator))
        else:
            values = torch.empty(part.shape, dtype=torch.float32, device=device).uniform_(0.25, 1.0, generator=generator)
            if fill.kind is FillKind.RANDOM:  # both signs: an epilogue's negative slope or clip must show
                signs = torch.randint(0, 2, part.shape, device=device, generator=generator, dtype=torch.int8)
                values.mul_(signs.mul_(2).sub_(1))
            part.copy_(values)
    return torch.as_strided(flat, dims, strides)


#: Types stored as bytes that torch cannot compute in: numbers copied into them would be
#: cast to bytes (every value in ±[0.25, 1) to 0), and every candidate, right or wrong,
#: would compute the same zeros. Their bit patterns are drawn instead.
_BYTE_CODED = frozenset({"data_type.FP4_E2M1", "data_type.INT4", "data_type.FP8_E5M3"})


def _byte_codes(dtype: str, signed: bool, shape: Any, torch: Any, device: Any, generator: Any) -> Any:
    """Bytes of nonzero, finite codes of ``dtype``. FP4_E2M1 and INT4 hold two values a
    byte: E2M1 magnitudes 0.5 to 6 (codes 1-7, sign bit 8), INT4 1 to 3. FP8_E5M3 (one
    value, no sign): exponents 14-16 of bias 15, so 0.5 to 3.75."""

    def draw(low: int, high: int) -> Any:
        return torch.randint(low, high, shape, device=device, generator=generator, dtype=torch.int16)

    if dtype == "data_type.FP8_E5M3":
        codes = draw(14, 17).mul_(8).add_(draw(0, 8))
    else:
        nibbles = []
        for _ in range(2):
            nibble = draw(1, 8) if dtype == "data_type.FP4_E2M1" else draw(1, 4)
            if signed and dtype == "data_type.FP4_E2M1":
                nibble.add_(draw(0, 2).mul_(8))
            nibbles.append(nibble)
        codes = nibbles[0].add_(nibbles[1].mul_(16))
    return codes.to(torch.uint8)


#: Copies of the outputs that comparing candidates keeps (one per group of agreeing ones).
OUTPUT_COPIES = 3
#: float32 tensors of an output's size that its bound takes: the magnitudes of the node
#: that computes it and of the one before (an epilogue's input), and the flat copy compared.
MAGNITUDE_COPIES = 3


@dataclass(frozen=True)
class TimingInputs:
    """The inputs candidates may be launched on: their plan, the bytes it takes, and the
    bytes left of the budget for a workspace."""

    plan: InputPlan
    need: int
    spare: int


def timing_inputs(description: Mapping[str, Any], specs: Sequence[TensorSpec], given: Mapping[int, Any],
                  budget: MemoryBudget, free: int) -> TimingInputs | Refusal:  # fmt: skip
    """What launching candidates on the caller's ``given`` tensors (already checked) and
    synthetic ones needs, or why nothing may be launched (a tensor of unknown role,
    ``budget`` of ``free`` device bytes exceeded)."""
    plan = plan_inputs(description, specs, given)
    if isinstance(plan, Refusal):
        return plan
    need, limit = plan.device_bytes(OUTPUT_COPIES, MAGNITUDE_COPIES), budget.bytes_of(free)
    if need > limit:
        return Refusal(f"launching candidates needs {format_size(need)}, over the budget of {format_size(limit)} "
                       f"({budget.describe()}, PLANCACHE_AUTOTUNE_MEMORY)")  # fmt: skip
    return TimingInputs(plan, need, limit - need)
