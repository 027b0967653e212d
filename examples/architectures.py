"""Tiny random models of architectures that break naive tensor parallelism (no meshplan import here).

Each factory returns an unmodified model and follows the ``meshplan check --model MODULE:FACTORY --config
JSON`` convention (``FACTORY(**overrides)``); each has a plan in ``plans/`` written from
``docs/tensor-parallel.md`` ("Architectures that need care"):

==================  =========================================  ==============================
factory             what breaks naive TP                       plan
==================  =========================================  ==============================
``gemma2``          scaled embedding subclass (``* sqrt(h)``)  ``plans/gemma2.yaml``
``gemma3``          + per-head ``q_norm``/``k_norm``            ``plans/gemma3.yaml``
``qwen3``           per-head ``q_norm``/``k_norm``              ``plans/qwen3.yaml``
``phi3``            fused ``qkv_proj`` (GQA: unequal parts)    ``plans/phi3.yaml`` (gathered)
``phi3_mha``        fused ``qkv_proj``, equal parts            ``plans/phi3_packed.yaml``
``olmo``            ``clip_qkv``: in-place ``clamp_``           ``plans/olmo.yaml``
``torch_transformer``  DTensor q/k/v (global head count)       ``plans/torch_transformer.yaml``
==================  =========================================  ==============================

Sizes divide tp = 2 and 4: hidden 64, 4 heads (2 KV heads where the architecture has GQA), head_dim 16,
vocab 128, 2 layers, dropout 0.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gemma2", "gemma3", "qwen3", "phi3", "phi3_mha", "olmo", "torch_transformer", "FACTORIES"]

_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _hf(config_cls: str, model_cls: str, overrides: dict, **fixed: Any):
    import transformers as tf
    return getattr(tf, model_cls)(getattr(tf, config_cls)(**{**_BASE, **fixed, **overrides}))


def gemma2(**overrides: Any):
    """``Gemma2ForCausalLM``: the embedding multiplies by ``sqrt(hidden_size)`` in its own forward."""
    return _hf("Gemma2Config", "Gemma2ForCausalLM", overrides)


def gemma3(**overrides: Any):
    """``Gemma3ForCausalLM`` (text): scaled embedding, per-head q/k norms, sliding and full layers."""
    return _hf("Gemma3TextConfig", "Gemma3ForCausalLM", overrides, sliding_window=8)


def qwen3(**overrides: Any):
    """``Qwen3ForCausalLM``: RMS norms over ``head_dim`` on each query and key head."""
    return _hf("Qwen3Config", "Qwen3ForCausalLM", overrides)


def phi3(**overrides: Any):
    """``Phi3ForCausalLM`` with GQA: one fused ``qkv_proj`` whose parts are unequal (q|k|v = 64|32|32)."""
    return _hf("Phi3Config", "Phi3ForCausalLM", overrides)


def phi3_mha(**overrides: Any):
    """``Phi3ForCausalLM`` as Phi-3-mini (KV heads = heads): equal q|k|v parts, shardable packed."""
    return _hf("Phi3Config", "Phi3ForCausalLM", overrides, num_key_value_heads=4)


def olmo(**overrides: Any):
    """``OlmoForCausalLM`` with ``clip_qkv``: the model clamps q/k/v in place."""
    return _hf("OlmoConfig", "OlmoForCausalLM", overrides, clip_qkv=0.5)


def torch_transformer(**overrides: Any):
    """torch's own test ``Transformer`` (``torch.testing._internal``): tied embeddings, learned positions, LayerNorm
    with bias, causal SDPA."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    args = dict(n_layers=2, vocab_size=128, max_seq_len=32, dim=64, n_heads=4, dropout_p=0.0)
    return Transformer(ModelArgs(**{**args, **overrides}))


#: name -> (factory, plan)
FACTORIES = {"gemma2": (gemma2, "plans/gemma2.yaml"), "gemma3": (gemma3, "plans/gemma3.yaml"),
             "qwen3": (qwen3, "plans/qwen3.yaml"), "phi3": (phi3, "plans/phi3.yaml"),
             "phi3_packed": (phi3_mha, "plans/phi3_packed.yaml"), "olmo": (olmo, "plans/olmo.yaml"),
             "torch_transformer": (torch_transformer, "plans/torch_transformer.yaml")}
