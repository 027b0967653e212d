"""Tests for the plain mixture-of-experts example model (examples/moe.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

import llama
from moe import GroupedExperts, ModelArgs, MoE, build, load_balance_loss, tiny_args  # examples/ is on sys.path

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one intra-op thread is as fast, and far faster on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokens(b=2, s=16, vocab=128, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def seeded_build(args, seed=0):
    torch.manual_seed(seed)
    return build(args)


def seeded_moe(args, seed=0, gate_std=0.5):
    """A standalone MoE layer with a router sharp enough that top-k choices are clear (no near-ties)."""
    torch.manual_seed(seed)
    moe = MoE(args)
    moe.init_weights(0.1, 0.1)
    with torch.no_grad():
        moe.router.gate.weight.normal_(std=gate_std)
    return moe


def hidden(t=24, dim=64, seed=1):
    return torch.randn(t, dim, generator=torch.Generator().manual_seed(seed))


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def reference_moe(moe, x, capacity=None):
    """Per-token loop: every kept token copy through its expert's SwiGLU, gate-weighted and summed.

    Returns the output and the per-expert count of kept copies; copies past ``capacity`` for their
    expert (in token order) are skipped."""
    args_k = moe.top_k
    logits = x @ moe.router.gate.weight.t()
    scores = logits.softmax(-1) if moe.router.score_func == "softmax" else logits.sigmoid()
    top, idx = scores.topk(args_k, dim=-1)
    if moe.router.norm_topk:
        top = top / top.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(x)
    seen = [0] * moe.n_experts
    for t in range(x.shape[0]):
        for j in range(args_k):
            e = int(idx[t, j])
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                continue
            out[t] += top[t, j] * swiglu(x[t], ex.w1[e], ex.w2[e], ex.w3[e])
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(x)
    kept = [min(s, capacity) if capacity is not None else s for s in seen]
    return out, torch.tensor(kept)


# (a) grouped experts against a per-token loop -------------------------------------------------------------

@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_matches_per_token_loop(gate, norm_topk, shared, top_k):
    moe = seeded_moe(tiny_args(gate=gate, norm_topk=norm_topk, shared_expert=shared, top_k=top_k))
    x = hidden()
    with torch.no_grad():
        got = moe(x)
        want, kept = reference_moe(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert moe.tokens_per_expert.tolist() == kept.tolist()
    assert moe.kept_per_expert.tolist() == kept.tolist()
    assert int(moe.tokens_per_expert.sum()) == x.shape[0] * top_k
    assert (moe.shared_expert is not None) == shared


def test_moe_keeps_leading_shape():
    moe = seeded_moe(tiny_args())
    x = hidden(t=24)
    torch.testing.assert_close(moe(x.view(2, 12, 64)), moe(x).view(2, 12, 64), rtol=0, atol=0)


def test_one_expert_top1_is_a_dense_feed_forward():
    moe = seeded_moe(tiny_args(n_experts=1, top_k=1))
    ffn = llama.FeedForward(64, 96)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ffn, name).weight.copy_(getattr(moe.experts, name)[0])
    x = hidden()
    torch.testing.assert_close(moe(x), ffn(x), rtol=1e-6, atol=1e-6)


def test_dispatch_sorts_copies_by_expert_stably():
    moe = seeded_moe(tiny_args())
    x = hidden()
    _, idx, _ = moe.router(x)
    x_sorted, routing = moe.dispatch(x, idx)
    experts_of_rows = idx.reshape(-1)[routing.copy_idx]
    assert torch.equal(experts_of_rows, torch.repeat_interleave(torch.arange(4), routing.counts))
    for e in range(4):  # token order within each expert
        toks = routing.token_idx[experts_of_rows == e]
        assert torch.all(toks[1:] > toks[:-1])
    assert torch.equal(x_sorted, x[routing.token_idx])
    assert routing.counts.dtype == torch.int64 and routing.num_tokens == x.shape[0]


# (b) capacity --------------------------------------------------------------------------------------------

def test_capacity_drops_tokens_past_the_limit():
    moe = seeded_moe(tiny_args(capacity_factor=0.5, shared_expert=False))
    with torch.no_grad():  # push most tokens to expert 0 so it overflows
        moe.router.gate.weight[0] += 1.0
    x = hidden(t=32) + 0.5
    cap = math.ceil(0.5 * 32 * 2 / 4)
    assert moe.capacity(32) == cap == 8
    with torch.no_grad():
        got = moe(x)
        want, kept = reference_moe(moe, x, capacity=cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert moe.kept_per_expert.tolist() == kept.tolist()
    assert (moe.kept_per_expert <= cap).all()
    assert int(moe.tokens_per_expert[0]) > cap  # something was dropped
    assert int(moe.kept_per_expert.sum()) < 32 * 2
    # a token whose every copy was dropped contributes nothing
    _, idx, _ = moe.router(x)
    _, routing = moe.dispatch(x, idx)
    dropped_all = sorted(set(range(32)) - set(routing.token_idx.tolist()))
    assert dropped_all, "expected some fully dropped tokens"
    assert torch.equal(got[dropped_all], torch.zeros(len(dropped_all), 64))


def test_no_capacity_drops_nothing():
    moe = seeded_moe(tiny_args(capacity_factor=None))
    with torch.no_grad():
        moe.router.gate.weight[0] += 1.0
    x = hidden(t=32) + 0.5
    assert moe.capacity(32) is None
    moe(x)
    assert torch.equal(moe.kept_per_expert, moe.tokens_per_expert)
    assert int(moe.kept_per_expert.sum()) == 64


def test_large_capacity_factor_matches_no_capacity():
    x = hidden()
    a = seeded_moe(tiny_args(capacity_factor=None))
    b = seeded_moe(tiny_args(capacity_factor=4.0))  # capacity = T·k ≥ any count
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


# (c) aux loss --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_aux_loss_by_hand_and_gradient(gate):
    moe = seeded_moe(tiny_args(gate=gate))
    x = hidden()
    moe(x)
    logits = x @ moe.router.gate.weight.t()
    probs = logits.softmax(-1) if gate == "softmax" else logits.sigmoid()
    probs = probs / probs.sum(-1, keepdim=True)
    idx = probs.topk(2, dim=-1).indices
    f = torch.stack([(idx == e).sum() for e in range(4)]).float() / idx.numel()
    want = 4 * (f * probs.mean(0)).sum()
    assert moe.aux_loss.dim() == 0
    torch.testing.assert_close(moe.aux_loss, want, rtol=1e-6, atol=1e-7)
    moe.aux_loss.backward()
    g = moe.router.gate.weight.grad
    assert g is not None and g.abs().sum() > 0
    assert moe.experts.w1.grad is None  # the aux loss reaches the router only


def test_uniform_routing_gives_aux_one():
    probs = torch.full((8, 4), 0.25)
    idx = torch.arange(16).remainder(4).view(8, 2)
    torch.testing.assert_close(load_balance_loss(probs, idx), torch.tensor(1.0))
    # fully collapsed routing with confident probs: E · 1 · 1
    probs = torch.zeros(8, 4)
    probs[:, 0] = 1.0
    assert float(load_balance_loss(probs, torch.zeros(8, 1, dtype=torch.long))) == pytest.approx(4.0)
    # a model whose routers give uniform probabilities: coef · 1 per MoE layer
    model = seeded_build(tiny_args(aux_loss_coef=0.01, n_layers=3, n_dense_layers=1))
    with torch.no_grad():
        for m in model.moe_layers():
            m.router.gate.weight.zero_()
    assert model.aux_loss().item() == 0.0  # before any forward
    model(tokens())
    assert model.aux_loss().item() == pytest.approx(0.01 * 2, rel=1e-6)


def test_transformer_aux_loss_sums_layers():
    model = seeded_build(tiny_args(aux_loss_coef=0.1))
    model(tokens())
    want = 0.1 * sum(m.aux_loss for m in model.moe_layers())
    torch.testing.assert_close(model.aux_loss(), want)
    assert all(0.5 < m.aux_loss.item() < 4.0 for m in model.moe_layers())


# (d) determinism and meta-device init --------------------------------------------------------------------

def test_seeded_build_is_deterministic_and_meta_friendly():
    args = tiny_args(shared_expert=True, n_dense_layers=1)
    a, b = seeded_build(args), seeded_build(args)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = seeded_build(args, seed=1)
    assert not torch.equal(c.state_dict()["layers.1.moe.experts.w1"], sa["layers.1.moe.experts.w1"])

    with torch.device("meta"):
        meta = build(args)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights(buffer_device="cpu")
    sm = meta.state_dict()
    assert all(torch.equal(sm[k], sa[k]) for k in sa)
    torch.testing.assert_close(meta.freqs_cis, a.freqs_cis, rtol=0, atol=0)
    x = tokens()
    torch.testing.assert_close(meta(x), a(x), rtol=0, atol=0)


def test_construction_does_not_advance_global_rng():
    torch.manual_seed(0)
    with torch.device("meta"):
        build(tiny_args())
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


def test_module_paths_for_plans():
    model = seeded_build(tiny_args(shared_expert=True, n_dense_layers=1))
    names = dict(model.named_modules())
    for path in [
        "tok_embeddings", "norm", "output", "layers.0.feed_forward.w1", "layers.1.attention.wq",
        "layers.1.attention.wk", "layers.1.attention.wv", "layers.1.attention.wo", "layers.1.attention_norm",
        "layers.1.ffn_norm", "layers.1.moe", "layers.1.moe.router.gate", "layers.1.moe.experts",
        "layers.1.moe.shared_expert.w1", "layers.1.moe.shared_expert.w2", "layers.1.moe.shared_expert.w3",
    ]:
        assert path in names, path
    assert "layers.0.moe" not in names and model.layers[0].moe is None
    assert isinstance(names["layers.1.moe.experts"], GroupedExperts)
    gate = names["layers.1.moe.router.gate"]
    assert isinstance(gate, torch.nn.Linear) and gate.bias is None and tuple(gate.weight.shape) == (4, 64)
    params = dict(model.named_parameters())
    assert tuple(params["layers.1.moe.experts.w1"].shape) == (4, 96, 64)
    assert tuple(params["layers.1.moe.experts.w2"].shape) == (4, 64, 96)
    assert tuple(params["layers.1.moe.experts.w3"].shape) == (4, 96, 64)
    assert isinstance(names["layers.1.attention_norm"], llama.RMSNorm)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_args_validation():
    with pytest.raises(ValueError, match="gate"):
        tiny_args(gate="relu")
    with pytest.raises(ValueError, match="top_k"):
        tiny_args(top_k=5)
    with pytest.raises(ValueError, match="capacity_factor"):
        tiny_args(capacity_factor=0.0)
    with pytest.raises(ValueError, match="n_dense_layers"):
        tiny_args(n_dense_layers=3)
    assert isinstance(ModelArgs(), llama.ModelArgs)


# (e) training --------------------------------------------------------------------------------------------

def stride_batch(b, s, vocab, gen):
    """Each token is the previous one plus a per-sequence stride (mod vocab): learnable in context."""
    start = torch.randint(0, vocab, (b, 1), generator=gen)
    stride = torch.randint(1, 4, (b, 1), generator=gen)
    return (start + stride * torch.arange(s + 1)).remainder(vocab)


def test_adamw_steps_reduce_loss():
    args = tiny_args(shared_expert=True, capacity_factor=1.0)  # capacity 128 of 256 copies: some dropped
    model = seeded_build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(25):
        seq = stride_batch(8, 32, args.vocab_size, gen)
        logits = model(seq[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, args.vocab_size), seq[:, 1:].reshape(-1))
        loss = ce + model.aux_loss()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert model.layers[0].moe.router.gate.weight.grad.abs().sum() > 0
            assert model.layers[0].moe.experts.w2.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.detach().item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses


# (f) a subset of experts ---------------------------------------------------------------------------------

def subset(full, lo, hi):
    part = GroupedExperts(full.w1.shape[2], full.w1.shape[1], hi - lo)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(part, name).copy_(getattr(full, name)[lo:hi])
    return part


def test_subset_of_experts_gives_the_same_rows():
    moe = seeded_moe(tiny_args())
    x = hidden(t=32)
    _, idx, _ = moe.router(x)
    x_sorted, routing = moe.dispatch(x, idx)
    counts = routing.counts
    full_out = moe.experts(x_sorted, counts)
    part = subset(moe.experts, 2, 4)
    assert part.num_experts == 2
    start = int(counts[:2].sum())
    torch.testing.assert_close(part(x_sorted[start:], counts[2:]), full_out[start:], rtol=0, atol=0)
    # zero-count local experts, and no rows at all
    empty = part(x_sorted[:0], torch.zeros(2, dtype=torch.long))
    assert empty.shape == (0, 64)
    n2 = int(counts[2])
    only_first = part(x_sorted[start:start + n2], torch.tensor([n2, 0]))
    torch.testing.assert_close(only_first, full_out[start:start + n2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="entries"):
        part(x_sorted[start:], counts)
    with pytest.raises(ValueError, match="split"):
        part(x_sorted, counts[2:])


def test_experts_replaced_by_two_shards_match():
    """What an expert-parallel wrapper does, in one process: each 'rank' runs its own experts' rows."""

    class TwoShards(torch.nn.Module):
        def __init__(self, full):
            super().__init__()
            self.shards = torch.nn.ModuleList([subset(full, 0, 2), subset(full, 2, 4)])

        def forward(self, x, counts):
            rows = x.split([int(counts[:2].sum()), int(counts[2:].sum())])
            return torch.cat([s(r, c) for s, r, c in zip(self.shards, rows, counts.split(2))])

    args = tiny_args(shared_expert=True)
    moe = seeded_moe(args)
    x = hidden(t=32)
    want = moe(x)
    want.sum().backward()
    want_grad = moe.experts.w1.grad.clone()
    moe.experts = TwoShards(moe.experts)
    got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()
    got_grad = torch.cat([s.w1.grad for s in moe.experts.shards])
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
