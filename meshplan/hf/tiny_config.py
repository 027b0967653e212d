"""Tiny random transformers models of any architecture, for numerics sweeps (``benchmarks/zoo.py``).

:func:`tiny_config` shrinks a transformers config while keeping what makes the architecture what it is: every
distinct kind of layer (``layer_types`` such as Gemma's sliding/full pattern, dense and MoE layers, attention
and Mamba layers), the MoE expert structure, partial rotary, qk-norms, ``clip_qkv``, biases, tied embeddings.
Every size a tp plan divides is a multiple of ``tp``::

    hidden   = 32·tp        heads   = 2·tp       kv heads = tp (GQA kept) or 2·tp    head_dim = 16
    ffn      = 2·hidden     vocab   = 64·tp      experts  = 4, top-2                  layers   = 2 (or one per kind)

Dropouts are 0, sliding windows 8 tokens (the numerics batch is ``8·tp`` long), rope settings rescaled to the
new ``head_dim`` (``mrope_section``, long-rope factors). Generic rules come first; :data:`OVERRIDES` holds the
few per-type settings the generic rules cannot derive, each with its reason.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tiny_config", "with_layers", "OVERRIDES", "HEAD_DIM"]

HEAD_DIM = 16

#: per model type: config overrides the generic rules cannot derive, and why
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "deepseek_ocr2_text": ({"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2},
                           "default leaves mlp_layer_types and num_experts_per_tok None, which the model indexes"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
                 "default config leaves layer_types None, which the model indexes"),
    "qwen4_exp_text": ({"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                        "indexer_compress_ratio": 2},
                       "every attention layer builds a QSA indexer, whose sizes default to None"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
                            "default rope_parameters is {}, but the model reads one entry per layer type"),
    "diffusion_gemma_text": ({"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 128},
                             "default builds the MoE block with num_experts and moe_intermediate_size None"),
}

_HEADS = ("num_attention_heads", "n_head", "num_heads", "swa_num_attention_heads", "num_sliding_attention_heads",
          "linear_num_heads", "linear_num_key_heads", "mamba_num_heads", "mamba_n_heads",
          "index_n_heads", "indexer_n_heads")
_KV_HEADS = ("num_key_value_heads", "swa_num_key_value_heads", "indexer_kv_heads", "linear_num_value_heads")
_HEAD_DIMS = ("head_dim", "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim",
              "mamba_head_dim", "mamba_d_head", "v_head_dim", "index_head_dim", "indexer_head_dim",
              "qk_nope_head_dim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "num_layers_per_stack")
_WINDOWS = ("sliding_window", "sliding_window_size", "attention_chunk_size")
_LORA = ("kv_lora_rank", "q_lora_rank", "o_lora_rank", "embedding_rank", "laurel_rank")
_SUBCONFIGS = ("text_config", "vision_config", "audio_config")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num_layers(d: dict) -> int | None:
    for key in _LAYERS:
        if _is_int(d.get(key)):
            return d[key]
    per_layer = d.get("layers_block_type") or d.get("layer_types")
    return len(per_layer) if isinstance(per_layer, (list, tuple)) else None


def _layer_lists(d: dict, n: int) -> list[str]:
    """Keys whose value is one entry per layer."""
    return [k for k, v in d.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 2 and "token" not in k
            and list(v) != list(range(n))]  # range(n): every layer's own index (moe_layers, kv_source_layers)


def _index_lists(d: dict, n: int) -> list[str]:
    """Keys whose value lists layer indices (``mlp_only_layers``, ``moe_layers``, …)."""
    return [k for k, v in d.items() if "layer" in k and isinstance(v, (list, tuple)) and k not in _layer_lists(d, n)
            and all(_is_int(i) and 0 <= i < n for i in v)]


def _keep_layers(d: dict, n: int) -> list[int]:
    """The fewest layer indices that keep every distinct kind of layer (at least 2)."""
    lists, indices = _layer_lists(d, n), _index_lists(d, n)
    per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    first_dense = next((d[k] for k in ("first_k_dense_replace", "num_dense_layers") if _is_int(d.get(k))), 0)
    step = d.get("decoder_sparse_step") if _is_int(d.get("decoder_sparse_step")) else 1
    kept, seen = [], set()
    for i in range(n):
        kind = (tuple(repr(d[k][i]) for k in lists), tuple(i in d[k] for k in indices), i < first_dense,
                (i + 1) % max(step, 1) == 0, repr(per_layer.get(i)))
        if kind not in seen:
            seen.add(kind)
            kept.append(i)
    for i in range(n):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _layers(d: dict, tp: int) -> dict[str, Any]:
    """Layer count and every per-layer setting for the kept layers."""
    n = _num_layers(d)
    if n is None:
        return {}
    kept = _keep_layers(d, n)
    out: dict[str, Any] = {k: len(kept) for k in _LAYERS if _is_int(d.get(k))}
    for k in _layer_lists(d, n):
        out[k] = [d[k][i] for i in kept]
    for k in _index_lists(d, n):
        out[k] = [j for j, i in enumerate(kept) if i in d[k]]
    if isinstance(d.get("per_layer_config"), dict):
        per_layer = {int(k): v for k, v in d["per_layer_config"].items()}
        out["per_layer_config"] = {j: _per_layer(per_layer[i], tp) for j, i in enumerate(kept) if i in per_layer}
    if _is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:  # the kept layers, then as many
        for k in _LAYERS:                                                        # reusing their caches
            if k in out:
                out[k] *= 2
        for k in _layer_lists(d, n):
            out[k] = out[k] * 2
        out["num_kv_shared_layers"] = len(kept)
    _fill(out, d, ("first_k_dense_replace", "num_dense_layers"), lambda v: sum(i < v for i in kept))
    # periodic patterns (every step-th layer sparse, attention every n-th): period 2 keeps both kinds in 2 layers
    periodic = [k for k in d if k.endswith(("_period", "_every_n_layers", "_interval", "sliding_window_pattern"))
                or k in ("decoder_sparse_step", "layer_group_size", "interleave_moe_layer_step", "moe_layer_freq")]
    _fill(out, d, periodic, 2, lambda v: _is_int(v) and v > 2)
    _fill(out, d, [k for k in d if k.endswith("_offset") and "layer" in k], lambda v: v % 2, _is_int)
    _fill(out, d, ("max_window_layers",), lambda v: sum(i < v for i in kept), _is_int)
    _fill(out, d, ("moe_layer_start_index",), lambda v: min(v, len(kept) - 1), _is_int)
    _fill(out, d, ("moe_layer_end_index",), len(kept) - 1)
    return out


def _fill(out: dict, d: dict, keys, value, when=lambda v: _is_int(v) and v > 0) -> None:
    """``out[k] = value`` (or ``value(d[k])``) for each of ``keys`` in ``d`` whose value passes ``when``."""
    for k in keys:
        if k in d and when(d[k]):
            out[k] = value(d[k]) if callable(value) else value


def _per_layer(values: dict, tp: int) -> dict:
    """One layer's overrides (``per_layer_config``): a distinct head_dim stays distinct (2·HEAD_DIM)."""
    out = dict(values)
    heads = next((values[k] for k in _HEADS if _is_int(values.get(k))), None)
    _fill(out, values, _HEAD_DIMS, HEAD_DIM)
    _fill(out, values, ("head_dim",), 2 * HEAD_DIM)
    _fill(out, values, _HEADS, 2 * tp)
    _fill(out, values, _KV_HEADS, lambda v: tp if heads and v < heads else 2 * tp)
    _fill(out, values, _WINDOWS, 8)
    _fill(out, values, _LORA, 16 * tp)
    _fill(out, values, _EXPERTS, 4)
    return out


def _rope(rope: Any, head_dim: int, max_pos: int, mrope: bool = False) -> Any:
    """Rope parameters consistent with ``head_dim`` (nested per layer type, or flat). ``mrope``: the model
    reads ``mrope_section`` (and falls back to one sized for its full head_dim): write one."""
    if not isinstance(rope, dict):
        return rope
    if any(isinstance(v, dict) or v is None for v in rope.values()) and "rope_type" not in rope:
        return {k: _rope(v, head_dim, max_pos, mrope) for k, v in rope.items()}
    rope = dict(rope)
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    if mrope or "mrope_section" in rope:  # sections (t, h, w) fill half the rotary dims
        sec = list(rope.get("mrope_section") or [3, 3, 2])
        new = [max(1, s * half // sum(sec)) for s in sec]
        rope["mrope_section"] = [new[0] + half - sum(new), *new[1:]]
    _fill(rope, rope, ("short_factor", "long_factor"), lambda v: (list(v) + [1.0] * half)[:half],
          lambda v: isinstance(v, (list, tuple)))
    _fill(rope, rope, ("original_max_position_embeddings",), lambda v: min(v, max_pos // 2))
    return rope


def _tiny_dict(d: dict, tp: int, mrope: bool = False) -> dict[str, Any]:
    """The shrunken values of config dict ``d`` (only the keys that change); ``mrope``: see :func:`_rope`."""
    heads, hidden, vocab, max_pos = 2 * tp, 32 * tp, 64 * tp, 128
    old_heads = next((d[k] for k in _HEADS if _is_int(d.get(k))), None)
    is_none = lambda v: v is None  # noqa: E731
    out: dict[str, Any] = {}
    _fill(out, d, ("hidden_size", "n_embd", "d_model"), hidden)
    _fill(out, d, _HEADS, heads)
    _fill(out, d, _KV_HEADS, lambda v: tp if old_heads and v < old_heads else heads)
    _fill(out, d, ("num_key_value_heads",), heads, is_none)  # None: as many as heads
    _fill(out, d, ("num_attention_heads_per_layer",), lambda v: [heads] * len(v), lambda v: isinstance(v, list))
    _fill(out, d, _HEAD_DIMS, HEAD_DIM)
    _fill(out, d, ("head_dim",), HEAD_DIM, is_none)
    if _is_int(d.get("qk_rope_head_dim")) and d["qk_rope_head_dim"] > 0:  # MLA: the rope part of each head
        out["qk_rope_head_dim"] = HEAD_DIM // 2
        _fill(out, d, ("head_dim",), HEAD_DIM // 2, lambda v: v == d["qk_rope_head_dim"])
        _fill(out, d, ("qk_head_dim",), out.get("qk_nope_head_dim", 0) + HEAD_DIM // 2)
    _fill(out, d, _LORA, hidden // 2)
    ffn = [k for k in d if any(s in k for s in ("intermediate_size", "ffn_hidden_size", "moe_hidden_size",
                                                "expert_dim", "hidden_size_per_layer_input", "moe_latent_size"))]
    _fill(out, d, ffn, 2 * hidden)
    _fill(out, d, ffn, lambda v: [2 * hidden if x > 0 else x for x in v],
          lambda v: isinstance(v, list) and all(_is_int(x) for x in v))
    moe = _is_int(d.get("moe_intermediate_size")) or any(_is_int(d.get(k)) and d[k] > 0 for k in _EXPERTS)
    some = lambda v: (_is_int(v) and v > 0) or (moe and v is None)  # noqa: E731  None with MoE sizes: unbuildable
    _fill(out, d, _EXPERTS, 4, some)
    _fill(out, d, _TOP_K, lambda v: min(v or 2, 2), some)
    _fill(out, d, _SHARED, 1, some)
    _fill(out, d, ("zero_expert_num",), 2)  # identity experts (LongCat)
    _fill(out, d, ("n_group", "num_expert_group", "topk_group"), 1)
    if all(_is_int(d.get(k)) for k in ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        out["mamba_d_head"] = d["mamba_expand"] * hidden // heads  # expand·hidden = heads·d_head
    _fill(out, d, ("out_hidden_size", "adapter_in_dim", "adapter_out_dim"), hidden)  # towers feed the text
    _fill(out, d, ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), vocab)
    _fill(out, d, ("max_position_embeddings", "n_positions", "n_ctx"), max_pos)
    _fill(out, d, ("original_max_position_embeddings",), max_pos // 2)
    _fill(out, d, [k for k in d if any(s in k for s in ("dropout", "pdrop", "jitter")) or k.endswith("_drop")],
          0.0, lambda v: isinstance(v, float))
    # special ids inside the vocabulary (padding_idx); image/audio ids stay outside so random ids never hit them
    ids = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id")
    _fill(out, d, ids, vocab - 1, lambda v: _is_int(v) and v >= vocab)
    _fill(out, d, ids, lambda v: [x if not _is_int(x) or x < vocab else vocab - 1 for x in v],
          lambda v: isinstance(v, list))
    _fill(out, d, _WINDOWS, 8)
    _fill(out, d, ("use_cache",), False, bool)  # training: hybrid caches (Mamba-only, cycled layers) break
    out.update(_layers({**d, **out}, tp))  # per-layer lists (intermediate sizes) already shrunk
    head_dim = out.get("qk_rope_head_dim") or out.get("head_dim") or HEAD_DIM
    _fill(out, d, ("rope_parameters", "rope_scaling"), lambda v: _rope(v, head_dim, max_pos, mrope),
          lambda v: isinstance(v, dict))
    _fill(out, d, ("rope_parameters",), None, lambda v: v == {})  # empty: let the config derive its own
    return out


def _config_class(config_or_model_type: Any):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if isinstance(config_or_model_type, str):
        return CONFIG_MAPPING[config_or_model_type], None
    return type(config_or_model_type), config_or_model_type


def tiny_config(config_or_model_type: Any, tp: int = 2, **overrides: Any):
    """A shrunken copy of a transformers config that keeps its architecture and divides by ``tp``.

    Args:
        config_or_model_type: a config instance, or a model type (``"gemma2"``: its default config).
        tp: the tensor-parallel degree every sharded size must divide.
        **overrides: config values set last (after :data:`OVERRIDES`).

    Returns:
        A new config of the same class; nested ``text_config`` / ``vision_config`` / ``audio_config`` shrunk too.

    Example::

        >>> cfg = tiny_config("gemma3_text", tp=2)
        >>> cfg.num_attention_heads, cfg.num_key_value_heads, cfg.layer_types
        (4, 2, ['sliding_attention', 'full_attention'])
    """
    cls, config = _config_class(config_or_model_type)
    config = config if config is not None else cls()
    data = config.to_dict()
    changes = _tiny_dict(data, tp, _reads_mrope(cls))
    for key in _SUBCONFIGS:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            changes[key] = tiny_config(sub, tp=tp).to_dict()
    changes.update(OVERRIDES.get(getattr(config, "model_type", ""), ({}, ""))[0])
    changes.update(overrides)
    data.update(changes)
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        data.pop(key, None)
    return cls.from_dict(data)


def _reads_mrope(config_class) -> bool:
    """Whether the modeling module of ``config_class`` reads ``mrope_section``."""
    import importlib.util
    spec = importlib.util.find_spec(config_class.__module__.replace(".configuration_", ".modeling_"))
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        return '"mrope_section"' in f.read()


def with_layers(config: Any, n: int, like: Any = None):
    """``config`` with ``n`` layers: its per-layer lists (``layer_types``, any list as long as its layer count)
    taken from ``like`` (a config with ``n`` layers: the model a tiny copy stands for) where it has them, else
    repeated cyclically (``[sliding, full]`` → ``[sliding, full, sliding, full]``).

    Example::

        >>> with_layers(tiny_config("gemma2"), 4).layer_types
        ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    """
    data, old = config.to_dict(), config.num_hidden_layers
    source = like.to_dict() if like is not None else {}
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) == old and old > 0:
            theirs = source.get(key)
            data[key] = theirs if isinstance(theirs, list) and len(theirs) == n else \
                [value[i % old] for i in range(n)]
    data["num_hidden_layers"] = n
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        data.pop(key, None)
    return type(config).from_dict(data)
