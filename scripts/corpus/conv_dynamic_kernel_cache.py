"""Dynamic shapes: one convolution + bias + ReLU (NHWC, bfloat16) for eight batch sizes,
each graph built with ``is_dynamic_shape_enabled=True`` against one kernel cache the
program shares across its builds, as the frontend's dynamic-shape samples do."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for

BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def body(report):
    handle = handle_on_current_stream()
    kernel_cache = cudnn.create_kernel_cache()
    c, hw, k = 32, 28, 32
    weight = (torch.randn(k, c, 3, 3, device="cuda") * 0.1).to(torch.bfloat16).to(memory_format=torch.channels_last)
    bias = torch.randn(1, k, 1, 1, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    for n in BATCH_SIZES:
        x = torch.randn(n, c, hw, hw, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
        y = torch.empty(n, k, hw, hw, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        with report.first_call(f"conv_n{n}"):
            graph = cudnn.pygraph(
                handle=handle,
                io_data_type=cudnn.data_type.BFLOAT16,
                intermediate_data_type=cudnn.data_type.FLOAT,
                compute_data_type=cudnn.data_type.FLOAT,
                is_dynamic_shape_enabled=True,
                kernel_cache=kernel_cache,
            )
            X, W, B = graph.tensor_like(x), graph.tensor_like(weight), graph.tensor_like(bias)
            conv = graph.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
            Y = graph.relu(input=graph.bias(input=conv, bias=B))
            Y.set_output(True).set_dim(list(y.shape)).set_stride(list(y.stride()))
            graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.execute({X: x, W: weight, B: bias, Y: y}, workspace_for(graph), handle=handle)
        want = torch.relu(torch.nn.functional.conv2d(x.float(), weight.float(), padding=1) + bias.float())
        report.output(f"y_n{n}", y, want, tolerance=2e-2)


run("conv_dynamic_kernel_cache", "build(), dynamic shapes + kernel cache", body)
