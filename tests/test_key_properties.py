"""Properties of the key over every op family the cuDNN Frontend Python API builds on a CPU.

For each family (tests/key_families.py): every variant that changes something that can
change the computation or the plan keys apart from the base and from every other such
variant; renaming tensors and nodes, creating tensors in another order, rebuilding, or
spelling the same graph otherwise keys alike; and no variant's key changes when the graph
is validated or when the backend reports its own layouts back. scripts/key_oracle.py
checks the same variants against cuDNN's own key on a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
import sys
from collections import defaultdict
from typing import Any

import cudnn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from key_families import FAMILIES, Family, Variant

from plancache import BuildOptions, InvalidGraphError, describe, make_key
from plancache.cudnn.replay import rebuild_graph
from plancache.key import (
    NODE_ATTRS_DENIED,
    NODE_ATTRS_KEYED,
    TENSOR_FIELDS_DENIED,
    TENSOR_FIELDS_KEYED,
    canonical_json,
)

ENV = {"gpu_name": "test", "cudnn_backend_version": "test"}
OPTIONS = BuildOptions()
FAMILY_NAMES = sorted(FAMILIES)


def key(variant: Variant, graph: Any = None) -> str:
    return make_key(describe(graph if graph is not None else variant.build(), tag=variant.tag), ENV, OPTIONS).digest


def _by_kind(family: Family) -> tuple[list[Variant], list[Variant]]:
    variants = family.variants()
    return [v for v in variants if v.kind != "same"], [v for v in variants if v.kind == "same"]


def test_the_families_cover_the_op_types() -> None:
    # Every op the Python API offers that has a backend lowering and builds without a GPU.
    types = {n.node_type.name for f in FAMILIES.values() for v in f.variants()[:1] + f.variants() for n in v.build().nodes}
    expected = {
        "CONV_FPROP", "CONV_DGRAD", "CONV_WGRAD", "MATMUL", "POINTWISE", "REDUCTION", "LAYERNORM", "LAYERNORM_BWD",
        "RMSNORM", "RMSNORM_BWD", "BATCHNORM", "BATCHNORM_BWD", "BATCHNORM_INFERENCE", "SDPA", "SDPA_BWD", "SDPA_FP8",
        "SLICE", "CONCATENATE", "RESHAPE", "TRANSPOSE", "ROPE", "ROPE_BWD", "BLOCK_SCALE_QUANTIZE", "BLOCK_SCALE_DEQUANTIZE",
        "MOE_GROUPED_MATMUL",
    }  # fmt: skip
    assert expected <= types


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_change_keys_apart(name: str) -> None:
    distinct, _ = _by_kind(FAMILIES[name])
    keys: dict[str, list[str]] = defaultdict(list)
    for variant in distinct:
        keys[key(variant)].append(variant.label)
    collisions = [labels for labels in keys.values() if len(labels) > 1]
    assert not collisions, f"{name}: variants that change the graph share a key: {collisions}"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_same_graph_spelled_otherwise_keys_alike(name: str) -> None:
    distinct, same = _by_kind(FAMILIES[name])
    base = key(distinct[0])
    differing = [v.label for v in same if key(v) != base]
    assert not differing, f"{name}: these spell the base graph yet key apart: {differing}"


def _simulate_backend_layouts(graph: Any) -> None:
    """What build_operation_graph() reports back: cuDNN's own strides for every op output
    whose strides it was not given (the pygraph overwrites unassigned ones with them)."""
    captured = sys.modules["cudnn._pygraph"]._CAPTURED_BY_TYPE
    for node in graph.nodes:
        given = set(captured[node.node_type][1]["outputs"]) if node.node_type in captured else set()
        for port, t in node.outputs.items():
            if t is not None and t.dim and not t.stride_assigned and port not in given:
                object.__setattr__(t, "stride", tuple(reversed(range(3, len(t.dim) + 3))))


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_key_survives_validation_and_the_backend_layouts(name: str) -> None:
    # The cache keys a graph, then the backend validates and plans that very object; the
    # same object may be keyed again. validate() fills in dims, strides and data types.
    rejected = []
    for variant in FAMILIES[name].variants():
        graph = variant.build()
        before = describe(graph, tag=variant.tag)
        try:
            graph.validate()
        except Exception:  # lowering needs a GPU, and inference runs first: inferred if lowering began
            if not graph._frozen:  # rejected before lowering: never planned, nothing to compare
                rejected.append(variant.label)
                continue
        assert describe(graph, tag=variant.tag) == before, f"{variant.id}: validate() changed the key"
        _simulate_backend_layouts(graph)
        assert describe(graph, tag=variant.tag) == before, f"{variant.id}: the backend's layouts changed the key"
    assert len(rejected) <= len(FAMILIES[name].variants()) // 4, f"{name}: validate() rejects too many variants: {rejected}"


def test_inferred_output_dims_key_like_given_ones() -> None:
    # A dgrad whose loss is an intermediate has no dX dims until validate(): the key
    # computes what validate() will fill in, which is what cuDNN then receives.
    family = FAMILIES["conv_dgrad"]
    inferred = next(v for v in family.variants() if v.label == "chain=True,via='infer'")
    graph = inferred.build()
    dx = graph.nodes[-1].outputs["DX"]
    assert not dx.dim
    described = describe(graph)["tensors"]["u3"]
    assert described["dim"] == [2, 4, 15, 15]  # (8 - 1) * 2 + 3 - 2
    given = dataclasses.replace(inferred, params={**inferred.params, "via": "out_dims", "dx": 15})
    assert key(given) == key(inferred)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_variant_replays_to_the_same_description(name: str) -> None:
    # A recorded manifest stores descriptions; replaying one must key what was recorded.
    for variant in FAMILIES[name].variants():
        if variant.tag is not None:
            continue  # a callable cannot be replayed from its tag
        description = describe(variant.build())
        assert describe(rebuild_graph(description)) == description, variant.id


# ---------------------------------------------------------------------------- exact values


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, width=64), st.floats(allow_nan=False, width=64))
def test_float_attributes_key_to_the_bit(a: float, b: float) -> None:
    variant = next(v for v in FAMILIES["pointwise_scalars"].variants() if v.label == "base")

    def with_slope(x: float) -> Variant:
        return dataclasses.replace(variant, params={**variant.params, "op": "leaky_relu", "scalars": {"negative_slope": x}})

    assert (key(with_slope(a)) == key(with_slope(b))) == (_bits(a) == _bits(b))


@settings(max_examples=100, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=32), st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_tensor_attributes_key_by_their_bytes(a: float, b: float) -> None:
    variant = next(v for v in FAMILIES["pointwise_scalars"].variants() if v.label == "base")

    def with_slope(x: float) -> Variant:
        return dataclasses.replace(variant, params={**variant.params, "scalars": {"negative_slope": ("torch", x, "float32")}})

    same = struct.pack("<f", a) == struct.pack("<f", b)
    assert (key(with_slope(a)) == key(with_slope(b))) == same


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(st.integers(-(2**31), 2**31), st.floats(allow_nan=False)), st.sampled_from(["COMPILE_TIME_CONST", "RUNTIME_PARAM"])
)
def test_graph_held_scalars_key_by_value_type_and_kind(value: float, scalar_type: str) -> None:
    base = next(v for v in FAMILIES["graph_scalar"].variants() if v.label == "base")
    variant = dataclasses.replace(base, params={**base.params, "value": value, "scalar_type": scalar_type})
    described = describe(variant.build())
    (scalar,) = (t for tid, t in described["tensors"].items() if tid.startswith("c"))
    assert scalar["scalar_type"] == f"scalar_type.{scalar_type}"
    if isinstance(value, float) and math.isfinite(value):
        assert scalar["scalar"] == value and type(scalar["scalar"]) is float
    elif isinstance(value, int):
        assert scalar["scalar"] == value and type(scalar["scalar"]) is int
    assert canonical_json(describe(variant.build())) == canonical_json(described)


# ---------------------------------------------------------------------------- coverage by construction


def test_every_tensor_field_is_keyed_or_denied() -> None:
    # A field cuDNN Frontend adds is keyed exactly (or refused) at run time; this test
    # makes the addition visible, so it gets a deliberate place in the lists.
    fields = {f.name for f in dataclasses.fields(cudnn.graph_types.Tensor)}
    unplaced = fields - TENSOR_FIELDS_KEYED - set(TENSOR_FIELDS_DENIED)
    assert not unplaced, f"Tensor fields neither keyed nor denied: {sorted(unplaced)}"
    assert not (TENSOR_FIELDS_KEYED & set(TENSOR_FIELDS_DENIED))


def test_every_node_attribute_is_keyed_or_denied() -> None:
    node = FAMILIES["matmul"].variants()[0].build().nodes[0]
    unplaced = set(vars(node)) - NODE_ATTRS_KEYED - set(NODE_ATTRS_DENIED)
    assert not unplaced, f"Node attributes neither keyed nor denied: {sorted(unplaced)}"


def _base_graph() -> Any:
    return FAMILIES["matmul"].variants()[0].build()


def test_a_new_tensor_field_is_keyed_not_dropped() -> None:
    graph = _base_graph()
    before = describe(graph)
    tensor = graph.nodes[0].inputs["A"]
    tensor.future_field = 3  # as a later cuDNN Frontend might add
    after = describe(graph)
    assert after != before and after["tensors"]["u1"]["x:future_field"] == 3
    tensor.future_field = object()
    with pytest.raises(
        InvalidGraphError, match=r"tensor 'A' field 'future_field' is a object, which plancache cannot key exactly"
    ):
        describe(graph)


def test_a_new_node_attribute_and_graph_argument_are_keyed() -> None:
    graph = _base_graph()
    before = describe(graph)
    graph.nodes[0].future_attribute = "x"
    assert describe(graph)["nodes"][0]["x:future_attribute"] == "x"
    graph = _base_graph()
    graph._cpp_graph_kwargs["future_argument"] = 7  # forwarded to the backend graph as it is
    assert describe(graph)["flags"]["kw:future_argument"] == 7
    graph = _base_graph()
    graph.future_public_attribute = True
    assert describe(graph)["flags"]["attr:future_public_attribute"] is True
    assert describe(_base_graph()) == before


def test_names_never_enter_the_description() -> None:
    for variant in (v for f in FAMILIES.values() for v in f.variants() if v.label == "renamed"):
        assert "renamed/" not in canonical_json(describe(variant.build(), tag=variant.tag)), variant.id


def test_variant_and_pair_counts() -> None:
    """The size of the property check, printed for the record (pytest -s shows it)."""
    variants = sum(len(f.variants()) for f in FAMILIES.values())
    apart = sum(math.comb(len(_by_kind(f)[0]), 2) for f in FAMILIES.values())
    alike = sum(len(_by_kind(f)[1]) for f in FAMILIES.values())
    print(f"\nkey properties: {len(FAMILIES)} families, {variants} variants, {apart} pairs keyed apart, {alike} keyed alike")
    assert variants >= 400 and apart >= 3000


def test_pairs_within_a_family_are_distinct_descriptions_not_just_digests() -> None:
    # The digest is a hash of the description; check the descriptions themselves once.
    family = FAMILIES["sdpa"]
    distinct, _ = _by_kind(family)
    texts = [canonical_json(describe(v.build(), tag=v.tag)) for v in distinct]
    for (a, ta), (b, tb) in itertools.combinations(zip(distinct, texts), 2):
        assert ta != tb, (a.label, b.label)


# ---------------------------------------------------------------------------- the GPU oracle's logic


def _oracle() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "key_oracle.py"
    spec = importlib.util.spec_from_file_location("key_oracle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["key_oracle"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_oracle_flags_exactly_the_pairs_cudnn_separates_and_plancache_does_not() -> None:
    oracle = _oracle()
    R = oracle.Result
    results = [
        R("f", "a", ours="1", ours_after="1", theirs="x"),
        R("f", "b", ours="1", ours_after="1", theirs="y"),  # cuDNN apart, plancache alike: a collision
        R("f", "c", ours="2", ours_after="2", theirs="x"),  # cuDNN alike, plancache apart: over-separated
        R("f", "d", ours="3", ours_after="4", theirs="z"),  # the key changed once built: unstable
        R("f", "e", ours="5", stage="cudnn", error="rejected"),  # skipped
    ]
    report = oracle.compare("f", results)
    assert report.variants == 5 and report.compared_pairs == 6
    assert report.collisions == [("a", "b")]
    assert report.cudnn_distinct_pairs == 5 and report.over_separated_pairs == 1
    assert report.unstable == ["d"]
    assert report.skipped == [("e", "cudnn", "rejected")]


def test_the_oracle_survives_variants_it_cannot_build(tmp_path: Any) -> None:
    # Without a GPU every variant stops at cuDNN; the run goes on and says nothing compared.
    oracle = _oracle()
    result = oracle.run_variant(FAMILIES["matmul"].variants()[0])
    assert result.ours is not None and not result.ok and result.stage == "cudnn"
    broken = dataclasses.replace(FAMILIES["matmul"].variants()[0], builder=lambda g, p: 1 / 0)
    assert oracle.run_variant(broken).stage == "build"
    out = tmp_path / "oracle.json"
    assert oracle.main(["matmul", "reshape", "--json", str(out)]) == 2
    payload = json.loads(out.read_text())
    comparable = sum(v.comparable for name in ("matmul", "reshape") for v in FAMILIES[name].variants())
    assert payload["summary"]["variants"] == payload["summary"]["skipped"] == comparable
    assert payload["summary"]["collisions"] == 0 and set(payload["results"]) == {"matmul", "reshape"}


def test_the_description_text_is_canonical_json_whichever_encoder_writes_it() -> None:
    """make_key writes a description with orjson where that gives canonical_json's very
    text, else with canonical_json: every family's every variant, and values orjson would
    write otherwise (floats, non-ASCII, DEL, escapes, big integers, integer keys, tuples)."""
    from plancache.key.key import _description_json

    for family in FAMILIES.values():
        for variant in family.variants():
            description = describe(variant.build(), tag=variant.tag)
            assert _description_json(description) == canonical_json(description), variant.label
    awkward: list[Any] = [1e-05, 1e-04, 0.00012, 1e-07, 1e16, 1e15 + 0.5, 0.1, 0.125, 1 / 3, -0.0, 5e-324, 1.5e300, "é", "\x7f", "\x01", "a\"b\\c\n", "v1.2", 2**70, -(2**63) - 1, (1, 2),
                          {1: "integer key"}, {"b": None, "a": True}]  # fmt: skip
    for value in awkward:
        assert _description_json({"x": value}) == canonical_json({"x": value}), value


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), _JSON_VALUES, max_size=6))
@settings(max_examples=400, deadline=None)
def test_any_json_value_is_written_as_canonical_json(value: dict[str, Any]) -> None:
    from plancache.key.key import _description_json

    assert _description_json(value) == canonical_json(value)
