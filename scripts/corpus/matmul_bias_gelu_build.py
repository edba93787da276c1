"""Batched matmul with a bias + GELU epilogue in bfloat16, planned with one ``build()`` call."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    b, m, k, n = 4, 128, 64, 128
    a = (torch.randn(b, m, k, device="cuda") * 0.5).to(torch.bfloat16)
    bm = (torch.randn(b, k, n, device="cuda") * 0.5).to(torch.bfloat16)
    bias = torch.randn(1, 1, n, device="cuda").to(torch.bfloat16)
    c = torch.empty(b, m, n, device="cuda", dtype=torch.bfloat16)

    with report.first_call("matmul_bias_gelu"):
        graph = cudnn.pygraph(
            handle=handle,
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        A = graph.tensor_like(a)
        B = graph.tensor_like(bm)
        bias_t = graph.tensor_like(bias)
        C = graph.gelu(input=graph.bias(input=graph.matmul(A, B), bias=bias_t))
        C.set_output(True).set_dim(list(c.shape)).set_stride(list(c.stride()))
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.execute({A: a, B: bm, bias_t: bias, C: c}, workspace_for(graph), handle=handle)

    want = torch.nn.functional.gelu(a.float() @ bm.float() + bias.float())
    report.output("c", c, want, tolerance=2e-2)


run("matmul_bias_gelu_build", "build()", body)
