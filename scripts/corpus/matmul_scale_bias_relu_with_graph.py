"""Matmul with a per-column scale, a bias and ReLU in half precision, written in a
``with cudnn.graph(handle) as (g, _):`` block and built with ``g.build()``."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    b, m, k, n = 2, 256, 128, 64
    a = (torch.randn(b, m, k, device="cuda") * 0.5).half()
    bm = (torch.randn(b, k, n, device="cuda") * 0.5).half()
    scale = (torch.rand(1, 1, n, device="cuda") + 0.5).half()
    bias = torch.randn(1, 1, n, device="cuda").half()
    c = torch.empty(b, m, n, device="cuda", dtype=torch.half)

    with report.first_call("matmul_scale_bias_relu"):
        with cudnn.graph(handle, io_data_type=cudnn.data_type.HALF) as (g, _):
            A = g.tensor(name="A", dim=[b, m, k], stride=row_major([b, m, k]))
            B = g.tensor(name="B", dim=[b, k, n], stride=row_major([b, k, n]))
            S = g.tensor(name="scale", dim=[1, 1, n], stride=[n, n, 1])
            bias_t = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1])
            product = g.matmul(A, B, compute_data_type=cudnn.data_type.FLOAT)
            C = g.relu(input=g.bias(input=g.scale(input=product, scale=S), bias=bias_t))
            C.set_output(True).set_dim([b, m, n]).set_stride(row_major([b, m, n]))
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.execute({A: a, B: bm, S: scale, bias_t: bias, C: c}, workspace_for(g), handle=handle)

    want = torch.relu((a.float() @ bm.float()) * scale.float() + bias.float())
    report.output("c", c, want, tolerance=1e-2)


run("matmul_scale_bias_relu_with_graph", "with cudnn.graph() + build()", body)
