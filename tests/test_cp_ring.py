"""meshplan's ring attention and its block kernel, in one process, float64, against dense one-device attention.

The ring's ranks run as threads joined by :class:`~meshplan.context_parallel.ring.QueueLinks` (the same schedule
code as the real :class:`~meshplan.context_parallel.ring.RingLinks`, the transport swapped): LocalTensorMode
simulates collectives, but its ``batch_isend_irecv`` fails in torch 2.13 (``AttributeError: 'LocalTensor' object
has no attribute '__src_rank__'``), so the real links are tested by the torchrun cases
(``tests/dist/cp_worker.py``). One fixed tolerance, ``RTOL`` (1e-9, ``tests/_float64.py``).
"""

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

from _float64 import RTOL
from meshplan.context_parallel.blocks import attend_block, block_grads, merge
from meshplan.context_parallel.chunks import rank_positions
from meshplan.context_parallel.masks import AttentionMask
from meshplan.context_parallel.ring import QueueLinks, Ring, ring_attend, ring_attention
from meshplan.errors import PlanError

pytestmark = pytest.mark.fast

MASKS = [AttentionMask(causal=True), AttentionMask(causal=False), AttentionMask(causal=True, window=5),
         AttentionMask(causal=True, softcap=2.0), AttentionMask(causal=False, window=3, softcap=1.0)]


def dense(q, k, v, mask, scale, documents=None):
    """Plain attention over the whole sequence: the one-device reference (GQA by repeat_interleave; documents
    ``(batch, seq)``: one keep-matrix per row)."""
    pos = torch.arange(q.shape[-2])
    keep = mask.keep(pos, pos, documents, documents)
    if documents is not None:
        keep = keep[:, None]
    g = q.shape[-3] // k.shape[-3]
    s = q @ k.repeat_interleave(g, -3).transpose(-1, -2) * scale
    if mask.softcap is not None:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, -3)


def inputs(heads=4, kv_heads=2, seq=32, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, seq, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(2, heads, seq, d, generator=g, dtype=torch.float64)


def close(got, want):
    return float((got - want).norm()) <= RTOL * max(float(want.norm()), 1e-300)


def run_ring(cp, load_balance, mask, q, k, v, dout, documents=None):
    """Every rank's (positions, out, dq, dk, dv), the ranks as threads over QueueLinks."""
    queues, res, errors = {}, {}, []

    def rank(r):
        try:
            idx = torch.tensor(rank_positions(q.shape[-2], cp, r, load_balance))
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
            ring = Ring(QueueLinks(queues, cp, r), load_balance, mask, q.shape[-1] ** -0.5, documents)
            out = ring_attend(ql, kl, vl, ring)
            out.backward(dout[:, :, idx])
            res[r] = (idx, out.detach(), ql.grad, kl.grad, vl.grad)
        except Exception as e:  # surfaced in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return res


@pytest.mark.parametrize("cp, load_balance", [(1, True), (2, True), (2, False), (4, True), (4, False)])
@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_ring_equals_one_device(cp, load_balance, mask):
    """Forward and q/k/v gradients, causal and full, GQA (4 query heads, 2 kv heads), windows, soft-caps."""
    q, k, v, dout = inputs()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = dense(qr, kr, vr, mask, q.shape[-1] ** -0.5)
    want.backward(dout)
    got = [torch.zeros_like(t) for t in (q, q, k, v)]
    for idx, *tensors in run_ring(cp, load_balance, mask, q, k, v, dout).values():
        for whole, part in zip(got, tensors):
            whole[:, :, idx] = part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want.detach(), qr.grad, kr.grad, vr.grad)):
        assert close(g, w), (name, float((g - w).abs().max()))


#: per batch row: three documents, one crossing chunk edges; one document; two, the first inside one chunk
DOCS = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 32, [0] * 3 + [1] * 29])


@pytest.mark.parametrize("cp, load_balance", [(2, True), (4, True), (4, False)])
@pytest.mark.parametrize("mask", MASKS[:3] + [AttentionMask(causal=True, window=6, softcap=1.5)], ids=repr)
def test_ring_with_documents_equals_one_device(cp, load_balance, mask):
    """Packed documents (one keep per batch row) under the ring, with windows and soft-caps: forward and q/k/v
    gradients equal one device's document-masked attention."""
    q, k, v, dout = (torch.cat([t, t[:1]]) for t in inputs())  # 3 rows, as DOCS
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = dense(qr, kr, vr, mask, q.shape[-1] ** -0.5, DOCS)
    want.backward(dout)
    got = [torch.zeros_like(t) for t in (q, q, k, v)]
    for idx, *tensors in run_ring(cp, load_balance, mask, q, k, v, dout, DOCS).values():
        for whole, part in zip(got, tensors):
            whole[:, :, idx] = part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want.detach(), qr.grad, kr.grad, vr.grad)):
        assert close(g, w), (name, float((g - w).abs().max()))


def test_ring_skips_blocks_documents_empty_and_drops_documents_inside_one():
    """A block whose chunks share no document in any row is skipped; one inside a single document in every row
    takes the mask-free path (no document ids: torch's fused kernel on CPU); the rest get their ids."""
    docs = torch.tensor([[0] * 4 + [1] * 4 + [2] * 8, [0] * 8 + [1] * 8])  # chunks of 4 at cp 2 head-tail
    ring = Ring(QueueLinks({}, 2, 0), True, AttentionMask(causal=True), 1.0, docs)
    assert ring.documents_of(range(12, 16), range(0, 4))[0] is False  # row 0: doc 2 vs 0; row 1: doc 1 vs 0
    assert ring.documents_of(range(12, 16), range(8, 12)) == (True, None, None)  # doc 2 and doc 1 throughout
    kept, q_doc, _ = ring.documents_of(range(4, 8), range(0, 4))  # row 1 shares doc 0, row 0 does not
    assert kept and q_doc.tolist() == [[1] * 4, [0] * 4]
    assert [(qr.start, kr.start) for _, qr, _, kr in ring.pairs(0, 4)] == [(0, 0), (12, 12)]  # (12, 0) skipped


def test_attend_block_and_merge_equal_sdpa():
    """Two key blocks merged by lse give SDPA over both; the covered block builds no mask, the far one is skipped."""
    q, k, v, _ = inputs(kv_heads=4)
    kw = {"scale": q.shape[-1] ** -0.5, "mask": AttentionMask(causal=True)}
    a = attend_block(q[:, :, 16:], k[:, :, :16], v[:, :, :16], q_pos=range(16, 32), k_pos=range(0, 16), **kw)
    b = attend_block(q[:, :, 16:], k[:, :, 16:], v[:, :, 16:], q_pos=range(16, 32), k_pos=range(16, 32), **kw)
    out, lse = merge(*a, *b)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, 16:]
    assert close(out, want)
    scores = (q[:, :, 16:] @ k.transpose(-1, -2)) * kw["scale"]
    assert close(lse, scores.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril()[16:], float("-inf"))
                 .logsumexp(-1))


def test_fully_masked_rows_give_minus_inf_and_no_nan():
    """A query block before every key of the block: lse = -inf, out = 0, and merging it changes nothing."""
    q, k, v, dout = inputs(kv_heads=4)
    q.requires_grad_()
    kw = {"scale": 0.3, "mask": AttentionMask(causal=True)}
    out, lse = attend_block(q[:, :, :8], k[:, :, 8:16], v[:, :, 8:16], q_pos=range(0, 8), k_pos=range(8, 16), **kw)
    assert bool(torch.isneginf(lse).all()) and not bool(out.any())
    # a window of 1 keeps only the diagonal: rows partly masked in one block, fully in the other
    win = {"scale": 0.3, "mask": AttentionMask(causal=True, window=1)}
    a = attend_block(q[:, :, 8:16], k[:, :, :8], v[:, :, :8], q_pos=range(8, 16), k_pos=range(0, 8), **win)
    b = attend_block(q[:, :, 8:16], k[:, :, 8:16], v[:, :, 8:16], q_pos=range(8, 16), k_pos=range(8, 16), **win)
    merged, mlse = merge(*a, *b)
    assert torch.equal(merged, b[0]) and torch.equal(mlse, b[1])
    (merged * dout[:, :, 8:16]).sum().backward()
    assert not bool(q.grad.isnan().any())
    none = merge(out, lse, out, lse)
    assert bool(torch.isneginf(none[1]).all()) and not bool(none[0].isnan().any())


def test_block_grads_equal_autograd_with_documents_and_tiles(monkeypatch):
    """The ring's recomputed block backward equals autograd through attend_block (documents, soft-cap, GQA,
    query tiles of 3 rows: every tile asks the mask again)."""
    import meshplan.context_parallel.blocks as blocks
    monkeypatch.setattr(blocks, "TILE_SCORES", 2 * 4 * 3 * 16)
    q, k, v, dout = inputs(seq=16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    doc = torch.tensor([0] * 5 + [1] * 11)
    kw = {"scale": 0.4, "mask": AttentionMask(causal=True, window=6, softcap=1.5), "q_pos": torch.arange(16),
          "k_pos": range(16), "q_doc": doc, "k_doc": doc}
    out, lse = attend_block(q, k, v, **kw)
    out.backward(dout)
    delta = (dout * out.detach()).sum(-1)
    dq, dk, dv = block_grads(q.detach(), k.detach(), v.detach(), dout, lse.detach(), delta, **kw)
    assert close(dq, q.grad) and close(dk, k.grad) and close(dv, v.grad)


def test_ring_refuses_dropout_and_foreign_masks():
    q, k, v, _ = inputs()
    links = QueueLinks({}, 1, 0)
    common = {"group": None, "cp": 1, "rank": 0, "load_balance": True, "where": "layers.0.attn", "links": links}
    with pytest.raises(PlanError, match=r"layers\.0\.attn asks scaled_dot_product_attention for dropout_p=0\.1"):
        ring_attention(q, k, v, dropout_p=0.1, **common)
    with pytest.raises(PlanError, match=r"layers\.0\.attn passes scaled_dot_product_attention a mask"):
        ring_attention(q, k, v, attn_mask=torch.randn(32, 32, dtype=torch.float64), **common)
    out = ring_attention(q, k, v, is_causal=True, enable_gqa=True, **common)
    assert close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("offset", [0, 8, 24])
def test_allgather_prefix_diagonal_equals_sdpa(offset):
    """The all-gather method's CPU chunk (a mask-free prefix merged with a causal diagonal, no mask tensor): out
    and gradients equal SDPA with the chunk's causal mask; GQA."""
    from meshplan.context_parallel.attention import _PrefixDiagonal
    q, k, v, dout = inputs(seq=32)
    c = 8
    keys = offset + c
    qc = q[:, :, offset:keys].clone().requires_grad_()
    kk, vv = k[:, :, :keys].clone().requires_grad_(), v[:, :, :keys].clone().requires_grad_()
    out = _PrefixDiagonal.apply(qc, kk, vv, offset, 0.35)
    out.backward(dout[:, :, :c])
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (qc, kk, vv))
    keep = torch.ones(c, keys, dtype=torch.bool).tril(offset)
    want = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=keep, scale=0.35, enable_gqa=True)
    want.backward(dout[:, :, :c])
    for g, w in ((out, want), (qc.grad, q2.grad), (kk.grad, k2.grad), (vv.grad, v2.grad)):
        assert close(g.detach(), w.detach())


def test_ring_explicit_math_equals_one_device(monkeypatch):
    """The explicit block math alone (torch's CPU flash kernel not used for any block): ring == one device."""
    import meshplan.context_parallel.blocks as blocks
    monkeypatch.setattr(blocks, "fused_causal", lambda *a, **kw: None)
    test_ring_equals_one_device(2, True, AttentionMask(causal=True))
    test_ring_equals_one_device(4, False, AttentionMask(causal=False))


def test_ring_saves_only_the_local_shards():
    """What autograd saves for the ring is this rank's q, k, v, out and lse: O(S/cp), measured with
    saved_tensors_hooks (nothing of the other ranks' K/V)."""
    q, k, v, _ = inputs(seq=64)
    saved = []
    links = QueueLinks({}, 1, 0)
    ql, kl, vl = (t[:, :, :32].clone().requires_grad_() for t in (q, k, v))  # a rank's shard
    ring = Ring(links, True, AttentionMask(causal=True), 0.3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        ring_attend(ql, kl, vl, ring)
    lse = 2 * 4 * 32 * 8  # float64 per (batch, head, row)
    assert sum(saved) == 2 * ql.numel() * 8 + kl.numel() * 8 + vl.numel() * 8 + lse


def test_estimate_names_the_cheaper_cp_method():
    """``meshplan estimate``'s cp line: each method's step time and memory at the plan's length; the ring keeps
    less (1/cp of K/V instead of all of it), all-gather moves fewer bytes (2(cp-1)/cp vs (3cp-2)/cp of K/V)."""
    from meshplan.context_parallel.costs import cp_method_line
    from meshplan.plan_file.document import load_plan
    from meshplan.solver.api import as_cluster, as_shape
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.step import evaluate
    cand, train = candidate_from_plan(load_plan("plans/llama_cp.yaml"), 8, 8192, 8)
    line = cp_method_line(evaluate, as_shape("llama3-8b"), cand, train, as_cluster("h100-80g"))
    assert line.startswith("context_parallel.method at seq 8192, cp 2: allgather_kv ")
    assert "; ring " in line and "torch_ring" in line and "least memory: ring" in line, line
    assert cp_method_line(evaluate, as_shape("llama3-8b"), dataclasses.replace(cand, cp=1), train,
                          as_cluster("h100-80g")) is None


@pytest.mark.parametrize("mask", [AttentionMask(causal=True), AttentionMask(causal=True, softcap=2.0)], ids=repr)
def test_ring_in_bfloat16_follows_float64(mask):
    """Half precision: blocks computed and merged in float32 (the CPU flash kernel's lse is float32; its backward
    takes it so): out and gradients within bf16's rounding (2e-2, fixed) of the float64 ring."""
    q, k, v, dout = inputs(seq=64)
    exact = run_ring(2, True, mask, q, k, v, dout)
    half = run_ring(2, True, mask, *(t.bfloat16() for t in (q, k, v, dout)))
    for r in exact:
        for a, b in zip(half[r][1:], exact[r][1:]):
            assert a.dtype == torch.bfloat16
            assert float((a.double() - b).norm() / b.norm()) <= 2e-2


@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_skips_the_blocks_no_query_reaches(monkeypatch, load_balance):
    """Causal, cp 4: a rank computes only the (query chunk, key chunk) pairs with the key chunk not after the query
    chunk; head-tail: 2·cp + 1 pairs on every rank (equal work), contiguous: rank r computes r + 1."""
    import meshplan.context_parallel.ring as ring_mod
    calls = {}
    real = ring_mod.attend_block

    def counting(q, k, v, *, q_pos, k_pos, **kw):
        key = threading.current_thread().name
        calls[key] = calls.get(key, 0) + 1
        assert k_pos.start <= q_pos.start  # never a block wholly after the queries
        return real(q, k, v, q_pos=q_pos, k_pos=k_pos, **kw)
    monkeypatch.setattr(ring_mod, "attend_block", counting)
    q, k, v, dout = inputs()
    cp = 4
    queues, counts = {}, []

    def rank(r):
        idx = torch.tensor(rank_positions(32, cp, r, load_balance))
        with torch.no_grad():
            ring_attend(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                        Ring(QueueLinks(queues, cp, r), load_balance, AttentionMask(causal=True), 0.3))
    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [calls.get(f"rank{r}", 0) for r in range(cp)]
    assert counts == ([2 * cp + 1] * cp if load_balance else [r + 1 for r in range(cp)]), counts


def test_check_line_states_each_methods_costs():
    from meshplan.context_parallel.check import context_lines
    ctx = {"cp": 4, "load_balance": True, "attention": ["layers.*.attn"], "attention_modules": 2, "positions": "none"}
    ring = context_lines({**ctx, "method": "ring"})[0]
    assert "ring (per attention module and step: 3 K/V hops forward, 3 K/V and 4 dK/dV hops backward, each 1/4 " \
           "of the sequence's K/V, overlapped with attention; saves 1/4 of K/V)" in ring, ring
    assert "saves the whole sequence's K/V" in context_lines({**ctx, "method": "allgather_kv"})[0]


def test_method_pairs_count_the_blocks_each_method_computes():
    """Causal: both methods compute the same blocks (a prefix and the diagonal triangle). A window: the ring
    computes the blocks it reaches (the diagonal a triangle when the window covers the chunk), all-gather the
    whole reached span of each chunk; the kept pairs are the mask's, counted by brute force."""
    from meshplan.context_parallel.chunks import method_pairs
    assert method_pairs(64, 2, True, "ring") == method_pairs(64, 2, True, "allgather_kv") == (1040, 1040)
    for cp, window in ((2, 20), (4, 9), (4, 12)):  # windows at least the chunk: a triangle
        ring, gather = (method_pairs(64, cp, True, m, window) for m in ("ring", "allgather_kv"))
        mask, c = AttentionMask(causal=True, window=window), 64 // (2 * cp)
        kept = max(sum(mask.pairs(j * c, (j + 1) * c, 0, 64) for j in (r, 2 * cp - 1 - r)) for r in range(cp))
        assert ring[1] == gather[1] <= kept and ring[0] < gather[0], (cp, window, ring, gather, kept)


def test_estimate_counts_sliding_windows():
    """transformers' sliding windows reach the cost model (Mistral: every layer; Gemma 3: its layer_types'
    sliding layers; Qwen2 with use_sliding_window off: none), shrink the estimate's attention work under cp, and
    the estimate line names each method's pairs on the busiest rank."""
    import dataclasses as dc
    from meshplan.context_parallel.costs import cp_attention_share, cp_method_line
    from meshplan.plan_file.document import load_plan
    from meshplan.solver.api import as_cluster
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.shape import shape_from_config
    from meshplan.solver.step import evaluate
    base = {"hidden_size": 4096, "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}  # transformers' spellings
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    shapes = {"MistralConfig": shape_from_config(base),
              "Gemma3TextConfig": shape_from_config({**base, "layer_types": (gemma * 5)[:22] + ["full_attention"] * 4}),
              "Qwen2Config": shape_from_config({**base, "use_sliding_window": False})}
    assert [(s.window, s.window_layers) for s in shapes.values()] == [(4096, 0), (4096, 19), (0, 0)]
    cand, train = candidate_from_plan(load_plan("plans/llama_cp.yaml"), 8, 32768, 8)
    cand = dc.replace(cand, cp=8)
    mistral = shapes["MistralConfig"]
    ring, gather = (cp_attention_share(mistral, cand, dc.replace(train, cp_method=m)) for m in ("ring", "allgather_kv"))
    assert ring < gather < 1.0, (ring, gather)
    plain = dc.replace(mistral, window=0)
    assert evaluate(mistral, cand, train, as_cluster("h100-80g")).step_time < \
        evaluate(plain, cand, train, as_cluster("h100-80g")).step_time
    line = cp_method_line(evaluate, shapes["Gemma3TextConfig"], cand, train, as_cluster("h100-80g"))
    assert "sliding window 4096 (19 of 26 layers): attention pairs per row and head on the busiest rank" in line, line
