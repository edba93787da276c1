"""RMS normalization (training: the output and the inverse RMS) in half precision, never
built explicitly: ``execute()`` builds the graph on its first call, as the frontend allows."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run

WORKSPACE_BYTES = 64 << 20  # the plan is not built yet, so its size cannot be asked; ample for a norm


def body(report):
    handle = handle_on_current_stream()
    rows, hidden = 2048, 1024
    x = torch.randn(rows, hidden, 1, 1, device="cuda").half()
    gamma = (torch.randn(1, hidden, 1, 1, device="cuda") * 0.5 + 1.0).float()
    eps = torch.full((1, 1, 1, 1), 1e-6, dtype=torch.float32)  # passed by value: a host scalar
    y = torch.empty_like(x)
    inv_rms = torch.empty(rows, 1, 1, 1, device="cuda", dtype=torch.float32)
    workspace = torch.empty(WORKSPACE_BYTES, device="cuda", dtype=torch.uint8)

    with report.first_call("rmsnorm"):
        graph = cudnn.pygraph(
            handle=handle,
            io_data_type=cudnn.data_type.HALF,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        X = graph.tensor(name="X", dim=[rows, hidden, 1, 1], stride=[hidden, 1, hidden, hidden])
        scale = graph.tensor(
            name="scale", dim=[1, hidden, 1, 1], stride=[hidden, 1, hidden, hidden], data_type=cudnn.data_type.FLOAT
        )
        epsilon = graph.tensor(
            name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, is_pass_by_value=True
        )
        Y, inv_var = graph.rmsnorm(norm_forward_phase=cudnn.norm_forward_phase.TRAINING, input=X, scale=scale, epsilon=epsilon)
        Y.set_output(True).set_dim([rows, hidden, 1, 1]).set_stride([hidden, 1, hidden, hidden])
        inv_var.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([rows, 1, 1, 1]).set_stride([1, 1, 1, 1])
        graph.execute({X: x, scale: gamma, epsilon: eps, Y: y, inv_var: inv_rms}, workspace, handle=handle)

    if graph.get_workspace_size() > WORKSPACE_BYTES:
        report.notes.append(f"the plan wants {graph.get_workspace_size()} workspace bytes")
    xf = x.float().view(rows, hidden)
    rms = torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + 1e-6)
    report.output("y", y.view(rows, hidden), xf * rms * gamma.view(1, hidden), tolerance=1e-2)
    report.output("inv_rms", inv_rms.view(rows), rms.view(rows), tolerance=1e-3)


run("rmsnorm_execute_builds", "execute() builds", body)
