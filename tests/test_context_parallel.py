"""Context parallelism without processes: the head-tail layout (:mod:`meshplan.context_parallel.chunks`), the
all-gather-K/V attention run rank by rank with the all-gather simulated (numerics, gradients, and the per-rank
attention FLOPs that the causal load balancer equalises), the mask classifier, the plan section, the model
checks (example Llama, transformers' Llama and Mistral), the batch sharding, and ``meshplan.parallelize``'s
refusals on a fake process group."""

import re
import types

import pytest
import torch
import torch.nn.functional as F

import hf_models
import meshplan
from llama import build, tiny_args
from meshplan import PlanError
from meshplan.context_parallel import attention as cp_attention
from meshplan.context_parallel.apply import check_context_parallel, check_plan_context
from meshplan.context_parallel.attention import allgather_kv_attention, mask_is_causal
from meshplan.context_parallel.batch import shard_batch
from meshplan.context_parallel.chunks import attention_pairs, check_seq_len, rank_chunks, rank_positions
from meshplan.plan_file.context_parallel import ContextParallel, PositionsBuffer, PositionsKwarg
from meshplan.plan_file.document import Plan

pytestmark = pytest.mark.fast
LLAMA_ATTN = "layers.*.attention"


# ------------------------------------------------------------------ chunks (pure)

@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8, 16, 64, 100, 1024])
@pytest.mark.parametrize("balance", [True, False])
def test_rank_positions_partition_the_sequence(cp, balance):
    chunks = 2 * cp if balance else cp
    for s in (chunks, 3 * chunks, 8 * chunks):
        every = [p for r in range(cp) for p in rank_positions(s, cp, r, balance)]
        assert sorted(every) == list(range(s)), (s, cp, balance)
        assert all(len(rank_positions(s, cp, r, balance)) == s // cp for r in (0, cp - 1))


def test_rank_chunks_and_positions():
    assert rank_chunks(4, 0, True) == (0, 7) and rank_chunks(4, 3, True) == (3, 4) and rank_chunks(4, 1, False) == (1,)
    assert rank_positions(8, 2, 0, True) == [0, 1, 6, 7] and rank_positions(8, 2, 1, True) == [2, 3, 4, 5]
    assert rank_positions(8, 2, 1, False) == [4, 5, 6, 7]
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="outside 0..3"):
            rank_chunks(4, bad, True)


@pytest.mark.parametrize("s, cp", [(16, 2), (64, 4), (96, 3)])
def test_layout_is_torchs_head_tail_balancer(s, cp):
    """``method: torch_ring`` relies on torch's own head-tail layout being the same as meshplan's."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    torch_order = _HeadTailLoadBalancer(s, cp, "cpu")._generate_indices().flatten().tolist()
    assert torch_order == [p for r in range(cp) for p in rank_positions(s, cp, r, True)]


def test_check_seq_len_messages():
    assert check_seq_len(96, 4, True) is None and check_seq_len(100, 4, False) is None
    assert check_seq_len(100, 4, True) == ("sequence length 100 is not divisible by 2·cp = 8 (causal load "
                                           "balance); valid: multiples of 8, e.g. 96, 104")
    assert check_seq_len(10, 4, False) == "sequence length 10 is not divisible by cp = 4; valid: multiples of 4, " \
                                          "e.g. 8, 12"
    assert check_seq_len(4, 4, True).endswith("valid: multiples of 8, e.g. 8")  # nothing smaller than 8
    # sequence parallelism splits each rank's share again over tp
    assert check_seq_len(48, 4, True, tp_sequence=4) is None
    why = check_seq_len(64, 4, True, tp_sequence=3)
    assert why.startswith("sequence length 64 is not divisible by 24 (2·cp = 8") and "tp = 3" in why
    assert why.endswith("valid: multiples of 24, e.g. 48, 72")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_attention_pairs_balanced_only_with_head_tail(cp):
    s = 16 * cp
    balanced = {attention_pairs(s, cp, r, True) for r in range(cp)}
    assert len(balanced) == 1  # computed and unmasked pairs: equal on every rank
    unbalanced = [attention_pairs(s, cp, r, False)[1] for r in range(cp)]
    assert unbalanced == sorted(unbalanced) and unbalanced[-1] > 1.5 * unbalanced[0]
    for lb in (True, False):  # together: the whole causal triangle, once
        assert sum(attention_pairs(s, cp, r, lb)[1] for r in range(cp)) == s * (s + 1) // 2


# ------------------------------------------------------------------ the attention, rank by rank

def _counting_sdpa(calls):
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):  # records (computed, unmasked) query-key pairs × batch × heads
        rows, kl = q.shape[:-1].numel(), k.shape[-2]
        assert attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype)  # bool, or additive (0 / -inf)
        keep = None if attn_mask is None else attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        calls.append((rows * kl, rows * kl if keep is None else int(keep.expand(*q.shape[:-1], kl).sum())))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    return sdpa


def _counting_blocks(calls):
    """The CPU path's blocks (a mask-free prefix, a causal diagonal: no SDPA call), counted the same way."""
    real = cp_attention.attend_block

    def attend_block(q, k, v, *, mask, q_pos, k_pos, **kw):
        rows = q.shape[:-2].numel()
        calls.append((rows * len(q_pos) * len(k_pos), rows * mask.pairs(q_pos.start, q_pos.stop, k_pos.start,
                                                                          k_pos.stop)))
        return real(q, k, v, mask=mask, q_pos=q_pos, k_pos=k_pos, **kw)
    return attend_block


def _run_ranks(monkeypatch, q, k, v, cp, balance, gqa=False, **kw):
    """Every rank's call on its shards (``kw``: the model's sdpa arguments, default ``is_causal=True``), the
    all-gather simulated; returns the full-sequence output and each rank's ``(computed, unmasked)`` pairs."""
    kw = kw or {"is_causal": True}
    pos = [torch.tensor(rank_positions(q.shape[-2], cp, r, balance)) for r in range(cp)]
    shards = [(k.index_select(-2, p), v.index_select(-2, p)) for p in pos]
    calls, rank = [], [0]

    def gather(key, value, group, n):
        assert group is None and n == cp and torch.equal(key, shards[rank[0]][0])
        return torch.cat([a for a, _ in shards], -2), torch.cat([b for _, b in shards], -2)
    monkeypatch.setattr(cp_attention, "_gather_kv", gather)
    monkeypatch.setattr(cp_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=_counting_sdpa(calls)))
    monkeypatch.setattr(cp_attention, "attend_block", _counting_blocks(calls))
    out, pairs = torch.zeros_like(q), []
    for r in range(cp):
        rank[0], before = r, len(calls)
        o = allgather_kv_attention(q.index_select(-2, pos[r]), *shards[r], enable_gqa=gqa, group=None, cp=cp,
                                   rank=r, load_balance=balance, **kw)
        out = out.index_copy(-2, pos[r], o)
        pairs.append(tuple(map(sum, zip(*calls[before:]))))
    return out, pairs


def _qkv(kv_heads, s=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("balance", [True, False])
def test_allgather_attention_exact_forward_and_backward(monkeypatch, balance, gqa):
    q, k, v = _qkv(2 if gqa else 4, dtype=torch.float64)  # float32 dV differs by summation order (~1e-6)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    weight = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    out, _ = _run_ranks(monkeypatch, q, k, v, cp=4, balance=balance, gqa=gqa)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # rank r's rows == the reference at its positions
    # dK/dV: each rank's contribution flows through the (simulated) gather into the leaves and sums over ranks,
    # as the reduce-scatter backward of the all-gather sums them
    for name, got, want in zip("qkv", torch.autograd.grad((out * weight).sum(), (q, k, v)), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gqa", [True, False])
def test_attention_flops_balanced_by_the_causal_balancer(monkeypatch, gqa):
    """The issue's requirement: each cp rank's attention FLOPs (unmasked query-key pairs it computes) are equal
    within 5% under the causal balancer, and are not without it."""
    cp, s = 4, 64
    q, k, v = _qkv(2 if gqa else 4, s)
    rows = q.shape[0] * q.shape[1]  # batch × query heads
    for balance in (True, False):
        _, pairs = _run_ranks(monkeypatch, q, k, v, cp=cp, balance=balance, gqa=gqa)
        assert pairs == [tuple(rows * n for n in attention_pairs(s, cp, r, balance)) for r in range(cp)]
        unmasked = [u for _, u in pairs]
        assert sum(unmasked) == rows * s * (s + 1) // 2  # the causal triangle, each pair on one rank
        if balance:
            assert max(unmasked) <= 1.05 * min(unmasked), unmasked
            assert len({c for c, _ in pairs}) == 1  # the computed (masked + unmasked) work too
        else:
            assert max(unmasked) > 1.5 * min(unmasked), unmasked


def test_block_masks_are_built_once_per_shape():
    """The layers share one additive mask per block shape (SDPA keeps it by reference for backward), so the
    masks' memory does not grow with the number of layers."""
    from meshplan.context_parallel.attention import block_mask
    masks = {}
    a = block_mask(4, 12, 8, torch.float32, torch.device("cpu"), masks)
    assert block_mask(4, 12, 8, torch.float32, torch.device("cpu"), masks) is a and len(masks) == 1
    assert torch.equal(a == 0, torch.ones(4, 12, dtype=torch.bool).tril(8))
    assert block_mask(4, 12, 8, torch.float64, torch.device("cpu"), masks) is not a and len(masks) == 2


def test_allgather_attention_full_attention(monkeypatch):
    q, k, v = _qkv(4, s=32)
    out, pairs = _run_ranks(monkeypatch, q, k, v, cp=2, balance=True, is_causal=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, rtol=0)
    assert pairs == [(8 * 16 * 32,) * 2] * 2  # no mask: every query of a rank against every key


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_allgather_attention_takes_the_local_causal_mask(monkeypatch, mask):
    """What a causal model builds for its local length (transformers: a 4-D mask) means causal over the sequence."""
    q, k, v = _qkv(2, s=32, dtype=torch.float64)
    tril = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()  # 32 tokens over cp 2
    local = tril if mask == "bool" else torch.zeros(tril.shape, dtype=q.dtype).masked_fill(~tril, float("-inf"))
    out, _ = _run_ranks(monkeypatch, q, k, v, cp=2, balance=True, gqa=True, attn_mask=local)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("v_dim", [8, 5])
def test_gather_kv_on_simulated_ranks(v_dim):
    """The real all-gather (stacked K/V when their shapes agree, else two) in rank order; its backward sums
    every rank's dK into the shard's owner (the reduce-scatter)."""
    import torch.distributed as dist
    from _local import from_ranks, local_ranks, rank_values, shutdown
    cp, g = 4, torch.Generator().manual_seed(1)
    ks, vs = ([torch.randn(2, 2, 3, d, generator=g) for _ in range(cp)] for d in (8, v_dim))
    ws = [torch.randn(2, 2, 3 * cp, 8, generator=g) for _ in range(cp)]
    try:
        with local_ranks(cp):
            key, value = from_ranks(ks).requires_grad_(), from_ranks(vs).requires_grad_()
            gk, gv = cp_attention._gather_kv(key, value, dist.group.WORLD, cp)
            (gk * from_ranks(ws)).sum().backward()
            gks, gvs, grads = rank_values(gk), rank_values(gv), rank_values(key.grad)
    finally:
        shutdown()  # the fake group local_ranks() leaves initialised
    for r in range(cp):
        assert torch.equal(gks[r], torch.cat(ks, -2)) and torch.equal(gvs[r], torch.cat(vs, -2))
        torch.testing.assert_close(grads[r], sum(ws)[..., 3 * r:3 * r + 3, :])


# ------------------------------------------------------------------ masks

def test_mask_is_causal():
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert mask_is_causal(tril, 6) is True
    assert mask_is_causal(tril.expand(2, 1, 6, 6), 6) is True
    additive = torch.zeros(6, 6).masked_fill(~tril, float("-inf"))
    assert mask_is_causal(additive, 6) is True
    assert mask_is_causal(torch.zeros(6, 6).masked_fill(~tril, torch.finfo(torch.float32).min), 6) is True
    assert mask_is_causal(torch.ones(6, 6, dtype=torch.bool), 6) is False
    assert mask_is_causal(torch.zeros(1, 1, 6, 6), 6) is False
    assert mask_is_causal(tril.index_fill(1, torch.tensor([0]), False), 6) is None  # a padded first token
    assert mask_is_causal(additive + torch.randn(6, 6).tril(), 6) is None  # a bias, not a mask
    assert mask_is_causal(tril, 5) is None  # not this length
    window = tril & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    assert mask_is_causal(window, 6) is None


def test_non_causal_mask_is_refused():
    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[:, :2] = False
    with pytest.raises(PlanError, match="layers.0.attention passes .* neither causal nor empty"):
        allgather_kv_attention(q, q, q, mask, group=None, cp=2, rank=0, load_balance=True, where="layers.0.attention")


# ------------------------------------------------------------------ the plan section

def test_plan_section_parses():
    def section(**cp):
        return Plan.from_data({"layout": {"cp": 2}, "context_parallel": cp}).context_parallel
    s = section(attention=LLAMA_ATTN)
    assert s == ContextParallel(attention=(LLAMA_ATTN,))
    assert (s.method, s.load_balance, s.positions, s.seq_dim) == ("allgather_kv", True, None, 1)
    s = section(attention=["a.*.b", "c"], method="ring", load_balance=False, positions={"kwarg": "position_ids"})
    assert s.attention == ("a.*.b", "c") and s.method == "ring" and not s.load_balance
    assert s.positions == PositionsKwarg(kwarg="position_ids")
    assert section(attention="x", positions={"buffer": "freqs_cis"}).positions == PositionsBuffer(buffer="freqs_cis")
    assert section(attention="x", positions={"buffer": "rope.t", "dim": 1}).positions.dim == 1
    assert section(attention="x", positions="none").positions == "none"


@pytest.mark.parametrize("cp, needle", [
    ({"attention": "x", "bogus": 1}, r"context_parallel\.bogus: Extra inputs"),
    ({"attention": "x", "method": "rings"}, r"context_parallel\.method: Input should be 'allgather_kv', 'ring' or 'torch_ring'"),
    ({"attention": []}, r"context_parallel\.attention: "),
    ({}, r"context_parallel\.attention: Field required"),
    ({"attention": "x", "positions": "nonee"}, r"context_parallel\.positions"),
    ({"attention": "x", "positions": {"buffer": "f", "dim": -1}}, r"context_parallel\.positions\..*dim"),
    ({"attention": "x", "positions": {"kwarg": "p", "buffer": "f"}}, r"context_parallel\.positions"),
    ({"attention": "x", "seq_dim": 0}, r"context_parallel\.seq_dim"),
    ({"attention": "x", "load_balance": "yes"}, r"context_parallel\.load_balance"),
])
def test_plan_section_errors(cp, needle):
    with pytest.raises(PlanError, match=needle):
        Plan.from_data({"context_parallel": cp}, source="p.yaml")


# ------------------------------------------------------------------ the model checks

def _section(**kw):
    return ContextParallel(**{"attention": (LLAMA_ATTN,), **kw})


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return build(tiny_args())


def test_check_example_llama(llama):
    r = check_context_parallel(llama, _section(positions=PositionsBuffer(buffer="freqs_cis")), "cpu")
    assert r.paths == ("layers.0.attention", "layers.1.attention") and r.buffer == "freqs_cis"
    assert r.kwarg is None and not r.inject_mask
    assert check_context_parallel(llama, _section(positions="none"), "cpu").buffer is None


@pytest.mark.parametrize("kw, needle", [
    ({"attention": ("layers.*.attn",)}, r"where\.attention: pattern 'layers\.\*\.attn' matched no module"),
    ({}, r"where\.positions: Transformer\.forward takes no position_ids"),
    ({"positions": PositionsBuffer(buffer="rope")}, r"no buffer 'rope'; its buffers: freqs_cis"),
    ({"positions": PositionsBuffer(buffer="freqs_cis", dim=3)}, r"positions\.dim: 3 but freqs_cis has 3 dims"),
    ({"positions": PositionsKwarg(kwarg="position_ids")}, r"no argument 'position_ids'; its arguments: tokens"),
    ({"positions": "none", "method": "torch_ring"}, r"where\.method: torch_ring .* CUDA only; this mesh is on cpu"),
])
def test_check_example_llama_errors(llama, kw, needle):
    with pytest.raises(PlanError, match=needle):
        check_context_parallel(llama, _section(**kw), "cpu", where="where")


HF_ATTN = ("model.layers.*.self_attn",)


def test_check_hf_llama_defaults():
    model = hf_models.llama()
    r = check_context_parallel(model, _section(attention=HF_ATTN), "cpu")
    assert r.paths == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert (r.kwarg, r.buffer, r.inject_mask) == ("position_ids", None, True)


def _eager_after_loading():
    model = hf_models.llama()
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("factory, kw, needle", [
    (hf_models.llama, {"attn_implementation": "eager"}, r"implementation='eager'.*attn_implementation='sdpa'"),
    (_eager_after_loading, {}, r"LlamaForCausalLM runs attention_implementation='eager'"),
    # sliding windows are honoured now (tests/test_cp_windows.py); a layer type that is not attention is not
    (lambda: hf_models.mistral(layer_types=["full_attention", "linear_attention"]), {},
     r"MistralForCausalLM has layer types \['full_attention', 'linear_attention'\] \(config.layer_types\).*got "
     r"\['linear_attention'\]"),
])
def test_check_hf_refusals(factory, kw, needle):
    with pytest.raises(PlanError, match=needle):
        check_context_parallel(factory(**kw), _section(attention=HF_ATTN), "cpu")


def test_check_hf_eager_only_class_not_told_sdpa():
    """Gemma2 refuses SDPA (soft-capping): suggesting attn_implementation='sdpa' there would fail at load."""
    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model("gemma2")
    assert why is None, why
    assert type(model)._supports_sdpa is False
    with pytest.raises(PlanError, match=r"does not take attn_implementation='sdpa'.*leave cp out") as e:
        check_context_parallel(model, _section(attention=HF_ATTN), "cpu")
    assert "load it with" not in str(e.value)


def test_check_hf_full_attention_accepted():
    assert check_context_parallel(hf_models.mistral(), _section(attention=HF_ATTN), "cpu").kwarg == "position_ids"
    # Qwen2 slides only in layers >= max_window_layers (28): both layers of this one attend fully
    model = hf_models.qwen2(use_sliding_window=True, sliding_window=16)
    assert model.config.layer_types == ["full_attention"] * 2
    try:
        check_context_parallel(model, _section(attention=HF_ATTN), "cpu")
    except PlanError as e:
        pytest.fail(f"BUG (meshplan/context_parallel/apply.py _check_hf): refuses a model whose layer_types are all "
                    f"full_attention because config.sliding_window is set: {e}")


def _tiny_sdpa(model_type):
    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model(model_type)
    assert model is not None, why
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("model_type, attn, needle", [
    # multimodal models' sliding layers (config.text_config.layer_types, issue 24) are honoured now:
    # tests/test_cp_windows.py::test_multimodal_windows_from_the_text_config
    # Doge's dynamic mask attention: refused by check, not at the first forward
    ("doge", "model.layers.*.self_attn", r"DogeForCausalLM uses dynamic mask attention \(config.keep_window_size="
                                         r"2048.*leave cp out of the layout \(its ranks then go to data "
                                         r"parallelism"),
])
def test_check_hf_refuses_what_cp_breaks(model_type, attn, needle):
    model = _tiny_sdpa(model_type)
    with pytest.raises(PlanError, match=needle):
        check_context_parallel(model, _section(attention=(attn,)), "cpu")
    plan = {"version": 1, "layout": {"cp": 2}, "context_parallel": {"attention": [attn]}}
    report = meshplan.check(model, plan)  # the same check, before anything changes
    assert not report.ok and any(re.search(needle, str(e)) for e in report.errors), report.errors
    followed = {"version": 1, "layout": {}, "blocks": {"pattern": attn.rsplit(".", 1)[0]}}  # cp left out
    followed = meshplan.check(model, followed, world_size=2)
    assert followed.ok, followed.errors



def test_check_audits_attention_outside_the_plan_on_a_small_copy():
    """HRM holds attention in two block lists (``H_module``, ``L_module``): a plan naming one passed ``check`` and
    was refused at the first forward (issue 24's hrm_text cp crash). ``check`` now runs the runtime's audit on a
    small copy, names the module and the pattern to add; with it the plan passes (and the zoo's cp 2 run equals
    one device)."""
    model = _tiny_sdpa("hrm_text")
    low, high = "model.L_module.layers.*.self_attn", "model.H_module.layers.*.self_attn"
    base = {"version": 1, "layout": {"cp": 2}, "blocks": {"pattern": "model.L_module.layers.*"}}
    report = meshplan.check(model, {**base, "context_parallel": {"attention": [low]}})
    msg = " | ".join(map(str, report.errors))
    assert not report.ok and f"{high} calls scaled_dot_product_attention outside the attention modules" in msg, msg
    assert f"add {high!r}" in msg, msg
    report = meshplan.check(model, {**base, "context_parallel": {"attention": [low, high]}})
    assert report.ok, report.errors
    report = meshplan.check(model, {**base, "context_parallel": {"attention": [low, high, "model.H_module.layers.*.mlp"]}})
    assert any("['model.H_module.layers.*.mlp'] called no scaled_dot_product_attention" in str(e)
               for e in report.errors), report.errors

# ------------------------------------------------------------------ batches

def _batch(s=16):
    ids = torch.arange(2 * s).view(2, s)
    return {"input_ids": ids, "labels": ids + 1000, "attention_mask": torch.ones(2, s, dtype=torch.long),
            "other": torch.zeros(2, 3), "flag": True}


@pytest.mark.parametrize("balance", [True, False])
def test_shard_batch(balance):
    inputs = _batch()
    for r in range(2):
        got, targets, shift = shard_batch(inputs, inputs["labels"], cp=2, rank=r, load_balance=balance)
        pos = torch.tensor(rank_positions(16, 2, r, balance))
        assert not shift and torch.equal(got["input_ids"], inputs["input_ids"][:, pos])
        assert torch.equal(targets, inputs["labels"][:, pos]) and got["attention_mask"].shape == (2, 8)
        assert got["other"] is inputs["other"] and got["flag"] is True  # not sequence-long: untouched


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_batch_shifts_over_the_whole_sequence(cp):
    inputs, c = _batch(), 16 // (2 * cp)
    for r in range(cp):
        got, targets, shift = shard_batch(inputs, None, cp=cp, rank=r, load_balance=True, shift=True)
        assert not shift and torch.equal(targets, got["shift_labels"])
        assert torch.equal(got["labels"], inputs["labels"][:, rank_positions(16, cp, r, True)])  # unshifted
        # the last token of this rank's first chunk: its target is the next token, held by another rank
        assert torch.equal(targets[:, c - 1], inputs["labels"][:, (r + 1) * c])
        # the sequence's last token (the end of rank 0's tail chunk) has no target
        assert (targets[:, -1] == -100).all() == (r == 0)


@pytest.mark.parametrize("inputs, targets, kw, needle", [
    ({"input_ids": torch.zeros(2, 100)}, torch.zeros(2, 100), {},
     r"context_parallel: sequence length 100 is not divisible by 2·cp = 8 .* e\.g\. 96, 104"),
    ({"input_ids": torch.zeros(2, 64)}, torch.zeros(2, 64), {"tp_sequence": 3}, r"divisible by 24"),
    ({"input_ids": torch.zeros(2, 64)}, torch.zeros(2), {}, r"the targets have no sequence dim 1 of length 64"),
    ({"input_ids": torch.zeros(2, 64)}, torch.zeros(2, 32), {}, r"targets have no sequence dim"),
    ({"n": 3, "x": torch.zeros(2)}, None, {}, r"no input tensor has a sequence dim 1"),
    ({"input_ids": torch.zeros(2, 64), "attention_mask": F.pad(torch.ones(2, 60), (0, 4))}, torch.zeros(2, 64), {},
     r"attention_mask pads some sequences"),
])
def test_shard_batch_errors(inputs, targets, kw, needle):
    with pytest.raises(PlanError, match=needle):
        shard_batch(inputs, targets, cp=4, rank=0, load_balance=True, **kw)


# ------------------------------------------------------------------ parallelize's refusals (fake group)

CP_LLAMA = {"attention": LLAMA_ATTN, "positions": {"buffer": "freqs_cis"}}


@pytest.mark.parametrize("layout, world, extra, needle", [
    ({"cp": 2}, 4, {}, r"<plan>: layout\.cp\(2\) > 1 needs a context_parallel section"),
    ({"cp": 2, "pp": 2}, 4, {"context_parallel": CP_LLAMA,
                             "pipeline": {"microbatches": 2, "split": "trace", "split_points": ["layers.1"]}},
     r"context_parallel: not with pipeline\.split: trace"),
    ({"cp": 2}, 2, {"context_parallel": CP_LLAMA, "blocks": {"pattern": "layers.*", "compile": True}},
     r"context_parallel: blocks\.compile is not supported with context parallelism"),
    ({"cp": 2}, 2, {"context_parallel": {"attention": LLAMA_ATTN}}, r"context_parallel\.positions: Transformer"),
    ({"cp": 8}, 8, {"context_parallel": {**CP_LLAMA, "method": "torch_ring"}}, r"torch_ring .* CUDA only"),
])
def test_parallelize_refusals(fake_pg, layout, world, extra, needle):
    model = build(tiny_args())
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with fake_pg(world):
        topo = meshplan.build_mesh(layout)
        with pytest.raises(PlanError, match=needle):
            meshplan.parallelize(model, {"layout": layout, **extra}, topo)
    assert meshplan.parallel_state(model) is None and not model._forward_pre_hooks  # refused before any change
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


def test_parallelize_cp_needs_a_topology(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh
    with fake_pg(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(PlanError, match=r"<plan>: context_parallel needs a meshplan Topology"):
            meshplan.parallelize(build(tiny_args()), {"context_parallel": CP_LLAMA}, mesh)


def test_parallelize_cp_with_pipeline_blocks(fake_pg):
    """``split: blocks`` stages keep their attention modules: the runtime routes those of this rank's stage."""
    layout = {"cp": 2, "pp": 2}
    with fake_pg(4):
        model = meshplan.parallelize(build(tiny_args()), {"layout": layout, "context_parallel": CP_LLAMA,
                                                          "pipeline": {"microbatches": 2}}, meshplan.build_mesh(layout))
    state = meshplan.parallel_state(model)
    assert state.pipeline is not None and state.context_parallel.cp == 2
    assert state.context_parallel.runtime.attention_paths == ("layers.0.attention",)  # stage 0 of 2


def test_check_plan_context_without_a_mesh(llama):
    """``meshplan check`` knows no device (None): ``torch_ring`` is not refused there; cp 1 applies nothing."""
    plan = Plan.from_data({"context_parallel": {**CP_LLAMA, "method": "torch_ring"}}, source="p.yaml")
    assert check_plan_context(llama, plan, 2, 1, None) == "p.yaml: context_parallel"
    assert check_plan_context(llama, plan, 1, 1, None) is None
    with pytest.raises(PlanError, match=r"p\.yaml: context_parallel\.method: torch_ring .* CUDA only"):
        check_plan_context(llama, plan, 2, 1, "cpu")
    assert check_plan_context(llama, Plan.from_data({}), 1, 4, "cpu") is None
    with pytest.raises(PlanError, match=r"p\.yaml: layout\.cp\(4\) > 1 needs a context_parallel section"):
        check_plan_context(llama, Plan.from_data({}, source="p.yaml"), 4, 1, "cpu")


# ------------------------------------------------------------------ the first forward's audit (runtime)

class _Attn(torch.nn.Module):
    def __init__(self, eager: bool = False):
        super().__init__()
        self.proj, self.eager = torch.nn.Linear(8, 8), eager

    def forward(self, x):
        q = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
        if self.eager:  # attention written by hand
            return (q @ q.transpose(-1, -2)).softmax(-1) @ q
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class _Toy(torch.nn.Module):
    def __init__(self, eager: bool = False):
        super().__init__()
        self.a, self.b = _Attn(eager), _Attn()

    def forward(self, x):
        return self.a(x).sum() + self.b(x).sum()


def _runtime(model, paths, attend=None):
    from meshplan.context_parallel.runtime import CpRuntime
    seen = []
    rt = CpRuntime(group=None, cp=2, rank=0, load_balance=True, seq_dim=1,
                   attend=attend or (lambda *a, where, **k: seen.append(where) or F.scaled_dot_product_attention(*a, **k)),
                   positions_kwarg=None, buffer=None, buffer_dim=0, patterns=tuple(paths), attention_paths=tuple(paths))
    rt.install(model)
    return rt, seen


@pytest.mark.parametrize("eager, paths, needle", [
    (False, ["a"], "b calls scaled_dot_product_attention outside the attention modules ['a']"),
    (True, ["a", "b"], "a computes a softmax over a 8×8 score matrix itself"),
])
def test_audit_refuses_attention_the_plan_does_not_route(eager, paths, needle):
    model = _Toy(eager)
    _runtime(model, paths)
    with pytest.raises(PlanError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        model(torch.randn(1, 8, 8))


def test_audit_passes_and_routes_only_the_attention_modules():
    model = _Toy()
    rt, seen = _runtime(model, ["a", "b"])
    model(torch.randn(1, 8, 8))
    model(torch.randn(1, 8, 8))  # audited once; routed every time
    assert seen == ["a", "b", "a", "b"] and rt.audited == {id(model)} and rt.depth == 0
    with pytest.raises(PlanError, match="not this rank's 2 equal chunks"):
        model(torch.randn(1, 7, 8))


def test_audit_names_an_attention_module_that_ran_no_sdpa():
    model = _Toy()
    model.b.forward = lambda x: x  # runs, but no attention
    _runtime(model, ["a", "b"])
    with pytest.raises(PlanError, match=r"\['b'\] called no scaled_dot_product_attention"):
        model(torch.randn(1, 8, 8))


@pytest.mark.parametrize("model_type,reads", [("afmoe", False), ("llama", True), ("qwen3_moe", True)])
def test_reads_packing_follows_the_models_own_mask(model_type, reads):
    """Afmoe builds its masks without ``position_ids``: one device attends across packed documents, so cp must not
    mask them apart (the zoo's cpdoc row was 2.4e-3 off on the loss); Llama and Qwen3-MoE hand them over."""
    pytest.importorskip("transformers")
    import torch

    from meshplan.context_parallel.hf_check import reads_packing
    from meshplan.hf.tiny_config import tiny_config
    from meshplan.hf.tiny_models import model_class
    with torch.device("meta"):
        model = model_class(model_type)(tiny_config(model_type, tp=2))
    assert reads_packing(model) is reads
