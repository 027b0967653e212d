"""Document masks (packed sequences), sliding windows and soft-capping in the all-gather attention, rank by rank
(the all-gather simulated), against one dense attention over the whole sequence in float64; the model's own local
mask checked; transformers' windows read per layer, and what stays refused named."""

import pytest
import torch
import torch.nn.functional as F

import hf_models
from _float64 import keep_float64
from meshplan.context_parallel import attention as cp_attention
from meshplan.context_parallel.attention import allgather_kv_attention, check_local_mask
from meshplan.context_parallel.batch import documents_of, position_ids_of
from meshplan.context_parallel.chunks import rank_positions
from meshplan.context_parallel.hf_check import check_hf_attention, layer_masks
from meshplan.context_parallel.masks import AttentionMask
from meshplan.errors import PlanError

pytestmark = pytest.mark.fast

S = 32


def _dense(q, k, v, mask, docs, gqa):
    """One device: the whole sequence's scores, soft-capped, masked by AttentionMask.keep, softmaxed."""
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if mask.softcap is not None:
        scores = mask.softcap * torch.tanh(scores / mask.softcap)
    pos = torch.arange(q.shape[-2])
    keep = mask.keep(pos, pos, docs, docs)
    if keep is not None:
        scores = scores.masked_fill(~(keep[:, None] if keep.dim() == 3 else keep), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _ranks(monkeypatch, q, k, v, cp, balance, gqa, **kw):
    """Every rank's call on its shards; the all-gather simulated (rank order, as the collective returns it)."""
    pos = [torch.tensor(rank_positions(q.shape[-2], cp, r, balance)) for r in range(cp)]
    shards = [(k.index_select(-2, p), v.index_select(-2, p)) for p in pos]
    monkeypatch.setattr(cp_attention, "_gather_kv", lambda *_: (torch.cat([a for a, _ in shards], -2),
                                                                torch.cat([b for _, b in shards], -2)))
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # V's head size (MLA's differs from Q's)
    for r in range(cp):
        o = allgather_kv_attention(q.index_select(-2, pos[r]), *shards[r], enable_gqa=gqa, group=None, cp=cp,
                                   rank=r, load_balance=balance, **kw)
        out = out.index_copy(-2, pos[r], o)
    return out


def _qkv(kv_heads, s=S):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    return q, k, v


DOCS = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 32])  # row 0: three documents; row 1: one
MASKS = [AttentionMask(window=3), AttentionMask(window=9), AttentionMask(window=40), AttentionMask(softcap=2.0),
         AttentionMask(window=5, softcap=1.5), AttentionMask(causal=False, window=4), AttentionMask()]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("docs", [None, DOCS], ids=["one_doc", "packed"])
@pytest.mark.parametrize("cp, balance, gqa", [(2, True, True), (4, True, False), (2, False, False)])
def test_allgather_matches_one_device(monkeypatch, mask, docs, cp, balance, gqa):
    q, k, v = _qkv(2 if gqa else 4)
    ref = _dense(q, k, v, mask, docs, gqa)
    weight = torch.randn_like(ref)
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    local = torch.arange(S // cp)  # the model's own mask of a shard: its layer's, over the local tokens
    out = _ranks(monkeypatch, q, k, v, cp, balance, gqa, attn_mask=mask.keep(local, local), mask=mask,
                 documents=docs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, got, exp in zip("qkv", torch.autograd.grad((out * weight).sum(), (q, k, v)), want):
        torch.testing.assert_close(got, exp, atol=1e-12, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_window_reads_only_the_key_chunks_it_reaches(monkeypatch):
    """A window of 3 at cp 4 (chunks of 4 tokens): each query chunk reads its own chunk and the one before."""
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(cp_attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(k.shape[-2]) or real(q, k, v, **kw))
    q, k, v = _qkv(4)
    local = torch.arange(8)
    _ranks(monkeypatch, q, k, v, 4, True, False, attn_mask=AttentionMask(window=3).keep(local, local),
           mask=AttentionMask(window=3))
    assert seen == [4, 8, 8, 8, 8, 8, 8, 8]  # rank 0's first chunk has nothing before it; 32 keys without skipping


def test_documents_from_position_ids():
    ids = torch.cat([position_ids_of([3, 2, 3]), position_ids_of([8])])
    assert ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    assert documents_of(ids).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]
    assert documents_of(position_ids_of([8])) is None  # one document: nothing to mask


def _local(kind, n=8, w=3):
    pos = torch.arange(n)
    return AttentionMask(window=w).keep(pos, pos) if kind == "window" else torch.ones(n, n, dtype=torch.bool).tril()


def test_local_mask_must_be_the_layers():
    window = AttentionMask(window=3)
    check_local_mask(_local("window")[None, None], False, window, 8, "l.0")  # the window over the local tokens
    add = torch.zeros(8, 8, dtype=torch.float64).masked_fill(~_local("window"), torch.finfo(torch.float64).min)
    check_local_mask(add, False, window, 8, "l.0")
    check_local_mask(None, True, AttentionMask(window=8), 8, "l.0")  # a window wider than the shard: skipped
    check_local_mask(_local("causal"), False, AttentionMask(window=8), 8, "l.0")
    for got, causal, needle in [(_local("causal"), False, "a mask that differs"), (None, True, "no mask"),
                                (_local("window", w=4), False, "a mask that differs"),
                                (torch.randn(8, 8), False, "a mask of shape")]:
        with pytest.raises(PlanError, match=rf"l.0 passes scaled_dot_product_attention {needle}.*window=3"):
            check_local_mask(got, causal, window, 8, "l.0")


def _tiny(model_type, **over):
    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model(model_type)
    assert model is not None, why
    for k, val in over.items():
        setattr(model.config.get_text_config(), k, val)
    model.config._attn_implementation = "sdpa"
    return model


def test_layer_masks_per_layer():
    m = hf_models.mistral(sliding_window=16)
    paths = tuple(p for p, _ in m.named_modules() if p.endswith("self_attn"))
    check_hf_attention(m, "cp")
    assert set(layer_masks(m, paths).values()) == {AttentionMask(window=16)}
    q = hf_models.qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert q.config.layer_types == ["full_attention", "sliding_attention"]
    assert layer_masks(q, ("model.layers.0.self_attn", "model.layers.1.self_attn")) == \
        {"model.layers.1.self_attn": AttentionMask(window=16)}
    assert layer_masks(hf_models.llama(), ("model.layers.0.self_attn",)) == {}


@pytest.mark.parametrize("model_type", ["muse_glimmer", "muse_spark"])
def test_multimodal_windows_from_the_text_config(model_type):
    """The text settings live in config.text_config (issue 24: read from the top-level config, cp 2 ran sliding
    layers as full attention, loss 41 % off in float64): layer 0 slides, layer 1 attends fully."""
    model = _tiny(model_type)
    check_hf_attention(model, "cp")
    paths = ("language_model.layers.0.self_attn", "language_model.layers.1.self_attn")
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"]
    assert layer_masks(model, paths) == {paths[0]: AttentionMask(window=8)}


def test_exaone4_slides_by_layer_type():
    """Exaone 4 keeps sliding_window on every attention module and slides only where layer_types says."""
    model = _tiny("exaone4")
    paths = tuple(f"model.layers.{i}.self_attn" for i in range(2))
    assert layer_masks(model, paths) == {paths[0]: AttentionMask(window=8)}


@pytest.mark.parametrize("model_type, needle", [
    ("gemma2", r"Gemma2ForCausalLM sets attn_logit_softcapping=50.0 \(config\)"),
    ("gpt_oss", r"GptOssForCausalLM has attention sinks \(model.layers.0.self_attn.sinks"),
    ("llama4_text", r"layer types \['chunked_attention', 'full_attention'\] \(config.layer_types\).*got "
                    r"\['chunked_attention'\]"),
    ("neomme", r"NeoMMEModel's config.sliding_window varies per layer"),  # check raised transformers' error
])
def test_still_refused_names_the_feature(model_type, needle):
    with pytest.raises(PlanError, match=needle):
        check_hf_attention(_tiny(model_type), "cp")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("factory", [hf_models.llama, lambda **kw: _tiny("mistral", **kw)], ids=["llama", "mistral"])
def test_without_cp_transformers_masks_documents_itself(impl, factory):
    """cp 1 (no cp section): transformers masks packed documents from the position ids alone, in sdpa and eager
    (and the window within each document) — but only without a cache: with the config's use_cache=True it
    builds one and ignores the packing (masking_utils._preprocess_mask_arguments); the cp runtime follows."""
    torch.manual_seed(0)
    model = factory().double().eval()
    model.config._attn_implementation = impl
    lengths = [5, 20, 7]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)))
    pos = position_ids_of(lengths)
    with torch.no_grad(), keep_float64():  # eager's float32 softmax kept in float64
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        cached = model(input_ids=ids, position_ids=pos, use_cache=True).logits
        alone = torch.cat([model(input_ids=part, use_cache=False).logits for part in ids.split(lengths, -1)], 1)
    # eager softmaxes in float32 (its dtype= argument): rounding of 2e-8 there, masking missed is 1e-2
    atol = 1e-12 if impl == "sdpa" else 1e-6
    torch.testing.assert_close(packed, alone, atol=atol, rtol=0)
    assert float((cached - alone).abs().max()) > 1e3 * atol


@pytest.mark.parametrize("lengths", [[32], [16, 16], [24, 8], [4, 28], [8, 4, 20]])
@pytest.mark.parametrize("cp", [2, 4])
def test_document_work_per_rank(lengths, cp):
    """document_pairs counts the dense keep-matrix (documents × causal × window); the head-tail layout of the row
    is balanced by tokens, not by work, once documents differ; head-tail per document balances the work exactly."""
    from meshplan.context_parallel.chunks import document_pairs, document_positions
    docs = torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)])
    pos = torch.arange(S)
    for mask in (AttentionMask(), AttentionMask(window=5)):
        keep = mask.keep(pos, pos, docs, docs)
        for r in range(cp):
            held = rank_positions(S, cp, r, True)
            assert document_pairs(held, lengths, mask) == int(keep[held].sum())
    layout = [document_positions(lengths, cp, r) for r in range(cp)]
    if any(n % (2 * cp) for n in lengths):
        assert layout == [None] * cp
        return
    assert sorted(p for held in layout for p in held) == list(range(S)) and len({len(h) for h in layout}) == 1
    assert len({document_pairs(held, lengths) for held in layout}) == 1
    row = [document_pairs(rank_positions(S, cp, r, True), lengths) for r in range(cp)]
    assert (len(set(row)) == 1) == (len(set(lengths)) == 1 or lengths == [16, 16])


def test_packed_documents_sharded_with_a_pipeline():
    """Every pipeline stage gets the keyword inputs (docs/pipeline.md), so packed documents under pp are sharded
    like any other position ids (they were refused while later stages got none)."""
    from types import SimpleNamespace as NS
    from meshplan.context_parallel.batch import shard_for_state
    rt = NS(cp=2, rank=0, load_balance=True, seq_dim=1, positions_kwarg="position_ids",
            documents_layout_possible=lambda kwargs: False)  # the row layout (a runtime that masks no documents)
    state = NS(context_parallel=NS(runtime=rt), topology=NS(layout=NS(pp=2, tp=1)), sequence_parallel=False)
    ids = torch.zeros(1, 8, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "position_ids": position_ids_of([4, 4])}
    assert shard_for_state(state, batch, None, shift=True)[0]["position_ids"].tolist() == [[0, 1, 2, 3]]
    whole = {**batch, "position_ids": position_ids_of([8])}
    assert shard_for_state(state, whole, None, shift=True)[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    rt.documents_layout_possible = lambda kwargs: True  # masked documents: chunk 0 of each, then chunk 3 of each
    assert shard_for_state(state, batch, None, shift=True)[0]["position_ids"].tolist() == [[0, 0, 3, 3]]
    assert rt.by_documents is True


def test_torch_ring_refuses_windows_and_documents():
    """torch's ring handlers take causal/full masks only; meshplan's ring takes windows and documents."""
    from meshplan.context_parallel.runtime import CpRuntime
    rt = CpRuntime(group=None, cp=2, rank=0, load_balance=True, seq_dim=1, attend=None, positions_kwarg=None,
                   buffer=None, buffer_dim=0, patterns=("a",), attention_paths=("a",), masked=False,
                   layer_masks={"a": AttentionMask(window=4)})
    with pytest.raises(PlanError, match=r"a needs AttentionMask\(causal=True, window=4.*method: torch_ring does not take.*use method: ring"):
        rt.masking("a")
    assert rt.masking("b") == {}


def test_config_window_only_where_the_attention_reads_it():
    """A config-wide sliding_window (no layer types, no module attribute) counts only for an attention whose
    forward hands it on (Mistral's does; Nemotron-H's config carries one its attention never reads)."""
    from types import SimpleNamespace as NS
    from meshplan.context_parallel.hf_check import _window

    class Reads(torch.nn.Module):
        def forward(self, x, sliding_window=None):
            return x

    class Ignores(torch.nn.Module):
        def forward(self, x):
            return x
    config = NS(sliding_window=8)
    assert _window(Reads(), config) == 8 and _window(Ignores(), config) is None
    assert _window(Reads(), NS(sliding_window=8, use_sliding_window=False)) is None


def test_keep_matrices_built_once_per_forward_and_shared(monkeypatch):
    """The layers of one forward share the keep-matrices (one per query chunk, off CUDA the additive float mask
    SDPA keeps for backward): a second layer adds no entry and gets the same tensors; a new documents tensor (the
    next batch) gets its own; outputs equal those without a cache."""
    q, k, v = _qkv(4)
    mask, keeps, built = AttentionMask(window=9), {}, []
    real = cp_attention.keep_matrix
    monkeypatch.setattr(cp_attention, "keep_matrix", lambda *a: built.append(real(*a)) or built[-1])
    docs, local = DOCS.clone(), torch.arange(S // 2)
    kw = {"mask": mask, "attn_mask": mask.keep(local, local)}
    plain = _ranks(monkeypatch, q, k, v, 2, True, False, documents=docs, **kw)
    for layer in range(2):
        out = _ranks(monkeypatch, q, k, v, 2, True, False, documents=docs, keeps=keeps, **kw)
        assert torch.equal(out, plain) and len(keeps) == 4  # 2 ranks x 2 chunks
    firsts, seconds = built[4:8], built[8:12]
    assert all(a is b and a.dtype == torch.float64 and a.shape[:2] == (2, 1) for a, b in zip(firsts, seconds))
    _ranks(monkeypatch, q, k, v, 2, True, False, documents=DOCS.clone(), keeps=keeps, **kw)
    assert len(keeps) == 8 and all(a is not b for a, b in zip(firsts, built[12:16]))


def test_mla_value_head_size_stays_exact(monkeypatch):
    """MLA (DeepSeek V2/V3, MiniCPM3, GLM-4 MoE lite, …: V's head size differs from Q/K's): torch's CPU flash kernel
    takes one head size, so the mask-free causal path and the ring's fused blocks step aside for them (the zoo's cp
    sweep crashed on 8 such models) and the result stays one device's."""
    from meshplan.context_parallel.blocks import attend_block
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, S, 12, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(_ranks(monkeypatch, q, k, v, 2, True, False, is_causal=True), ref, atol=1e-12, rtol=0)
    with torch.no_grad():
        out, _ = attend_block(q, k, v, scale=12 ** -0.5, mask=AttentionMask(causal=True), q_pos=range(S),
                              k_pos=range(S))
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("model_type", ["embedding_gemma2_text", "ultrabert"])
def test_bidirectional_windows_are_refused(model_type):
    """An encoder's window reaches both sides of a query; AttentionMask's window is causal (keys before the query):
    reading it as one ran EmbeddingGemma 2 and UltraBERT 1.6e-2 / 4.9e-2 off one device at cp 2 (the zoo)."""
    model = _tiny(model_type)
    paths = tuple(n for n, m in model.named_modules() if n.endswith("self_attn"))
    with pytest.raises(PlanError, match="bidirectional attention"):
        layer_masks(model, paths)
