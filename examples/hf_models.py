"""Tiny random transformers models, built the way users build them (no download, any device).

Each factory takes keyword overrides of the transformers config and returns the
unmodified transformers model (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``GPT2LMHeadModel``). Sizes divide tp = 2 and 4: hidden 64,
4 heads, 2 KV heads (GPT-2: 4 heads), vocab 128, 2 layers; dropout 0 so a
parallel run can match a single device bit for bit up to reduction order.
They follow the ``meshplan check --model MODULE:FACTORY --config JSON``
convention (``FACTORY(**config)``), e.g.::

    meshplan check plans/hf_llama.yaml --model examples.hf_models:llama --config '{"num_hidden_layers": 4}'

Build on the meta device with ``with torch.device("meta"): model = llama()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["llama", "mistral", "qwen2", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe", "FACTORIES", "tiny_config"]

_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False)


#: mixture-of-experts: 4 experts (FFN 96, not the hidden size), top-2, no router noise, no router-logit loss
_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, intermediate_size=96),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
                      head_dim=16, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                      shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[]),
}


def tiny_config(name: str, **overrides: Any):
    """The transformers config of the tiny ``name`` model (``llama``, ``mistral``, ``qwen2``, ``gpt2``,
    ``mixtral``, ``qwen3_moe``, ``qwen2_moe``)."""
    import transformers as tf
    if name == "gpt2":
        base = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
        return tf.GPT2Config(**{**base, **overrides})
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
           "mixtral": tf.MixtralConfig, "qwen3_moe": tf.Qwen3MoeConfig, "qwen2_moe": tf.Qwen2MoeConfig}[name]
    extra = {"sliding_window": None} if name in ("mistral", "mixtral") else {}
    extra.update(_MOE.get(name, {}))
    return cls(**{**_DECODER, **extra, **overrides})


def _build(name: str, cls_name: str, overrides: dict):
    import transformers as tf
    return getattr(tf, cls_name)(tiny_config(name, **overrides))


def llama(**overrides: Any):
    """A tiny random ``LlamaForCausalLM``."""
    return _build("llama", "LlamaForCausalLM", overrides)


def mistral(**overrides: Any):
    """A tiny random ``MistralForCausalLM`` (sliding window off: the sequence fits)."""
    return _build("mistral", "MistralForCausalLM", overrides)


def qwen2(**overrides: Any):
    """A tiny random ``Qwen2ForCausalLM`` (q/k/v projections carry biases)."""
    return _build("qwen2", "Qwen2ForCausalLM", overrides)


def mixtral(**overrides: Any):
    """A tiny random ``MixtralForCausalLM`` (4 experts, top-2)."""
    return _build("mixtral", "MixtralForCausalLM", overrides)


def qwen3_moe(**overrides: Any):
    """A tiny random ``Qwen3MoeForCausalLM`` (4 experts, top-2, per-head q/k norms)."""
    return _build("qwen3_moe", "Qwen3MoeForCausalLM", overrides)


def qwen2_moe(**overrides: Any):
    """A tiny random ``Qwen2MoeForCausalLM`` (4 experts, top-2, a gated shared expert)."""
    return _build("qwen2_moe", "Qwen2MoeForCausalLM", overrides)


def gpt2(**overrides: Any):
    """A tiny random ``GPT2LMHeadModel`` (packed ``Conv1D`` c_attn, tied lm_head)."""
    return _build("gpt2", "GPT2LMHeadModel", overrides)


#: name → factory, and the plan each ships with
FACTORIES = {"llama": (llama, "plans/hf_llama.yaml"), "mistral": (mistral, "plans/hf_llama.yaml"),
             "qwen2": (qwen2, "plans/qwen2.yaml"), "gpt2": (gpt2, "plans/gpt2.yaml")}
