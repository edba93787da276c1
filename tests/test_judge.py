"""Issue #44: the judge agrees with cuDNN Frontend, on real blobs and on every keyed attribute.

The store's judge (``store.judge``) holds a blob's own graph against the frontend form of
its key's description (``key.frontend_form``). Here:

* every real blob recorded on a GPU (``tests/data/plans``: plancache's graphs, and the
  entries real programs stored, ``tests/data/plans/real``: cuDNN Frontend's own tests,
  FlashInfer's cuDNN attention) is accepted for its own description and refused for every
  other (the matrix is diagonal), and refused when any single keyed attribute of its
  description changes, unless the judgement names that attribute as unproven;
* for graphs that differ only in a node setting (attention causal or not, its scale, a
  convolution's padding and dilation with the same output shape, its stride, a pointwise
  mode), the other's blob would compute the other graph, and a Redis hit refuses it (a hit,
  ``verify``, ``export`` and ``import``, signed and unsigned: ``test_trust_entries.py``);
* a plan the judge refuses right after it was built is served, never stored, counted and
  told once, and ``plancache stats`` shows its graph;
* a FlashInfer-style attention whose ragged offsets are 1-D tensors (``tensor_like`` of a
  (b+1)-row int32 tensor), which the frontend writes ``[b+1, 1, 1, 1]``, is stored and then
  served from the store.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))  # gpu_native, record_plans: the corpus

from click.testing import CliRunner
from graphs import ConvBiasRelu, assert_runs_correctly
from test_trust_entries import DONORS, GRAPH_DONORS, forged, stored

from plancache import PlanCache, Store
from plancache.cache import judging
from plancache.cli import cli
from plancache.formats.plan_blob import PlanBlob
from plancache.formats.ubjson import decode as decode_ubjson
from plancache.key import canonical_json, describe
from plancache.key.frontend_form import POINTWISE_MODES, FrontendForm, frontend_form
from plancache.store import problem
from plancache.store.judge import ANOTHER_GRAPH, judge

MakeCache = Callable[..., PlanCache]
DATA = Path(__file__).parent / "data" / "plans"


# ---------------------------------------------------------------------------- the recorded corpus


@dataclasses.dataclass(frozen=True)
class Recorded:
    name: str
    description: dict[str, Any]
    blob: bytes


def _recorded() -> list[Recorded]:
    """Every real blob with the description it was built from: plancache's own graphs
    (``scripts/gpu_native.py``, described here; those that need CUDA to be made are left
    out), and the stored entries of real programs (``scripts/record_plans.py``)."""
    import gpu_native
    import record_plans

    found = [Recorded(name, description, blob) for name, (description, blob) in gpu_native.described_here().items()]
    for path in sorted((DATA / "real").glob("*.jsonl.xz")):
        for item in record_plans.read(path):
            found.append(Recorded(f"{item['source']}:{item['label']}:{item['key'][:8]}", item["description"],
                                  record_plans.blob_of(item)))  # fmt: skip
    return found


RECORDED = _recorded()


@functools.cache
def recorded_forms() -> list[FrontendForm]:
    """The frontend form of each recorded description, made once for the module's tests."""
    return [frontend_form(r.description) for r in RECORDED]


def test_the_corpus_holds_real_programs() -> None:
    sources = {r.name.split(":")[0] for r in RECORDED}
    assert len(RECORDED) >= 11, [r.name for r in RECORDED]
    assert {"conv_bias_relu", "sdpa_ragged", "sdpa_backward", "layernorm"} <= sources


def test_the_recorded_matrix_is_diagonal() -> None:
    """Each recorded blob is a plan of its own description's graph, and of no other."""
    forms = recorded_forms()
    identities = [canonical_json(r.description) for r in RECORDED]
    wrong = []
    for blob_of in RECORDED:  # the blob outermost: it is decoded once for the whole row
        own, blob = canonical_json(blob_of.description), PlanBlob.of(blob_of.blob)
        for recorded, form, identity in zip(RECORDED, forms, identities):
            refusal = judge(blob, recorded.description, form).refusal
            if (refusal is None) != (identity == own):
                wrong.append((blob_of.name, recorded.name, refusal))
    assert wrong == []


def _other(value: Any, where: str) -> Any:
    """A different value of the same kind, as a caller could have set it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, list) and value and isinstance(value[0], int) and not isinstance(value[0], bool):
        return [value[0] + 1, *value[1:]]
    if isinstance(value, str) and value.startswith("data_type."):
        return "data_type.HALF" if value != "data_type.HALF" else "data_type.FLOAT"
    if isinstance(value, str) and where.endswith("mode") and value in POINTWISE_MODES:
        return "tanh" if value != "tanh" else "relu"
    if isinstance(value, str) and "." in value:
        kind, member = value.split(".", 1)
        return f"{kind}.{'INFERENCE' if member != 'INFERENCE' else 'TRAINING'}"
    return None


def _keyed(description: dict[str, Any]) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Every keyed attribute that a caller sets and a plan depends on: each node's
    parameters and compute type, each caller tensor's layout, data type and by-value flag,
    the graph's data types and shape flags."""
    for i, node in enumerate(description["nodes"]):
        for name, value in node["params"].items():
            if not name.startswith("_") and not isinstance(value, dict):
                yield f"node {i} parameter {name}", ("nodes", i, "params", name)
        yield f"node {i} compute data type", ("nodes", i, "compute_data_type")
    used = frontend_form(description).used
    for tid, tensor in description["tensors"].items():
        if tid[0] != "u" or tid not in used:
            continue
        for name in ("dim", "stride", "dtype", "is_pass_by_value", "ragged_offset_multiplier"):
            if tensor.get(name) is not None:
                yield f"tensor {tid} {name}", ("tensors", tid, name)
    for name in description["context"]:
        yield f"graph {name}", ("context", name)
    for name in ("dynamic_shape", "override_shape"):
        yield f"graph flag {name}", ("flags", name)


def _at(description: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        description = description[step]
    return description


@pytest.mark.parametrize("recorded", RECORDED, ids=[r.name for r in RECORDED])
def test_any_single_keyed_attribute_changed_is_refused(recorded: Recorded) -> None:
    """The recorded blob against its own description with one keyed attribute changed:
    refused, or (where the blob cannot show it) named unproven by the judgement."""
    blob = PlanBlob.of(recorded.blob)  # decoded once, as the store's judge keeps it for its load
    accepted = judge(blob, recorded.description)
    assert accepted.refusal is None
    changed = 0
    for label, path in _keyed(recorded.description):
        value = _other(_at(recorded.description, path), str(path[-1]))
        if value is None:
            continue
        mutated = copy.deepcopy(recorded.description)
        _at(mutated, path[:-1])[path[-1]] = value
        verdict = judge(blob, mutated)
        changed += 1
        if verdict.refusal is None:
            named = [u for u in verdict.unproven if str(path[-1]).replace("_", " ") in u.replace("_", " ")
                     or (path[-1] == "compute_data_type" and "compute data type" in u)]  # fmt: skip
            assert named, f"{label} changed to {value!r}: still accepted, and not named unproven ({verdict.unproven})"
    assert changed >= 3


def _detailed(form: FrontendForm) -> FrontendForm:
    """``form`` without what lets the judge compare a tensor or a node's ports in one step
    (``FormTensor.written``, ``FormNode.names``): the judge then compares field by field."""
    return dataclasses.replace(
        form,
        tensors={tid: tensor._replace(written=None) for tid, tensor in form.tensors.items()},
        nodes=tuple(node._replace(names=(None, None)) for node in form.nodes),
        _laid_out={},
    )


@pytest.mark.parametrize("recorded", RECORDED, ids=[r.name for r in RECORDED])
def test_one_step_comparisons_accept_only_what_the_detailed_ones_accept(recorded: Recorded) -> None:
    """A blob's tensors and ports written exactly as the form predicts are taken in one
    comparison each; that shortcut must never accept what the field-by-field comparison
    refuses, nor refuse what it accepts: for this blob against every recorded description
    and against its own with each keyed attribute changed, the verdicts are the same."""
    checked: list[tuple[dict[str, Any], FrontendForm | None]] = list(zip([r.description for r in RECORDED], recorded_forms()))
    for _label, path in _keyed(recorded.description):
        value = _other(_at(recorded.description, path), str(path[-1]))
        if value is not None:
            mutated = copy.deepcopy(recorded.description)
            _at(mutated, path[:-1])[path[-1]] = value
            checked.append((mutated, None))
    differ, blob = [], PlanBlob.of(recorded.blob)  # decoded once, as the store's judge keeps it for its load
    for description, made in checked:
        try:
            form = made or frontend_form(description)
        except ValueError:
            continue  # a description no pygraph makes: refused before any comparison
        quick, detailed = judge(blob, description, form), judge(blob, description, _detailed(form))
        if (quick.refusal is None) != (detailed.refusal is None):
            differ.append((canonical_json(description)[:200], quick.refusal, detailed.refusal))
    assert differ == []


# ---------------------------------------------------------------------------- graphs that differ in one setting

#: The pairs of ``test_trust_entries.DONORS`` that differ in one setting only; a hit,
#: ``verify``, ``export`` and ``import`` (signed and unsigned) refusing each are tested there.
PAIRS = [name for name in GRAPH_DONORS if name not in ("other shapes", "other data type", "other ops")]


@pytest.mark.parametrize("pair", PAIRS)
def test_the_other_graphs_blob_computes_the_other_graph(make_cache: MakeCache, pair: str) -> None:
    """Why it matters: served, the planted blob would compute the other graph."""
    own, other = DONORS[pair]
    _, planted = forged(make_cache, pair)
    payload = json.loads(decode_ubjson(planted.blob)["cudnn_backend_data"])
    assert payload["description"] == describe(other.graph()) != describe(own.graph())


@pytest.mark.redis
@pytest.mark.parametrize("pair", PAIRS)
def test_a_redis_hit_refuses_the_other_graphs_blob(make_cache: MakeCache, make_tier: Any, redis_server: Any, pair: str) -> None:
    """Planted in Redis, signed with the fleet's secret: refused by every node, which builds instead."""
    from redis_fixtures import SECRET

    from plancache.store.codec import encode_entry
    from plancache.tiers.remote import sign_value

    entry, planted = forged(make_cache, pair)
    tier = make_tier(redis_server.url)
    raw = redis_server.client()
    raw.set(
        tier.redis_key(planted.key, planted.env_id),
        sign_value(encode_entry(planted), SECRET, tier.redis_key(planted.key, planted.env_id)),
    )
    assert tier.get(planted.key, planted.env_id) is None
    assert tier.stats()["refused"] == 1
    own = DONORS[pair][0]
    node = make_cache(directory=Path(Store().directory).parent / "another-node", remote=make_tier(redis_server.url))
    plan = node.get(own.graph())
    assert plan.source == "built"  # the fleet's value refused: this node autotunes
    assert_runs_correctly(plan, own)
    kept = node.store.get(entry.key)
    assert kept is not None and kept.blob != planted.blob
    raw.close()


# ---------------------------------------------------------------------------- never store what is refused


@pytest.mark.judge_disagreement
def test_a_plan_the_judge_refuses_is_served_not_stored_counted_and_told_once(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cache_dir: Path
) -> None:
    """A judge made to disagree with the frontend (it refuses every relu): the plan built
    is used by the process that built it, never stored, counted, told once; the store keeps
    why for ``plancache stats``; a second process builds again."""
    from plancache.store import entry as entry_module
    from plancache.store.judge import Judgement

    def disagreeing(blob: bytes, description: dict[str, Any], form: Any = None) -> Judgement:
        relu = any(node["params"].get("mode") == "relu" for node in description["nodes"])
        return (
            Judgement(f"{ANOTHER_GRAPH} (node 2 (POINTWISE) has mode 'RELU_FWD', not 'TANH_FWD')")
            if relu
            else judge(blob, description, form)
        )

    monkeypatch.setattr(entry_module, "judge", disagreeing)
    spec = ConvBiasRelu(n=1)
    cache = make_cache()
    plan = cache.get(spec.graph())
    assert plan.source == "built"
    assert_runs_correctly(plan, spec)
    assert cache.store.keys() == [] and cache.counters["judge_disagreements"] == 1
    stats = cache.stats()
    assert ANOTHER_GRAPH in stats["judge_disagreement"] and "RELU_FWD" in stats["judge_disagreement"]
    (unstored,) = stats["unstored_plans"].values()
    assert unstored["why"] == "judge_disagreements"
    refused = cache.lookup.unstored.disagreements[plan.key]  # kept for a report of the defect (record_plans)
    assert judge(refused.blob, refused.description).refusal is None  # the real judge accepts what the broken one refused
    cache.get(ConvBiasRelu(n=2).graph())  # a second disagreement: counted, not told again
    told = [r.getMessage() for r in caplog.records if "judge refuses" in r.getMessage()]
    assert cache.counters["judge_disagreements"] == 2 and len(told) == 1 and "defect of plancache" in told[0]
    [first, second] = Store().stats()["unstored"]
    assert {first["why"], second["why"]} == {"judge_disagreements"} and first["times"] == 1
    again = make_cache()  # another process: nothing stored, nothing quarantined, built again
    assert again.get(spec.graph()).source == "built" and again.counters["corrupt"] == 0
    assert again.store.quarantined() == [] and again.store.stats()["unstored"][0]["times"] == 2
    assert again.store.keys() == []
    shown = CliRunner().invoke(cli, ["stats"])  # the graphs that cannot be persisted, and why
    assert shown.exit_code == 0 and f"not stored    {plan.key[:12]} CONV_FPROP" in shown.output and "2 time(s)" in shown.output
    monkeypatch.setattr(entry_module, "judge", judge)
    fixed = make_cache()  # a judge that agrees again stores it, and the note goes
    assert fixed.get(spec.graph()).source == "built" and fixed.store.keys() != []
    assert all(row["key"] != plan.key for row in fixed.store.stats()["unstored"])


@pytest.mark.judge_disagreement
def test_an_entry_quarantined_and_rebuilt_to_the_same_verdict_is_not_stored_again(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No quarantine loop: a stored entry the judge refuses is quarantined once; its rebuild,
    refused alike, is served and not stored, so the next process finds nothing to refuse."""
    from plancache.store import entry as entry_module
    from plancache.store.judge import Judgement

    spec = ConvBiasRelu(n=1)
    [key] = stored(make_cache, [spec])
    monkeypatch.setattr(entry_module, "judge", lambda blob, description, form=None: Judgement(f"{ANOTHER_GRAPH} (made so)"))
    monkeypatch.setattr(judging, "code_version", lambda: "another judge")  # a judge changed is other code: nothing kept holds
    cache = make_cache()
    plan = cache.get(spec.graph())
    assert plan.source == "rebuilt" and cache.counters["corrupt"] == 1 and cache.counters["judge_disagreements"] == 1
    assert_runs_correctly(plan, spec)
    assert cache.store.keys() == [] and [q["key"] for q in cache.store.quarantined()] == [key]
    later = make_cache()
    assert later.get(spec.graph()).source == "built" and later.counters["corrupt"] == 0
    assert len(later.store.quarantined()) == 1 and later.store.stats()["unstored"][0]["times"] == 2


# ---------------------------------------------------------------------------- ragged offsets declared 1-D


@dataclasses.dataclass(frozen=True)
class RaggedAttention:
    """Attention over a ragged batch declared as FlashInfer declares it: each ragged offset
    is ``tensor_like`` of a (b+1)-row int32 tensor (1-D), the sequence lengths (b, 1, 1, 1)."""

    b: int = 2
    h: int = 2
    s: int = 8
    d: int = 16
    uids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 50, 51)  # q, k, v, o, seq_q, seq_kv, offset_q, offset_kv

    def offsets(self) -> Any:
        import torch

        return torch.arange(self.b + 1, dtype=torch.int32) * (self.s * self.h * self.d)

    def graph(self) -> Any:
        import cudnn
        import torch

        g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
        dims, strides = [self.b, self.h, self.s, self.d], [self.s * self.h * self.d, self.d, self.h * self.d, 1]
        # tensor_like of a device tensor (a host one would be passed by value): "meta" stands for
        # FlashInfer's CUDA tensors here; only its shape, strides and data type are read.
        offsets = torch.empty(self.b + 1, dtype=torch.int32, device="meta")
        ro_q, ro_kv = g.tensor_like(offsets), g.tensor_like(offsets)
        ro_q.set_uid(self.uids[6])
        ro_kv.set_uid(self.uids[7])
        q, k, v = (g.tensor(name=n, dim=dims, stride=strides, data_type=cudnn.data_type.HALF, uid=u)
                   for n, u in zip("qkv", self.uids))  # fmt: skip
        q.set_ragged_offset(ro_q)
        k.set_ragged_offset(ro_kv)
        v.set_ragged_offset(ro_kv)
        lens = torch.empty((self.b, 1, 1, 1), dtype=torch.int32, device="meta")
        seq_q, seq_kv = g.tensor_like(lens), g.tensor_like(lens)
        seq_q.set_uid(self.uids[4])
        seq_kv.set_uid(self.uids[5])
        o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=self.d**-0.5, generate_stats=False, use_causal_mask=True,
                      use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv)  # fmt: skip
        o.set_output(True).set_uid(self.uids[3]).set_dim(dims).set_stride(strides).set_ragged_offset(ro_q)
        return g


def test_ragged_offsets_declared_1d_are_written_4d_and_the_plan_is_served_from_the_store(make_cache: MakeCache) -> None:
    """Found with FlashInfer's cuDNN prefill on an H100: its plans were refused at every
    start, as plans of another graph (``tensor 50: dims [5, 1, 1, 1]``)."""
    import torch

    spec = RaggedAttention()
    description = describe(spec.graph())
    assert description["tensors"]["u50"]["dim"] == [spec.b + 1]
    [key] = stored(make_cache, [spec])
    entry = Store().get(key)
    assert entry is not None
    written = {t["uid"]: t for t in decode_ubjson(entry.blob)["tensors"]}
    assert written[50]["dim"] == [spec.b + 1, 1, 1, 1] and written[50]["stride"] == [1, 1, 1, 1]
    assert written[2]["dim"] == [spec.b, spec.h, spec.d, spec.s]  # K as the frontend hands it to cuDNN: transposed
    assert problem(entry) is None
    cache = make_cache()
    plan = cache.get(spec.graph())
    assert plan.source == "loaded" and cache.counters["corrupt"] == 0 and cache.counters["judge_disagreements"] == 0
    pack = {u: torch.randn(spec.b, spec.s, spec.h, spec.d).half().permute(0, 2, 1, 3) for u in spec.uids[:4]}  # BSHD in memory
    pack.update({spec.uids[4]: torch.full((spec.b, 1, 1, 1), spec.s, dtype=torch.int32),
                 spec.uids[5]: torch.full((spec.b, 1, 1, 1), spec.s, dtype=torch.int32),
                 spec.uids[6]: spec.offsets(), spec.uids[7]: spec.offsets()})  # fmt: skip
    plan.execute(pack)
    q, k, v = (pack[u].float() for u in spec.uids[:3])
    mask = torch.ones(spec.s, spec.s, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.d**-0.5)
    torch.testing.assert_close(pack[spec.uids[3]].float(), expected, atol=2e-2, rtol=2e-2)


def test_the_cpu_backends_blobs_carry_the_frontends_attributes(make_cache: MakeCache) -> None:
    """The test backend writes its blobs' graphs in the frontend's form, so the CPU suite
    sees what a GPU's blob says: the pointwise modes, the convolution's settings, the
    graph's context, virtual tensors wired between the ops."""
    [key] = stored(make_cache, [ConvBiasRelu(n=1, padding=2, dilation=2)])
    entry = Store().get(key)
    assert entry is not None
    graph = decode_ubjson(entry.blob)
    conv, bias, relu = graph["nodes"]
    assert (conv["tag"], conv["pre_padding"], conv["post_padding"], conv["dilation"], conv["math_mode"]) == (
        "CONV_FPROP", [2, 2], [2, 2], [2, 2], "CROSS_CORRELATION")  # fmt: skip
    assert (bias["mode"], relu["mode"]) == ("ADD", "RELU_FWD")
    assert conv["outputs"]["Y"] == bias["inputs"]["IN_0"] and bias["outputs"]["OUT_0"] == relu["inputs"]["IN_0"]
    virtual = {t["uid"] for t in graph["tensors"] if t["is_virtual"]}
    assert virtual == {conv["outputs"]["Y"], bias["outputs"]["OUT_0"]}
    assert graph["context"]["io_data_type"] == "FLOAT" and graph["context"]["sm_count"] == -1


def test_a_wiring_change_is_refused() -> None:
    """The same ops and tensors with two inputs of one op swapped is another graph."""
    description = describe(ConvBiasRelu(n=1).graph())
    blob = DATA.joinpath("conv_bias_relu.ubj").read_bytes()
    real = describe(__import__("gpu_native").CASES["conv_bias_relu"]())
    assert judge(blob, real).refusal is None
    swapped = copy.deepcopy(real)
    node = swapped["nodes"][1]
    node["inputs"] = {"IN_0": node["inputs"]["IN_1"], "IN_1": node["inputs"]["IN_0"]}
    assert ANOTHER_GRAPH in str(judge(blob, swapped).refusal)
    assert description != real  # (the CPU graph and the recorded one are other sizes)


def test_record_plans_keeps_each_entry_once_and_reads_back_what_the_judge_accepts(make_cache: MakeCache, tmp_path: Path) -> None:
    import record_plans

    stored(make_cache, [ConvBiasRelu(n=1), ConvBiasRelu(n=2)])
    directory = Path(Store().directory)
    assert record_plans.record([directory], tmp_path, source="cpu") == 2
    assert record_plans.record([directory], tmp_path, source="cpu") == 0  # nothing twice
    items = record_plans.read(tmp_path / "cpu.jsonl.xz")
    assert [judge(record_plans.blob_of(i), i["description"]).refusal for i in items] == [None, None]
    assert record_plans.record([directory], tmp_path, source="small", max_file=100) == 0  # the size cap holds


@pytest.mark.slow
def test_bench_blob_check_times_first_and_later_hits(tmp_path: Path) -> None:
    """``scripts/bench_blob_check.py`` (a part of ``gpu-check``'s benchmarks) times a key's
    first hit (its form derived) and its later hits, with and without the judge, and writes
    what it prints."""
    import subprocess

    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "bench_blob_check.py"),
                           "--runs", "20", "--backend", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    assert "a key's later hit (its form kept)" in done.stdout and "first hit of a key (its form derived)" in done.stdout
    figures = json.loads(out.read_text())
    assert set(figures["store_hit"]) == {"first", "later"}
    assert all(row["with_us"] > 0 and row["without_us"] > 0 for row in figures["store_hit"].values())
    assert figures["recorded"] and all(us > 0 for us in figures["recorded"].values())
