#!/usr/bin/env python3
"""FlashInfer's cuDNN attention, unchanged, plain, cold and warm under PLANCACHE_PATCH_CUDNN=1.

FlashInfer reaches cuDNN's attention through cuDNN Frontend's Python graphs
(``flashinfer.cudnn``): its decode and prefill entry points build a pygraph per shape and
plan it with the frontend. With ``PLANCACHE_PATCH_CUDNN=1`` plancache serves those plans
without a change to FlashInfer. This runner calls FlashInfer as its own tests call it
(``tests/attention/test_cudnn_decode.py``, ``test_cudnn_prefill.py``): paged and ragged KV,
page tables, ragged offsets in elements and in tokens, head dims 128 and 192/128, fp16 and
bf16, causal, LSE, ``q_len_per_req`` > 1, and the ``BatchPrefillWith{Paged,Ragged}KVCache
Wrapper(backend="cudnn")`` wrappers; every case in its own fresh process per mode:

  plain   PLANCACHE_PATCH_CUDNN unset: FlashInfer and the frontend alone
  cold    the variable on, an empty PLANCACHE_DIR: plancache autotunes and stores
  warm    the same directory, a fresh process (``--warm-runs`` of them)

Each case's first call is timed (host wall time to a synchronized output, the graph's
construction, planning and first execution included), its output (and LSE) compared with
a float32 PyTorch reference computed from the same inputs, and the outputs of the modes
with each other (cold and warm run the same stored plan). The call is then made again
(``--calls`` in all, each output held to the reference): an engine that does not repeat its
own bits (the order of a split reduction) is held to the reference alone. Per drop-in
process: plancache's counters (hits, misses, quarantines, judge disagreements, plans not
stored), the engines of the stored plans, and every plancache warning. Printed: a table
of the cases by mode and one line per check; ``--out`` writes everything as JSON;
``--record DIR`` copies the stored entries there (``scripts/record_plans.py``: the judge's
corpus), and any plan the judge refused (``flashinfer-refused``: the judge's defects, with
their blobs and descriptions).

Exit status: 0 when every output matched its reference in every mode, cold and warm gave
the same bits where the engine repeats its own, no plan was refused or quarantined, no
judge disagreement was counted, and every warm first call was faster than plain; 1
otherwise.

    python3 scripts/gpu_flashinfer.py --out flashinfer.json --record tests/data/plans/real
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

#: Cases: name -> keyword arguments of ``_run_case``.
CASES: dict[str, dict[str, Any]] = {
    "decode paged bf16": dict(kind="decode", b=8, s_kv=512, page=16, h_qo=32, h_kv=8, d=128, dtype="bfloat16"),
    "decode paged fp16 graph-safe": dict(kind="decode", b=16, s_kv=512, page=16, h_qo=32, h_kv=8, d=128, dtype="float16",
                                         graph_safe=True),
    "decode q_len_per_req 2 lse": dict(kind="decode", b=4, s_kv=256, page=16, h_qo=16, h_kv=4, d=128, dtype="bfloat16",
                                       q_len=2, lse=True),
    "prefill paged causal lse": dict(kind="prefill", b=4, s_q=64, s_kv=256, page=16, h_qo=8, h_kv=2, d=128,
                                     dtype="bfloat16", causal=True, lse=True),
    "prefill paged fp16": dict(kind="prefill", b=3, s_q=17, s_kv=96, page=8, h_qo=4, h_kv=4, d=128, dtype="float16"),
    "prefill ragged elements causal": dict(kind="prefill", b=4, s_q=48, s_kv=128, h_qo=8, h_kv=8, d=128,
                                           dtype="bfloat16", causal=True),
    "prefill ragged tokens lse": dict(kind="prefill", b=3, s_q=32, s_kv=64, h_qo=8, h_kv=2, d=128, dtype="bfloat16",
                                      lse=True, units="tokens"),
    "prefill ragged d192/128 causal": dict(kind="prefill", b=2, s_q=40, s_kv=40, h_qo=8, h_kv=8, d=192, d_v=128,
                                           dtype="bfloat16", causal=True),
    "wrapper paged causal": dict(kind="wrapper_paged", b=4, s_q=32, s_kv=128, page=16, h_qo=8, h_kv=2, d=128,
                                 dtype="bfloat16", causal=True),
    "wrapper ragged": dict(kind="wrapper_ragged", b=3, s_q=24, s_kv=64, h_qo=8, h_kv=8, d=128, dtype="bfloat16"),
}  # fmt: skip

TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3}  # relative to the reference's largest value, element by element


# ---------------------------------------------------------------------------- one case, in a child


def _lengths(torch: Any, b: int, high: int, low: int, device: str) -> Any:
    """Per-request lengths in [low, high], the longest one ``high`` (shape (b, 1, 1, 1))."""
    lens = torch.randint(low, high + 1, (b, 1, 1, 1), dtype=torch.int32)
    lens[0] = high
    return lens.to(device)


def _indptr(torch: Any, lens: Any, unit: int) -> Any:
    flat = lens.view(-1).to(torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=lens.device), torch.cumsum(flat, 0) * unit]).to(torch.int32)


def _reference(torch: Any, q: list[Any], k: list[Any], v: list[Any], scale: float, causal: bool) -> tuple[list[Any], list[Any]]:
    """Float32 attention per request, bottom-right causal as FlashInfer's: output and the
    base-2 log-sum-exp of each query row and head."""
    outs, lses = [], []
    for qi, ki, vi in zip(q, k, v):
        qf, kf, vf = qi.float(), ki.float(), vi.float()
        group = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
        if causal:
            s_q, s_kv = qf.shape[0], kf.shape[0]
            rows = torch.arange(s_q, device=qf.device)[:, None] + (s_kv - s_q)
            scores = scores.masked_fill(torch.arange(s_kv, device=qf.device)[None, :] > rows, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # (h, q)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vf))
        lses.append((lse / math.log(2)).transpose(0, 1))  # (q, h), base 2
    return outs, lses


def _pages(torch: Any, tokens: list[Any], page: int, h: int, d: int, dtype: Any, device: str) -> tuple[Any, Any]:
    """Each request's K (or V) rows in pages of ``page`` tokens: the cache (pages, h, page,
    d) and the page table (b, pages per request), pages handed out in a shuffled order."""
    per_req = max(math.ceil(t.shape[0] / page) for t in tokens)
    order = torch.randperm(per_req * len(tokens))
    cache = torch.zeros(per_req * len(tokens), h, page, d, dtype=dtype)
    table = torch.zeros(len(tokens), per_req, dtype=torch.int32)
    for i, rows in enumerate(tokens):
        for p in range(per_req):
            slot = int(order[i * per_req + p])
            table[i, p] = slot
            chunk = rows[p * page : (p + 1) * page].cpu()
            cache[slot, :, : chunk.shape[0]] = chunk.transpose(0, 1)
    return cache.to(device), table.to(device)


def run_case(name: str, spec: dict[str, Any], calls: int = 2) -> dict[str, Any]:
    """One case in this process: inputs, the timed first call and ``calls - 1`` more, the reference, the errors."""
    import flashinfer
    import torch

    device = "cuda"
    torch.manual_seed(sum(map(ord, name)))
    dtype = getattr(torch, spec["dtype"])
    b, h_qo, h_kv, d = spec["b"], spec["h_qo"], spec["h_kv"], spec["d"]
    d_v = spec.get("d_v", d)
    kind, want_lse = spec["kind"], spec.get("lse", False)
    causal = spec.get("causal", False) or spec.get("q_len", 1) > 1  # multi-token decode is bottom-right causal
    scale = 1.0 / math.sqrt(d)
    workspace = torch.empty(128 << 20, dtype=torch.int8, device=device)
    q_len = spec.get("q_len", 1)
    s_q_max = spec.get("s_q", q_len)
    seq_q = (torch.full((b, 1, 1, 1), q_len, dtype=torch.int32, device=device) if kind == "decode"
             else _lengths(torch, b, s_q_max, 1, device))  # fmt: skip
    seq_kv = _lengths(torch, b, spec["s_kv"], s_q_max, device)
    q_rows = [torch.randn(int(n), h_qo, d, dtype=dtype, device=device) for n in seq_q.view(-1)]
    k_rows = [torch.randn(int(n), h_kv, d, dtype=dtype, device=device) for n in seq_kv.view(-1)]
    v_rows = [torch.randn(int(n), h_kv, d_v, dtype=dtype, device=device) for n in seq_kv.view(-1)]
    q = torch.cat(q_rows)
    paged = "page" in spec
    if paged:
        k_cache, table = _pages(torch, k_rows, spec["page"], h_kv, d, dtype, device)
        v_cache, _ = _pages(torch, v_rows, spec["page"], h_kv, d_v, dtype, device)
        # the same shuffled slots for V: rebuild V in K's slots
        v_cache = torch.zeros_like(v_cache)
        for i, rows in enumerate(v_rows):
            for p in range(table.shape[1]):
                chunk = rows[p * spec["page"] : (p + 1) * spec["page"]]
                v_cache[int(table[i, p]), :, : chunk.shape[0]] = chunk.transpose(0, 1)
    else:
        k_cache, v_cache, table = torch.cat(k_rows), torch.cat(v_rows), None
    torch.cuda.synchronize()

    call: Callable[[], Any]
    if kind == "decode":
        offsets = _indptr(torch, seq_q, h_qo * d)

        def call() -> Any:
            return flashinfer.cudnn.decode.cudnn_batch_decode_with_kv_cache(
                q, k_cache, v_cache, scale, workspace, max_sequence_kv=spec["s_kv"], actual_seq_lens_kv=seq_kv,
                block_tables=table, is_cuda_graph_compatible=spec.get("graph_safe", False), batch_offsets_q=offsets,
                batch_offsets_o=offsets, return_lse=want_lse, q_len_per_req=q_len)  # fmt: skip
    elif kind == "prefill":
        units = spec.get("units", "elements")
        unit = (lambda width: 1) if units == "tokens" else (lambda width: width)
        kw: dict[str, Any] = dict(
            max_token_per_sequence=s_q_max, max_sequence_kv=spec["s_kv"], actual_seq_lens_q=seq_q, actual_seq_lens_kv=seq_kv,
            block_tables=table, causal=causal, return_lse=want_lse, batch_offsets_q=_indptr(torch, seq_q, unit(h_qo * d)),
            batch_offsets_o=_indptr(torch, seq_q, unit(h_qo * d_v)), batch_offsets_units=units, is_cuda_graph_compatible=True)  # fmt: skip
        if not paged:
            kw.update(
                batch_offsets_k=_indptr(torch, seq_kv, unit(h_kv * d)), batch_offsets_v=_indptr(torch, seq_kv, unit(h_kv * d_v))
            )

        def call() -> Any:
            return flashinfer.cudnn.prefill.cudnn_batch_prefill_with_kv_cache(q, k_cache, v_cache, scale, workspace, **kw)
    else:
        call = _wrapper_call(flashinfer, torch, spec, kind, q, k_cache, v_cache, table, seq_q, seq_kv, workspace, scale)

    started = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - started) * 1e3
    out, lse = result if isinstance(result, tuple) else (result, None)
    expected, expected_lse = _reference(torch, q_rows, k_rows, v_rows, scale, causal)
    ref = torch.cat(expected)

    def error(output: Any) -> float:
        return float(((output.float().view_as(ref) - ref).abs() / ref.abs().max()).max())

    worst, digests = error(out), [_digest(out)]
    for _ in range(calls - 1):  # the same plan on the same inputs: whether its engine repeats its own bits
        again = call()
        again = again[0] if isinstance(again, tuple) else again
        torch.cuda.synchronize()
        worst, digests = max(worst, error(again)), [*digests, _digest(again)]
    row: dict[str, Any] = {"first_ms": first_ms, "worst": worst, "ok": worst <= TOLERANCE[spec["dtype"]],
                           "bits": digests[0], "deterministic": len(set(digests)) == 1, "calls": calls,
                           "distinct_bits": len(set(digests))}  # fmt: skip
    if want_lse and lse is not None:
        ref_lse = torch.cat(expected_lse)  # base 2; a natural-log LSE is compared in its own base
        found = lse.float().reshape(ref_lse.shape)
        lse_worst = min(float((found - ref_lse).abs().max()), float((found - ref_lse * math.log(2)).abs().max()))
        row.update(lse_worst=lse_worst, ok=row["ok"] and lse_worst <= 2e-2, lse_bits=_digest(lse))
    return row


def _wrapper_call(flashinfer: Any, torch: Any, spec: dict[str, Any], kind: str, q: Any, k_cache: Any, v_cache: Any, table: Any,
                  seq_q: Any, seq_kv: Any, workspace: Any, scale: float) -> Callable[[], Any]:  # fmt: skip
    """FlashInfer's prefill wrappers with ``backend="cudnn"``, planned as its tests plan them."""
    h_qo, h_kv, d, causal = spec["h_qo"], spec["h_kv"], spec["d"], spec.get("causal", False)
    q_indptr = _indptr(torch, seq_q, 1)  # token offsets, as every backend of the wrappers takes them (0.7)
    if kind == "wrapper_paged":
        page = spec["page"]
        pages = (seq_kv.view(-1) + page - 1) // page
        kv_indptr = _indptr(torch, pages.view(-1, 1, 1, 1), 1)
        kv_indices = torch.cat([table[i, : int(n)] for i, n in enumerate(pages)]).int()
        last = torch.where(seq_kv.view(-1) % page == 0, torch.full_like(seq_kv.view(-1), page), seq_kv.view(-1) % page).int()
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="cudnn")
        wrapper.plan(q_indptr, kv_indptr, kv_indices, last, h_qo, h_kv, d, page, causal=causal, q_data_type=q.dtype,
                     seq_lens=seq_kv, seq_lens_q=seq_q, sm_scale=scale, max_token_per_sequence=spec["s_q"],
                     max_sequence_kv=spec["s_kv"], block_tables=table)  # fmt: skip
        # "NHD": each page is (tokens, heads, dim) in memory, as the wrappers take it by default;
        # the wrapper hands cuDNN a transposed, strided view of it
        k_nhd, v_nhd = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
        return lambda: wrapper.run(q, (k_nhd, v_nhd))
    kv_indptr = _indptr(torch, seq_kv, 1)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="cudnn")
    wrapper.plan(q_indptr, kv_indptr, h_qo, h_kv, d, causal=causal, q_data_type=q.dtype, seq_lens=seq_kv, seq_lens_q=seq_q,
                 sm_scale=scale, max_token_per_sequence=spec["s_q"], max_sequence_kv=spec["s_kv"])  # fmt: skip
    return lambda: wrapper.run(q, k_cache, v_cache)


def _digest(tensor: Any) -> str:
    import hashlib

    return hashlib.sha256(
        tensor.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy().tobytes()
    ).hexdigest()


def child(name: str, out: Path) -> int:
    """Run case ``name`` in this fresh process and write its row (and plancache's counters
    and warnings, when it is patched) to ``out``."""
    import logging

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage()[:400])

    logging.getLogger("plancache").addHandler(Keep(logging.WARNING))
    started = time.perf_counter()
    try:
        row = run_case(name, CASES[name], int(os.environ.get("GPU_FLASHINFER_CALLS", "2")))
    except Exception as exc:
        row = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    row["process_s"] = time.perf_counter() - started
    row["warnings"] = warnings
    if "plancache.integrations.frontend" in sys.modules:
        from plancache.integrations import frontend

        cache = frontend.current()
        if cache is not None:
            stats = cache.stats()
            row["counters"] = {k: v for k, v in stats["process"].items() if isinstance(v, int)}
            row["unstored"] = stats["unstored_plans"]
            row["judge_disagreement"] = stats["judge_disagreement"]
            stored = cache.store.keys()
            entries = (cache.store.get(key) for key in stored)
            row["engines"] = sorted(str(entry.engine)[:160] for entry in entries if entry is not None)
            refused = list(cache.lookup.unstored.disagreements.values())
            if refused and os.environ.get("GPU_FLASHINFER_RECORD"):  # the judge's defects, for its corpus
                from record_plans import record_entries

                record_entries(refused, Path(os.environ["GPU_FLASHINFER_RECORD"]), source="flashinfer-refused")
    out.write_text(json.dumps(row))
    return 0


# ---------------------------------------------------------------------------- the parent


def _spawn(name: str, mode: str, cache_dir: Path, work: Path, calls: int, record: Path | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    if record is not None:
        env["GPU_FLASHINFER_RECORD"] = str(record)
    env["GPU_FLASHINFER_CALLS"] = str(calls)
    if mode != "plain":
        env.update(PLANCACHE_PATCH_CUDNN="1", PLANCACHE_DIR=str(cache_dir))
    out = work / f"{abs(hash((name, mode, time.time())))}.json"
    # The start-up hook first, as an installed plancache's .pth file runs it (inert without the variable).
    launch = ("import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv.pop(0); import _plancache_startup, runpy; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", launch, str(ROOT), __file__, "--child", name, "--child-out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if not out.exists():
        return {"ok": False, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--record", type=Path, help="copy the cold runs' stored entries there (the judge's corpus)")
    parser.add_argument("--warm-runs", type=int, default=1)
    parser.add_argument(
        "--calls", type=int, default=2, help="calls per process (from the second on: whether the engine repeats its bits)"
    )
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (each case's modes stay in order)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.child_out)
    import flashinfer

    print(f"gpu_flashinfer: FlashInfer {flashinfer.__version__}", flush=True)
    report: dict[str, Any] = {"flashinfer": flashinfer.__version__, "cases": {}}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work, cache_dir = Path(tmp), Path(tmp) / "plancache"

        def case(name: str) -> dict[str, dict[str, Any]]:
            rows = {"plain": _spawn(name, "plain", cache_dir, work, args.calls),
                    "cold": _spawn(name, "cold", cache_dir, work, args.calls, args.record)}  # fmt: skip
            for i in range(args.warm_runs):
                mode = f"warm{i + 1}" if args.warm_runs > 1 else "warm"
                rows[mode] = _spawn(name, "warm", cache_dir, work, args.calls, args.record)
            print(_line(name, rows), flush=True)
            return rows

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for name, rows in zip(args.cases, pool.map(case, args.cases)):
                report["cases"][name] = rows
                failures += _checks(name, rows)
        if args.record is not None:
            from record_plans import record

            written = record([cache_dir], args.record, source="flashinfer")
            print(f"gpu_flashinfer: recorded {written} entries into {args.record}")
    report["failures"] = failures
    for failure in failures:
        print(f"FAILED {failure}")
    refused = sum(r.get("counters", {}).get("corrupt", 0) for rows in report["cases"].values() for r in rows.values())
    disagreements = sum(
        r.get("counters", {}).get("judge_disagreements", 0) for rows in report["cases"].values() for r in rows.values()
    )
    print(f"gpu_flashinfer: {len(args.cases)} cases, {len(failures)} failed checks, {refused} quarantined, "
          f"{disagreements} judge disagreements")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if not failures else 1


def _checks(name: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    failed = []
    for mode, row in rows.items():
        if not row.get("ok"):
            failed.append(f"{name} {mode}: {row.get('error') or 'output off the reference by ' + str(row.get('worst'))}")
        counters = row.get("counters", {})
        for counter in ("corrupt", "judge_disagreements", "unloadable"):
            if counters.get(counter):
                failed.append(f"{name} {mode}: {counter} {counters[counter]} ({'; '.join(row.get('warnings', []))[:600]})")
        if mode.startswith("warm") and counters.get("misses"):
            failed.append(
                f"{name} {mode}: {counters['misses']} misses on a warm start ({'; '.join(row.get('warnings', []))[:400]})"
            )
    cold = rows.get("cold", {})
    for mode, row in rows.items():
        if mode.startswith("warm"):
            # Bits say "the same plan" only of an engine that repeats its own bits; one that does
            # not (a split reduction's order) is held to the reference alone, above.
            repeatable = row.get("deterministic") and cold.get("deterministic")
            if repeatable and row.get("bits") != cold.get("bits"):
                failed.append(f"{name} {mode}: output bits differ from the cold run's, each repeatable in its own "
                              f"process (the same stored plan?): engines {row.get('engines')} against {cold.get('engines')}")  # fmt: skip
            if "first_ms" in row and "first_ms" in rows["plain"] and row["first_ms"] >= rows["plain"]["first_ms"]:
                failed.append(
                    f"{name} {mode}: first call {row['first_ms']:.1f} ms, not faster than plain {rows['plain']['first_ms']:.1f} ms"
                )
    return failed


def _varied(row: dict[str, Any]) -> str:
    return f", bits vary: {row.get('distinct_bits', 2)} of {row.get('calls', 2)} calls distinct"


def _line(name: str, rows: dict[str, dict[str, Any]]) -> str:
    cells = []
    for mode, row in rows.items():
        if "first_ms" in row:
            cells.append(
                f"{mode} {row['first_ms']:.1f} ms (err {row['worst']:.2g}{'' if row.get('deterministic') else _varied(row)})"
            )
        else:
            cells.append(f"{mode} ERROR {row.get('error', '')[:160]}")
    return f"{name:34s} " + " | ".join(cells)


if __name__ == "__main__":
    sys.exit(main())
