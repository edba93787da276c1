"""Causal prefill attention reading K and V from paged caches (fixed-size blocks in one
container, found through block tables), with per-sequence query lengths, in half
precision; written in a ``with cudnn.graph(handle) as (g, _):`` block, then ``g.build()``."""

import cudnn
import torch
from _corpus import handle_on_current_stream, row_major, run, workspace_for


def body(report):
    handle = handle_on_current_stream()
    b, h, s, d, block = 2, 4, 128, 64, 16
    scale = d**-0.5
    blocks_per_seq = s // block
    num_blocks = b * blocks_per_seq
    q_lengths, kv_lengths = [128, 50], [128, 128]

    q = torch.randn(b, h, s, d, device="cuda").half()
    k, v = torch.randn(b, h, s, d, device="cuda").half(), torch.randn(b, h, s, d, device="cuda").half()
    # The caches: logical block j of sequence i lives in physical block table[i, 0, j, 0].
    generator = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks, generator=generator).view(b, blocks_per_seq).tolist()
    table = torch.tensor(slots, dtype=torch.int32, device="cuda").view(b, 1, blocks_per_seq, 1)
    k_cache = torch.zeros(num_blocks, h, block, d, device="cuda", dtype=torch.half)
    v_cache = torch.zeros_like(k_cache)
    for i in range(b):
        for j in range(blocks_per_seq):
            k_cache[slots[i][j]] = k[i, :, j * block : (j + 1) * block]
            v_cache[slots[i][j]] = v[i, :, j * block : (j + 1) * block]
    seq_q = torch.tensor(q_lengths, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)
    seq_kv = torch.tensor(kv_lengths, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)
    o = torch.zeros(b, h, s, d, device="cuda", dtype=torch.half)

    with report.first_call("sdpa_paged"):
        with cudnn.graph(handle, io_data_type=cudnn.data_type.HALF) as (g, _):
            Q = g.tensor_like(q)
            K_cache, V_cache = g.tensor_like(k_cache), g.tensor_like(v_cache)
            K_table, V_table = g.tensor_like(table), g.tensor_like(table)
            Seq_q, Seq_kv = g.tensor_like(seq_q), g.tensor_like(seq_kv)
            Out, _ = g.sdpa(q=Q, k=K_cache, v=V_cache, attn_scale=scale, use_causal_mask=True, use_padding_mask=True,
                          seq_len_q=Seq_q, seq_len_kv=Seq_kv, paged_attention_k_table=K_table,
                          paged_attention_v_table=V_table, paged_attention_max_seq_len_kv=s, generate_stats=False,
                          name="sdpa_paged")  # fmt: skip
            Out.set_output(True).set_dim([b, h, s, d]).set_stride(row_major([b, h, s, d]))
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        pack = {Q: q, K_cache: k_cache, V_cache: v_cache, K_table: table, V_table: table, Seq_q: seq_q, Seq_kv: seq_kv, Out: o}
        g.execute(pack, workspace_for(g), handle=handle)

    got, want = [], []
    for i, n in enumerate(q_lengths):  # the valid query rows of each sequence
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i : i + 1, :, :n].float(), k[i : i + 1, :, : kv_lengths[i]].float(), v[i : i + 1, :, : kv_lengths[i]].float(),
            is_causal=True, scale=scale,
        )  # fmt: skip
        want.append(ref.flatten())
        got.append(o[i : i + 1, :, :n].flatten())
    report.output("o_valid_rows", torch.cat(got), torch.cat(want), tolerance=1e-2)


run("sdpa_paged_with_graph", "with cudnn.graph() + build()", body)
