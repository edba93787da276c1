"""Layer normalization (training: the output, the mean and the inverse variance) in
bfloat16, in a builder decorated with ``@cudnn.jit`` that returns ``(graph, tensors)``."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    rows, hidden = 1024, 768
    bf16 = {"io_data_type": cudnn.data_type.BFLOAT16, "intermediate_data_type": cudnn.data_type.FLOAT,
            "compute_data_type": cudnn.data_type.FLOAT}  # fmt: skip

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    def layernorm(rows, hidden):
        x_dims, p_dims, s_dims = [rows, hidden, 1, 1], [1, hidden, 1, 1], [rows, 1, 1, 1]
        with cudnn.graph(handle, **bf16) as (g, _):
            X = g.tensor(name="X", dim=x_dims, stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.BFLOAT16)
            scale = g.tensor(name="scale", dim=p_dims, stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.FLOAT)
            bias = g.tensor(name="bias", dim=p_dims, stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.FLOAT)
            eps = g.tensor(
                name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, is_pass_by_value=True
            )
            Y, mean, inv_var = g.layernorm(norm_forward_phase=cudnn.norm_forward_phase.TRAINING, input=X, scale=scale, bias=bias,
                                           epsilon=eps)  # fmt: skip
            Y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16).set_dim(x_dims).set_stride([hidden, 1, hidden, hidden])
            mean.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(s_dims).set_stride([1, 1, 1, 1])
            inv_var.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(s_dims).set_stride([1, 1, 1, 1])
            return g, [X, scale, bias, eps, Y, mean, inv_var]

    x = torch.randn(rows, hidden, 1, 1, device="cuda").to(torch.bfloat16)
    gamma = torch.randn(1, hidden, 1, 1, device="cuda") * 0.5 + 1.0
    beta = torch.randn(1, hidden, 1, 1, device="cuda") * 0.1
    eps = torch.full((1, 1, 1, 1), 1e-5, dtype=torch.float32)  # passed by value: a host scalar
    y = torch.empty_like(x)
    mean = torch.empty(rows, 1, 1, 1, device="cuda", dtype=torch.float32)
    inv_var = torch.empty(rows, 1, 1, 1, device="cuda", dtype=torch.float32)

    with report.first_call("layernorm"):
        graph, uids = layernorm(rows, hidden)
        graph.execute(dict(zip(uids, [x, gamma, beta, eps, y, mean, inv_var])), workspace_for(graph), handle=handle)

    xf = x.float().view(rows, hidden)
    want = torch.nn.functional.layer_norm(xf, (hidden,), gamma.view(hidden), beta.view(hidden), 1e-5)
    report.output("y", y.view(rows, hidden), want, tolerance=2e-2)
    report.output("mean", mean.view(rows), xf.mean(dim=1), tolerance=1e-3)
    report.output("inv_var", inv_var.view(rows), torch.rsqrt(xf.var(dim=1, unbiased=False) + 1e-5), tolerance=1e-3)


run("layernorm_jit", "@cudnn.jit", body)
