"""A right result every time: candidates checked against each other, inputs that cannot fault.

Each class of bug is shown by the CPU test backend the way a GPU shows it: an engine that
computes a wrong result and is the fastest; a launch through bad offsets that poisons the
device for the rest of the process; a device with little memory; a capture in progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import cudnn
import pytest
import torch

import plancache
from plancache import BuildOptions, TensorMismatchError
from plancache.autotuning.inputs import Refusal, materialize, plan_inputs
from plancache.formats.ubjson import decode as decode_ubjson
from plancache.formats.ubjson import encode as encode_ubjson
from plancache.key import describe, tensor_table
from plancache.store.codec import decode_entry, encode_entry
from plancache.testing import CpuTestBackend
from plancache.testing.kernels import fault
from plancache.testing.library import HANDLE_BYTES
from plancache.workflows import templates

DT = cudnn.data_type
MATMUL = {"b": 2, "m": 8, "n": 8, "k": 16, "dtype": "float32"}


def matmul_graph() -> Any:
    return templates.build("matmul_bias_act", **MATMUL)


def run_and_compare(plan: Any, seed: int = 0) -> float:
    """The plan's largest error against the float32 reference, on fresh inputs."""
    pack = templates.allocate("matmul_bias_act", device="cpu", seed=seed, **MATMUL)
    plan.execute(pack)
    expected = templates.reference("matmul_bias_act", pack, **MATMUL)
    out = pack[max(pack)]
    return float((out.float() - expected).abs().max() / expected.abs().max())


def cache(tmp_path: Path, **backend: Any) -> plancache.PlanCache:
    return plancache.PlanCache(tmp_path, backend=CpuTestBackend(**backend), auto_prime=False)


def rewrite(tmp_path: Path, sql: str, *parameters: Any) -> None:
    """Change the stored rows behind plancache's back, as an older plancache left them."""
    conn = sqlite3.connect(tmp_path / "plans.db")
    conn.execute(sql, parameters)
    conn.commit()
    conn.close()


def chosen_again(tmp_path: Path, key: str) -> tuple[plancache.PlanCache, Any]:
    """A fresh cache's lookup of the matmul, which must build ``key``'s plan again (a
    recheck), not serve the stored one nor call it corrupt."""
    fresh = cache(tmp_path, candidates=4)
    plan = fresh.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert plan.key == key and plan.source == "built"
    assert fresh.counters["rechecks"] == 1 and fresh.counters["corrupt"] == 0
    return fresh, plan


# ------------------------------------------------------------------ wrong engines


@pytest.mark.parametrize("policy", ["heuristic", "topk", "exhaustive"])
def test_a_wrong_fastest_engine_is_never_chosen_stored_or_served(tmp_path: Path, policy: str) -> None:
    options = BuildOptions(policy=policy, top_k=3)
    first = cache(tmp_path, candidates=5, wrong=[0])  # the heuristics' first choice, and the fastest
    plan = first.get(matmul_graph(), options=options)
    assert run_and_compare(plan) < 1e-5
    entry = first.store.get(plan.key)
    assert entry is not None and entry.check is not None
    assert entry.check["status"] == "agreed"
    assert [r["engine"] for r in entry.check["rejected"]] == ["test_engine_0"]
    assert entry.candidates[0]["status"] == "rejected"
    first.close()
    again = cache(tmp_path, candidates=5, wrong=[0])  # a fresh process: served from the store
    plan = again.get(matmul_graph(), options=options)
    assert plan.source == "loaded" and run_and_compare(plan, seed=1) < 1e-5


#: A bf16 matmul with K = 1024 and no activation: its outputs reach tens, some lie in (-1, 0).
WIDE = {"b": 1, "m": 64, "n": 64, "k": 1024, "dtype": "bfloat16", "act": None}


def wide_reference(pack: dict[int, Any]) -> Any:
    return templates.reference("matmul_bias_act", pack, **WIDE)


@pytest.mark.parametrize("policy", ["heuristic", "topk", "exhaustive"])
def test_an_engine_wrong_only_on_a_band_of_outputs_is_rejected_under_every_policy(tmp_path: Path, policy: str) -> None:
    # The fastest candidate and the heuristics' first choice writes 0 wherever the right
    # output lies in (-1, 0): a few dozen of 4,096 outputs, each off by less than 1 while
    # the outputs reach tens. Judged by the largest difference against the largest output
    # (the rule before), that is well inside a bf16 tolerance, and it was served.
    c = cache(tmp_path, candidates=5, wrong_band={0: (-1.0, 0.0)})
    plan = c.get(templates.build("matmul_bias_act", **WIDE), options=BuildOptions(policy=policy, top_k=3))
    assert plan.engine is not None and plan.engine.name != "test_engine_0"
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None and entry.check["rule"] == 2
    rejected = {r["engine"]: r for r in entry.check["rejected"]}
    assert set(rejected) == {"test_engine_0"}
    assert 0 < rejected["test_engine_0"]["outside"] < 4096 * 0.1
    assert rejected["test_engine_0"]["worst"] > 4
    pack = templates.allocate("matmul_bias_act", device="cpu", seed=3, **WIDE)
    plan.execute(pack)
    out, want = pack[max(pack)].float(), wide_reference(pack)
    in_band = (want > -1) & (want < 0)
    # bf16 rounding (half an ulp) and a right engine's own rounding (one more) at most
    assert bool(in_band.any()) and bool(((out - want).abs() <= 2**-6 * want.abs() + 1e-3).all())


def test_right_engines_that_round_differently_all_agree(tmp_path: Path) -> None:
    # Odd candidates round every third element one ulp the other way, as right engines
    # differ: none of them may be rejected, or the check would throw right engines away.
    c = cache(tmp_path, candidates=6)
    plan = c.get(templates.build("matmul_bias_act", **WIDE), options=BuildOptions(policy="exhaustive"))
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None
    assert entry.check["status"] == "agreed" and entry.check["agreeing"] == 6 and entry.check["rejected"] == []
    nudged = [r for r in entry.candidates if r["index"] % 2 == 1]
    assert nudged and all(r["outside"] == 0 and 0 < r["deviation"] <= 1.0 for r in nudged)


def test_entries_checked_under_the_older_rule_are_chosen_again(tmp_path: Path) -> None:
    old = cache(tmp_path, candidates=4)
    key = old.get(matmul_graph(), options=BuildOptions(policy="exhaustive")).key
    entry = old.store.get(key)
    assert entry is not None and entry.check is not None
    old.close()
    rule1 = {k: v for k, v in entry.check.items() if k != "rule"}  # what plancache stored before the rule had a number
    entry.check = rule1
    rewrite(tmp_path, "UPDATE plans SET check_json = ?, meta_sha256 = ?", json.dumps(rule1, sort_keys=True), entry.meta_digest())
    fresh, _ = chosen_again(tmp_path, key)
    stored = fresh.store.get(key)
    assert stored is not None and stored.check is not None and stored.check["rule"] == 2


def test_a_check_record_of_the_wrong_shape_is_judged_unsound_not_chosen_again(tmp_path: Path) -> None:
    # A list where the check's object belongs, under a metadata checksum that matches it.
    old = cache(tmp_path, candidates=4)
    key = old.get(matmul_graph(), options=BuildOptions(policy="exhaustive")).key
    entry = old.store.get(key)
    assert entry is not None
    old.close()
    entry.check = ["rule", 2]  # type: ignore[assignment]
    entry.meta_sha256 = entry.meta_digest()
    rewrite(tmp_path, "UPDATE plans SET check_json = ?, meta_sha256 = ?", json.dumps(entry.check), entry.meta_sha256)
    assert plancache.store.unsound(entry) == "malformed entry (its check record is a list)"
    fresh = cache(tmp_path, candidates=4)
    plan = fresh.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert plan.key == key and run_and_compare(plan) < 1e-5
    assert fresh.counters["corrupt"] == 1 and fresh.counters["rechecks"] == 0


def test_knob_variants_of_one_wrong_engine_do_not_outvote_the_others(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=5, wrong=[0, 1], engine_ids=[0, 0, 1, 2, 3])
    plan = c.get(matmul_graph(), options=BuildOptions(policy="heuristic"))
    assert run_and_compare(plan) < 1e-5
    assert plan.engine is not None and plan.engine.name == "test_engine_2"


def test_without_a_majority_nothing_is_persisted_and_one_warning_names_the_engines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = cache(tmp_path, candidates=2, wrong=[1])
    with caplog.at_level(logging.WARNING, logger="plancache"):
        plan = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
        again = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert (plan.source == "unpersisted" and again is plan) or again.key == plan.key
    assert plan.engine is not None and plan.engine.name == "test_engine_0"  # the frontend's own choice
    assert c.store.stats()["entries"] == 0
    assert c.stats()["process"]["no_majority"] == 1
    warnings = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(warnings) == 1 and "test_engine_0" in warnings[0] and "test_engine_1" in warnings[0]


def test_entries_stored_before_checking_are_chosen_again_not_served(tmp_path: Path) -> None:
    # A plan stored unchecked, by a wrong engine, as plancache 0.1 could have.
    old = cache(tmp_path, candidates=4)
    key = old.get(matmul_graph(), options=BuildOptions(policy="exhaustive")).key
    old.close()
    stored = decode_ubjson(sqlite3.connect(tmp_path / "plans.db").execute("SELECT blob FROM plans").fetchone()[0])
    stored["cudnn_backend_data"] = json.dumps({**json.loads(stored["cudnn_backend_data"]), "wrong": True}, sort_keys=True)
    raw = encode_ubjson(stored)
    rewrite(tmp_path, "UPDATE plans SET blob = ?, blob_sha256 = ?, check_json = NULL, meta_sha256 = NULL", raw,
            hashlib.sha256(raw).hexdigest())  # fmt: skip
    fresh, plan = chosen_again(tmp_path, key)
    assert run_and_compare(plan) < 1e-5
    entry = fresh.store.get(key)
    assert entry is not None and entry.check is not None and entry.check["status"] == "agreed"


def test_the_check_travels_with_bundles_and_unchecked_entries_are_refused(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=3, wrong=[2])
    key = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive")).key
    entry = c.store.get(key)
    assert entry is not None
    decoded = decode_entry(encode_entry(entry))
    assert decoded.check == entry.check and decoded.check is not None
    assert decoded.check["rejected"][0]["engine"] == "test_engine_2"
    entry.check = None
    entry.meta_sha256 = entry.meta_digest()
    with pytest.raises(ValueError, match="not checked element by element"):
        decode_entry(encode_entry(entry))


def test_show_lists_the_rejected_engines(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from plancache.cli import cli

    c = cache(tmp_path, candidates=4, wrong=[1])
    key = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive")).key
    c.close()
    result = CliRunner().invoke(cli, ["show", key[:12], "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "agreed: 3 of 4 candidates, element by element; rejected: test_engine_1 (" in result.output
    assert "rejected     #1 test_engine_1: disagrees" in result.output
    header = next(line for line in result.output.splitlines() if "MEDIAN_MS" in line)
    assert header.split()[-2:] == ["OUTSIDE", "WORST"] and "ERROR" not in result.output  # "ERROR 0" read as an error


# ------------------------------------------------------------------ inputs that cannot fault


def ragged_sdpa(b: int = 2, h: int = 2, s: int = 8, d: int = 16) -> Any:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    offsets = [g.tensor(name=f"ro_{n}", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32) for n in "qko"]
    layout = {"dim": [b, h, s, d], "stride": [s * h * d, d, h * d, 1], "data_type": DT.FLOAT}
    q = g.tensor(name="q", ragged_offset=offsets[0], **layout)
    k = g.tensor(name="k", ragged_offset=offsets[1], **layout)
    v = g.tensor(name="v", ragged_offset=offsets[1], **layout)
    sq = g.tensor(name="sq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    skv = g.tensor(name="skv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.25, generate_stats=False, use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv,
                  use_causal_mask=True)  # fmt: skip
    o.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"]).set_ragged_offset(offsets[2])
    for uid, t in enumerate([*offsets, q, k, v, sq, skv, o], start=1):
        t.set_uid(uid)
    return g


def paged_decode(b: int = 2, h: int = 2, d: int = 16, pool: int = 1, block: int = 4, pages: int = 2) -> Any:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    q = g.tensor(name="q", dim=[b, h, 1, d], stride=[h * d, d, h * d, 1], data_type=DT.FLOAT)
    cache_layout = {"dim": [pool, h, block, d], "stride": [h * block * d, block * d, d, 1], "data_type": DT.FLOAT}
    k, v = g.tensor(name="k", **cache_layout), g.tensor(name="v", **cache_layout)
    tables = [g.tensor(name=f"pt_{n}", dim=[b, 1, pages, 1], stride=[pages, pages, 1, 1], data_type=DT.INT32) for n in "kv"]
    sq = g.tensor(name="sq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    skv = g.tensor(name="skv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.25, generate_stats=False, use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv,
                  paged_attention_k_table=tables[0], paged_attention_v_table=tables[1],
                  paged_attention_max_seq_len_kv=pages * block)  # fmt: skip
    o.set_output(True).set_dim([b, h, 1, d]).set_stride([h * d, d, h * d, 1])
    for uid, t in enumerate([q, k, v, *tables, sq, skv, o], start=1):
        t.set_uid(uid)
    return g


def moe(experts: int = 3, tokens: int = 70, hidden: int = 8, n: int = 4) -> Any:
    g = cudnn.pygraph(intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    token = g.tensor(name="token", dim=[1, tokens, hidden], stride=[tokens * hidden, hidden, 1], data_type=DT.FLOAT)
    weight = g.tensor(name="weight", dim=[experts, hidden, n], stride=[hidden * n, 1, hidden], data_type=DT.FLOAT)
    offsets = g.tensor(name="fto", dim=[experts, 1, 1], stride=[1, 1, 1], data_type=DT.INT32)
    out = g.moe_grouped_matmul(token, weight, offsets, mode=cudnn.moe_grouped_matmul_mode.NONE, compute_data_type=DT.FLOAT)
    out.set_output(True).set_data_type(DT.FLOAT).set_dim([1, tokens, n]).set_stride([tokens * n, n, 1])
    for uid, t in enumerate([token, weight, offsets, out], start=1):
        t.set_uid(uid)
    return g


@pytest.mark.parametrize("make", [ragged_sdpa, paged_decode, moe], ids=["ragged", "paged", "moe"])
def test_steering_inputs_are_valid_for_their_role(make: Any) -> None:
    graph = make()
    description, specs = describe(graph), tensor_table(graph)
    plan = plan_inputs(description, specs)
    assert not isinstance(plan, Refusal), plan
    assert fault(description, specs, materialize(plan, torch, "cpu", torch.Generator().manual_seed(0))) is None


def test_a_dropout_mask_is_filled_with_zeros_and_ones_and_its_scale_with_one() -> None:
    """sdpa(dropout=(mask, scale)): the mask and the scale were filled as a seed and an
    offset (7, 8, 9...), scaling the output 1e5 times past what its bound models, so right
    engines were judged apart and nothing was stored."""
    dt = cudnn.data_type
    dims, strides = [1, 2, 32, 16], [2 * 32 * 16, 32 * 16, 16, 1]
    g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides, uid=i) for i, n in enumerate("qkv", 1))
    mask = g.tensor(name="mask", dim=[1, 2, 32, 32], stride=[2 * 32 * 32, 32 * 32, 32, 1], uid=5)
    scale = g.tensor(name="scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT, uid=6)
    o, _ = g.sdpa(q=q, k=k, v=v, is_inference=True, attn_scale=0.25, dropout=(mask, scale))
    o.set_output(True).set_uid(4).set_dim(dims).set_stride(strides)
    description, specs = describe(g), tensor_table(g)
    plan = plan_inputs(description, specs)
    assert not isinstance(plan, Refusal), plan
    pack = materialize(plan, torch, "cpu", torch.Generator().manual_seed(0))
    assert set(pack[5].float().unique().tolist()) == {0.0, 1.0} and pack[6].item() == 1.0


def test_byte_coded_inputs_are_not_all_zero() -> None:
    """An NVFP4 block-scaled matmul: its FP4 data is stored as bytes, and the numbers copied
    into them were cast to 0, so every candidate, right or wrong, computed zeros and no
    wrong engine could be seen. Both values of each byte are nonzero now."""
    dt = cudnn.data_type
    m, k, n, block = 32, 64, 16, 16
    g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)
    a = g.tensor(name="A", dim=[1, m, k], stride=[m * k, k, 1], data_type=dt.FP4_E2M1, uid=1)
    sa = g.tensor(name="SA", dim=[1, m, k // block], stride=[m * k // block, k // block, 1], data_type=dt.FP8_E4M3, uid=2)
    b = g.tensor(name="B", dim=[1, k, n], stride=[k * n, 1, k], data_type=dt.FP4_E2M1, uid=3)
    sb = g.tensor(name="SB", dim=[1, k // block, n], stride=[k * n // block, 1, k // block], data_type=dt.FP8_E4M3, uid=4)
    product = g.matmul(
        g.block_scale_dequantize(a, sa, block_size=[1, block]), g.block_scale_dequantize(b, sb, block_size=[block, 1])
    )
    product.set_output(True).set_uid(5).set_data_type(dt.BFLOAT16).set_dim([1, m, n]).set_stride([m * n, n, 1])
    description, specs = describe(g), tensor_table(g)
    plan = plan_inputs(description, specs)
    assert not isinstance(plan, Refusal), plan
    pack = materialize(plan, torch, "cpu", torch.Generator().manual_seed(0))
    for uid in (1, 3):
        data = pack[uid].view(torch.uint8)
        assert bool(((data & 0x7) != 0).all()) and bool(((data >> 4 & 0x7) != 0).all())  # no ±0 among the E2M1 values
        assert bool((data & 0x8).any()) or bool((data & 0x80).any())  # both signs


@pytest.mark.parametrize("make", [ragged_sdpa, paged_decode], ids=["ragged", "paged-one-page-pool"])
def test_integers_filled_with_one_fault_where_role_valid_values_do_not(make: Any) -> None:
    graph = make()
    description, specs = describe(graph), tensor_table(graph)
    plan = plan_inputs(description, specs)
    assert not isinstance(plan, Refusal), plan
    pack = materialize(plan, torch, "cpu", torch.Generator().manual_seed(0))
    assert fault(description, specs, pack) is None
    # What autotuning filled integers with before: ones. The test device faults on them.
    ones = {uid: t.fill_(1) if not t.dtype.is_floating_point else t for uid, t in pack.items()}
    assert fault(description, specs, ones) is not None


@pytest.mark.parametrize("make", [ragged_sdpa, paged_decode, moe], ids=["ragged", "paged", "moe"])
def test_a_miss_on_a_steering_graph_launches_and_compares_without_a_fault(tmp_path: Path, make: Any) -> None:
    c = cache(tmp_path, candidates=3, wrong=[0])
    plan = c.get(make(), options=BuildOptions(policy="exhaustive"))
    backend = c.backend
    assert backend.cuda.poisoned is None and backend.cuda.errors == []
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None and entry.check["status"] == "agreed"
    assert [r["engine"] for r in entry.check["rejected"]] == ["test_engine_0"]


def test_a_launch_through_bad_offsets_poisons_the_test_device_for_good(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=2)
    graph = ragged_sdpa()
    plan = c.get(graph)
    description, specs = describe(ragged_sdpa()), tensor_table(ragged_sdpa())
    built = plan_inputs(description, specs)
    assert not isinstance(built, Refusal)
    pack = materialize(built, torch, "cpu", torch.Generator().manual_seed(0))
    pack[1].fill_(1)  # misaligned ragged offsets of q
    with pytest.raises(plancache.ExecutionError, match="misaligned address"):
        plan.execute(pack)
    with pytest.raises(RuntimeError, match="sticky"):
        c.get(templates.build("matmul_bias_act", **MATMUL))  # everything after fails, as after a sticky error


def test_a_tensor_of_unknown_role_launches_nothing(tmp_path: Path) -> None:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    q, k, v = (g.tensor(name=n, dim=[1, 1, 4, 8], stride=[32, 32, 8, 1], data_type=DT.FLOAT) for n in "qkv")
    stray = g.tensor(name="stray", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.5, generate_stats=False, seq_len_kv=stray)
    o.set_output(True).set_dim([1, 1, 4, 8]).set_stride([32, 32, 8, 1])
    for uid, t in enumerate([q, k, v, stray, o], start=1):
        t.set_uid(uid)
    description = describe(g)
    description["nodes"][0]["inputs"]["sink_token"] = description["nodes"][0]["inputs"].pop("seq_len_kv")
    refusal = plan_inputs(description, tensor_table(g))
    assert isinstance(refusal, Refusal) and "does not know the role of tensor" in refusal.why


def test_over_the_memory_budget_nothing_is_allocated_or_launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 KiB free once cuDNN's handle holds its buffer: 25% of it is 256 bytes.
    c = cache(tmp_path, candidates=4, wrong=[0], memory=HANDLE_BYTES + (1 << 10))
    plan = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert c.backend.cuda.peak == c.backend.cuda.allocated == HANDLE_BYTES, "nothing but the handle's buffer"
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None and entry.check["status"] == "not run"
    assert "over the budget" in entry.check["why"] and "PLANCACHE_AUTOTUNE_MEMORY" in entry.check["why"]
    assert entry.timing["method"].startswith("not timed: launching candidates needs")
    monkeypatch.setenv("PLANCACHE_AUTOTUNE_MEMORY", "0")
    zero = plancache.PlanCache(tmp_path / "zero", backend=CpuTestBackend(), auto_prime=False)
    plan = zero.get(matmul_graph())
    assert zero.store.get(plan.key).check["status"] == "not run"  # type: ignore[union-attr]


def test_within_the_budget_what_timing_allocated_is_given_back(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=3)
    c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert c.backend.cuda.peak > HANDLE_BYTES and c.backend.cuda.allocated == HANDLE_BYTES, "all but the handle's buffer"


def test_inputs_are_checked_like_a_launch_and_never_written(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=3)
    pack = templates.allocate("matmul_bias_act", device="cpu", seed=0, **MATMUL)
    out_uid = max(pack)
    pack[out_uid].fill_(42.0)
    before = {uid: t.clone() for uid, t in pack.items()}
    c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"), inputs=pack)
    for uid, tensor in pack.items():
        assert torch.equal(tensor, before[uid]), f"uid {uid} was written"
    bad = dict(pack)
    bad[min(pack)] = torch.zeros(3, 3)
    with pytest.raises(TensorMismatchError, match=r"inputs\[1\] has shape \[3, 3\]"):
        cache(tmp_path / "other", candidates=3).get(matmul_graph(), inputs=bad)


def test_nothing_is_launched_while_this_thread_captures(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=3, wrong=[0])
    cuda = c.backend.cuda
    stream = cuda.new_stream(blocking=False)
    cuda.begin_capture(stream, "thread_local")
    with cuda.stream(stream), pytest.raises(plancache.CaptureInProgressError):
        c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    capture = cuda.end_capture(stream)
    assert capture.recorded == 0 and capture.invalidated is None, "autotuning touched the caller's capture"
    assert c.store.stats()["entries"] == 0


def test_a_candidate_that_fails_to_launch_leaves_the_others_checked(tmp_path: Path) -> None:
    c = cache(tmp_path, candidates=4, unlaunchable=[0], wrong=[3])
    plan = c.get(matmul_graph(), options=BuildOptions(policy="exhaustive"))
    assert run_and_compare(plan) < 1e-5
    entry = c.store.get(plan.key)
    assert entry is not None and entry.check is not None
    assert entry.candidates[0]["status"] == "failed" and entry.candidates[3]["status"] == "rejected"


# ------------------------------------------------------------------ the test device computes what cuDNN computes


def _evaluate(graph: Any, values: dict[str, Any]) -> dict[str, Any]:
    from plancache.key import canonical_json
    from plancache.testing.kernels import evaluate

    return evaluate(json.loads(canonical_json(describe(graph))), dict(values))


def test_the_test_device_computes_attention_without_attn_scale_unscaled_as_cudnn_does() -> None:
    """cuDNN lowers an omitted attn_scale as 1.0; the test device scaled by 1/sqrt(d), so a
    right-result check on it passed against a result cuDNN never gives."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    qi, ki, vi = (g.tensor(name=n, dim=[1, 2, 8, 16], stride=[256, 128, 16, 1], uid=u) for u, n in ((1, "q"), (2, "k"), (3, "v")))
    o, _ = g.sdpa(q=qi, k=ki, v=vi, is_inference=True)
    o.set_output(True).set_uid(4)
    got = _evaluate(g, {"u1": q, "u2": k, "u3": v})["u4"]
    assert torch.allclose(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0), atol=1e-5)


def test_the_test_device_computes_pointwise_parameters_and_grouped_convolutions() -> None:
    """A swish's beta was ignored, a leaky relu's slope of 0 read as 0.01, and a grouped
    convolution was refused as an invalid graph."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for build, expected in ((lambda g, a: g.swish(a, swish_beta=2.0), x * torch.sigmoid(2 * x)),
                            (lambda g, a: g.leaky_relu(a, negative_slope=0.0), torch.relu(x))):  # fmt: skip
        g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
        build(g, g.tensor(name="a", dim=[4, 8], stride=[8, 1], uid=1)).set_output(True).set_uid(2)
        assert torch.allclose(_evaluate(g, {"u1": x})["u2"], expected, atol=1e-6)
    image, weight = torch.randn(1, 8, 5, 5), torch.randn(4, 2, 3, 3)  # four groups of two channels
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    xi = g.tensor(name="x", dim=[1, 8, 5, 5], stride=[200, 1, 40, 8], uid=1)
    wi = g.tensor(name="w", dim=[4, 2, 3, 3], stride=[18, 1, 6, 2], uid=2)
    g.conv_fprop(xi, wi, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True).set_uid(3)
    got = _evaluate(g, {"u1": image, "u2": weight})["u3"]
    assert torch.allclose(got, torch.nn.functional.conv2d(image, weight, padding=1, groups=4), atol=1e-5)


def _sdpa_with(**options: Any) -> Any:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    qi, ki, vi = (g.tensor(name=n, dim=[1, 1, 4, 8], stride=[32, 32, 8, 1], uid=u) for u, n in ((1, "q"), (2, "k"), (3, "v")))
    o, _ = g.sdpa(q=qi, k=ki, v=vi, is_inference=True, attn_scale=0.3, **options)
    o.set_output(True).set_uid(4)
    return g


def _conv_with(**options: Any) -> Any:
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    xi = g.tensor(name="x", dim=[1, 2, 5, 5], stride=[50, 1, 10, 2], uid=1)
    wi = g.tensor(name="w", dim=[3, 2, 3, 3], stride=[18, 1, 6, 2], uid=2)
    g.conv_fprop(xi, wi, stride=[1, 1], dilation=[1, 1], **options).set_output(True).set_uid(3)
    return g


@pytest.mark.parametrize(
    ("make", "named"),
    [(lambda: _sdpa_with(use_causal_mask_bottom_right=True), "use_causal_mask_bottom_right"),
     (lambda: _sdpa_with(use_causal_mask=True, sliding_window_length=2), "sliding_window_length"),
     (lambda: _conv_with(padding=[1, 1], convolution_mode=cudnn._compiled_module.convolution_mode.CONVOLUTION), "convolution_mode"),
     (lambda: _conv_with(pre_padding=[1, 1], post_padding=[0, 0]), "post_padding")],
)  # fmt: skip
def test_what_the_test_device_does_not_compute_is_unsupported_never_a_wrong_result(tmp_path: Path, make: Any,
                                                                                   named: str) -> None:  # fmt: skip
    """Each was computed without its parameter: a result cuDNN never gives, which a test passed on."""
    with pytest.raises(NotImplementedError, match=named):
        _evaluate(make(), {})
    with pytest.raises(plancache.BuildError, match=f"cannot run .*{named}"):
        cache(tmp_path).get(make())


def _instancenorm_backward(n: int, c: int, h: int, w: int) -> Any:
    """The backward graph of cuDNN Frontend's own test_instancenorm.py (bf16, channels last)."""
    dt = cudnn.data_type
    g = cudnn.pygraph(intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)
    big, small = [c * h * w, 1, w * c, c], [c, 1, c, c]
    dy = g.tensor(name="dy", dim=[n, c, h, w], stride=big, data_type=dt.BFLOAT16, uid=1)
    x = g.tensor(name="x", dim=[n, c, h, w], stride=big, data_type=dt.BFLOAT16, uid=2)
    scale = g.tensor(name="scale", dim=[1, c, 1, 1], stride=small, data_type=dt.BFLOAT16, uid=3)
    mean = g.tensor(name="mean", dim=[n, c, 1, 1], stride=small, data_type=dt.FLOAT, uid=4)
    inv = g.tensor(name="inv_var", dim=[n, c, 1, 1], stride=small, data_type=dt.FLOAT, uid=5)
    dx, dscale, dbias = g.instancenorm_backward(name="DIN", grad=dy, input=x, scale=scale, mean=mean, inv_variance=inv)
    dx.set_output(True).set_data_type(dt.BFLOAT16).set_uid(6).set_dim([n, c, h, w]).set_stride(big)
    dscale.set_output(True).set_data_type(dt.BFLOAT16).set_uid(7).set_dim([1, c, 1, 1]).set_stride(small)
    dbias.set_output(True).set_data_type(dt.BFLOAT16).set_uid(8).set_dim([1, c, 1, 1]).set_stride(small)
    return g


def test_a_norm_backward_gets_the_statistics_of_its_input() -> None:
    """An instance-norm backward's saved mean and inverse variance were random in
    ±[0.25, 1): half the inverse variances negative and the means unrelated to the input.
    Two right formulations of the backward then differ by far more than rounding (one that
    uses sum(x - mean) = 0, as the forward guarantees, and one that does not), so right
    engines could disagree, nothing was stored, and every later run autotuned the graph
    again. The statistics are now those of the input, as the forward computes them."""
    from plancache.autotuning.bounds import coarse_tolerance

    n, c, h, w = 2, 4, 16, 16
    g = _instancenorm_backward(n, c, h, w)
    description, specs = describe(g), tensor_table(g)
    plan = plan_inputs(description, specs)
    assert not isinstance(plan, Refusal), plan
    pack = materialize(plan, torch, "cpu", torch.Generator().manual_seed(0))
    x, mean, inv = pack[2].float(), pack[4], pack[5]
    assert torch.allclose(mean, x.mean(dim=(2, 3), keepdim=True), atol=1e-6)
    assert torch.allclose(inv, torch.rsqrt(x.var(dim=(2, 3), unbiased=False, keepdim=True) + 1e-5), rtol=1e-5)

    g_ = pack[1].float() * pack[3].float()
    count = h * w
    xhat = (x - mean) * inv
    closed = inv * (g_ - g_.mean(dim=(2, 3), keepdim=True) - xhat * (g_ * xhat).mean(dim=(2, 3), keepdim=True))
    dvar = -0.5 * inv**3 * (g_ * (x - mean)).sum(dim=(2, 3), keepdim=True)
    dmean = -inv * g_.sum(dim=(2, 3), keepdim=True) - 2 * dvar * (x - mean).sum(dim=(2, 3), keepdim=True) / count
    general = g_ * inv + dvar * 2 * (x - mean) / count + dmean / count
    tolerance = coarse_tolerance(description, [s for s in specs if s.is_output]) * closed.abs().max()
    assert (closed - general).abs().max() < tolerance / 100
