"""Tests for the plain Llama example model (examples/llama.py)."""

import pytest
import torch

from llama import ModelArgs, Transformer, build, tiny_args  # examples/ is on sys.path (tests/conftest.py)

pytestmark = pytest.mark.fast


def tokens(b=2, s=16, vocab=128, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def seeded_build(args, seed=0):
    torch.manual_seed(seed)
    return build(args)


def test_forward_backward_cpu():
    model = seeded_build(tiny_args())
    logits = model(tokens())
    assert logits.shape == (2, 16, 128) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_module_paths_for_plans():
    model = seeded_build(tiny_args())
    names = dict(model.named_modules())
    for path in [
        "tok_embeddings", "norm", "output", "layers.0", "layers.1.attention_norm",
        "layers.1.attention.wq", "layers.1.attention.wk", "layers.1.attention.wv",
        "layers.1.attention.wo", "layers.1.attention.resid_dropout", "layers.1.ffn_norm",
        "layers.1.feed_forward.w1", "layers.1.feed_forward.w2", "layers.1.feed_forward.w3",
        "layers.1.feed_forward.dropout",
    ]:
        assert path in names, path
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.layers[0].attention.wk.out_features == 2 * 16  # 2 kv heads x head_dim 16
    assert "freqs_cis" not in model.state_dict()  # non-persistent buffer


def test_gqa_matches_mha_with_expanded_kv_weights():
    """kv head j serves q heads j*n_rep .. (j+1)*n_rep-1 (repeat_interleave)."""
    gqa = seeded_build(tiny_args())  # 4 heads, 2 kv heads
    mha = seeded_build(tiny_args(n_kv_heads=4))
    state = gqa.state_dict()
    hd = 16
    for key, w in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[key] = w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)


def test_head_reshape_stored_equals_infer():
    x = tokens()
    infer = seeded_build(tiny_args(head_reshape="infer"))
    stored = seeded_build(tiny_args(head_reshape="stored"))
    torch.testing.assert_close(stored(x), infer(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="head_reshape"):
        tiny_args(head_reshape="guess")


def test_tied_embeddings_share_parameter():
    model = seeded_build(tiny_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = seeded_build(tiny_args())
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 128 * 64
    model(tokens()).sum().backward()
    assert model.tok_embeddings.weight.grad is model.output.weight.grad


def test_meta_build_to_empty_init_weights_matches_cpu_build():
    args = tiny_args(tie_embeddings=False)
    torch.manual_seed(123)
    cpu = build(args)
    torch.manual_seed(123)
    with torch.device("meta"):
        meta = build(args)
    assert all(p.is_meta for p in meta.parameters()) and meta.freqs_cis.is_meta
    meta.to_empty(device="cpu")
    meta.init_weights(buffer_device="cpu")
    assert meta.freqs_cis.device.type == "cpu"
    for (name, p), (_, q) in zip(cpu.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q), name
    torch.testing.assert_close(meta.freqs_cis, cpu.freqs_cis, rtol=0, atol=0)
    x = tokens()
    torch.testing.assert_close(meta(x), cpu(x), rtol=0, atol=0)


def test_init_weights_is_deterministic_and_reinitializes():
    model = seeded_build(tiny_args())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    torch.manual_seed(0)
    model.init_weights()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    norm = model.layers[0].attention_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))


def test_causal_and_positions_follow_input_length():
    """A prefix gives the prefix of the logits: causal mask + RoPE from h.shape[1]."""
    model = seeded_build(tiny_args()).eval()
    x = tokens(s=20)
    torch.testing.assert_close(model(x[:, :7]), model(x)[:, :7], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(s=65))


def test_dropout_train_vs_eval():
    model = seeded_build(tiny_args(dropout=0.5))
    x = tokens()
    model.eval()
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(x), model(x))
    attn = model.layers[0].attention
    assert attn.resid_dropout.p == 0.5 and attn.dropout == 0.5
    assert model.layers[0].feed_forward.dropout.p == 0.5


def test_model_args_defaults_and_validation():
    args = ModelArgs(dim=32, n_heads=4)
    assert args.n_kv_heads == 4
    with pytest.raises(ValueError):
        ModelArgs(dim=32, n_heads=4, n_kv_heads=3)
    assert isinstance(Transformer(tiny_args()), torch.nn.Module)
