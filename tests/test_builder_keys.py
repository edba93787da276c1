"""``@cache.builder`` keys its arguments as ``describe`` keys the graphs built from them: a
signature two different graphs share would return the first one's plan for the second.
And ``tag=`` through ``get`` and ``builder`` (docs/key.md)."""

from __future__ import annotations

import dataclasses
import enum
import math
import pickle
from typing import Any, NamedTuple

import cudnn
import numpy as np
import pytest
import torch
from graphs import ConvBiasRelu, row_major
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from key_families import softcap

from plancache import BuildError, BuildOptions, ConfigError, InvalidGraphError, PlanCache, UnkeyableArgumentError

DT = cudnn.data_type
HEURISTIC = BuildOptions(policy="heuristic")  # builds in milliseconds on the CPU test backend


def leaky_relu(slope: Any, n: int = 4) -> Any:
    """y = leaky_relu(x) of [1, n] floats: its key holds ``slope`` exactly."""
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    x = g.tensor(name="x", dim=[1, n], stride=[n, 1], data_type=DT.FLOAT, uid=1)
    y = g.relu(x, negative_slope=slope)
    y.set_output(True).set_uid(2).set_dim([1, n]).set_stride([n, 1])
    return g


def test_zero_negative_zero_and_the_int_zero_are_three_plans(cache: PlanCache) -> None:
    """The memo keyed by ``==``: 0.0, -0.0 and 0 got one plan, though get() keys the three
    graphs apart."""
    built = cache.builder(leaky_relu, options=HEURISTIC)
    for slope in (0.0, -0.0, 0, False, 0.0, -0.0):
        assert built(slope).key == cache.get(leaky_relu(slope), options=HEURISTIC).key, slope
    assert len(built.plans) == 4  # type: ignore[attr-defined]


def test_a_mutated_container_is_keyed_by_its_content_at_each_call(cache: PlanCache) -> None:
    """A list argument changed between two calls must not get the first call's plan (a
    slope of 0.0 changed to -0.0 did: the memo compared the list by ==)."""
    built = cache.builder(lambda slopes: leaky_relu(slopes[0]), options=HEURISTIC)
    slopes = [0.0]
    first = built(slopes)
    slopes[0] = -0.0
    assert built(slopes).key == cache.get(leaky_relu(-0.0), options=HEURISTIC).key != first.key
    slopes[0] = 0.25
    assert built(slopes).key != first.key
    assert built([0.0]).key == first.key


@dataclasses.dataclass
class MutableConfig:
    slope: float


@dataclasses.dataclass(frozen=True)
class FrozenConfig:
    slope: float


class Plain:
    def __init__(self, slope: float) -> None:
        self.slope = slope


def test_an_object_without_a_stable_value_is_refused_in_one_line_naming_key(cache: PlanCache) -> None:
    """A config object whose attribute changed between two calls got the first call's plan;
    an unhashable one (a mutable dataclass, a set of lists) raised a bare TypeError."""
    built = cache.builder(lambda config: leaky_relu(config.slope), options=HEURISTIC)
    for config in (MutableConfig(0.5), Plain(0.5)):
        with pytest.raises(UnkeyableArgumentError, match=r"argument 1 .*pass key=") as caught:
            built(config)
        assert "\n" not in str(caught.value) and isinstance(caught.value, TypeError)
    with pytest.raises(UnkeyableArgumentError, match=r"argument 'f' is a callable.*tag="):
        cache.builder(lambda f: leaky_relu(0.5))(f=lambda: 0)
    frozen = built(FrozenConfig(0.5))  # declares its value: keyed by its fields
    assert built(FrozenConfig(0.5)) is frozen and built(FrozenConfig(0.25)).key != frozen.key
    explicit = cache.builder(lambda config: leaky_relu(config.slope), options=HEURISTIC, key=lambda config: config.slope)
    assert explicit(Plain(0.5)).key == frozen.key


class Mode(enum.Enum):
    A = 1
    B = 2


class Pair(NamedTuple):
    a: Any
    b: Any


#: Arguments a builder meets, chosen so that many compare equal in Python and key apart
#: in describe (0, 0.0, -0.0, False; 1, 1.0, True; (1, 2) and (1.0, 2); a list and a tuple).
VALUES: list[Any] = [
    0, 0.0, -0.0, False, 1, 1.0, True, None, math.nan, math.inf, "a", b"a", (1, 2), (1.0, 2), (True, 2), [1, 2], {"k": 1},
    {"k": 1.0}, {"k": 1, "j": 2}, {"j": 2, "k": 1}, Mode.A, Mode.B, 1.5, Pair(1, 2), FrozenConfig(0.0),
    FrozenConfig(-0.0), np.float32(0.0), np.float32(-0.0), np.array([1, 2]), np.array([1.0, 2.0]), torch.float16,
    torch.float32, np.dtype("float32"), np.dtype("float16"), slice(1, 2), cudnn.data_type.HALF, cudnn.data_type.FLOAT, torch.zeros(2, 3),
    torch.zeros(2, 3).t(), torch.zeros(2, 3, dtype=torch.float64), (torch.zeros(1), 0.0),
]  # fmt: skip


def truth(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """What a builder function sees of its arguments, exactly: pickled (which tells 0.0,
    -0.0, 0 and False apart, and keeps a dict's order), tensors by layout."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), str(value.device))
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return (type(value).__name__, *(plain(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, plain(v)) for k, v in value.items()))
        if isinstance(value, cudnn.data_type):
            return ("cudnn", value.name)
        return value

    return pickle.dumps((plain(args), sorted((k, plain(v)) for k, v in kwargs.items())), protocol=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(calls=st.lists(st.tuples(st.lists(st.sampled_from(VALUES), max_size=3),
                                st.dictionaries(st.sampled_from(["p", "q"]), st.sampled_from(VALUES), max_size=2)),
                      min_size=1, max_size=8))  # fmt: skip
def test_the_builders_plan_is_always_the_plan_get_returns_for_the_graph_it_builds(
    cache: PlanCache, calls: list[tuple[list[Any], dict[str, Any]]]
) -> None:
    seen: dict[bytes, int] = {}

    def graph_of(*args: Any, **kwargs: Any) -> Any:
        # Every different argument value builds another graph (another width).
        return leaky_relu(0.0, n=seen.setdefault(truth(args, kwargs), len(seen)) + 1)

    built = cache.builder(graph_of, options=HEURISTIC)
    for args, kwargs in calls:
        assert built(*args, **kwargs).key == cache.get(graph_of(*args, **kwargs), options=HEURISTIC).key, (args, kwargs)


def test_a_builder_repeat_with_tensors_builds_nothing(cache: PlanCache) -> None:
    calls = []

    @cache.builder(options=HEURISTIC)
    def conv(x: torch.Tensor, w: torch.Tensor, padding: tuple[int, int] = (1, 1)) -> Any:
        calls.append(1)
        return ConvBiasRelu(n=x.shape[0], padding=padding[0]).graph()

    x, w = torch.zeros(2, 8, 6, 6), torch.zeros(4, 8, 3, 3)
    plan = conv(x, w)
    assert conv(torch.ones(2, 8, 6, 6), w) is plan and conv(x, w, (1, 1)) is not None and len(calls) == 2


# ---------------------------------------------------------------------------- tag=


def sdpa_with_score_mod(cap: float) -> Any:
    dims = [1, 2, 8, 16]
    g = cudnn.pygraph(io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    q, k, v = (g.tensor(name=n, dim=dims, stride=row_major(dims), data_type=DT.HALF, uid=u) for n, u in zip("qkv", (21, 22, 23)))
    o, _ = g.sdpa(q, k, v, attn_scale=0.25, use_causal_mask=True, generate_stats=False, score_mod=softcap(cap))
    o.set_output(True).set_uid(25).set_dim(dims).set_stride(row_major(dims))
    return g


def test_get_and_builder_take_the_tag_the_key_docs_promise(cache: PlanCache) -> None:
    """A graph with a score_mod is "keyed by a tag you give", but neither get nor the
    builder took one: such graphs could not be cached through the public API."""
    with pytest.raises(InvalidGraphError, match="tag="):
        cache.get(sdpa_with_score_mod(30.0))
    # Keyed with the tag, the graph reaches the backend; the CPU test backend does not
    # compute a score_mod and says so (on a GPU it builds).
    with pytest.raises(BuildError, match="score_mod"):
        cache.get(sdpa_with_score_mod(30.0), tag="softcap=30/v1")
    with pytest.raises(BuildError, match="score_mod"):
        cache.builder(sdpa_with_score_mod, tag="softcap/v1")(30.0)
    # A tag is part of the key: every graph's, through get and the builder alike.
    conv = ConvBiasRelu()
    tagged = cache.get(conv.graph(), tag="v1", options=HEURISTIC)
    assert tagged.key != cache.get(conv.graph(), options=HEURISTIC).key
    assert tagged.key != cache.get(conv.graph(), tag="v2", options=HEURISTIC).key
    assert tagged.key == cache.get(conv.graph(), tag="v1", options=HEURISTIC).key
    assert cache.builder(lambda: conv.graph(), tag="v1", options=HEURISTIC)().key == tagged.key
    # Under a tag, a callable argument is keyed by identity (the tag stands for what it does).
    mod = softcap(30.0)
    built = cache.builder(lambda f: conv.graph(), tag="v1", options=HEURISTIC)
    assert built(mod) is built(mod) and built(mod).key == tagged.key and len(built.plans) == 1  # type: ignore[attr-defined]
    for bad in (3, "", " "):
        with pytest.raises(ConfigError, match="tag"):
            cache.get(conv.graph(), tag=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="tag"):
            cache.builder(lambda: conv.graph(), tag=bad)  # type: ignore[arg-type]
