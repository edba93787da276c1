"""The canonical description and the key: stable, rename-proof, and sensitive to every
part that can change a plan."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import cudnn
import pytest
from graphs import EXAMPLES, CausalSdpa, ConvBiasRelu, MatmulBiasRelu, row_major

from plancache import BuildOptions, InvalidGraphError, PlanCache, describe, make_key
from plancache.key import KEY_FORMAT, canonical_json, environment_id, tensor_table
from plancache.testing import CpuTestBackend

DT = cudnn.data_type
ENV = CpuTestBackend().environment()
TESTS_DIR = Path(__file__).resolve().parent


def key_of(spec: Any, environment: dict[str, Any] = ENV, options: BuildOptions | None = None) -> str:
    return make_key(describe(spec.graph()), environment, options or BuildOptions()).digest


# ---------------------------------------------------------------------------- describe


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_describe_is_json_serializable_and_stable(name: str) -> None:
    spec = EXAMPLES[name]
    graph = spec.graph()
    description = describe(graph)
    text = json.dumps(description, allow_nan=False)
    assert json.loads(text) == description  # plain JSON types only: no tuples, enums, objects
    assert describe(graph) == description  # describing does not mutate the graph
    assert canonical_json(describe(spec.graph())) == canonical_json(description)  # a fresh graph
    digest = make_key(description, ENV, BuildOptions()).digest
    assert len(digest) == 64 and set(digest) <= set("0123456789abcdef")


def test_description_names_tensors_by_uid_and_virtuals_by_order() -> None:
    description = describe(ConvBiasRelu().graph())
    assert set(description["tensors"]) == {"u1", "u2", "u3", "u4", "v0", "v1"}
    assert [n["type"] for n in description["nodes"]] == ["CONV_FPROP", "POINTWISE", "POINTWISE"]
    assert description["nodes"][0]["inputs"] == {"image": "u1", "weight": "u2"}
    assert description["nodes"][2]["outputs"] == {"OUT_0": "u4"}
    assert description["tensors"]["u4"]["is_output"] is True
    assert description["tensors"]["u1"]["stride"] == [288, 1, 48, 8]  # channels-last
    assert "X" not in json.dumps(description)  # names never enter the key


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_renaming_tensors_and_nodes_does_not_change_the_key(name: str) -> None:
    spec = EXAMPLES[name]
    renamed = dataclasses.replace(spec, prefix="renamed/")
    graph = renamed.graph()
    assert all(t.name.startswith("renamed/") for t in graph.tensors.values())
    assert all(n.name.startswith("renamed/") for n in graph.nodes)
    assert describe(graph) == describe(spec.graph())
    assert key_of(renamed) == key_of(spec)


def test_renaming_a_tensor_after_building_does_not_change_the_key() -> None:
    graph = MatmulBiasRelu().graph()
    before = describe(graph)
    graph.tensors["A"].set_name("something_else")
    assert describe(graph) == before


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_key_is_the_same_after_the_graph_is_validated(name: str) -> None:
    # The backend validates and plans the very graph object it was given; asking the
    # cache for that object again must find the same key.
    graph = EXAMPLES[name].graph()
    before = describe(graph)
    with contextlib.suppress(Exception):  # lowering needs a GPU driver; inference runs first
        graph.validate()
    assert describe(graph) == before
    for tensor in graph.tensors.values():  # as the backend's layout inference reports back
        if tensor.is_virtual and tensor.dim:
            object.__setattr__(tensor, "stride", tuple(reversed(range(1, len(tensor.dim) + 1))))
    assert describe(graph) == before


def test_validate_fills_in_what_the_key_leaves_out() -> None:
    graph = ConvBiasRelu().graph()
    relu_input = graph.nodes[2].inputs["IN_0"]  # the bias output: no dims until inference
    assert not relu_input.dim and relu_input.data_type is None
    with contextlib.suppress(Exception):
        graph.validate()
    assert list(relu_input.dim) == [2, 4, 6, 6] and relu_input.data_type == DT.FLOAT


# One baseline and variants that each change one thing that can change the plan.
CONV = ConvBiasRelu()
MATMUL = MatmulBiasRelu()
SDPA = CausalSdpa()
VARIANTS: dict[str, tuple[Any, Any]] = {
    "conv shape n": (CONV, dataclasses.replace(CONV, n=3)),
    "conv shape h": (CONV, dataclasses.replace(CONV, h=8)),
    "conv shape c": (CONV, dataclasses.replace(CONV, c=16)),
    "conv stride layout": (CONV, dataclasses.replace(CONV, layout="nchw")),
    "conv dtype": (CONV, dataclasses.replace(CONV, dtype="HALF")),
    "conv uid": (CONV, dataclasses.replace(CONV, uids=(1, 2, 3, 5))),
    "conv uid swap": (CONV, dataclasses.replace(CONV, uids=(2, 1, 3, 4))),
    "conv padding": (CONV, dataclasses.replace(CONV, padding=0)),
    "conv stride": (CONV, dataclasses.replace(CONV, conv_stride=2)),
    "conv dilation": (CONV, dataclasses.replace(CONV, dilation=2)),
    "conv compute type": (CONV, dataclasses.replace(CONV, compute="HALF")),
    "conv dynamic shape": (CONV, dataclasses.replace(CONV, dynamic=True)),
    "matmul shape": (MATMUL, dataclasses.replace(MATMUL, m=16)),
    "matmul stride": (MATMUL, dataclasses.replace(MATMUL, b_layout="col")),
    "matmul dtype": (MATMUL, dataclasses.replace(MATMUL, dtype="BFLOAT16")),
    "matmul uid": (MATMUL, dataclasses.replace(MATMUL, uids=(11, 12, 13, 15))),
    "matmul compute type": (MATMUL, dataclasses.replace(MATMUL, compute="HALF")),
    "matmul dynamic shape": (MATMUL, dataclasses.replace(MATMUL, dynamic=True)),
    "sdpa causal flag": (SDPA, dataclasses.replace(SDPA, causal=False)),
    "sdpa shape": (SDPA, dataclasses.replace(SDPA, s=16)),
    "sdpa head dim": (SDPA, dataclasses.replace(SDPA, d=32)),
    "sdpa dtype": (SDPA, dataclasses.replace(SDPA, dtype="BFLOAT16")),
    "sdpa compute type": (SDPA, dataclasses.replace(SDPA, compute="HALF")),
    "sdpa scale uid": (SDPA, dataclasses.replace(SDPA, uids=(21, 22, 23, 26, 25))),
    "sdpa scale by value vs float": (SDPA, dataclasses.replace(SDPA, scale_by_value=False)),
    "sdpa float scale value": (
        dataclasses.replace(SDPA, scale_by_value=False),
        dataclasses.replace(SDPA, scale_by_value=False, attn_scale=0.5),
    ),
    "sdpa dynamic shape": (SDPA, dataclasses.replace(SDPA, dynamic=True)),
}


@pytest.mark.parametrize("change", sorted(VARIANTS))
def test_any_change_that_can_alter_the_plan_changes_the_key(change: str) -> None:
    base, variant = VARIANTS[change]
    assert key_of(variant) != key_of(base)


def test_all_variants_have_distinct_keys() -> None:
    specs = {spec for pair in VARIANTS.values() for spec in pair}
    keys = {key_of(spec) for spec in specs}
    assert len(keys) == len(specs)


def test_pass_by_value_scale_value_is_not_part_of_the_key() -> None:
    # The value of a pass-by-value scale arrives at execute time; only a baked float keys.
    assert key_of(dataclasses.replace(SDPA, attn_scale=0.5)) == key_of(SDPA)


def test_key_is_the_same_in_a_subprocess_with_another_hash_seed() -> None:
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from graphs import EXAMPLES\n"
        "from plancache import BuildOptions, describe, make_key\n"
        "from plancache.testing import CpuTestBackend\n"
        "env = CpuTestBackend().environment()\n"
        "print(json.dumps({n: make_key(describe(s.graph()), env, BuildOptions()).digest "
        "for n, s in EXAMPLES.items()}))\n"
    )
    expected = {name: key_of(spec) for name, spec in EXAMPLES.items()}
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == expected


# ---------------------------------------------------------------------------- what cuDNN receives


def _family_variant(family: str, label: str) -> Any:
    from key_families import FAMILIES

    return next(v for v in FAMILIES[family].variants() if v.label == label)


def _family_key(family: str, label: str) -> str:
    variant = _family_variant(family, label)
    return make_key(describe(variant.build(), tag=variant.tag), ENV, BuildOptions()).digest


@pytest.mark.parametrize(
    ("family", "labels"),
    [
        ("conv_dgrad", ["base", "dx=15"]),  # dX 16x16 vs 15x15 from the same 8x8 loss, stride 2
        ("conv_wgrad", ["base", "r=4"]),  # 3x3 vs 4x4 filters
        ("reduction", ["base", "out=[2, 1, 64]", "out=[1, 1, 1]"]),  # [B,M,1] vs [B,1,N] vs [1,1,1]
        ("conv_reduction", ["base", "out=[2, 16, 1, 1]"]),  # over channels vs over H, W
        ("reshape", ["base", "out=[16, 16]"]),  # [2,128] vs [16,16]
    ],
)
def test_output_dims_the_op_pushes_to_cudnn_are_keyed(family: str, labels: list[str]) -> None:
    # out_dims= sets an op output's dims without marking them assigned, yet the pygraph
    # pushes them to cuDNN for these ops: they decide what the graph computes.
    keys = [_family_key(family, label) for label in labels]
    assert len(set(keys)) == len(keys)


def test_key_is_the_same_before_and_after_validate_when_validate_infers_pushed_dims() -> None:
    variant = _family_variant("conv_dgrad", "chain=True,via='infer'")
    graph = variant.build()
    before = describe(graph)
    with contextlib.suppress(Exception):  # lowering needs a GPU; inference runs first
        graph.validate()
    assert list(graph.nodes[-1].outputs["DX"].dim) == [2, 4, 15, 15]
    assert describe(graph) == before


def test_tensor_valued_scalar_attributes_are_keyed_exactly() -> None:
    # str(torch.tensor(0.10004)) is "tensor(0.1000)": the old text key collided.
    a = _family_key("pointwise_scalars", "scalars={'negative_slope': ('torch', 0.1, 'float32')}")
    b = _family_key("pointwise_scalars", "scalars={'negative_slope': ('torch', 0.10004, 'float32')}")
    c = _family_key("pointwise_scalars", "scalars={'negative_slope': ('torch', 0.1, 'float64')}")
    assert len({a, b, c}) == 3


def test_ragged_offset_multiplier_is_keyed() -> None:
    keys = [_family_key("sdpa_ragged", label) for label in ("base", "multiplier=2", "o_multiplier=2")]
    assert len(set(keys)) == 3


def test_scalar_type_of_a_graph_held_scalar_is_keyed() -> None:
    assert _family_key("graph_scalar", "base") != _family_key("graph_scalar", "scalar_type='RUNTIME_PARAM'")


def test_graph_held_scalars_need_no_uid_and_stay_out_of_the_tensor_table() -> None:
    # graph.tensor_scalar() is the usual idiom: the pygraph gives the scalar an automatic
    # uid and embeds its value; the caller binds nothing for it.
    graph = _family_variant("graph_scalar", "base").build()
    description = describe(graph)
    assert description["tensors"]["c0"] == {
        "scalar": 0.5, "scalar_type": "scalar_type.COMPILE_TIME_CONST", "is_virtual": False, "is_output": False,
    }  # fmt: skip
    assert [spec.uid for spec in tensor_table(graph)] == [1, 2]
    # A runtime pass-by-value tensor the caller creates with a uid stays in the table.
    caller = _family_variant("graph_scalar", "scalar='caller'").build()
    table = {spec.uid: spec for spec in tensor_table(caller)}
    assert set(table) == {1, 2, 5} and table[5].is_pass_by_value


def test_graph_held_scalar_values_key_by_value_and_type() -> None:
    labels = ["base", "value=0.25", "value=0.5000001", "value=2.0", "value=2", "value=-0.0", "value=0.0"]
    keys = [_family_key("graph_scalar", label) for label in labels]
    assert len(set(keys)) == len(keys)


def test_torch_dtypes_in_the_graph_context_key_like_cudnn_ones_before_and_after_validate() -> None:
    import torch

    def graph(io: Any, intermediate: Any, compute: Any) -> Any:
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=intermediate, compute_data_type=compute)
        a = g.tensor(name="A", dim=[1, 4, 8], stride=[32, 8, 1], uid=1)
        b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], uid=2)
        g.relu(g.matmul(a, b, name="mm"), name="relu").set_output(True).set_uid(3)
        return g

    torch_graph = graph(torch.bfloat16, torch.float32, torch.float32)
    before = describe(torch_graph)
    assert before == describe(graph(DT.BFLOAT16, DT.FLOAT, DT.FLOAT))
    with contextlib.suppress(Exception):  # fills the tensors' data types with torch dtypes
        torch_graph.validate()
    assert describe(torch_graph) == before


def test_a_kernel_cache_the_caller_attached_is_keyed_but_not_plancaches_own() -> None:
    from plancache.key import mark_shared_kernel_cache

    spec = MatmulBiasRelu(dynamic=True)
    plain = describe(spec.graph())
    own = spec.graph()
    own._cpp_graph_kwargs["kernel_cache"] = object()  # as cudnn.pygraph(kernel_cache=...) stores it
    assert describe(own) != plain and describe(own)["flags"]["kernel_cache"] is True
    shared = object()
    mark_shared_kernel_cache(shared)
    attached = spec.graph()
    before = describe(attached)
    attached._cpp_graph_kwargs["kernel_cache"] = shared  # what the backend does after keying
    assert describe(attached) == before == plain


def test_device_properties_are_keyed_by_their_serialized_form() -> None:
    from key_families import FakeDeviceProperties

    def graph(sm_count: int) -> Any:
        g = MatmulBiasRelu().graph()
        g._cpp_graph_kwargs["device_property"] = FakeDeviceProperties(sm_count)
        return g

    assert describe(graph(132)) == describe(graph(132))
    assert describe(graph(132)) != describe(graph(114)) != describe(MatmulBiasRelu().graph())


def test_tensor_spec_alignment_defaults_to_16_bytes_and_reads_old_tables() -> None:
    spec = tensor_table(ConvBiasRelu().graph())[0]
    assert spec.alignment == 16
    old = {k: v for k, v in spec.to_dict().items() if k != "alignment"}  # a table stored before the field
    assert type(spec).from_dict(old) == spec
    assert type(spec).from_dict({**old, "alignment": 256}).alignment == 256


def test_a_tensor_spec_read_from_a_table_is_the_one_its_constructor_makes() -> None:
    """``from_dict`` sets the fields itself (a store hit reads two tables of specs): the
    spec is the frozen dataclass its constructor makes, each value converted alike."""
    spec = tensor_table(ConvBiasRelu().graph())[0]
    read = type(spec).from_dict({**spec.to_dict(), "uid": str(spec.uid), "dims": [str(d) for d in spec.dims], "is_output": 0})
    assert read == spec and hash(read) == hash(spec) and repr(read) == repr(spec)
    assert type(read.uid) is int and type(read.dims) is tuple and all(type(d) is int for d in read.dims)
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.uid = 9  # type: ignore[misc]
    assert dataclasses.replace(read, uid=9).uid == 9 and pickle.loads(pickle.dumps(read)) == spec


# ---------------------------------------------------------------------------- invalid graphs


def test_missing_output_uid_is_an_error_naming_the_tensor() -> None:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    a = g.tensor(name="A", dim=[1, 4, 8], stride=[32, 8, 1], uid=1)
    b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], uid=2)
    out = g.matmul(a, b, name="mm")
    out.set_output(True).set_name("the_output")  # no set_uid
    with pytest.raises(InvalidGraphError) as info:
        describe(g)
    assert "'the_output'" in str(info.value)
    assert info.value.reason == "missing uid"
    assert info.value.node == "mm"


def test_missing_input_uid_is_an_error_naming_the_tensor() -> None:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    a = g.tensor(name="input_without_uid", dim=[1, 4, 8], stride=[32, 8, 1])
    b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], uid=2)
    g.matmul(a, b, name="mm").set_output(True).set_uid(3)
    with pytest.raises(InvalidGraphError, match="'input_without_uid' has no uid") as info:
        describe(g)
    assert info.value.reason == "missing uid"


def test_auto_uids_key_the_numbered_uids_as_if_set_and_change_nothing() -> None:
    def graph(set_uids: bool) -> tuple[Any, list[Any]]:
        g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        a = g.tensor(name="A", dim=[1, 4, 8], stride=[32, 8, 1])
        b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1])
        out = g.matmul(a, b, name="mm")
        out.set_output(True)
        if set_uids:
            for t in (a, b, out):
                t.set_uid(t.get_uid())
        return g, [a, b, out]

    plain, tensors = graph(False)
    with pytest.raises(InvalidGraphError, match="has no uid"):
        describe(plain)
    assert describe(plain, auto_uids=True) == describe(graph(True)[0])
    assert not any(t.uid_assigned for t in tensors)  # keyed as they are: nothing set


def test_duplicate_uid_is_refused() -> None:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    a = g.tensor(name="A", dim=[1, 4, 8], stride=[32, 8, 1], uid=1)
    with pytest.raises(ValueError, match="already user-assigned"):
        g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], uid=1)  # pygraph refuses it itself
    b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], uid=2)
    g.matmul(a, b, name="mm").set_output(True).set_uid(3)
    b.uid = 1  # behind pygraph's back: describe must still notice
    with pytest.raises(InvalidGraphError, match="share uid 1") as info:
        describe(g)
    assert info.value.reason == "duplicate uid"
    assert "'A'" in str(info.value) and "'B'" in str(info.value)


def test_tensors_sharing_a_name_still_key_their_shapes() -> None:
    # pygraph allows duplicate names (they are labels) and drops such names from
    # graph.tensors; their shapes must still reach the key and the tensor table.
    def graph(m: int) -> Any:
        g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        a = g.tensor(name="x", dim=[1, m, 8], stride=row_major([1, m, 8]), uid=1)
        b = g.tensor(name="x", dim=[1, 8, 4], stride=row_major([1, 8, 4]), uid=2)
        g.matmul(a, b, name="mm").set_output(True).set_uid(3)
        return g

    assert "x" not in graph(4).tensors
    assert make_key(describe(graph(4)), ENV, BuildOptions()) != make_key(describe(graph(16)), ENV, BuildOptions())
    assert [spec.uid for spec in tensor_table(graph(4))] == [1, 2, 3]


def test_torch_and_cudnn_dtype_spellings_key_alike() -> None:
    import torch

    def graph(dtype: Any) -> Any:
        g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        a = g.tensor(name="A", dim=[1, 4, 8], stride=[32, 8, 1], data_type=dtype, uid=1)
        b = g.tensor(name="B", dim=[1, 8, 2], stride=[16, 2, 1], data_type=DT.FLOAT, uid=2)
        g.matmul(a, b, name="mm").set_output(True).set_uid(3)
        return g

    assert describe(graph(torch.float32)) == describe(graph(DT.FLOAT))
    assert tensor_table(graph(torch.float32))[0].dtype == "data_type.FLOAT"  # so Plan checks it


def test_not_a_graph_and_empty_graph_are_refused() -> None:
    with pytest.raises(InvalidGraphError, match=r"expected a cudnn\.pygraph"):
        describe(object())
    with pytest.raises(InvalidGraphError, match="no operations"):
        describe(cudnn.pygraph(io_data_type=DT.FLOAT))


def test_callable_attribute_is_refused_unless_tagged() -> None:
    # A score_mod's repr says nothing about what it computes (softcap 30 or 50): it cannot
    # be keyed, so it is refused, naming the node and the parameter, unless the caller tags it.
    spec = CausalSdpa(scale_by_value=False)

    def graph() -> Any:
        g = cudnn.pygraph(io_data_type=DT.HALF, compute_data_type=DT.FLOAT)
        q, k, v = (g.tensor(name=n, dim=spec.qkv_dims, stride=row_major(spec.qkv_dims), uid=u) for n, u in zip("qkv", (1, 2, 3)))
        o, _ = g.sdpa(q, k, v, attn_scale=0.5, score_mod=lambda graph, score: score, name="sdpa")
        o.set_output(True).set_uid(4)
        return g

    with pytest.raises(InvalidGraphError, match="node 'sdpa' param 'score_mod' is a callable") as info:
        describe(graph())
    assert info.value.node == "sdpa"
    assert info.value.reason == "callable without tag"
    tagged = describe(graph(), tag="identity/v1")
    assert tagged == describe(graph(), tag="identity/v1")
    assert tagged != describe(graph(), tag="identity/v2")
    assert tagged["tag"] == "identity/v1"


def test_the_values_a_tagged_score_mod_captured_are_keyed() -> None:
    """One tag, "softcap", for a softcap of 30 and of 50: the callable reads graph-held
    scalars that no node touches, and cuDNN compiles their values into the plan. They were
    not keyed, so the graph capped at 50 was served the plan capped at 30."""
    spec = CausalSdpa(scale_by_value=False)

    def graph(cap: float) -> Any:
        g = cudnn.pygraph(io_data_type=DT.HALF, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        q, k, v = (g.tensor(name=n, dim=spec.qkv_dims, stride=row_major(spec.qkv_dims), uid=u) for n, u in zip("qkv", (1, 2, 3)))
        cap_t = g.tensor_scalar(cap, cudnn.scalar_type.COMPILE_TIME_CONST)
        inverse = g.tensor_scalar(1.0 / cap, cudnn.scalar_type.COMPILE_TIME_CONST)

        def softcap(graph: Any, score: Any) -> Any:
            return graph.mul(graph.tanh(graph.mul(score, inverse)), cap_t)

        o, _ = g.sdpa(q, k, v, attn_scale=0.5, score_mod=softcap, name="sdpa")
        o.set_output(True).set_uid(4)
        return g

    assert describe(graph(30.0), tag="softcap") == describe(graph(30.0), tag="softcap")
    assert describe(graph(30.0), tag="softcap") != describe(graph(50.0), tag="softcap")
    assert [t.uid for t in tensor_table(graph(30.0))] == [1, 2, 3, 4]  # not in the variant pack


def test_tensor_table_lists_the_variant_pack() -> None:
    table = tensor_table(ConvBiasRelu().graph())
    assert [(s.uid, s.name, s.is_output) for s in table] == [(1, "X", False), (2, "W", False), (3, "B", False), (4, "Y", True)]
    assert table[0].strides == (288, 1, 48, 8)
    assert all(s.dtype == "data_type.FLOAT" for s in table)
    sdpa = {s.name: s for s in tensor_table(CausalSdpa().graph())}
    assert sdpa["scale"].is_pass_by_value and not sdpa["q"].is_pass_by_value
    assert type(table[0]).from_dict(table[0].to_dict()) == table[0]


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "fastest"},
        {"top_k": 0},
        {"heuristic_modes": ()},
        {"heuristic_modes": ("A", "C")},
        {"workspace_limit": -1},
    ],
)
def test_build_options_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BuildOptions(**kwargs)


def test_build_options_defaults_and_valid_values() -> None:
    assert BuildOptions().policy == "topk"
    for policy in ("heuristic", "topk", "exhaustive"):
        assert BuildOptions(policy=policy).to_dict()["policy"] == policy
    options = BuildOptions(heuristic_modes=("B",), workspace_limit=0, top_k=1)
    assert options.to_dict() == {
        "policy": "topk", "top_k": 1, "heuristic_modes": ["B"], "workspace_limit": 0, "kernel_cache": True,
    }  # fmt: skip


def test_build_options_enter_the_key() -> None:
    spec = EXAMPLES["conv_bias_relu"]
    base = key_of(spec, options=BuildOptions())
    assert key_of(spec, options=BuildOptions(policy="exhaustive")) != base
    assert key_of(spec, options=BuildOptions(top_k=2)) != base
    assert key_of(spec, options=BuildOptions(workspace_limit=1 << 20)) != base
    assert key_of(spec, options=BuildOptions(heuristic_modes=("A",))) != base
    assert key_of(spec, options=BuildOptions(kernel_cache=False)) != base
    # top_k only matters to the topk policy
    heuristic = key_of(spec, options=BuildOptions(policy="heuristic"))
    assert key_of(spec, options=BuildOptions(policy="heuristic", top_k=3)) == heuristic


# ---------------------------------------------------------------------------- environment, explain


def test_environment_change_changes_the_key() -> None:
    other = {**ENV, "cudnn_backend_version": "99999"}
    spec = EXAMPLES["matmul_bias_relu"]
    assert key_of(spec, environment=other) != key_of(spec)
    assert environment_id(other) != environment_id(ENV)
    assert environment_id(dict(reversed(list(ENV.items())))) == environment_id(ENV)  # order-free


def test_plan_cache_key_uses_the_backend_environment(make_cache: Any) -> None:
    graph_spec = EXAMPLES["causal_sdpa"]
    here = make_cache().key(graph_spec.graph())
    there = make_cache(backend=CpuTestBackend(environment={"gpu_name": "Other GPU"})).key(graph_spec.graph())
    assert here.digest == key_of(graph_spec)
    assert here != there
    assert here.parts["environment"]["gpu_name"] == "CPU test device"
    assert there.parts["environment"]["gpu_name"] == "Other GPU"


def test_explain_shows_which_part_differs() -> None:
    spec = EXAMPLES["conv_bias_relu"]
    base = make_key(describe(spec.graph()), ENV, BuildOptions())
    other_env = make_key(describe(spec.graph()), {**ENV, "sm_count": 132}, BuildOptions())
    other_graph = make_key(describe(dataclasses.replace(spec, padding=0).graph()), ENV, BuildOptions())

    def differing(a: Any, b: Any) -> set[str]:
        ea, eb = a.explain(), b.explain()
        assert set(ea) == set(eb) == {"format", "graph", "environment", "options"}
        return {part for part in ea if ea[part]["sha256"] != eb[part]["sha256"]}

    assert differing(base, other_env) == {"environment"}
    assert differing(base, other_graph) == {"graph"}
    assert differing(base, base) == set()
    explained = base.explain()
    assert explained["format"]["value"] == KEY_FORMAT
    assert explained["environment"]["value"] == ENV
    json.dumps(explained)  # printable by the CLI


def test_plan_cache_key_matches_the_plan(cache: PlanCache) -> None:
    graph = EXAMPLES["conv_bias_relu"].graph()
    assert cache.get(graph).key == cache.key(graph).digest


def test_the_digest_is_the_hash_of_the_canonical_parts() -> None:
    """make_key assembles the canonical text from its parts' texts: it must equal
    canonical_json of the parts, whatever environment text a caller passes in."""
    import hashlib

    from plancache.key import canonical_json

    for spec in EXAMPLES.values():
        key = make_key(describe(spec.graph()), ENV, BuildOptions(policy="exhaustive"))
        assert key.digest == hashlib.sha256(canonical_json(key.parts).encode()).hexdigest()
        again = make_key(describe(spec.graph()), ENV, BuildOptions(policy="exhaustive"), environment_json=canonical_json(ENV))
        assert again.digest == key.digest


def test_an_input_whose_dims_set_dim_changed_is_keyed_by_the_stride_it_is_lowered_with() -> None:
    """``g.tensor(dim=[4, 64, 64]).set_dim([4, 64, 32])`` keeps the stride filled in for the
    old dims, (4096, 64, 1), and that is what cuDNN receives: the first 32 columns of a
    padded buffer, another layout (and plan) than a dense [4, 64, 32]. Both were given one
    key, so the padded graph was served the dense one's plan."""

    def matmul(padded: bool) -> Any:
        g = cudnn.pygraph(io_data_type=DT.HALF, compute_data_type=DT.FLOAT)
        a = g.tensor(dim=[4, 64, 64] if padded else [4, 64, 32], uid=1)
        if padded:
            a.set_dim([4, 64, 32])
        b = g.tensor(dim=[4, 32, 16], uid=2)
        g.matmul(a, b).set_output(True).set_uid(3)
        return g

    dense, padded = matmul(False), matmul(True)
    assert describe(padded)["tensors"]["u1"]["stride"] == [4096, 64, 1]
    assert [t.strides for t in tensor_table(padded) if t.uid == 1] == [(4096, 64, 1)]
    assert make_key(describe(dense), ENV, BuildOptions()).digest != make_key(describe(padded), ENV, BuildOptions()).digest
