"""A repeat lookup of the same graph object reuses its key, and never a stale one.

``GraphKeys`` (plancache.cache.keys) computes a graph's key once per state of the graph
(plancache.key.state). The property that matters: after any change to a graph that has
been keyed, the key it gives is the key ``describe`` + ``make_key`` give the changed graph
(or both refuse it). Each test below keys a graph, changes it, and compares the two.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cudnn
import pytest
from graphs import ConvBiasRelu
from key_families import FAMILIES

import plancache.cache.keys as keys_module
from plancache import BuildOptions, InvalidGraphError, describe, make_key
from plancache.cache.keys import GraphKeys
from plancache.key import canonical_json
from plancache.key.state import GraphState
from plancache.runtime.plan import names_of

ENV = {"gpu_name": "test", "cudnn_backend_version": "9"}
ENV_JSON = canonical_json(ENV)
OPTIONS = BuildOptions()

# Families whose graphs hold every kind of value a pygraph holds: lists of ints, floats,
# enums, bools, graph-held scalars, pass-by-value tensors, ragged offsets, callables.
SAMPLED = ["conv_fprop", "matmul", "pointwise_scalars", "graph_scalar", "layernorm", "sdpa", "sdpa_ragged", "sdpa_score_mod",
           "reduction", "reshape"]  # fmt: skip


def fresh(graph: Any, tag: str | None = None) -> Any:
    """What describing the graph now gives: (digest, names), or the refusal's type."""
    try:
        return make_key(describe(graph, tag), ENV, OPTIONS).digest, names_of(graph)
    except InvalidGraphError as exc:
        return type(exc)


def memoized(keys: GraphKeys, graph: Any, tag: str | None = None) -> Any:
    try:
        key, names = keys.key(graph, OPTIONS, ENV, "env", ENV_JSON, tag)
    except InvalidGraphError as exc:
        return type(exc)
    return key.digest, names


def family_graph(name: str) -> tuple[Any, str | None]:
    matching = [f for f in FAMILIES.values() if f.name == name]
    if not matching:
        pytest.skip(f"no family {name} in this frontend's tables")
    base = matching[0].variants()[0]
    return base.build(), base.tag


# ---------------------------------------------------------------------- changes


def _other_member(v: Any) -> Any:
    members = [m for m in type(v).__members__.values() if m != v]
    return members[0] if members else None


def _changes_of(value: Any) -> Iterator[tuple[str, Callable[[Any], Any]]]:
    """Ways to change one value: each a label and a function of the old value giving the
    new one (or changing it in place and returning it)."""
    if value.__class__ is bool:
        yield "flipped", lambda v: not v
        yield "as int", lambda v: int(v)
    elif value.__class__ is int:
        yield "plus one", lambda v: v + 1
        if value in (0, 1):
            yield "as bool", lambda v: bool(v)
        yield "as float", lambda v: float(v)
    elif value.__class__ is float:
        yield "negated" if value else "negative zero", lambda v: -v if v else -0.0
        yield "nudged", lambda v: v + 1.0
    elif value.__class__ is list and value and all(type(x) is int for x in value):
        yield "element changed in place", lambda v: (v.__setitem__(0, v[0] + 1), v)[1]
        if value[0] in (0, 1):
            yield "element as bool in place", lambda v: (v.__setitem__(0, bool(v[0])), v)[1]
        yield "as tuple", lambda v: tuple(v)
    elif hasattr(type(value), "__members__") and _other_member(value) is not None:
        yield "another member", _other_member


def _slots(graph: Any) -> Iterator[tuple[str, Callable[[Any], Any], str]]:
    """Every attribute of every tensor, node, node parameter and of the context, as a path
    that finds it again in a graph built alike: (label, owner-of-the-value finder, name)."""
    tensors = list(graph._tensor_by_uid.values())
    for i, t in enumerate(tensors):
        for name in vars(t):
            yield f"tensor {t.name} {name}", lambda g, i=i: list(g._tensor_by_uid.values())[i], name
    for i, node in enumerate(graph._nodes):
        for name in ("compute_data_type",):
            yield f"node {node.name} {name}", lambda g, i=i: g._nodes[i], name
        for name in node.params:
            yield f"node {node.name} param {name}", lambda g, i=i: ("params", g._nodes[i]), name
    for name in vars(graph.context):
        yield f"context {name}", lambda g: g.context, name


def _cases(family: str) -> Iterator[tuple[str, Callable[[Any], None]]]:
    graph, _ = family_graph(family)
    for label, find, name in _slots(graph):
        owner = find(graph)
        value = owner[1].params[name] if isinstance(owner, tuple) else getattr(owner, name)
        for how, change in _changes_of(value):

            def apply(g: Any, find: Callable[[Any], Any] = find, name: str = name, change: Callable[[Any], Any] = change) -> None:
                owner = find(g)
                if isinstance(owner, tuple):
                    owner[1].params[name] = change(owner[1].params[name])
                else:
                    object.__setattr__(owner, name, change(getattr(owner, name)))

            yield f"{label}: {how}", apply


@pytest.mark.parametrize("family", SAMPLED)
def test_every_change_of_a_keyed_graph_gives_the_key_describe_gives(family: str) -> None:
    cases = list(_cases(family))
    assert len(cases) > 10, f"{family}: too few changes to mean anything"
    differed = 0
    for label, apply in cases:
        graph, tag = family_graph(family)
        keys = GraphKeys()
        before = memoized(keys, graph, tag)
        assert memoized(keys, graph, tag) == before == fresh(graph, tag)  # (the second takes the state)
        assert memoized(keys, graph, tag) == before  # (the third reads it)
        apply(graph)
        after = fresh(graph, tag)
        assert memoized(keys, graph, tag) == after, f"{family}, {label}: the memo kept a stale key"
        differed += after != before
    assert differed, f"{family}: no change changed the key, so the test showed nothing"


def test_adding_an_operation_renaming_and_api_setters_give_new_keys_and_names() -> None:
    spec = ConvBiasRelu()
    keys = GraphKeys()

    def changed(change: Callable[[Any], Any]) -> None:
        graph = spec.graph()
        before = memoized(keys, graph)
        assert memoized(keys, graph) == before  # its state taken
        change(graph)
        after = memoized(keys, graph)
        assert after == fresh(graph)
        assert after != before

    y = lambda g: g.tensors["Y"]  # noqa: E731
    changed(lambda g: y(g).set_dim([2, 4, 6, 7]))
    changed(lambda g: y(g).set_stride([144, 36, 6, 1]))
    changed(lambda g: y(g).set_data_type(cudnn.data_type.HALF))
    changed(lambda g: y(g).set_uid(9))
    changed(lambda g: y(g).set_name("out"))  # the same key, other names
    changed(lambda g: g.tensors["X"].dim.__setitem__(0, 3))
    changed(lambda g: g._nodes[0].params["padding"].__setitem__(0, 0))
    changed(lambda g: g.relu(y(g), name="again").set_output(True).set_uid(11))
    changed(lambda g: g.deselect_engines(["eng0"]))


def test_a_repeat_lookup_of_an_unchanged_graph_describes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = ConvBiasRelu().graph()
    keys = GraphKeys()
    first = memoized(keys, graph)
    assert memoized(keys, graph) == first  # its state is taken at its second lookup
    calls = []
    monkeypatch.setattr(keys_module, "describe", lambda *a, **k: calls.append(a) or describe(*a, **k))
    for _ in range(3):
        assert memoized(keys, graph) == first
    assert calls == []
    graph.tensors["Y"].set_dim([2, 4, 6, 7])
    assert memoized(keys, graph) != first
    assert len(calls) == 1


def test_a_graph_holding_a_value_that_cannot_be_compared_is_described_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    graph = ConvBiasRelu().graph()
    graph._nodes[1].params["table"] = torch.ones(2)  # its bytes are keyed, and may change in place
    assert GraphState.of(graph) is None
    keys = GraphKeys()
    calls = []
    monkeypatch.setattr(keys_module, "describe", lambda *a, **k: calls.append(a) or describe(*a, **k))
    first = memoized(keys, graph)
    assert memoized(keys, graph) == first
    graph._nodes[1].params["table"][0] = 2.0
    assert memoized(keys, graph) == fresh(graph) != first
    assert len(calls) == 3


def test_the_memo_does_not_keep_a_graph_alive() -> None:
    graph = ConvBiasRelu().graph()
    keys = GraphKeys()
    memoized(keys, graph)
    ref = weakref.ref(graph)
    del graph
    gc.collect()
    assert ref() is None
