"""Comparing two candidates' outputs element by element (``autotuning.consensus.compare``).

The comparison takes a path without masks for the common case, outputs whose elements are
all finite, and the masked path only where non-finite values occur. Both are held here to
the rule written the plain way: non-finite values at the same places with the same values
(else every element is outside), the finite ones each against its own bound, 0/0 counted as
equal and a difference where nothing is allowed as infinitely far.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plancache.autotuning import consensus
from plancache.autotuning.bounds import Bound
from plancache.autotuning.consensus import Agreement, compare


def plain(got: torch.Tensor, expected: torch.Tensor, bound: Bound) -> Agreement:
    """The rule, with masks, in the precision the comparison computes in."""
    x, y = (got.double(), expected.double()) if expected.element_size() > 4 else (got.float(), expected.float())
    finite = y.isfinite()
    if not bool((x.isfinite() == finite).all()) or not bool((x[~finite].nan_to_num() == y[~finite].nan_to_num()).all()):
        return Agreement(outside=y.numel(), elements=y.numel(), worst=math.inf)
    if bound.coarse:
        kept = y[finite]
        m: object = float(kept.abs().max()) if kept.numel() else 0.0
    else:
        m = bound.magnitude.reshape(-1).to(x.dtype)[finite] if bound.magnitude.dim() else float(bound.magnitude)
    x, y = x[finite], y[finite]
    if not x.numel():
        return Agreement(elements=got.numel())
    limit = bound.relative * torch.maximum(x.abs(), y.abs()) + bound.absolute * m
    ratio = ((x - y).abs() / limit).nan_to_num(nan=0.0, posinf=math.inf)
    return Agreement(outside=int((ratio > 1.0).sum()), elements=got.numel(), worst=float(ratio.max()))


SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 65504.0]


@st.composite
def outputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, Bound]:
    n = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.float64, torch.bfloat16]))
    values = st.one_of(st.floats(-1e3, 1e3, width=32), st.sampled_from(SPECIAL))
    expected = draw(st.lists(values, min_size=n, max_size=n))
    # The other output: mostly the same values nudged by a few of their ulps, some replaced.
    nudges = draw(st.lists(st.one_of(st.floats(-3e-3, 3e-3), st.sampled_from(SPECIAL)), min_size=n, max_size=n))
    got = [e + d if math.isfinite(d) and abs(d) < 1 else d for e, d in zip(expected, nudges, strict=True)]
    kind = draw(st.sampled_from(["coarse", "scalar", "tensor"]))
    magnitude = None if kind == "coarse" else torch.tensor(4.0) if kind == "scalar" else torch.rand(n) * 10
    bound = Bound(relative=2.0**-10, absolute=draw(st.sampled_from([0.0, 2.0**-23, 2.0**-10])), magnitude=magnitude)
    return torch.tensor(got, dtype=torch.float64).to(dtype), torch.tensor(expected, dtype=torch.float64).to(dtype), bound


@settings(max_examples=300, deadline=None)
@given(case=outputs(), chunk=st.sampled_from([7, 1 << 24]))
def test_the_comparison_follows_the_rule_written_plainly(case: tuple[torch.Tensor, torch.Tensor, Bound], chunk: int) -> None:
    got, expected, bound = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(consensus, "_CHUNK", chunk)
        found = compare({1: got}, {1: expected}, {1: bound})
    wanted = plain(got, expected, bound)  # the whole output at once, however it was chunked
    assert found.outside == wanted.outside and found.elements == wanted.elements
    assert found.worst == pytest.approx(wanted.worst, rel=1e-6) or (math.isnan(found.worst) and math.isnan(wanted.worst))


def test_a_wrong_band_of_outputs_is_counted_and_equal_infinities_agree() -> None:
    expected = torch.tensor([1.0, -2.0, math.inf, 0.0, -math.inf, 3.0])
    got = expected.clone()
    got[5] = 3.5  # off by far more than rounding
    agreement = compare({1: got}, {1: expected}, {1: Bound(relative=2.0**-10, absolute=0.0, magnitude=torch.tensor(1.0))})
    assert agreement.outside == 1 and agreement.elements == 6 and not agreement.agrees
    assert agreement.worst == pytest.approx(0.5 / (2.0**-10 * 3.5))


def test_an_infinity_where_the_other_is_finite_fails_every_element() -> None:
    expected = torch.tensor([1.0, 2.0, 3.0])
    got = torch.tensor([1.0, math.inf, 3.0])
    agreement = compare({1: got}, {1: expected}, {1: Bound(relative=2.0**-10, absolute=0.0)})
    assert agreement == Agreement(outside=3, elements=3, worst=math.inf)


def test_a_difference_where_nothing_is_allowed_is_infinitely_far() -> None:
    expected, got = torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.4e-45])  # its bound rounds to 0
    agreement = compare({1: got}, {1: expected}, {1: Bound(relative=2.0**-10, absolute=0.0, magnitude=torch.tensor(0.0))})
    assert agreement.outside == 1 and agreement.worst == math.inf
