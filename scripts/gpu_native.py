"""The native load and launch path against the frontend's, on a GPU; and the real plan blobs
the CPU tests read.

    python3 scripts/gpu_native.py [--record tests/data/plans] [--out native.json]

For every graph kind (convolution, matmul with epilogues, SDPA forward with a by-value
scale and stats, SDPA backward, ragged and paged SDPA, layer and RMS norms, MoE): the graph
is planned by ``PlanCache.get`` (heuristic policy), its stored blob is loaded twice, by the
frontend (``deserialize``) and by plancache's native path (``engines.native``: cuDNN's C
API), and both launch on the same role-valid inputs. Their outputs must be bit-identical.
Printed per graph: identical or not, the native gate's refusal if any, the time to load
each way, and the host time of a launch each way (median of 200, pointers repeating).

``--record DIR`` also writes each blob (``NAME.ubj``) and what the GPU said of it
(``NAME.json``: the tensor table, the frontend's workspace size, the outputs' checksums) as
test data for ``tests/test_native.py``.

Exit status: 0 when every graph loaded natively gave the frontend's bits, 1 otherwise.
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

import cudnn
import torch

import plancache
from plancache.engines.inputs import materialize, plan_inputs
from plancache.engines.native import NativePlan, library, parse, refusal
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


def matmul_clip() -> Any:
    g = cudnn.pygraph(**BF16)
    a = g.tensor(name="A", dim=[1, 256, 1024], stride=[256 * 1024, 1024, 1], data_type=DT.BFLOAT16)
    b = g.tensor(name="B", dim=[1, 1024, 256], stride=[1024 * 256, 256, 1], data_type=DT.BFLOAT16)
    y = g.relu(g.matmul(a, b, compute_data_type=DT.FLOAT), lower_clip=-1.0, upper_clip=6.0)
    y.set_output(True).set_data_type(DT.BFLOAT16).set_dim([1, 256, 256]).set_stride([65536, 256, 1])
    numbered(a, b, y)
    return g


def sdpa_forward_stats() -> Any:
    b, h, s, d = 2, 4, 256, 64
    dims, stats = [b, h, s, d], [b, h, s, 1]
    g = cudnn.pygraph(**BF16)
    q, k, v = (g.tensor(name=n, dim=dims, stride=row_major(dims), data_type=DT.BFLOAT16) for n in "qkv")
    o, st = g.sdpa(q=q, k=k, v=v, attn_scale=d**-0.5, use_causal_mask=True, generate_stats=True, name="sdpa")
    o.set_output(True).set_dim(dims).set_stride(row_major(dims))
    st.set_output(True).set_data_type(DT.FLOAT).set_dim(stats).set_stride(row_major(stats))
    numbered(q, k, v, o, st)
    return g


def sdpa_backward() -> Any:
    b, h, s, d = 2, 4, 256, 64
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


def sdpa_ragged() -> Any:
    bucket, h, s, d = 2, 4, 128, 64
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


def norm(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        n, c, hw = 64, 256, 16
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


def batchnorm_backward() -> Any:
    n, c, hw = 16, 64, 32
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


def _bits(tensor: Any) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _host_us(launch: Callable[[], None], runs: int = 200) -> float:
    for _ in range(10):
        launch()
    times = []
    for _ in range(runs):
        started = time.perf_counter_ns()
        launch()
        times.append((time.perf_counter_ns() - started) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def check(name: str, build: Callable[[], Any], cache: Any, record: Path | None) -> dict[str, Any]:
    row: dict[str, Any] = {"graph": name}
    plan = cache.get(build(), options=plancache.BuildOptions(policy="heuristic"))
    entry = cache.store.get(plan.key)
    blob, specs = entry.blob, [TensorSpec.from_dict(t) if isinstance(t, dict) else t for t in entry.tensors]
    device = torch.cuda.current_device()
    found = plan_inputs(entry.description, specs, {})
    if isinstance(found, str):
        raise RuntimeError(f"no role-valid inputs: {found}")
    pack = materialize(found, torch, f"cuda:{device}", torch.Generator(device="cuda").manual_seed(0))
    outputs = [s.uid for s in specs if s.is_output]
    stream = torch.cuda.current_stream().cuda_stream

    # The frontend's path: its own deserialize of the stored blob into a fresh pygraph, on
    # a handle whose stream is a non-blocking stream of this script's (its warm-up captures
    # the handle's stream), then its own execute. Not backend.load, nor plan.native: both
    # are plancache's native path, which would be compared with itself.
    fe_stream = torch.cuda.Stream()  # torch's streams are non-blocking
    fe_handle = cudnn.create_handle()
    cudnn.set_stream(handle=fe_handle, stream=fe_stream.cuda_stream)
    torch.cuda.synchronize()  # the inputs are ready before the frontend's stream reads them
    started = time.perf_counter()
    frontend = cudnn.pygraph(handle=fe_handle)
    frontend.deserialize(blob)
    row["frontend_load_ms"] = 1e3 * (time.perf_counter() - started)
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
    want = {uid: _bits(pack[uid]) for uid in outputs}
    row["frontend_launch_us"] = _host_us(lambda: launch_fe(pack))

    # The native path: cuDNN's C API.
    record_ = parse(blob)
    row["refusal"] = refusal(record_)
    row["fields"] = sorted(record_.fields)
    row["by_value"] = len(record_.by_value)
    row["workspace_changes"] = sorted({c.operation for c in record_.workspace.values()})
    row["replacements"] = len(record_.replacements)
    lib = library()
    handle = lib.create_handle()
    lib.set_stream(handle, stream)
    started = time.perf_counter()
    native = NativePlan(lib, record_, handle, device)
    row["native_load_ms"] = 1e3 * (time.perf_counter() - started)
    row["workspace"] = {"stored": entry.workspace_size, "native": native.workspace_size}
    workspace = torch.empty(max(native.workspace_size, entry.workspace_size, 1), dtype=torch.uint8, device="cuda")
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
    torch.cuda.synchronize()
    got = {uid: _bits(pack[uid]) for uid in outputs}
    row["identical"] = got == want
    row["native_launch_us"] = _host_us(lambda: native.launch(user, workspace.data_ptr(), handle, stream))
    torch.cuda.synchronize()
    if record is not None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, default=None, help="write the blobs and facts here")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--only", default="", help="comma-separated graph names")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cache = plancache.PlanCache(work, auto_prime=False)
        for name in names:
            try:
                rows.append(check(name, CASES[name], cache, args.record))
            except Exception as exc:
                rows.append(
                    {"graph": name, "failure": f"{type(exc).__name__}: {str(exc)[:500]}", "trace": traceback.format_exc()[-2000:]}
                )
        cache.close()
    print(
        f"{'graph':22} {'result':10} {'FE load ms':>10} {'native ms':>10} {'1st launch':>10} {'FE us':>7} {'native us':>9}  notes"
    )
    ok = True
    for r in rows:
        if "failure" in r:
            ok = False
            print(f"{r['graph']:22} FAILED     {r['failure'][:200]}")
            continue
        result = "identical" if r["identical"] else "DIFFERENT"
        ok = ok and r["identical"]
        notes = f"refused: {r['refusal']}" if r["refusal"] else ""
        notes += f" by_value={r['by_value']} ws_ops={r['workspace_changes']} repl={r['replacements']} ws={r['workspace']}"
        print(f"{r['graph']:22} {result:10} {r['frontend_load_ms']:10.1f} {r['native_load_ms']:10.1f} "
              f"{r['native_first_launch_ms']:10.2f} {r['frontend_launch_us']:7.1f} {r['native_launch_us']:9.1f}  {notes}")  # fmt: skip
    print(f"gpu_native: {sum(1 for r in rows if r.get('identical'))} of {len(rows)} graphs bit-identical")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
