"""A program with a workspace budget: a convolution and a long-K matmul (where split-K
plans want scratch memory), each planned with the frontend's five steps under
``deselect_workspace_greater_than(WORKSPACE_LIMIT)``, half precision. The workspace each
graph gets is sized by the plan, as the program asks for it."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for

WORKSPACE_LIMIT = 1 << 20  # bytes: what this program can spare for cuDNN's scratch memory


def plan_within_budget(graph):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.deselect_workspace_greater_than(WORKSPACE_LIMIT)
    graph.check_support()
    graph.build_plans()
    if graph.get_workspace_size() > WORKSPACE_LIMIT:
        raise RuntimeError(f"the plan needs {graph.get_workspace_size()} bytes of workspace, over the limit")


def half_graph(handle):
    return cudnn.pygraph(handle=handle, io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip


def body(report):
    handle = handle_on_current_stream()

    n, c, hw, k = 2, 64, 16, 64
    x = torch.randn(n, c, hw, hw, device="cuda").half().to(memory_format=torch.channels_last)
    weight = (torch.randn(k, c, 3, 3, device="cuda") * 0.1).half().to(memory_format=torch.channels_last)
    y = torch.empty(n, k, hw, hw, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    with report.first_call("conv"):
        graph = half_graph(handle)
        X, W = graph.tensor_like(x), graph.tensor_like(weight)
        Y = graph.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
        Y.set_output(True).set_dim(list(y.shape)).set_stride(list(y.stride()))
        plan_within_budget(graph)
        graph.execute({X: x, W: weight, Y: y}, workspace_for(graph), handle=handle)
    report.output("y", y, torch.nn.functional.conv2d(x.float(), weight.float(), padding=1), tolerance=1e-2)

    b, m, kk, nn = 1, 128, 16384, 128
    a = (torch.randn(b, m, kk, device="cuda") * 0.1).half()
    bm = (torch.randn(b, kk, nn, device="cuda") * 0.1).half()
    out = torch.empty(b, m, nn, device="cuda", dtype=torch.half)
    with report.first_call("matmul_long_k"):
        graph = half_graph(handle)
        A, B = graph.tensor_like(a), graph.tensor_like(bm)
        C = graph.matmul(A, B)
        C.set_output(True).set_dim([b, m, nn]).set_stride(row_major([b, m, nn]))
        plan_within_budget(graph)
        graph.execute({A: a, B: bm, C: out}, workspace_for(graph), handle=handle)
    report.output("c", out, a.float() @ bm.float(), tolerance=1e-2)


run("conv_matmul_workspace_limit", "five steps + workspace limit", body)
