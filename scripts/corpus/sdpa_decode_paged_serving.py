"""Decode attention over a paged KV cache, built the way serving libraries build it: a
graph builder decorated with ``@cudnn.jit`` on top of ``@cudnn.graph_cache`` (keyed by
every layout the graph bakes in), fixed tensor uids, one cuDNN handle per thread and
device pointed at the current stream, and the ordered ``execute(buffers, workspace,
handle=..., tensor_uids=...)`` of a hot loop. Two batch sizes, on two threads; each step
runs twice (the second is served by the graph cache)."""

import threading

import cudnn
import torch
from _corpus import run

BLOCK, HEADS, HEAD_DIM, MAX_SEQ_KV = 16, 8, 128, 256
WORKSPACE_BYTES = 32 << 20  # a serving engine hands cuDNN one preallocated buffer
# The uids a serving library gives its operands, once, for every graph it builds.
Q_UID, K_UID, V_UID, K_TABLE_UID, V_TABLE_UID, SEQ_Q_UID, SEQ_KV_UID, O_UID = 1, 2, 3, 201, 202, 100, 101, 1000
ORDER = (Q_UID, K_UID, V_UID, K_TABLE_UID, V_TABLE_UID, SEQ_Q_UID, SEQ_KV_UID, O_UID)

_handles = threading.local()


def handle_for(device):
    """This thread's cuDNN handle of ``device`` (the thread's current one, where its
    tensors live), pointed at the current stream."""
    by_device = getattr(_handles, "by_device", None)
    if by_device is None:
        by_device = _handles.by_device = {}
    if device not in by_device:
        by_device[device] = cudnn.create_handle()
    cudnn.set_stream(handle=by_device[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return by_device[device]


def layout(t):
    return tuple(t.shape), tuple(t.stride()), t.dtype


def decode_key(q, k_cache, v_cache, table, seq_q, seq_kv, scale):
    return ("decode", q.device, scale, *(layout(t) for t in (q, k_cache, v_cache, table, seq_q, seq_kv)))


@cudnn.jit(heur_modes=[cudnn.heur_mode.A])
@cudnn.graph_cache(key_fn=decode_key)
def decode_graph(q, k_cache, v_cache, table, seq_q, seq_kv, scale):
    b = q.shape[0]
    with cudnn.graph(handle_for(q.device), io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                     compute_data_type=cudnn.data_type.FLOAT) as (g, _):  # fmt: skip
        Q, K, V = g.tensor_like(q), g.tensor_like(k_cache), g.tensor_like(v_cache)
        KTable, VTable = g.tensor_like(table), g.tensor_like(table)
        SeqQ, SeqKV = g.tensor_like(seq_q), g.tensor_like(seq_kv)
        for t, uid in zip((Q, K, V, KTable, VTable, SeqQ, SeqKV), ORDER):
            t.set_uid(uid)
        Out, _ = g.sdpa(name="decode", q=Q, k=K, v=V, attn_scale=scale, use_padding_mask=True, seq_len_q=SeqQ, seq_len_kv=SeqKV,
                      paged_attention_k_table=KTable, paged_attention_v_table=VTable,
                      paged_attention_max_seq_len_kv=MAX_SEQ_KV, generate_stats=False)  # fmt: skip
        Out.set_uid(O_UID).set_output(True).set_dim([b, HEADS, 1, HEAD_DIM]).set_stride([HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, 1])
        return g, [Q, K, V, KTable, VTable, SeqQ, SeqKV, Out]


class PagedCache:
    """K and V of every request in fixed-size blocks, found through a block table."""

    def __init__(self, kv_lengths, generator):
        b, pages = len(kv_lengths), MAX_SEQ_KV // BLOCK
        self.k = torch.randn(b, HEADS, MAX_SEQ_KV, HEAD_DIM, device="cuda").half()
        self.v = torch.randn(b, HEADS, MAX_SEQ_KV, HEAD_DIM, device="cuda").half()
        slots = torch.randperm(b * pages, generator=generator).view(b, pages)
        self.table = slots.to(torch.int32).to("cuda").view(b, 1, pages, 1)
        self.k_cache = torch.zeros(b * pages, HEADS, BLOCK, HEAD_DIM, device="cuda", dtype=torch.half)
        self.v_cache = torch.zeros_like(self.k_cache)
        for i in range(b):
            for j in range(pages):
                self.k_cache[slots[i, j]] = self.k[i, :, j * BLOCK : (j + 1) * BLOCK]
                self.v_cache[slots[i, j]] = self.v[i, :, j * BLOCK : (j + 1) * BLOCK]
        self.kv_lengths = kv_lengths
        self.seq_q = torch.ones(b, 1, 1, 1, dtype=torch.int32, device="cuda")
        self.seq_kv = torch.tensor(kv_lengths, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)


def decode_step(q, cache, out, workspace, scale):
    graph, _ = decode_graph(q, cache.k_cache, cache.v_cache, cache.table, cache.seq_q, cache.seq_kv, scale)
    buffers = (q, cache.k_cache, cache.v_cache, cache.table, cache.table, cache.seq_q, cache.seq_kv, out)
    graph.execute(buffers, workspace, handle=handle_for(q.device), tensor_uids=ORDER)


def reference(q, cache, scale):
    rows = []
    for i, n in enumerate(cache.kv_lengths):
        k, v = cache.k[i : i + 1, :, :n].float(), cache.v[i : i + 1, :, :n].float()
        rows.append(torch.nn.functional.scaled_dot_product_attention(q[i : i + 1].float(), k, v, scale=scale))
    return torch.cat(rows)


def body(report):
    scale = HEAD_DIM**-0.5
    generator = torch.Generator().manual_seed(11)
    batches = {"decode_b4": [256, 17, 100, 64], "decode_b8": [5, 256, 128, 31, 200, 77, 16, 250]}
    requests = {}  # what the engine hands each serving thread: the caches, the queries, the buffers
    for name, kv_lengths in batches.items():
        q = torch.randn(len(kv_lengths), HEADS, 1, HEAD_DIM, device="cuda").half()
        workspace = torch.empty(WORKSPACE_BYTES, device="cuda", dtype=torch.uint8)
        requests[name] = (q, PagedCache(kv_lengths, generator), torch.empty_like(q), workspace)
    errors = []

    def serve(name):  # one serving thread: its own handle
        try:
            q, cache, out, workspace = requests[name]
            with report.first_call(name):
                decode_step(q, cache, out, workspace, scale)
            decode_step(q, cache, out, workspace, scale)  # the next step: the graph cache's graph
            torch.cuda.synchronize()
        except BaseException as exc:  # re-raised on the main thread: the program's outcome
            errors.append(exc)

    serve("decode_b4")  # the main thread
    worker = threading.Thread(target=serve, args=("decode_b8",))
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    for name, (q, cache, out, _) in requests.items():
        report.output(f"o_{name}", out, reference(q, cache, scale), tolerance=1e-2)


run("sdpa_decode_paged_serving", "@cudnn.jit + @cudnn.graph_cache, tensor_uids", body)
