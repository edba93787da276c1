"""Plan.execute: correct results by uid and by name, and every tensor mismatch refused
before anything is launched."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from graphs import EXAMPLES, CausalSdpa, ConvBiasRelu, assert_runs_correctly, channels_last

from plancache import Plan, PlanCache, TensorMismatchError, TensorSpec
from plancache.testing import CpuTestBackend

CONV = EXAMPLES["conv_bias_relu"]  # uids X=1, W=2, B=3, Y=4


class CountingBackend(CpuTestBackend):
    def __init__(self) -> None:
        super().__init__()
        self.executions = 0

    def compute(self, *args: Any) -> None:
        self.executions += 1  # every launch of a test plan, by either path, computes here
        super().compute(*args)


@pytest.fixture
def counting(make_cache: Any) -> tuple[PlanCache, CountingBackend]:
    backend = CountingBackend()
    return make_cache(backend=backend), backend


@pytest.fixture
def conv_plan(counting: tuple[PlanCache, CountingBackend]) -> Plan:
    return counting[0].get(CONV.graph())


def refuse(plan: Plan, pack: dict[Any, Any], backend: CountingBackend, *expected: str) -> TensorMismatchError:
    """Execute must raise naming each expected problem, launching nothing and leaving the
    output buffer as it was."""
    output = next((t for ref, t in pack.items() if ref in (4, "Y")), None)
    before = output.clone() if output is not None else None
    with pytest.raises(TensorMismatchError) as info:
        plan.execute(pack)
    for text in expected:
        assert text in str(info.value), (text, str(info.value))
    assert backend.executions == 0
    if output is not None:
        assert torch.equal(output, before)
    return info.value


# ---------------------------------------------------------------------------- correct runs


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_execute_by_uid_matches_torch(name: str, cache: PlanCache) -> None:
    spec = EXAMPLES[name]
    assert_runs_correctly(cache.get(spec.graph()), spec, seed=3)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_execute_by_name_matches_torch(name: str, cache: PlanCache) -> None:
    spec = EXAMPLES[name]
    assert_runs_correctly(cache.get(spec.graph()), spec, seed=4, by_name=True)


def test_names_and_uids_mix_and_call_is_execute(conv_plan: Plan) -> None:
    pack = CONV.tensors(seed=5)
    conv_plan({"X": pack[1], 2: pack[2], "B": pack[3], 4: pack[4]})
    torch.testing.assert_close(pack[4], CONV.reference(pack))
    assert conv_plan.check({"X": pack[1], "W": pack[2], "B": pack[3], "Y": pack[4]}).keys() == {1, 2, 3, 4}


def test_half_precision_conv(cache: PlanCache) -> None:
    spec = dataclasses.replace(CONV, dtype="HALF")
    plan = cache.get(spec.graph())
    assert {t.dtype for t in plan.tensors} == {"data_type.HALF"}
    assert_runs_correctly(plan, spec)


def test_a_pass_by_value_scale_is_read_at_execute_time(cache: PlanCache) -> None:
    spec = CausalSdpa(attn_scale=0.125)
    plan = cache.get(spec.graph())
    pack = spec.tensors(seed=6)
    pack[spec.uids[3]] = torch.full((1, 1, 1, 1), 0.125)
    plan.execute(pack)
    expected = spec.reference(pack)
    torch.testing.assert_close(pack[spec.uids[4]].float(), expected, atol=1e-2, rtol=1e-2)
    pack[spec.uids[3]] = torch.full((1, 1, 1, 1), 1.0)  # not baked into the plan
    plan.execute(pack)
    assert not torch.allclose(pack[spec.uids[4]].float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("scale", "problem"),
    [
        (0.125, "is a float: a pass-by-value scalar is a one-element CPU tensor"),
        (torch.full((1, 1, 1, 1), 0.125, dtype=torch.float64), "has dtype torch.float64, the plan needs torch.float32"),
        (torch.full((4,), 0.125), "has 4 elements: a pass-by-value scalar has one"),
        (torch.full((1,), 0.125, device="meta"), "is on meta: a pass-by-value scalar is read from host memory"),
    ],
)
def test_a_pass_by_value_scalar_cuDNN_would_misread_is_refused(cache: PlanCache, scale: Any, problem: str) -> None:
    """cuDNN reads a pass-by-value scalar through a host pointer, as the plan's type: a
    float64, a device tensor's address or a Python float (no pointer at all) was launched
    unchecked; the CPU stand-in read it right, cuDNN would not."""
    spec = CausalSdpa(attn_scale=0.125)
    plan = cache.get(spec.graph())
    pack = spec.tensors(seed=6)
    pack[spec.uids[3]] = scale
    with pytest.raises(TensorMismatchError, match=problem):
        plan.execute(pack)


def test_names_may_be_a_str_subclass(cache: PlanCache) -> None:
    """A StrEnum member equal to a tensor's name names it, on the fast path as on the slow
    one (the fast path took it for a uid, and the slow path then found nothing to say)."""
    import enum

    class Name(str, enum.Enum):
        X, W, B, Y = "X", "W", "B", "Y"

    plan = cache.get(CONV.graph())
    by_uid = CONV.tensors(seed=2)
    plan.execute({Name(name): by_uid[uid] for name, uid in zip("XWBY", CONV.uids, strict=True)})


def test_prepare_returns_the_plan_and_launches_count(counting: tuple[PlanCache, CountingBackend]) -> None:
    cache, backend = counting
    plan = cache.get(CONV.graph())
    assert plan.workspace_size > 0  # the test kernels stage their outputs in scratch memory
    assert plan.prepare() is plan
    for seed in range(3):
        plan.execute(CONV.tensors(seed))
    assert backend.executions == 3
    assert backend.driver.simulated.launches == 3, "every launch through the plan's native path"


def test_repr_names_key_and_source(conv_plan: Plan) -> None:
    text = repr(conv_plan)
    assert conv_plan.key[:12] in text and "built" in text and "[1, 2, 3, 4]" in text and "cpu:0" in text


# ---------------------------------------------------------------------------- size-1 dims


def test_strides_of_size_one_dims_are_not_checked(conv_plan: Plan) -> None:
    pack = CONV.tensors(seed=7)
    bias = torch.randn(1, 4, 1, 1)  # contiguous: strides (4, 1, 1, 1), the plan says (4, 1, 4, 4)
    assert bias.stride() != tuple(channels_last([1, 4, 1, 1]))
    pack[3] = bias
    conv_plan.execute(pack)
    torch.testing.assert_close(pack[4], CONV.reference(pack))


def test_size_one_batch_takes_any_batch_stride(cache: PlanCache) -> None:
    spec = ConvBiasRelu(n=1)
    plan = cache.get(spec.graph())
    pack = spec.tensors(seed=8)
    x = pack[1]
    storage = torch.zeros(x.numel() + 16)
    odd = storage.as_strided(x.shape, (12345, *x.stride()[1:]))  # batch stride is never stepped
    odd.copy_(x)
    pack[1] = odd
    plan.execute(pack)
    torch.testing.assert_close(pack[4], spec.reference(pack))


# ---------------------------------------------------------------------------- mismatches


def test_wrong_shape_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[1] = torch.zeros(2, 8, 6, 7).to(memory_format=torch.channels_last)
    error = refuse(conv_plan, pack, counting[1], "'X' (uid 1) has shape [2, 8, 6, 7], the plan needs [2, 8, 6, 6]")
    assert error.key == conv_plan.key


def test_wrong_output_shape_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[4] = torch.zeros(2, 4, 6, 5).to(memory_format=torch.channels_last)
    refuse(conv_plan, pack, counting[1], "'Y' (uid 4) has shape")


def test_wrong_stride_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[1] = pack[1].contiguous()  # NCHW, the plan was built channels-last
    refuse(conv_plan, pack, counting[1], "'X' (uid 1) has strides [288, 36, 6, 1], the plan needs [288, 1, 48, 8]")


def test_wrong_output_stride_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[4] = torch.zeros(2, 4, 6, 6)  # contiguous output for a channels-last plan
    refuse(conv_plan, pack, counting[1], "'Y' (uid 4) has strides")


def test_wrong_dtype_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[2] = pack[2].half()
    assert pack[2].stride() == tuple(channels_last(CONV.w_dims))  # only the dtype is wrong
    refuse(conv_plan, pack, counting[1], "'W' (uid 2) has dtype torch.float16, the plan needs torch.float32")


def test_missing_tensor_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    del pack[3]
    refuse(conv_plan, pack, counting[1], "missing 'B' (uid 3)")


def test_unknown_uid_and_name_are_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    refuse(conv_plan, {**pack, 99: pack[1]}, counting[1], "99 is not a tensor of this plan")
    refuse(conv_plan, {**pack, "nope": pack[1]}, counting[1], "'nope' is not a tensor of this plan")


def test_tensor_given_twice_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    refuse(conv_plan, {**pack, "X": pack[1].clone()}, counting[1])


def test_not_a_tensor_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack: dict[Any, Any] = CONV.tensors()
    pack[1] = [[1.0, 2.0]]
    refuse(conv_plan, pack, counting[1], "'X' (uid 1) is a list, not a tensor")


def test_tensor_on_another_device_is_refused(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    pack[2] = torch.empty_strided(CONV.w_dims, channels_last(CONV.w_dims), device="meta")
    refuse(conv_plan, pack, counting[1], "'W' (uid 2) is on meta, the plan runs on cpu:0")


def test_every_problem_is_named_at_once(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    del pack[2]
    pack[1] = pack[1].double()
    pack[3] = torch.zeros(1, 5, 1, 1)
    error = refuse(conv_plan, pack, counting[1], "missing 'W' (uid 2)", "'X' (uid 1) has dtype", "'B' (uid 3) has shape")
    assert len(error.problems) == 3


def test_mismatch_error_is_a_value_error_that_pickles(conv_plan: Plan) -> None:
    pack = CONV.tensors()
    del pack[1]
    with pytest.raises(ValueError) as info:
        conv_plan.execute(pack)
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, TensorMismatchError)
    assert copy.problems == info.value.problems and copy.key == conv_plan.key
    assert str(copy) == str(info.value)


def test_a_refused_call_leaves_the_plan_usable(conv_plan: Plan, counting: Any) -> None:
    pack = CONV.tensors()
    refuse(conv_plan, {k: v for k, v in pack.items() if k != 1}, counting[1])
    conv_plan.execute(pack)
    assert counting[1].executions == 1
    torch.testing.assert_close(pack[4], CONV.reference(pack))


def test_unknown_dims_are_not_checked() -> None:
    # A backend may not know an output's shape; such a spec accepts any shape.
    specs = [
        TensorSpec(1, "x", (2, 3), (3, 1), "data_type.FLOAT", False),
        TensorSpec(2, "y", (), (), "data_type.FLOAT", True),
    ]
    plan = Plan(key="k" * 64, backend=CpuTestBackend(), native=None, tensors=specs, workspace_size=0,
                engine=None, source="built", device=0)  # fmt: skip
    assert plan.check({1: torch.zeros(2, 3), 2: torch.zeros(5)}).keys() == {1, 2}
    with pytest.raises(TensorMismatchError, match="has dtype"):
        plan.check({1: torch.zeros(2, 3), 2: torch.zeros(5, dtype=torch.int32)})


@pytest.mark.parametrize("ref", [True, 1.0, "1"])
def test_a_tensor_keyed_by_what_only_looks_like_its_uid_is_refused(counting: tuple[PlanCache, CountingBackend], ref: Any) -> None:
    # True and 1.0 hash and compare as 1 does, and were taken for uid 1; "1" is no name.
    cache, backend = counting
    plan = cache.get(CONV.graph())
    tensors: dict[Any, Any] = dict(CONV.tensors(seed=0))
    tensors[ref] = tensors.pop(1)
    with pytest.raises(TensorMismatchError, match=r"is neither a uid|is not a tensor of this plan"):
        plan.execute(tensors)
    assert backend.executions == 0
