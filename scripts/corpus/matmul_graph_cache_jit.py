"""A bias + ReLU matmul epilogue in bfloat16, built by a function decorated with
``@cudnn.jit`` on top of ``@cudnn.graph_cache`` (the frontend's samples stack the two);
called twice, the second call served by the in-process cache."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    bf16 = {"io_data_type": cudnn.data_type.BFLOAT16, "intermediate_data_type": cudnn.data_type.FLOAT,
            "compute_data_type": cudnn.data_type.FLOAT}  # fmt: skip

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    @cudnn.graph_cache(key_fn=lambda b, m, n, k: ("matmul", b, m, n, k))
    def matmul(b, m, n, k):
        with cudnn.graph(handle, **bf16) as (g, _):
            A = g.tensor(name="A", dim=[b, m, k], stride=row_major([b, m, k]), data_type=cudnn.data_type.BFLOAT16)
            B = g.tensor(name="B", dim=[b, k, n], stride=row_major([b, k, n]), data_type=cudnn.data_type.BFLOAT16)
            bias = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1], data_type=cudnn.data_type.BFLOAT16)
            C = g.relu(input=g.bias(input=g.matmul(A, B), bias=bias))
            C.set_output(True).set_data_type(cudnn.data_type.BFLOAT16).set_dim([b, m, n]).set_stride(row_major([b, m, n]))
            return g, [A, B, bias, C]

    b, m, n, k = 4, 256, 256, 128
    a = (torch.randn(b, m, k, device="cuda") * 0.5).to(torch.bfloat16)
    bm = (torch.randn(b, k, n, device="cuda") * 0.5).to(torch.bfloat16)
    bias = torch.randn(1, 1, n, device="cuda").to(torch.bfloat16)
    c = torch.empty(b, m, n, device="cuda", dtype=torch.bfloat16)

    with report.first_call("matmul_bias_relu"):
        graph, uids = matmul(b, m, n, k)
        graph.execute(dict(zip(uids, [a, bm, bias, c])), workspace_for(graph), handle=handle)
    again, _ = matmul(b, m, n, k)
    if again is not graph:
        report.notes.append("graph_cache returned another graph for the same key")

    report.output("c", c, torch.relu(a.float() @ bm.float() + bias.float()), tolerance=2e-2)


run("matmul_graph_cache_jit", "@cudnn.jit + @cudnn.graph_cache", body)
