"""Causal scaled dot-product attention in bfloat16, forward (with softmax stats) and backward
on the forward's output, each planned with one ``build()`` call."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for

BF16 = {"io_data_type": cudnn.data_type.BFLOAT16, "intermediate_data_type": cudnn.data_type.FLOAT,
        "compute_data_type": cudnn.data_type.FLOAT}  # fmt: skip


def body(report):
    handle = handle_on_current_stream()
    b, h, s, d = 2, 4, 256, 64
    scale = d**-0.5
    dims, stats_dims = [b, h, s, d], [b, h, s, 1]
    q, k, v, d_o = (torch.randn(b, h, s, d, device="cuda").to(torch.bfloat16) for _ in range(4))
    o = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)

    with report.first_call("sdpa_forward"):
        fwd = cudnn.pygraph(handle=handle, **BF16)
        Q, K, V = (fwd.tensor(name=n, dim=dims, stride=row_major(dims)) for n in ("q", "k", "v"))
        Out, Stats = fwd.sdpa(q=Q, k=K, v=V, attn_scale=scale, use_causal_mask=True, generate_stats=True, name="sdpa")
        Out.set_output(True).set_dim(dims).set_stride(row_major(dims))
        Stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(stats_dims).set_stride(row_major(stats_dims))
        fwd.build([cudnn.heur_mode.A])
        fwd.execute({Q: q, K: k, V: v, Out: o, Stats: stats}, workspace_for(fwd), handle=handle)

    dq, dk, dv = (torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with report.first_call("sdpa_backward"):
        bwd = cudnn.pygraph(handle=handle, **BF16)
        Q, K, V, Out, dO = (bwd.tensor(name=n, dim=dims, stride=row_major(dims)) for n in ("q", "k", "v", "o", "dO"))
        Stats = bwd.tensor(name="stats", dim=stats_dims, stride=row_major(stats_dims), data_type=cudnn.data_type.FLOAT)
        dQ, dK, dV = bwd.sdpa_backward(q=Q, k=K, v=V, o=Out, dO=dO, stats=Stats, attn_scale=scale, use_causal_mask=True)
        for t in (dQ, dK, dV):
            t.set_output(True).set_dim(dims).set_stride(row_major(dims))
        bwd.build([cudnn.heur_mode.A])
        bwd.execute({Q: q, K: k, V: v, Out: o, dO: d_o, Stats: stats, dQ: dq, dK: dk, dV: dv}, workspace_for(bwd), handle=handle)

    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
    of = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    of.backward(d_o.float())
    report.output("o", o, of.detach(), tolerance=2e-2)
    report.output("dq", dq, qf.grad, tolerance=2e-2)
    report.output("dk", dk, kf.grad, tolerance=2e-2)
    report.output("dv", dv, vf.grad, tolerance=2e-2)


run("sdpa_fwd_bwd_causal_build", "build()", body)
