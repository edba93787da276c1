"""Prewarm manifests: format, expansion, per-entry errors with line numbers, builder
references, TOML, writing, and recording graphs into a manifest that replays exactly."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from graphs import EXAMPLES, assert_runs_correctly

from plancache import BuildOptions, InvalidGraphError, ManifestError, PlanCache
from plancache.cache.recording import record_to
from plancache.cudnn.replay import rebuild_graph
from plancache.key import describe
from plancache.workflows import templates
from plancache.workflows.manifest import SCHEMA, ManifestEntry, load_manifest, parse_manifest, write_manifest

MakeCache = Callable[..., PlanCache]

CONV = {"n": 2, "c": 8, "h": 6, "w": 6, "k": 4}
MATMUL = {"b": 2, "m": 4, "k": 16, "n": 8}
SDPA = {"b": 1, "h": 2, "s": 8, "d": 16}


def manifest_text(*entries: Any) -> str:
    """A manifest with one entry per line, so entry i is on line 3 + i."""
    body = ",\n".join(f"  {json.dumps(e)}" for e in entries)
    return '{"version": 1,\n "entries": [\n' + body + "\n]}\n"


def write(tmp_path: Path, text: str, name: str = "manifest.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def builder_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user module of graph builders next to the manifest, removed after the test."""
    name = f"user_builders_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from plancache.workflows import templates

            def conv(n, c=8, act="relu"):
                return templates.build("conv_bias_act", n=n, c=c, h=6, w=6, k=4, act=act)

            def not_a_graph():
                return 42

            def broken(n):
                raise RuntimeError("the builder blew up")

            VALUE = 3
            """
        )
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the manifest's pythonpath is undone after
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------------- format and expansion


def test_list_params_expand_into_their_cartesian_product(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        manifest_text({"template": "conv_bias_act", "params": {**CONV, "n": [1, 2, 4], "dtype": ["float16", "bfloat16"]}}),
    )
    entries, errors = load_manifest(path)
    assert errors == []
    assert len(entries) == 6
    assert {(e.spec["params"]["n"], e.spec["params"]["dtype"]) for e in entries} == {
        (n, d) for n in (1, 2, 4) for d in ("float16", "bfloat16")
    }
    assert {(e.index, e.line, e.kind) for e in entries} == {(0, 3, "template")}
    assert len({json.dumps(describe(e.build()), sort_keys=True) for e in entries}) == 6


def test_a_toml_date_among_a_builders_arguments_is_labelled(tmp_path: Path) -> None:
    """TOML has dates; a builder entry's label (every report row) raised TypeError on one,
    so ``prewarm --dry-run --json`` ended in a traceback with nothing on stdout."""
    path = tmp_path / "manifest.toml"
    path.write_text('version = 1\n\n[[entries]]\nbuilder = "mymod:make"\nargs = [2024-01-01]\n')
    (entry,), errors = load_manifest(path, listing=True)
    assert errors == [] and entry.label == 'mymod:make("2024-01-01")'


def test_shapes_list_parameter_sets_merged_over_params(tmp_path: Path) -> None:
    entry = {"template": "sdpa", "params": {"h": 2, "d": 16}, "shapes": [{"b": 1, "s": 8}, {"b": 2, "s": [16, 32]}]}
    entries, errors = load_manifest(write(tmp_path, manifest_text(entry)))
    assert errors == []
    assert [(e.spec["params"]["b"], e.spec["params"]["s"]) for e in entries] == [(1, 8), (2, 16), (2, 32)]


def test_example_manifest_is_valid_and_names_the_benchmark_suite() -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "manifest.json"
    entries, errors = load_manifest(path)
    assert errors == []
    assert [e.spec["template"] for e in entries] == ["conv_bias_act"] * 3 + ["matmul_bias_act"] * 2 + ["sdpa"] * 2
    jsonschema.validate(json.loads(path.read_text()), SCHEMA)
    relu = {"act": "relu"}
    assert [(e.spec["template"], e.spec["params"]) for e in entries] == [
        ("conv_bias_act", {"n": 32, "c": 128, "h": 56, "w": 56, "k": 256, **relu}),
        ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64, **relu}),
        ("conv_bias_act", {"n": 16, "c": 256, "h": 28, "w": 28, "k": 256, "bias": False, "act": None}),
        ("matmul_bias_act", {"b": 16, "m": 512, "k": 1024, "n": 512, **relu}),
        ("matmul_bias_act", {"b": 8, "m": 1024, "k": 1024, "n": 1024, "bias": False, "act": None}),
        ("sdpa", {"b": 4, "h": 16, "s": 1024, "d": 64, "causal": True}),
        ("sdpa", {"b": 2, "h": 32, "s": 2048, "d": 128, "causal": False}),
    ]


def test_entry_options_apply_over_the_default(tmp_path: Path) -> None:
    entry = {
        "template": "matmul_bias_act",
        "params": MATMUL,
        "name": "mm",
        "options": {"policy": "exhaustive", "heuristic_modes": ["A"]},
    }
    (e,), errors = load_manifest(write(tmp_path, manifest_text(entry)))
    assert errors == []
    options = e.build_options(BuildOptions(top_k=3))
    assert (options.policy, options.heuristic_modes, options.top_k) == ("exhaustive", ("A",), 3)
    assert e.label.startswith("mm: matmul_bias_act b=2")


# ---------------------------------------------------------------------------- bad entries


def test_bad_entries_are_reported_with_index_and_line_while_others_load(tmp_path: Path, builder_module: str) -> None:
    text = manifest_text(
        {"template": "conv_bias_act", "params": CONV},  # 0: good (line 3)
        {"template": "conv_transpose", "params": CONV},  # 1: unknown op
        {"template": "conv_bias_act", "params": {**CONV, "n": -1}},  # 2: malformed shape
        {"template": "conv_bias_act", "params": {**CONV, "h": "56"}},  # 3: malformed shape
        {"template": "conv_bias_act", "params": {**CONV, "n": [[1, 2]]}},  # 4: nested list
        {"builder": "no_such_module_xyz:build"},  # 5: missing builder module
        {"builder": f"{builder_module}:missing"},  # 6: missing function
        {"builder": f"{builder_module}:VALUE"},  # 7: not callable
        {"template": "sdpa", "builder": "a:b"},  # 8: two kinds
        {"template": "sdpa", "params": SDPA, "colour": "red"},  # 9: unknown field
        {"template": "matmul_bias_act", "params": {**MATMUL, "act": "softsign"}},  # 10: unknown activation
        {"template": "sdpa", "params": SDPA},  # 11: good
        {"builder": f"{builder_module}:conv", "kwargs": {"n": 2}},  # 12: good
    )
    text = text.replace('{"version": 1,', '{"version": 1, "pythonpath": ["."],')
    entries, errors = load_manifest(write(tmp_path, text))
    assert sorted({e.index for e in entries}) == [0, 11, 12]
    assert [e.fields["entry"] for e in errors] == list(range(1, 11))
    for error in errors:
        assert isinstance(error, ManifestError)
        assert error.fields["line"] == 3 + error.fields["entry"]
        assert error.fields["path"] == str(tmp_path / "manifest.json")
        assert str(error).startswith(f"{tmp_path / 'manifest.json'}:{error.fields['line']}: entry {error.fields['entry']}: ")
    messages = {e.fields["entry"]: str(e) for e in errors}
    assert "unknown template 'conv_transpose'" in messages[1]
    assert "positive integer" in messages[2] and "positive integer" in messages[3]
    assert "no_such_module_xyz" in messages[5] and "cannot be imported" in messages[5]
    assert "has no attribute 'missing'" in messages[6]
    assert "not callable" in messages[7]
    assert "exactly one of" in messages[8]
    assert "colour" in messages[9]
    assert "softsign" in messages[10]


def test_unreadable_documents_give_one_error_and_no_entries(tmp_path: Path) -> None:
    entries, errors = load_manifest(write(tmp_path, '{"version": 1,\n "entries": [\n  {"template": }\n]}'))
    assert entries == [] and len(errors) == 1
    assert errors[0].fields["line"] == 3 and "not valid JSON" in str(errors[0])

    entries, errors = load_manifest(write(tmp_path, '{"version": 7, "entries": []}'))
    assert entries == [] and "newer than this plancache supports" in str(errors[0])

    entries, errors = load_manifest(write(tmp_path, '{"entries": []}'))
    assert entries == [] and "'version' is a required property" in str(errors[0])

    entries, errors = load_manifest(tmp_path / "absent.json")
    assert entries == [] and "cannot read the manifest" in str(errors[0])


def test_builder_failures_surface_at_build_time(tmp_path: Path, builder_module: str) -> None:
    text = manifest_text({"builder": f"{builder_module}:not_a_graph"}, {"builder": f"{builder_module}:broken", "args": [1]})
    text = text.replace('{"version": 1,', '{"version": 1, "pythonpath": ["."],')
    (bad_type, broken), errors = load_manifest(write(tmp_path, text))
    assert errors == []
    with pytest.raises(ManifestError, match=r"manifest.json:3: entry 0: builder .* returned int, not a cudnn.pygraph"):
        bad_type.build()
    with pytest.raises(RuntimeError, match="blew up"):
        broken.build()


# ---------------------------------------------------------------------------- builders, TOML, writing


def test_builder_reference_with_args_kwargs_and_expand(tmp_path: Path, builder_module: str) -> None:
    entry = {"builder": f"{builder_module}:conv", "args": [2], "kwargs": {"c": 8}, "expand": {"act": ["relu", None]}}
    text = manifest_text(entry).replace('{"version": 1,', '{"version": 1, "pythonpath": ["."],')
    entries, errors = load_manifest(write(tmp_path, text))
    assert errors == []
    assert [e.spec["kwargs"] for e in entries] == [{"c": 8, "act": "relu"}, {"c": 8, "act": None}]
    for e, act in zip(entries, ("relu", None)):
        expected = templates.build("conv_bias_act", **{**CONV, "act": act})
        assert describe(e.build()) == describe(expected)


def test_builders_in_the_test_suite_are_referenced_by_module_path(tmp_path: Path) -> None:
    (e,), errors = load_manifest(write(tmp_path, manifest_text({"builder": "graphs:conv_bias_relu", "kwargs": {"n": 3}})))
    assert errors == []
    assert describe(e.build()) == describe(EXAMPLES["conv_bias_relu"].__class__(n=3).graph())


def test_toml_manifest_with_line_numbers(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """\
        version = 1

        [[entries]]
        template = "conv_bias_act"
        params = { n = [1, 2], c = 8, h = 6, w = 6, k = 4 }

        [[entries]]
        template = "nope"

        [[entries]]
        template = "sdpa"
        params = { b = 1, h = 2, s = 8, d = 16 }
        """
    )
    entries, errors = load_manifest(write(tmp_path, text, "manifest.toml"))
    assert [(e.index, e.line) for e in entries] == [(0, 3), (0, 3), (2, 10)]
    assert [(e.fields["entry"], e.fields["line"]) for e in errors] == [(1, 7)]


def test_write_manifest_round_trips(tmp_path: Path) -> None:
    entries, _ = parse_manifest(manifest_text({"template": "conv_bias_act", "params": {**CONV, "n": [1, 2]}, "name": "c"}))
    path = tmp_path / "out" / "written.json"
    write_manifest(path, [*entries, {"template": "sdpa", "params": SDPA}])
    again, errors = load_manifest(path)
    assert errors == []
    assert [e.to_dict() for e in again] == [e.to_dict() for e in entries] + [{"template": "sdpa", "params": SDPA}]
    jsonschema.validate(json.loads(path.read_text()), SCHEMA)


# ---------------------------------------------------------------------------- recording and replay


def test_recorded_manifest_replays_to_identical_keys(
    tmp_path: Path, make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "recorded.json"
    monkeypatch.setenv("PLANCACHE_RECORD", str(record))
    cache = make_cache()
    graphs = [spec.graph() for spec in EXAMPLES.values()]
    graphs += [templates.build("conv_bias_act", **CONV), templates.build("sdpa", **SDPA, causal=False, h_kv=1)]
    keys = [cache.get(g).key for g in graphs]
    for g in graphs:
        cache.get(g)  # repeats add nothing
    # A planned graph cannot be planned again (as in cuDNN): other options need a fresh one.
    exhaustive = cache.get(next(iter(EXAMPLES.values())).graph(), options=BuildOptions(policy="exhaustive")).key
    keys.append(exhaustive)

    entries, errors = load_manifest(record)
    assert errors == []
    assert len(entries) == len(keys) == len(set(keys))
    replayed = [cache.key(e.build(), e.build_options(cache.options)).digest for e in entries]
    assert replayed == keys
    assert entries[-1].options is not None and entries[-1].options["policy"] == "exhaustive"

    # Another recorder of the same file (another process, say) appends nothing it holds.
    record_to(record)._seen.clear()  # type: ignore[attr-defined]
    record_to(record)(graphs[0], cache.key(graphs[0]))
    assert len(json.loads(record.read_text())["entries"]) == len(keys)


def test_replayed_graphs_run_correctly(tmp_path: Path, make_cache: MakeCache) -> None:
    path = tmp_path / "recorded.json"
    recorder = make_cache()
    recorder.add_recorder(record_to(path))
    for spec in EXAMPLES.values():
        recorder.get(spec.graph())
    fresh = make_cache(directory=tmp_path / "fresh")
    entries, _ = load_manifest(path)
    for entry, spec in zip(entries, EXAMPLES.values()):
        plan = fresh.get(entry.build())
        assert plan.source == "built"
        assert_runs_correctly(plan, spec)


def test_graph_entry_with_an_unknown_op_fails_when_built(tmp_path: Path) -> None:
    description = describe(templates.build("matmul_bias_act", **MATMUL))
    description["nodes"][0]["type"] = "MATMUL_TRANSPOSE_ZZZ"
    (entry,), errors = load_manifest(write(tmp_path, manifest_text({"graph": description})))
    assert errors == []
    with pytest.raises(InvalidGraphError, match="cannot replay a MATMUL_TRANSPOSE_ZZZ node"):
        entry.build()


def test_replay_refuses_an_inexact_rebuild() -> None:
    description = describe(templates.build("conv_bias_act", **CONV))
    description["tensors"]["u1"]["is_output"] = True  # no graph describes an unproduced input so
    with pytest.raises(InvalidGraphError, match=r"differs from the recorded one at .tensors.u1.is_output") as info:
        rebuild_graph(description)
    assert info.value.fields["reason"] == "inexact replay"

    description = describe(templates.build("conv_bias_act", **CONV))
    description["nodes"][2]["params"]["bogus"] = 1
    with pytest.raises(InvalidGraphError, match="refused the recorded parameters") as info:
        rebuild_graph(description)
    assert info.value.fields["node"] == 2


def test_graph_entries_are_validated_against_the_schema(tmp_path: Path) -> None:
    entries, errors = load_manifest(write(tmp_path, manifest_text({"graph": {"nodes": [], "tensors": {}}})))
    assert entries == [] and "nodes" in str(errors[0]) and errors[0].fields["line"] == 3


def test_manifest_entries_compare_by_value() -> None:
    a = ManifestEntry(0, "template", {"template": "sdpa", "params": SDPA})
    assert a == ManifestEntry(0, "template", {"template": "sdpa", "params": SDPA})
    assert a.where == "<manifest>: entry 0"


def test_line_numbers_in_a_pretty_printed_manifest(tmp_path: Path) -> None:
    document = {
        "pythonpath": [],
        "version": 1,
        "entries": [
            {"template": "conv_bias_act", "params": CONV},
            {"template": "conv_bias_act", "params": {**CONV, "k": 0}},
            {"name": "x", "template": "sdpa", "params": {**SDPA, "d": "sixty-four"}},
        ],
    }
    text = json.dumps(document, indent=2)
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line == "    {"]
    entries, errors = load_manifest(write(tmp_path, text))
    assert [e.line for e in entries] == starts[:1]
    assert [e.fields["line"] for e in errors] == starts[1:]


def test_more_malformed_shapes_and_a_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    (tmp_path / "explodes_on_import_zz.py").write_text("raise RuntimeError('import-time failure')\n")
    monkeypatch.delitem(sys.modules, "explodes_on_import_zz", raising=False)
    text = manifest_text(
        {"template": "conv_bias_act", "params": {**CONV, "stride": 0}},  # would divide by zero
        {"template": "conv_bias_act", "params": {**CONV, "r": 9, "padding": 0}},  # kernel larger than the input
        {"template": "conv_bias_act", "params": {**CONV, "bias": "yes"}},
        {"template": "sdpa", "params": {**SDPA, "s": 0}},
        {"builder": "explodes_on_import_zz:g"},
        {"template": "sdpa", "params": {**SDPA, "s_kv": 4, "h_kv": 1}},  # good
    )
    entries, errors = load_manifest(write(tmp_path, text))
    assert [e.index for e in entries] == [5]
    messages = [str(e) for e in errors]
    assert [e.fields["line"] for e in errors] == [3, 4, 5, 6, 7]
    assert "stride must be an integer >= 1, not 0" in messages[0]
    assert "output would be empty" in messages[1]
    assert "bias must be true or false" in messages[2]
    assert "s must be a positive integer" in messages[3]
    assert "RuntimeError: import-time failure" in messages[4]


@pytest.mark.parametrize("case", ["fifo", "device", "deep json", "deep toml", "too large", "expands too far", "many lists"])
def test_a_hostile_manifest_is_refused_in_one_line_in_bounded_time(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manifests are files users name: a FIFO or a device is never read, a file over the
    size cap is refused, nesting thousands deep is one line rather than a RecursionError,
    and an entry whose lists multiply past ``MAX_GRAPHS`` is refused before any graph is
    made (four lists of 300 values are 8.1e9 graphs). Each within seconds, exit code 3."""
    import os
    import time

    from click.testing import CliRunner

    from plancache.cli import cli
    from plancache.workflows import manifest as manifest_module

    path = tmp_path / ("m.toml" if case == "deep toml" else "m.json")
    expected = {
        "fifo": "is a FIFO, not a regular file",
        "device": "is a character device, not a regular file",
        "deep json": "nested too deeply to read as JSON",
        "deep toml": "nested too deeply to read as TOML",
        "too large": "is larger than",
        "expands too far": "more than the 100,000 left of the 100,000 a manifest may hold",
        "many lists": "expands to 8,100,000,000 graphs",
    }[case]
    if case == "fifo":
        os.mkfifo(path)
    elif case == "device":
        path = Path("/dev/zero")
    elif case == "deep json":
        path.write_text('{"version": 1, "entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "deep toml":
        path.write_text("version = 1\nx = " + "[" * 5_000 + "]" * 5_000 + "\n")
    elif case == "too large":
        monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1_000)
        path.write_text(manifest_text(*[{"template": "conv_bias_relu", "params": CONV}] * 40))
    else:  # 20**4 = 160,000 graphs, or 300**4
        values = list(range(1, 21 if case == "expands too far" else 301))
        path.write_text(manifest_text({"template": "conv_bias_relu", "params": {**CONV, **dict.fromkeys("nchw", values)}}))
    started = time.monotonic()
    result = CliRunner().invoke(cli, ["--dir", str(tmp_path / "cache"), "prewarm", str(path), "--dry-run"])
    assert time.monotonic() - started < 10
    assert result.exit_code == 3, result.output
    assert expected in result.output and "Traceback" not in result.output, result.output
