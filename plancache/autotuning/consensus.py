"""Checking candidates against each other, element by element.

cuDNN offers engines that compute wrong results (on cuDNN 9.19, matmul engines that ignore
an epilogue's negative slope or clip), and a persistent cache would serve such a choice to
every later process. So every candidate that autotuning launches runs on the same inputs,
and its outputs are compared with the others': a candidate outside the majority is
rejected and never chosen.

**Comparing two candidates.** Every element of every output is held against its own bound
(``autotuning.bounds``). What is recorded of a comparison (``Agreement``) is how many
elements lie outside their bound, what fraction of the output that is, and the worst ratio
of an element's difference to its bound. Two right engines differ by rounding: every
element within about one bound. A candidate with any element more than ``FAR`` times its
bound away from the other's disagrees with it: that much is not rounding.

Why element by element: an engine that ignores a relu's ``lower_clip=-1`` moves each
negative output by at most 1 while a bf16 matmul's outputs reach 150. Against the largest
output that is an error of 0.007, inside any tolerance a bf16 output allows, yet half the
outputs are wrong, those near zero by 100%. Against each element's own bound, those
elements are hundreds of bounds away.

Non-finite values must sit at the same places with the same values, or the comparison
fails everywhere. Integer and boolean outputs must be equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..formats.check import CHECK_RULE
from .bounds import Bound

__all__ = ["FAR", "RULE", "Agreement", "Consensus", "Group", "compare"]

#: How many times its bound an element may be off before the candidate disagrees.
FAR = 4.0
#: The version of this rule, recorded with each check; the store serves only entries
#: checked under it (``store.entry.CHECK_RULE``) and has older ones chosen again.
RULE = CHECK_RULE
_CHUNK = 1 << 24  # elements compared at once


@dataclass(frozen=True)
class Agreement:
    """How one candidate's outputs compare with another's, over every output."""

    outside: int = 0  # elements outside their bound
    elements: int = 0
    worst: float = 0.0  # largest |a - b| / bound of any element; inf: non-finite or integer mismatch

    @property
    def agrees(self) -> bool:
        return self.worst <= FAR

    @property
    def fraction(self) -> float:
        return self.outside / self.elements if self.elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        """As stored (JSON has no infinity: None stands for it)."""
        return {"outside": self.outside, "fraction": self.fraction, "worst": self.worst if math.isfinite(self.worst) else None}

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(self.outside + other.outside, self.elements + other.elements, max(self.worst, other.worst))


_MISMATCH = Agreement(outside=1, elements=1, worst=math.inf)


def compare(a: Mapping[int, Any], b: Mapping[int, Any], bounds: Mapping[int, Bound]) -> Agreement:
    """Every output of ``a`` against the same output of ``b`` (contiguous tensors on one
    device), element by element, in chunks so that the temporaries stay small."""
    total = Agreement()
    for uid, expected in b.items():
        got = a[uid].reshape(-1)
        expected = expected.reshape(-1)
        if not (expected.dtype.is_floating_point or expected.dtype.is_complex):
            total += Agreement(elements=expected.numel()) if bool((got == expected).all()) else _MISMATCH
            continue
        total += _compare_floats(got, expected, bounds[uid])
    return total


def _compare_floats(got: Any, expected: Any, bound: Bound) -> Agreement:
    wide = expected.element_size() > 4
    magnitude = None if bound.coarse else bound.magnitude.reshape(-1) if bound.magnitude.dim() else bound.magnitude
    scale = _largest(expected, wide) if bound.coarse else 0.0
    outside, worst = 0, 0.0
    for start in range(0, expected.numel(), _CHUNK):
        x, y = got[start : start + _CHUNK], expected[start : start + _CHUNK]
        x, y = (x.double(), y.double()) if wide else (x.float(), y.float())
        if magnitude is None:
            m: Any = scale
        elif magnitude.dim():
            m = magnitude[start : start + _CHUNK].to(x.dtype)
        else:
            m = float(magnitude)
        diff = x - y
        # A finite sum: every element of both is finite (a sum that overflows takes the
        # careful path too). The common case needs no mask, no indexing and few kernels:
        # a process's first miss loads every distinct kernel it runs (milliseconds each).
        found = _finite_chunk(x, y, diff, bound, m) if math.isfinite(float(diff.sum())) else _chunk(x, y, bound, m)
        if found is None:
            return Agreement(outside=expected.numel(), elements=expected.numel(), worst=math.inf)
        outside, worst = outside + found[0], max(worst, found[1])
    return Agreement(outside=outside, elements=expected.numel(), worst=worst)


def _finite_chunk(x: Any, y: Any, diff: Any, bound: Bound, m: Any) -> tuple[int, float]:
    """(elements outside their bound, the worst ratio) of a chunk whose elements are all
    finite; ``diff`` is ``x - y``, and is overwritten."""
    limit = x.abs().maximum(y.abs()).mul_(bound.relative).add_(bound.absolute * m)
    ratio = diff.abs_().div_(limit).nan_to_num_(nan=0.0, posinf=math.inf)  # 0/0: equal, nothing allowed
    return int((ratio > 1.0).sum()), float(ratio.max())


def _chunk(x: Any, y: Any, bound: Bound, m: Any) -> tuple[int, float] | None:
    """What ``_finite_chunk`` says of a chunk that holds non-finite values, which must sit at
    the same places with the same values (None where they do not), the rest compared."""
    finite = y.isfinite()
    if not bool((x.isfinite() == finite).all()) or not bool((x[~finite].nan_to_num() == y[~finite].nan_to_num()).all()):
        return None
    x, y = x[finite], y[finite]
    if not x.numel():
        return 0, 0.0
    if not isinstance(m, (int, float)):
        m = m[finite]
    return _finite_chunk(x, y, x - y, bound, m)


def _largest(values: Any, wide: bool) -> float:
    """The largest magnitude of the finite elements of ``values``."""
    largest = 0.0
    for start in range(0, values.numel(), _CHUNK):
        part = values[start : start + _CHUNK]
        part = (part.double() if wide else part.float()).abs().nan_to_num_(nan=0.0, posinf=0.0)
        if part.numel():
            largest = max(largest, float(part.max()))
    return largest


@dataclass
class Group:
    """Candidates whose outputs agree with those of the first member, ``members[0]``."""

    outputs: Mapping[int, Any]
    members: list[int] = field(default_factory=list)
    agreements: dict[int, Agreement] = field(default_factory=dict)  # member -> against members[0]


@dataclass
class Consensus:
    """The groups of the candidates compared so far, under the outputs' bounds."""

    bounds: Mapping[int, Bound]
    groups: list[Group] = field(default_factory=list)

    def add(self, index: int, outputs: Mapping[int, Any]) -> None:
        """Place candidate ``index`` (its ``outputs``) in the first group it agrees with."""
        for group in self.groups:
            agreement = compare(outputs, group.outputs, self.bounds)
            if agreement.agrees:
                group.members.append(index)
                group.agreements[index] = agreement
                return
        self.groups.append(Group(outputs=outputs, members=[index], agreements={index: Agreement()}))

    @property
    def compared(self) -> int:
        return sum(len(g.members) for g in self.groups)

    def majority(self) -> Group | None:
        """The group holding more than half of the candidates, at least two; None without."""
        return next((g for g in self.groups if len(g.members) >= 2 and 2 * len(g.members) > self.compared), None)

    def outliers(self, majority: Group) -> dict[int, Agreement]:
        """Each candidate outside ``majority``, with how its group's outputs compare with
        the majority's."""
        found: dict[int, Agreement] = {}
        for group in self.groups:
            if group is not majority:
                found.update(dict.fromkeys(group.members, compare(group.outputs, majority.outputs, self.bounds)))
        return found

    def spread(self) -> Agreement:
        """The widest disagreement between the first group and any other."""
        others = [compare(g.outputs, self.groups[0].outputs, self.bounds) for g in self.groups[1:]]
        return max(others, key=lambda a: a.worst, default=Agreement())
