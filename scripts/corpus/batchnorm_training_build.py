"""Batch normalization in training (the output, the batch mean and inverse variance, and
the updated running statistics) of an NHWC half-precision batch with float32 parameters,
then ``g.build()``; epsilon and momentum passed by value, as the frontend's samples do."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    n, c, h, w = 8, 64, 28, 28
    eps, momentum = 1e-3, 0.1
    x = torch.randn(n, c, h, w, device="cuda").half().to(memory_format=torch.channels_last)
    gamma = torch.randn(1, c, 1, 1, device="cuda") * 0.5 + 1.0
    beta = torch.randn(1, c, 1, 1, device="cuda") * 0.1
    running_mean = torch.randn(1, c, 1, 1, device="cuda") * 0.1
    running_var = torch.rand(1, c, 1, 1, device="cuda") + 0.5
    epsilon = torch.full((1, 1, 1, 1), eps, dtype=torch.float32)  # passed by value: host scalars
    momentum_value = torch.full((1, 1, 1, 1), momentum, dtype=torch.float32)
    y = torch.empty_like(x)
    saved_mean, saved_inv_var = torch.empty_like(gamma), torch.empty_like(gamma)
    next_mean, next_var = torch.empty_like(gamma), torch.empty_like(gamma)

    with report.first_call("batchnorm"):
        graph = cudnn.pygraph(handle=handle, io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip
        X = graph.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=cudnn.data_type.HALF)
        Scale = graph.tensor(name="scale", dim=list(gamma.shape), stride=list(gamma.stride()))
        Bias = graph.tensor(name="bias", dim=list(beta.shape), stride=list(beta.stride()))
        InMean = graph.tensor(name="in_running_mean", dim=list(gamma.shape), stride=list(gamma.stride()))
        InVar = graph.tensor(name="in_running_var", dim=list(gamma.shape), stride=list(gamma.stride()))
        Eps = graph.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True)
        Momentum = graph.tensor(name="momentum", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True)
        Y, SavedMean, SavedInvVar, NextMean, NextVar = graph.batchnorm(
            name="BN", input=X, scale=Scale, bias=Bias, in_running_mean=InMean, in_running_var=InVar, epsilon=Eps,
            momentum=Momentum,
        )  # fmt: skip
        Y.set_output(True).set_data_type(cudnn.data_type.HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
        for stat in (SavedMean, SavedInvVar, NextMean, NextVar):
            stat.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])

        pack = {X: x, Scale: gamma, Bias: beta, InMean: running_mean, InVar: running_var, Eps: epsilon,
                Momentum: momentum_value, Y: y, SavedMean: saved_mean, SavedInvVar: saved_inv_var, NextMean: next_mean,
                NextVar: next_var}  # fmt: skip
        graph.execute(pack, workspace_for(graph), handle=handle)

    xf = x.float()
    ref_mean, ref_var = running_mean.flatten().clone(), running_var.flatten().clone()  # updated in place by torch
    want = torch.nn.functional.batch_norm(xf, ref_mean, ref_var, weight=gamma.flatten(), bias=beta.flatten(), training=True,
                                          momentum=momentum, eps=eps)  # fmt: skip
    batch_var = xf.var(dim=(0, 2, 3), unbiased=False)
    report.output("y", y, want, tolerance=1e-2)
    report.output("saved_mean", saved_mean.flatten(), xf.mean(dim=(0, 2, 3)), tolerance=1e-3)
    report.output("saved_inv_var", saved_inv_var.flatten(), torch.rsqrt(batch_var + eps), tolerance=1e-3)
    report.output("next_running_mean", next_mean.flatten(), ref_mean, tolerance=1e-3)
    report.output("next_running_var", next_var.flatten(), ref_var, tolerance=1e-3)


run("batchnorm_training_build", "build()", body)
