"""The native load and launch path against the frontend's, on a GPU; and the real plan blobs
the CPU tests read.

    python3 scripts/gpu_native.py [--record tests/data/plans] [--out native.json]

For every graph kind (convolution, matmul with epilogues, SDPA forward with a by-value
scale and stats, SDPA backward, ragged and paged SDPA, layer and RMS norms, MoE): the graph
is planned by ``PlanCache.get`` (heuristic policy), its stored blob is loaded twice, by the
frontend (``deserialize``) and by plancache's native path (``guest.native``: cuDNN's C
API), and both launch on the same role-valid inputs. Their outputs must be bit-identical.
Printed per graph: identical or not, the native gate's refusal if any, the time to load
each way, and the host time of a launch each way (median of 200, pointers repeating).

``--record DIR`` also writes each blob (``NAME.ubj``) and what the GPU said of it
(``NAME.json``: the tensor table, the frontend's workspace size, the outputs' checksums) as
test data for ``tests/test_native.py``.

Exit status: 0 when every graph loaded natively gave the frontend's bits, 1 otherwise.

``--smoke``: the graph kinds the CPU test backend computes (convolution, matmuls, SDPA
causal, ragged and paged, MoE) at tiny sizes, through the same
code: ``PlanCache.get``, the stored entry, role-valid inputs, ``parse``, ``refusal`` and
``NativePlan`` over the backend's C library (``backend.driver.library()``, which on a GPU is
``cudnn.library()``), its launch, the table and JSON. The frontend's own
``deserialize`` and ``execute``, and so the bit-identical comparison, are skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib
import cudnn
import torch

import plancache
from plancache.autotuning.inputs import Refusal, materialize, plan_inputs
from plancache.guest.native import NativePlan, parse, refusal
from plancache.key import TensorSpec
from plancache.workflows import templates

DT = cudnn.data_type
BF16 = {"io_data_type": DT.BFLOAT16, "intermediate_data_type": DT.FLOAT, "compute_data_type": DT.FLOAT}


def row_major(dims: list[int]) -> list[int]:
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def numbered(*tensors: Any) -> None:
    for uid, t in enumerate(tensors, start=1):
        t.set_uid(uid)


def matmul_clip(m: int = 256, k: int = 1024, n: int = 256) -> Any:
    g = cudnn.pygraph(**BF16)
    a = g.tensor(name="A", dim=[1, m, k], stride=[m * k, k, 1], data_type=DT.BFLOAT16)
    b = g.tensor(name="B", dim=[1, k, n], stride=[k * n, n, 1], data_type=DT.BFLOAT16)
    y = g.relu(g.matmul(a, b, compute_data_type=DT.FLOAT), lower_clip=-1.0, upper_clip=6.0)
    y.set_output(True).set_data_type(DT.BFLOAT16).set_dim([1, m, n]).set_stride([m * n, n, 1])
    numbered(a, b, y)
    return g


def sdpa_forward_stats(b: int = 2, h: int = 4, s: int = 256, d: int = 64) -> Any:
    dims, stats = [b, h, s, d], [b, h, s, 1]
    g = cudnn.pygraph(**BF16)
    q, k, v = (g.tensor(name=n, dim=dims, stride=row_major(dims), data_type=DT.BFLOAT16) for n in "qkv")
    o, st = g.sdpa(q=q, k=k, v=v, attn_scale=d**-0.5, use_causal_mask=True, generate_stats=True, name="sdpa")
    o.set_output(True).set_dim(dims).set_stride(row_major(dims))
    st.set_output(True).set_data_type(DT.FLOAT).set_dim(stats).set_stride(row_major(stats))
    numbered(q, k, v, o, st)
    return g


def sdpa_backward(b: int = 2, h: int = 4, s: int = 256, d: int = 64) -> Any:
    dims, stats = [b, h, s, d], [b, h, s, 1]
    g = cudnn.pygraph(**BF16)
    q, k, v, o, d_o = (
        g.tensor(name=n, dim=dims, stride=row_major(dims), data_type=DT.BFLOAT16) for n in ("q", "k", "v", "o", "dO")
    )
    st = g.tensor(name="stats", dim=stats, stride=row_major(stats), data_type=DT.FLOAT)
    dq, dk, dv = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=st, attn_scale=d**-0.5, use_causal_mask=True)
    for t in (dq, dk, dv):
        t.set_output(True).set_dim(dims).set_stride(row_major(dims))
    numbered(q, k, v, o, d_o, st, dq, dk, dv)
    return g


def sdpa_ragged(bucket: int = 2, h: int = 4, s: int = 128, d: int = 64) -> Any:
    g = cudnn.pygraph(**BF16)
    ro = {n: g.tensor(name=f"ro_{n}", dim=[bucket + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32) for n in "qkvo"}
    layout = {"dim": [bucket, h, s, d], "stride": [s * h * d, d, h * d, 1], "data_type": DT.BFLOAT16}
    q, k, v = (g.tensor(name=n, ragged_offset=ro[n], **layout) for n in "qkv")
    sq = g.tensor(name="seq_q", dim=[bucket, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    skv = g.tensor(name="seq_kv", dim=[bucket, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=d**-0.5, generate_stats=False, use_causal_mask=True, use_padding_mask=True,
                  seq_len_q=sq, seq_len_kv=skv)  # fmt: skip
    o.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"]).set_ragged_offset(ro["o"])
    numbered(ro["q"], ro["k"], ro["v"], ro["o"], q, k, v, sq, skv, o)
    return g


def sdpa_paged() -> Any:
    from gpu_right_result import _paged

    return _paged(cudnn, torch)[0]


def moe() -> Any:
    from gpu_right_result import _moe

    return _moe(cudnn, torch)[0]


def norm(kind: str, n: int = 64, c: int = 256, hw: int = 16) -> Callable[[], Any]:
    def build() -> Any:
        g = cudnn.pygraph(**BF16)
        x_dims = [n, c, hw, hw] if kind == "instancenorm" else [n * hw, c, 1, 1]
        x_stride = [c * hw * hw, 1, hw * c, c] if kind == "instancenorm" else [c, 1, c, c]
        x = g.tensor(name="X", dim=x_dims, stride=x_stride, data_type=DT.BFLOAT16)
        scale = g.tensor(name="scale", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=DT.FLOAT)
        bias = None if kind == "rmsnorm" else g.tensor(name="bias", dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=DT.FLOAT)
        eps = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.FLOAT, is_pass_by_value=True)
        phase = cudnn.norm_forward_phase.TRAINING
        if kind == "rmsnorm":
            y, inv = g.rmsnorm(norm_forward_phase=phase, input=x, scale=scale, epsilon=eps)
            outs = [y, inv]
            numbered_inputs = [x, scale, eps]
        else:
            y, mean, inv = getattr(g, kind)(norm_forward_phase=phase, input=x, scale=scale, bias=bias, epsilon=eps)
            outs = [y, mean, inv]
            numbered_inputs = [x, scale, bias, eps]
        y.set_output(True).set_data_type(DT.BFLOAT16).set_dim(x_dims).set_stride(x_stride)
        stats = [n, c, 1, 1] if kind == "instancenorm" else [n * hw, 1, 1, 1]
        for t in outs[1:]:
            t.set_output(True).set_data_type(DT.FLOAT).set_dim(stats).set_stride(row_major(stats))
        numbered(*numbered_inputs, *outs)
        return g

    return build


def batchnorm_backward(n: int = 16, c: int = 64, hw: int = 32) -> Any:
    dims, stride = [n, c, hw, hw], [c * hw * hw, 1, hw * c, c]
    g = cudnn.pygraph(**BF16)
    grad = g.tensor(name="dY", dim=dims, stride=stride, data_type=DT.BFLOAT16)
    x = g.tensor(name="X", dim=dims, stride=stride, data_type=DT.BFLOAT16)
    scale, mean, inv = (
        g.tensor(name=n_, dim=[1, c, 1, 1], stride=[c, 1, c, c], data_type=DT.FLOAT) for n_ in ("scale", "mean", "inv_var")
    )
    dx, dscale, dbias = g.batchnorm_backward(grad=grad, input=x, scale=scale, mean=mean, inv_variance=inv)
    dx.set_output(True).set_data_type(DT.BFLOAT16).set_dim(dims).set_stride(stride)
    for t in (dscale, dbias):
        t.set_output(True).set_data_type(DT.FLOAT).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
    numbered(grad, x, scale, mean, inv, dx, dscale, dbias)
    return g


CASES: dict[str, Callable[[], Any]] = {
    "conv_bias_relu": lambda: templates.build("conv_bias_act", n=8, c=64, h=56, w=56, k=64),
    "matmul_bias_relu": lambda: templates.build("matmul_bias_act", b=4, m=512, n=512, k=1024),
    "matmul_clip": matmul_clip,
    "sdpa_causal": lambda: templates.build("sdpa", b=2, h=8, s=512, d=64, causal=True),
    "sdpa_forward_stats": sdpa_forward_stats,
    "sdpa_backward": sdpa_backward,
    "sdpa_ragged": sdpa_ragged,
    "sdpa_paged": sdpa_paged,
    "layernorm": norm("layernorm"),
    "rmsnorm": norm("rmsnorm"),
    "instancenorm": norm("instancenorm"),
    "batchnorm_backward": batchnorm_backward,
    "moe_grouped_matmul": moe,
}

#: The graph kinds the CPU test backend computes, at tiny sizes, for a smoke run (paged
#: decode and MoE take gpu_right_result's smoke sizes). SDPA with stats, SDPA backward and
#: the norms it does not compute: a smoke run reports them as skipped.
SMOKE_CASES: dict[str, Callable[[], Any]] = {
    "conv_bias_relu": lambda: templates.build("conv_bias_act", n=1, c=8, h=6, w=6, k=8),
    "matmul_bias_relu": lambda: templates.build("matmul_bias_act", b=1, m=8, n=8, k=16),
    "matmul_clip": lambda: matmul_clip(8, 16, 8),
    "sdpa_causal": lambda: templates.build("sdpa", b=1, h=1, s=16, d=16, causal=True),
    "sdpa_ragged": lambda: sdpa_ragged(2, 2, 16, 16),
    "sdpa_paged": sdpa_paged,
    "moe_grouped_matmul": moe,
}


#: Where ``--record`` wrote the blobs the CPU tests read.
RECORDED = Path(__file__).resolve().parent.parent / "tests" / "data" / "plans"


def described_here() -> dict[str, tuple[dict[str, Any], bytes]]:
    """Each recorded case's description, made on this machine, with its recorded blob; the
    cases whose graphs need CUDA to be made (paged attention, MoE) are left out on a CPU."""
    from plancache.key import describe

    found = {}
    for name, build in CASES.items():
        try:
            description = describe(build())
        except (AssertionError, RuntimeError):
            if torch.cuda.is_available():
                raise  # on a GPU every case is made
            # without one, torch's CPU build says "Torch not compiled with CUDA enabled" and its
            # CUDA build "Found no NVIDIA driver" (PyPI's Linux wheels are CUDA builds)
            continue
        found[name] = (description, (RECORDED / f"{name}.ubj").read_bytes())
    return found


def _bits(tensor: Any) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _host_us(launch: Callable[[], None], runs: int = 200) -> float:
    if benchlib.smoke():
        runs = 3
    for _ in range(10 if not benchlib.smoke() else 1):
        launch()
    times = []
    for _ in range(runs):
        started = time.perf_counter_ns()
        launch()
        times.append((time.perf_counter_ns() - started) / 1e3)
    benchlib.synchronize(torch)
    return statistics.median(times)


def _frontend(blob: bytes, entry: Any, pack: dict[int, Any], outputs: list[int], device: int) -> dict[str, Any]:
    """The frontend's path: its own deserialize of the stored blob into a fresh pygraph, on
    a handle whose stream is a non-blocking stream of this script's (its warm-up captures
    the handle's stream), then its own execute. Not backend.load, nor plan.native: both
    are plancache's native path, which would be compared with itself. Returns its load
    and launch times and its outputs' bits (``want``)."""
    found: dict[str, Any] = {}
    fe_stream = torch.cuda.Stream()  # torch's streams are non-blocking
    fe_handle = cudnn.create_handle()
    cudnn.set_stream(handle=fe_handle, stream=fe_stream.cuda_stream)
    torch.cuda.synchronize()  # the inputs are ready before the frontend's stream reads them
    started = time.perf_counter()
    frontend = cudnn.pygraph(handle=fe_handle)
    frontend.deserialize(blob)
    found["frontend_load_ms"] = 1e3 * (time.perf_counter() - started)
    if isinstance(frontend, NativePlan):
        raise RuntimeError("the frontend's path returned a native plan: nothing would be compared")
    fe_workspace = torch.empty(max(frontend.get_workspace_size(), entry.workspace_size, 1), dtype=torch.uint8,
                               device=f"cuda:{device}")  # fmt: skip

    def launch_fe(tensors: dict[int, Any]) -> None:
        frontend.execute(tensors, fe_workspace, handle=fe_handle)

    for uid in outputs:
        pack[uid].zero_()
    torch.cuda.synchronize()
    launch_fe(pack)
    torch.cuda.synchronize()
    found["want"] = {uid: _bits(pack[uid]) for uid in outputs}
    found["frontend_launch_us"] = _host_us(lambda: launch_fe(pack))
    return found


def check(name: str, build: Callable[[], Any], cache: Any, record: Path | None) -> dict[str, Any]:
    row: dict[str, Any] = {"graph": name}
    plan = cache.get(build(), options=plancache.BuildOptions(policy="heuristic"))
    entry = cache.store.get(plan.key)
    blob, specs = entry.blob, [TensorSpec.from_dict(t) if isinstance(t, dict) else t for t in entry.tensors]
    driver = cache.backend.driver  # cuDNN's on a GPU, the CPU test backend's simulated one in a smoke run
    device = cache.backend.current_device()
    where = benchlib.device() if benchlib.smoke() else f"cuda:{device}"
    found = plan_inputs(entry.description, specs, {})
    if isinstance(found, Refusal):
        raise RuntimeError(f"no role-valid inputs: {found.why}")
    pack = materialize(found, torch, where, torch.Generator(device=benchlib.device()).manual_seed(0))
    outputs = [s.uid for s in specs if s.is_output]
    stream = driver.stream_getter()(device)  # this thread's current stream, as cuDNN takes it

    frontend = benchlib.gpu_only("the frontend's own deserialize and execute (the bits compared with)", _frontend, blob, entry,
                                 pack, outputs, device)  # fmt: skip
    want = None if frontend is None else frontend.pop("want")
    row.update(frontend or {"frontend_load_ms": None, "frontend_launch_us": None})

    # The native path: cuDNN's C API (the process's cudnn.library() on a GPU).
    record_ = parse(blob)
    row["refusal"] = refusal(record_)
    row["fields"] = sorted(record_.fields)
    row["by_value"] = len(record_.by_value)
    row["workspace_changes"] = sorted({c.operation for c in record_.workspace.values()})
    row["replacements"] = len(record_.replacements)
    lib = driver.library()
    handle = lib.create_handle()
    lib.set_stream(handle, stream)
    started = time.perf_counter()
    native = NativePlan(lib, record_, handle, device)
    row["native_load_ms"] = 1e3 * (time.perf_counter() - started)
    row["workspace"] = {"stored": entry.workspace_size, "native": native.workspace_size}
    workspace = torch.empty(max(native.workspace_size, entry.workspace_size, 1), dtype=torch.uint8, device=where)
    user = [pack[uid].data_ptr() for uid in native.user_uids]
    missing = sorted(set(native.user_uids) - set(pack))
    row["user_uids"] = list(native.user_uids)
    if missing:
        raise RuntimeError(f"the variant pack needs uids the tensor table lacks: {missing}")
    for uid in outputs:
        pack[uid].zero_()
    started = time.perf_counter()
    native.launch(user, workspace.data_ptr(), handle, stream)
    row["native_first_launch_ms"] = 1e3 * (time.perf_counter() - started)
    benchlib.synchronize(torch)
    got = {uid: _bits(pack[uid]) for uid in outputs}
    row["identical"] = None if want is None else got == want  # None: not compared (a smoke run)
    row["native_launch_us"] = _host_us(lambda: native.launch(user, workspace.data_ptr(), handle, stream))
    benchlib.synchronize(torch)
    if record is not None and want is not None:
        record.mkdir(parents=True, exist_ok=True)
        (record / f"{name}.ubj").write_bytes(blob)
        facts = {
            "graph": name,
            "tensors": [t.to_dict() for t in specs],
            "workspace_size": entry.workspace_size,
            "native_workspace_size": native.workspace_size,
            "user_uids": list(native.user_uids),
            "output_sha256": {str(uid): hashlib.sha256(want[uid]).hexdigest() for uid in outputs},
            "environment": entry.environment,
            "recorded": time.strftime("%Y-%m-%d"),
        }
        (record / f"{name}.json").write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, default=None, help="write the blobs and facts here")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--record-corpus", type=Path, default=None,
                        help="add the stored entries to the judge's corpus there (scripts/record_plans.py)")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated graph names")
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    if smoke and args.record is not None:
        parser.error("--record writes what a GPU said of its blobs: not with --smoke")
    if smoke:
        import gpu_right_result

        gpu_right_result._smoke_sizes()  # paged decode and MoE at its smoke sizes
    cases = SMOKE_CASES if smoke else CASES
    names = []
    for name in [n for n in args.only.split(",") if n] or list(CASES):
        if name in CASES and name not in cases:
            benchlib.gpu_only(f"{name}: a graph kind the CPU test backend does not compute", lambda: None)
        else:
            names.append(name)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cache = plancache.PlanCache(work, backend=benchlib.backend(), auto_prime=False)
        for name in names:
            try:
                rows.append(check(name, cases[name], cache, args.record))
            except Exception as exc:
                rows.append(
                    {"graph": name, "failure": f"{type(exc).__name__}: {str(exc)[:500]}", "trace": traceback.format_exc()[-2000:]}
                )
        cache.close()
        if args.record_corpus is not None:
            from record_plans import record

            print(f"gpu_native: {record([Path(work)], args.record_corpus, source='plancache-native')} entries recorded")
    print(
        f"{'graph':22} {'result':10} {'FE load ms':>10} {'native ms':>10} {'1st launch':>10} {'FE us':>7} {'native us':>9}  notes"
    )
    ok = True
    fmt = benchlib.fmt
    for r in rows:
        if "failure" in r:
            ok = False
            print(f"{r['graph']:22} FAILED     {r['failure'][:200]}")
            continue
        result = {True: "identical", False: "DIFFERENT", None: "skipped"}[r["identical"]]
        ok = ok and r["identical"] is not False
        notes = f"refused: {r['refusal']}" if r["refusal"] else ""
        notes += f" by_value={r['by_value']} ws_ops={r['workspace_changes']} repl={r['replacements']} ws={r['workspace']}"
        print(f"{r['graph']:22} {result:10} {fmt(r['frontend_load_ms'], '10.1f')} {r['native_load_ms']:10.1f} "
              f"{r['native_first_launch_ms']:10.2f} {fmt(r['frontend_launch_us'], '7.1f')} {r['native_launch_us']:9.1f}  {notes}")  # fmt: skip
    launched = sum(1 for r in rows if "failure" not in r)
    if smoke:
        print(f"gpu_native smoke run: {launched} of {len(rows)} graphs loaded and launched natively, none compared")
    else:
        print(f"gpu_native: {sum(1 for r in rows if r.get('identical'))} of {len(rows)} graphs bit-identical")
    benchlib.report_skipped("gpu_native")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
