"""How far two right candidates' outputs may differ, element by element.

Two right engines compute the same sums in different orders and round at different
places, so their outputs differ, but only by rounding. An engine that is wrong on part of
its output (one that ignores a clip moves only the outputs the clip would have changed)
may be off by little next to the output's *largest* value, yet by far more than rounding
at the elements it gets wrong. So each element is judged on its own:

    |a - b|  <=  relative * max(|a|, |b|)  +  absolute * m

* ``relative``: one ulp of the output's data type, the step by which two engines that
  round the same value correctly may still differ after the final rounding;
* ``absolute * m``: the rounding accumulated before that, which scales with the
  magnitudes that went into the element, ``m``, not with the element itself: a sum of
  large terms of both signs may end near zero, and its rounding error is that of the
  terms. ``absolute`` is ``sqrt(K)`` ulp of the compute type for the longest reduction
  ``K``, plus one ulp of each narrower type the graph rounds to on the way (a virtual
  tensor narrower than float32, the probabilities attention keeps in its io type).

``m`` is computed from the inputs the candidates run on, per element, by a model of the
graph's nodes (``_Magnitudes``): ``|A| @ |B|`` for a matmul, the convolution of ``|x|``
with ``|w|``, ``max |V|`` for attention, and through pointwise epilogues by how much each
can stretch a difference (a negative slope of 3 stretches it 3 times). A node the model
does not know (an exp, a division, a normalization, a backward pass) leaves its outputs
to the coarse bound: ``m`` is then the output's largest magnitude and ``absolute``
also covers ``4 ulp`` of every rounding.

The bound is an estimate of rounding, not a proof; ``autotuning.consensus`` holds a candidate
outside the consensus only when some element is ``FAR`` times beyond it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..key import TensorSpec

__all__ = ["ULP", "Bound", "bounds", "coarse_tolerance"]

#: Spacing of each data type's numbers at 1 (its machine epsilon).
ULP = {
    "data_type.DOUBLE": 2.0**-52, "data_type.FLOAT": 2.0**-23, "data_type.HALF": 2.0**-10,
    "data_type.BFLOAT16": 2.0**-7, "data_type.FP8_E4M3": 2.0**-3, "data_type.FP8_E5M2": 2.0**-2,
    "data_type.FP8_E5M3": 2.0**-3, "data_type.FP8_E8M0": 1.0, "data_type.FP4_E2M1": 0.5,
}  # fmt: skip
_FLOAT32 = ULP["data_type.FLOAT"]
ATTENTION = frozenset({"SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8", "SDPA_MXFP8_BWD"})
#: Pointwise functions engines may evaluate with fast approximations (a GELU through tanh,
#: an exponential in hardware): right engines then differ by about ``APPROXIMATION`` of
#: the function's input. On an H200, two engines' GELU of a bf16 matmul differed by up
#: to 8 bounds without this term, both within 2 ulp of a float32 reference.
APPROXIMATED = frozenset({"gelu", "gelu_approx_tanh", "erf", "tanh", "sigmoid", "swish", "elu", "softplus", "exp", "log",
                          "sin", "cos", "tan", "rsqrt", "sqrt", "reciprocal", "div", "pow"})  # fmt: skip
APPROXIMATION = 2.0**-10


@dataclass(frozen=True)
class Bound:
    """The element-wise bound of one output: ``relative * max(|a|, |b|) + absolute * m``.
    ``magnitude`` is ``m`` (a tensor broadcastable to the output, on its device), or None
    for the coarse bound, where ``m`` is the largest magnitude of the output compared with."""

    relative: float
    absolute: float
    magnitude: Any = None

    @property
    def coarse(self) -> bool:
        return self.magnitude is None


def _dims(description: Mapping[str, Any], tid: Any) -> list[int]:
    tensor = (description.get("tensors") or {}).get(tid) if isinstance(tid, str) else None
    dims = tensor.get("dim") if isinstance(tensor, Mapping) else None
    return [int(d) for d in dims] if isinstance(dims, list) else []


def _reduction(description: Mapping[str, Any], node: Mapping[str, Any]) -> int:
    """The longest sum ``node`` computes one output element from (1 when unknown)."""
    kind, ports = str(node.get("type")), node.get("inputs") or {}

    def dim(port: str, axis: int) -> int:
        dims = _dims(description, ports.get(port))
        return dims[axis] if dims and -len(dims) <= axis < len(dims) else 1

    if kind == "MATMUL":
        return dim("A", -1)
    if kind in ("MOE_GROUPED_MATMUL", "MOE_GROUPED_MATMUL_BWD"):
        return max(dim("token", -1), dim("token", -2))
    if kind == "CONV_FPROP":
        return math.prod(_dims(description, ports.get("weight"))[1:] or [1])
    if kind in ("CONV_DGRAD", "CONV_WGRAD"):
        grad = _dims(description, ports.get("loss") or ports.get("DY") or ports.get("dy"))
        return max(
            math.prod(grad[2:] or [1]) * (grad[0] if grad else 1), math.prod(_dims(description, ports.get("filter"))[1:] or [1])
        )
    if kind in ATTENTION:
        return max(dim("q", -1), dim("k", 2), dim("q", 2))
    if "NORM" in kind:
        return math.prod(_dims(description, ports.get("input") or ports.get("x"))[1:] or [1])
    if kind == "REDUCTION":
        return math.prod(_dims(description, ports.get("input") or ports.get("IN_0")) or [1])
    return 1


@dataclass(frozen=True)
class _Roundings:
    """The graph's roundings, read from its description once."""

    accumulated: float  # ulp (at 1) accumulated before the final rounding, per unit of m
    narrow: float  # ulp of every narrow rounding on the way (virtual tensors, attention's io type)

    @classmethod
    def of(cls, description: Mapping[str, Any]) -> _Roundings:
        context = description.get("context") or {}
        io = context.get("io_data_type")
        intermediate = context.get("intermediate_data_type")
        compute = ULP.get(context.get("compute_data_type") or "", _FLOAT32)
        narrow = 0.0
        for tensor in (description.get("tensors") or {}).values():
            if isinstance(tensor, Mapping) and tensor.get("is_virtual"):
                step = ULP.get(tensor.get("dtype") or intermediate or "", 0.0)
                narrow += step if step > _FLOAT32 else 0.0
        longest, computes = 1, [compute]
        for node in description.get("nodes") or []:
            longest = max(longest, _reduction(description, node))
            computes.append(ULP.get(node.get("compute_data_type") or "", 0.0))
            if str(node.get("type")) in ATTENTION:  # the probabilities are rounded to the io type
                narrow += ULP.get(io or _value_type(description, node) or "", 0.0)
            if str((node.get("params") or {}).get("mode")) in APPROXIMATED:
                narrow += APPROXIMATION
        return cls(accumulated=math.sqrt(longest) * max(computes) + narrow, narrow=narrow)


def _value_type(description: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """An attention node's io type when the graph leaves it unset: that of its V (else Q),
    which the tensors then carry themselves."""
    tensors = description.get("tensors") or {}
    for port in ("v", "q"):
        ref = (node.get("inputs") or {}).get(port)
        dtype = (tensors.get(ref) or {}).get("dtype") if isinstance(ref, str) else None
        if dtype in ULP:
            return str(dtype)
    return None


def coarse_tolerance(description: Mapping[str, Any], outputs: Sequence[TensorSpec]) -> float:
    """The rule before element-wise bounds (``4 ulp`` of every rounding plus ``4 sqrt(K)``
    ulp of the compute type), relative to an output's largest magnitude: what an element
    of an output whose magnitudes are not modelled may differ by."""
    roundings = _Roundings.of(description)
    return 4.0 * (sum(ULP.get(spec.dtype or "", 0.0) for spec in outputs) + roundings.accumulated)


def bounds(description: Mapping[str, Any], specs: Sequence[TensorSpec], pack: Mapping[int, Any]) -> dict[int, Bound]:
    """The bound of every floating-point output of the graph, by uid, for candidates run on
    ``pack`` (the inputs, by uid). Never raises for a graph it cannot model: such outputs
    get the coarse bound."""
    outputs = [spec for spec in specs if spec.is_output]
    roundings = _Roundings.of(description)
    coarse = coarse_tolerance(description, outputs)
    model = _Magnitudes(description, pack)
    found: dict[int, Bound] = {}
    for spec in outputs:
        relative = ULP.get(spec.dtype or "", _FLOAT32)
        magnitude = model.of(f"u{spec.uid}", pack.get(spec.uid))
        if magnitude is None:
            found[spec.uid] = Bound(relative=relative, absolute=coarse)
        else:
            found[spec.uid] = Bound(relative=relative, absolute=roundings.accumulated, magnitude=magnitude)
    return found


# ---------------------------------------------------------------------- magnitudes

#: How far a pointwise function can stretch a difference of its input, and whether its
#: value stays within its input's magnitude (so ``m`` bounds the value too).
_STRETCH = {
    "identity": 1.0, "neg": 1.0, "abs": 1.0, "tanh": 1.0, "erf": 1.13, "gelu": 1.13, "gelu_approx_tanh": 1.13,
    "elu": 1.0,  # the frontend's elu has alpha 1: slope at most 1, and |elu(x)| <= |x|
}  # fmt: skip


class _Magnitudes:
    """``m`` of every tensor the model can follow, computed on the pack's device in float32,
    node by node in the description's order (its nodes are topologically sorted)."""

    def __init__(self, description: Mapping[str, Any], pack: Mapping[int, Any]) -> None:
        self.description = description
        self.pack = pack
        self.known: dict[str, Any] = {}
        self.done = False

    def of(self, tid: str, like: Any) -> Any:
        """``m`` of tensor ``tid`` shaped like ``like`` (the output), or None."""
        if not self.done:
            self.done = True
            try:
                self._follow()
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError, MemoryError):
                self.known.clear()  # out of memory, an unexpected layout: every output coarse
        found = self.known.get(tid)
        if found is None or like is None:
            return None
        try:
            return found.expand(like.shape) if found.dim() else found
        except RuntimeError:  # the model's shape is not the output's: do not guess
            return None

    def _input(self, tid: str) -> Any:
        if tid in self.known:
            return self.known[tid]
        tensors = self.description.get("tensors") or {}
        if tid.startswith("c"):  # a constant the graph holds
            scalar = (tensors.get(tid) or {}).get("scalar")
            value = scalar.get("float") if isinstance(scalar, Mapping) else scalar
            return _torch().tensor(abs(float(value))) if isinstance(value, (int, float, str)) else None
        if tid.startswith("u"):
            tensor = self.pack.get(int(tid[1:]))
            if tensor is not None and tensor.dtype.is_floating_point:
                return tensor.detach().abs().float()
        return None

    def _follow(self) -> None:
        torch = _torch()
        with torch.no_grad():
            for node in self.description.get("nodes") or []:
                ins = {port: self._input(tid) for port, tid in (node.get("inputs") or {}).items() if isinstance(tid, str)}
                for port, tid in (node.get("outputs") or {}).items():
                    value = self._node(torch, node, port, ins)
                    if value is not None:
                        self.known[tid] = value

    def _node(self, torch: Any, node: Mapping[str, Any], port: str, ins: Mapping[str, Any]) -> Any:
        kind, params = str(node.get("type")), node.get("params") or {}
        if kind == "MATMUL":
            a, b = ins.get("A"), ins.get("B")
            return None if a is None or b is None else torch.matmul(a.to(b.device), b)
        if kind == "CONV_FPROP":
            return _conv(torch, ins.get("image"), ins.get("weight"), params)
        if kind == "POINTWISE":
            return _pointwise(torch, str(params.get("mode")), ins, params)
        if kind == "SDPA" and port.lower() == "o":
            v = ins.get("v")
            return None if v is None else v.amax().reshape(())  # softmax weights sum to 1
        return None


def _conv(torch: Any, x: Any, w: Any, params: Mapping[str, Any]) -> Any:
    if x is None or w is None or x.dim() not in (3, 4, 5) or x.shape[1] % w.shape[1]:
        return None
    functional = torch.nn.functional
    conv = {3: functional.conv1d, 4: functional.conv2d, 5: functional.conv3d}[x.dim()]
    groups = x.shape[1] // w.shape[1]
    return conv(x, w.to(x.device), padding=params["padding"], stride=params["stride"], dilation=params["dilation"], groups=groups)


def _pointwise(torch: Any, mode: str, ins: Mapping[str, Any], params: Mapping[str, Any]) -> Any:
    a, b = ins.get("IN_0"), ins.get("IN_1")
    if a is None or (len(ins) > 1 and b is None):
        return None
    if b is not None:  # |a - b| <= |a| + |b|, |a b| = |a| |b|, and max or min is at most the larger
        combine = {"add": torch.add, "sub": torch.add, "bias": torch.add, "mul": torch.mul, "scale": torch.mul,
                   "max": torch.maximum, "min": torch.maximum}.get(mode)  # fmt: skip
        return None if combine is None else combine(a, b.to(a.device))
    if mode in ("relu", "leaky_relu"):
        slope = params.get("negative_slope")
        slope = float(slope) if slope is not None else (0.01 if mode == "leaky_relu" else 0.0)
        # a clip never stretches a difference; the lower one can lift a value to itself
        return a * max(1.0, abs(slope)) + abs(float(params.get("lower_clip") or 0.0))
    if mode == "swish":  # x * sigmoid(beta x): its slope grows with beta
        return a * (1.1 * max(1.0, abs(float(params.get("swish_beta") or 1.0))))
    if mode == "softplus":  # log(1 + e^x): slope at most 1, and ln 2 above |x| at most
        return a + 0.6931471805599453
    if mode == "sigmoid":
        return torch.clamp(a * 0.25, min=1.0)  # its value is at most 1, its slope at most 1/4
    stretch = _STRETCH.get(mode)
    return None if stretch is None else a * stretch


def _torch() -> Any:
    import torch

    return torch
