"""Built-in templates: every layout builds, keys differently and matches its reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import plancache
from plancache.key import canonical_json
from plancache.workflows import templates

SMALL = {
    "conv_bias_act": {"n": 2, "c": 8, "h": 6, "w": 6, "k": 4},
    "matmul_bias_act": {"b": 2, "m": 5, "n": 3, "k": 4},
    "sdpa": {"b": 1, "h": 2, "s": 8, "d": 4},
}
CASES = [(name, layout) for name, layouts in templates.LAYOUTS.items() for layout in layouts]


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_every_layout_matches_the_reference(make_cache: Any, name: str, layout: str) -> None:
    params = {**SMALL[name], "dtype": "float32", "layout": layout}
    plan = make_cache().get(templates.build(name, **params))
    tensors = templates.allocate(name, device="cpu", **params)
    for spec in templates.layout(name, **params):
        assert tensors[spec.uid].stride() == spec.stride
    plan.execute(tensors)
    assert torch.allclose(tensors[4].float(), templates.reference(name, tensors, **params), atol=1e-5)


@pytest.mark.parametrize("name", sorted(templates.LAYOUTS))
def test_layouts_are_part_of_the_key(name: str) -> None:
    keys = {canonical_json(plancache.describe(templates.build(name, **SMALL[name], layout=layout)))
            for layout in templates.LAYOUTS[name]}  # fmt: skip
    assert len(keys) == len(templates.LAYOUTS[name])


def test_an_unknown_layout_is_a_clear_error() -> None:
    with pytest.raises(plancache.ManifestError, match="layout must be one of"):
        templates.build("conv_bias_act", **SMALL["conv_bias_act"], layout="chwn")


def test_a_manifest_lists_layouts_like_any_other_parameter(tmp_path: Any) -> None:
    import json

    from plancache.workflows.manifest import load_manifest

    path = tmp_path / "m.json"
    entry = {"template": "matmul_bias_act", "params": {**SMALL["matmul_bias_act"], "layout": ["nn", "nt", "tn"]}}
    path.write_text(json.dumps({"version": 1, "entries": [entry]}))
    entries, errors = load_manifest(path)
    assert errors == [] and len(entries) == 3
    described = {canonical_json(plancache.describe(e.build())) for e in entries}
    assert len(described) == 3


def test_each_template_build_pickles_by_reference() -> None:
    """``prewarm --devices`` sends an entry's builder to a spawned worker by pickle: a
    template's ``build`` given as a builder must survive it (a closure would not)."""
    import pickle

    for template in templates.TEMPLATES.values():
        assert pickle.loads(pickle.dumps(template.build)) is not None, template.name
