"""A graph cuDNN does not support (attention with a head dimension of 60: its attention
takes multiples of 8), built the way frontend code tries a configuration: the rejection is
caught as ``cudnn.cudnnGraphNotSupportedError`` and the configuration skipped."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    b, h, s, d = 1, 2, 128, 60
    dims = [b, h, s, d]
    q, k, v = (torch.randn(*dims, device="cuda").to(torch.bfloat16) for _ in range(3))
    o = torch.zeros(*dims, device="cuda", dtype=torch.bfloat16)
    with report.first_call("sdpa_d60"):
        graph = cudnn.pygraph(
            handle=handle,
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        Q, K, V = (graph.tensor(name=n, dim=dims, stride=row_major(dims)) for n in ("q", "k", "v"))
        Out, _ = graph.sdpa(q=Q, k=K, v=V, attn_scale=d**-0.5, use_causal_mask=True, generate_stats=False)
        Out.set_output(True).set_dim(dims).set_stride(row_major(dims))
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.execute({Q: q, K: k, V: v, Out: o}, workspace_for(graph), handle=handle)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=d**-0.5)
    report.output("o", o, want, tolerance=2e-2)  # only if this GPU's cuDNN took it after all


run("sdpa_unsupported_rejected", "build(), rejected", body)
