"""Instance normalization (training: the output, and the mean and inverse variance of each
image and channel) of an NHWC half-precision batch, planned with the frontend's five
steps, the epsilon passed by value."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    n, c, h, w = 8, 32, 32, 32
    eps = 1e-5
    x = torch.randn(n, c, h, w, device="cuda").half().to(memory_format=torch.channels_last)
    gamma = (torch.randn(1, c, 1, 1, device="cuda") * 0.5 + 1.0).half().to(memory_format=torch.channels_last)
    beta = (torch.randn(1, c, 1, 1, device="cuda") * 0.1).half().to(memory_format=torch.channels_last)
    epsilon = torch.full((1, 1, 1, 1), eps, dtype=torch.float32)  # passed by value: a host scalar
    y = torch.empty_like(x)
    mean = torch.empty(n, c, 1, 1, device="cuda", dtype=torch.float32)
    inv_var = torch.empty(n, c, 1, 1, device="cuda", dtype=torch.float32)

    with report.first_call("instancenorm"):
        graph = cudnn.pygraph(handle=handle, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
        X, Scale, Bias = graph.tensor_like(x), graph.tensor_like(gamma), graph.tensor_like(beta)
        Eps = graph.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                           is_pass_by_value=True)  # fmt: skip
        Y, Mean, InvVar = graph.instancenorm(name="IN", norm_forward_phase=cudnn.norm_forward_phase.TRAINING, input=X,
                                             scale=Scale, bias=Bias, epsilon=Eps)  # fmt: skip
        Y.set_output(True).set_data_type(cudnn.data_type.HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
        Mean.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        InvVar.set_output(True).set_data_type(cudnn.data_type.FLOAT)

        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

        pack = {X: x, Scale: gamma, Bias: beta, Eps: epsilon, Y: y, Mean: mean, InvVar: inv_var}
        graph.execute(pack, workspace_for(graph), handle=handle)

    xf = x.float()
    want = torch.nn.functional.instance_norm(xf, weight=gamma.float().view(c), bias=beta.float().view(c), eps=eps)
    report.output("y", y, want, tolerance=1e-2)
    report.output("mean", mean, xf.mean(dim=(2, 3), keepdim=True), tolerance=1e-3)
    report.output("inv_var", inv_var, torch.rsqrt(xf.var(dim=(2, 3), unbiased=False, keepdim=True) + eps), tolerance=1e-3)


run("instancenorm_five_step", "five steps", body)
