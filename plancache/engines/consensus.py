"""Checking candidates against each other: the tolerance, the error, the consensus.

cuDNN offers engines that compute wrong results (on cuDNN 9.19, matmul engines that ignore
an epilogue's negative slope or clip, with relative errors of 0.10 to 7.5), and a
persistent cache would serve such a choice to every later process. So every candidate
that autotuning launches runs on the same inputs, and its outputs are compared with the
others': a candidate outside the majority is rejected and never chosen.

**Error.** For each output, ``max |a - b| / max |b|`` (the largest difference, relative to
the output's largest magnitude; the absolute difference when ``b`` is all zeros), and the
largest over the outputs. Non-finite values must sit at the same places with the same
values, or the error is infinite. Integer and boolean outputs must be equal.

**Tolerance.** Two right engines differ by how they round and accumulate, so the
tolerance is summed from the graph's data types and the size of its reductions:

* ``4 ulp`` of each place the result is rounded to a narrow type: every output's type, each
  virtual tensor whose type (or the intermediate type) is narrower than float32, and one
  more of the io type per attention node (engines keep the softmax probabilities in it);
* ``4 * sqrt(K) ulp`` of the compute type, for the longest reduction ``K`` (a matmul's
  inner dimension, a convolution's C*R*S, attention's head size or key length, a norm's
  normalized size), since independent rounding errors of a sum of ``K`` terms grow as
  ``sqrt(K)``.

``ulp`` is the spacing of the type's numbers at 1: 2^-7 for bfloat16, 2^-10 for float16,
2^-23 for float32, 2^-3 and 2^-2 for the fp8 types. For a bfloat16 matmul with a float32
epilogue the tolerance is 0.031; for float16 0.0039: far below the errors of the wrong
engines, and four times the one ulp by which right engines differ after the final rounding.

**Consensus.** Candidates join groups: one whose outputs are within the tolerance of the
group's first member joins it, else it starts a group. A majority group has more than half
of the candidates compared, and at least two of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..key import TensorSpec

__all__ = ["ULP", "Consensus", "Group", "max_error", "tolerance"]

#: Spacing of each data type's numbers at 1 (its machine epsilon).
ULP = {
    "data_type.DOUBLE": 2.0**-52, "data_type.FLOAT": 2.0**-23, "data_type.HALF": 2.0**-10,
    "data_type.BFLOAT16": 2.0**-7, "data_type.FP8_E4M3": 2.0**-3, "data_type.FP8_E5M2": 2.0**-2,
    "data_type.FP8_E5M3": 2.0**-3, "data_type.FP8_E8M0": 1.0, "data_type.FP4_E2M1": 0.5,
}  # fmt: skip
_FLOAT32 = ULP["data_type.FLOAT"]
_CHUNK = 1 << 24  # elements compared at once
_ATTENTION = frozenset({"SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8", "SDPA_MXFP8_BWD"})


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
    if kind in _ATTENTION:
        return max(dim("q", -1), dim("k", 2), dim("q", 2))
    if "NORM" in kind:
        return math.prod(_dims(description, ports.get("input") or ports.get("x"))[1:] or [1])
    if kind == "REDUCTION":
        return math.prod(_dims(description, ports.get("input") or ports.get("IN_0")) or [1])
    return 1


def tolerance(description: Mapping[str, Any], outputs: Sequence[TensorSpec]) -> float:
    """The largest error (``max_error``) two right candidates of this graph may show."""
    context = description.get("context") or {}
    io = context.get("io_data_type")
    intermediate = context.get("intermediate_data_type")
    compute = context.get("compute_data_type") or "data_type.FLOAT"
    rounding = sum(ULP.get(spec.dtype or "", 0.0) for spec in outputs)
    for tensor in (description.get("tensors") or {}).values():
        if isinstance(tensor, Mapping) and tensor.get("is_virtual"):
            step = ULP.get(tensor.get("dtype") or intermediate or "", 0.0)
            rounding += step if step > _FLOAT32 else 0.0
    longest, computes = 1, [ULP.get(compute, _FLOAT32)]
    for node in description.get("nodes") or []:
        longest = max(longest, _reduction(description, node))
        computes.append(ULP.get(node.get("compute_data_type") or "", 0.0))
        if str(node.get("type")) in _ATTENTION:
            rounding += ULP.get(io or "", 0.0)
    return 4.0 * rounding + 4.0 * math.sqrt(longest) * max(computes)


def max_error(a: Mapping[int, Any], b: Mapping[int, Any]) -> float:
    """The largest error of any output of ``a`` against the same output of ``b`` (contiguous
    tensors on one device), compared in chunks so that the temporaries stay small."""
    worst = 0.0
    for uid, expected in b.items():
        got = a[uid].reshape(-1)
        expected = expected.reshape(-1)
        if not (expected.dtype.is_floating_point or expected.dtype.is_complex):
            if not bool((got == expected).all()):
                return math.inf
            continue
        diff, scale = 0.0, 0.0
        for start in range(0, expected.numel(), _CHUNK):
            x, y = got[start : start + _CHUNK], expected[start : start + _CHUNK]
            x, y = (x.double(), y.double()) if y.element_size() > 4 else (x.float(), y.float())
            finite = y.isfinite()
            if not bool((x.isfinite() == finite).all()) or not bool((x[~finite].nan_to_num() == y[~finite].nan_to_num()).all()):
                return math.inf
            if bool(finite.any()):
                diff = max(diff, float((x[finite] - y[finite]).abs().max()))
                scale = max(scale, float(y[finite].abs().max()))
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@dataclass
class Group:
    """Candidates whose outputs agree with those of the first member, ``members[0]``."""

    outputs: Mapping[int, Any]
    members: list[int] = field(default_factory=list)
    errors: dict[int, float] = field(default_factory=dict)  # member -> error against members[0]


@dataclass
class Consensus:
    """The groups of the candidates compared so far."""

    tolerance: float
    groups: list[Group] = field(default_factory=list)

    def add(self, index: int, outputs: Mapping[int, Any]) -> None:
        """Place candidate ``index`` (its ``outputs``) in the first group it agrees with."""
        for group in self.groups:
            error = max_error(outputs, group.outputs)
            if error <= self.tolerance:
                group.members.append(index)
                group.errors[index] = error
                return
        self.groups.append(Group(outputs=outputs, members=[index], errors={index: 0.0}))

    @property
    def compared(self) -> int:
        return sum(len(g.members) for g in self.groups)

    def majority(self) -> Group | None:
        """The group holding more than half of the candidates, at least two; None without."""
        for group in self.groups:
            if len(group.members) >= 2 and 2 * len(group.members) > self.compared:
                return group
        return None

    def outliers(self, majority: Group) -> dict[int, float]:
        """Each candidate outside ``majority``, with the error of its group's outputs
        against the majority's."""
        found: dict[int, float] = {}
        for group in self.groups:
            if group is not majority:
                error = max_error(group.outputs, majority.outputs)
                found.update(dict.fromkeys(group.members, error))
        return found

    def spread(self) -> float:
        """The largest error between the first group and any other (0.0 with one group)."""
        return max((max_error(g.outputs, self.groups[0].outputs) for g in self.groups[1:]), default=0.0)
