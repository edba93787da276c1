"""Convolution + bias + ReLU, NHWC half precision, planned with the frontend's five steps."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    n, c, h, w, k = 8, 64, 32, 32, 64
    x = torch.randn(n, c, h, w, device="cuda").half().to(memory_format=torch.channels_last)
    weight = (torch.randn(k, c, 3, 3, device="cuda") * 0.1).half().to(memory_format=torch.channels_last)
    bias = torch.randn(1, k, 1, 1, device="cuda").half().to(memory_format=torch.channels_last)
    y = torch.empty(n, k, h, w, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)

    with report.first_call("conv_bias_relu"):
        graph = cudnn.pygraph(
            handle=handle,
            io_data_type=cudnn.data_type.HALF,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        X = graph.tensor_like(x)
        W = graph.tensor_like(weight)
        B = graph.tensor_like(bias)
        conv = graph.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
        Y = graph.relu(input=graph.bias(input=conv, bias=B))
        Y.set_output(True).set_dim(list(y.shape)).set_stride(list(y.stride()))

        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

        graph.execute({X: x, W: weight, B: bias, Y: y}, workspace_for(graph), handle=handle)

    want = torch.relu(torch.nn.functional.conv2d(x.float(), weight.float(), padding=1) + bias.float())
    report.output("y", y, want, tolerance=1e-2)


run("conv_bias_relu_five_step", "five steps", body)
