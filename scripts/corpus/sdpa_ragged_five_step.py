"""Attention over packed (ragged) sequences in half precision: q, k, v and o hold only the
valid tokens of each sequence back to back, addressed through ragged offsets, with a
padding mask from the sequence lengths; planned with the frontend's five steps."""

import cudnn
import torch
from _corpus import handle_on_current_stream, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    b, h, s, d = 3, 4, 128, 64
    scale = d**-0.5
    lengths = [128, 77, 30]  # tokens of each sequence (queries and keys alike)
    dims, strides = [b, h, s, d], [s * h * d, d, h * d, 1]  # BSHD: each token's heads side by side

    starts = [sum(lengths[:i]) for i in range(b + 1)]
    offsets = torch.tensor(starts, dtype=torch.int32, device="cuda").mul_(h * d).view(b + 1, 1, 1, 1)  # in elements
    seq_len = torch.tensor(lengths, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)

    def packed(scale_by=1.0):  # a buffer for b * s tokens, the valid ones packed at the front
        flat = torch.zeros(b * s * h * d, device="cuda", dtype=torch.half)
        flat[: starts[-1] * h * d] = (torch.randn(starts[-1] * h * d, device="cuda") * scale_by).half()
        return flat

    q_flat, k_flat, v_flat = packed(), packed(), packed()
    o_flat = torch.zeros(b * s * h * d, device="cuda", dtype=torch.half)
    view = lambda flat: flat.as_strided(dims, strides)  # noqa: E731

    with report.first_call("sdpa_ragged"):
        graph = cudnn.pygraph(
            handle=handle,
            io_data_type=cudnn.data_type.HALF,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        int32 = cudnn.data_type.INT32
        q_off = graph.tensor(name="q_offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        kv_off = graph.tensor(name="kv_offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        o_off = graph.tensor(name="o_offsets", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        seq_q = graph.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        seq_kv = graph.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
        Q = graph.tensor(name="q", dim=dims, stride=strides, ragged_offset=q_off)
        K = graph.tensor(name="k", dim=dims, stride=strides, ragged_offset=kv_off)
        V = graph.tensor(name="v", dim=dims, stride=strides, ragged_offset=kv_off)
        Out, _ = graph.sdpa(q=Q, k=K, v=V, attn_scale=scale, use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                          generate_stats=False, name="sdpa")  # fmt: skip
        Out.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(o_off)

        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

        pack = {Q: view(q_flat), K: view(k_flat), V: view(v_flat), Out: view(o_flat), q_off: offsets, kv_off: offsets,
                o_off: offsets, seq_q: seq_len, seq_kv: seq_len}  # fmt: skip
        graph.execute(pack, workspace_for(graph), handle=handle)

    got, want = [], []
    for i, n in enumerate(lengths):  # each sequence on its own: [n, h, d] tokens
        tokens = slice(starts[i] * h * d, starts[i + 1] * h * d)
        q_i, k_i, v_i = (flat[tokens].view(n, h, d).transpose(0, 1).float() for flat in (q_flat, k_flat, v_flat))
        want.append(torch.nn.functional.scaled_dot_product_attention(q_i, k_i, v_i, scale=scale).transpose(0, 1))
        got.append(o_flat[tokens].view(n, h, d))
    report.output("o_tokens", torch.cat(got), torch.cat(want), tolerance=1e-2)


run("sdpa_ragged_five_step", "five steps", body)
