"""transformers models under context parallelism: the attention features a sequence shard cannot express, read
from the model's config before anything changes (``meshplan check`` and :func:`meshplan.parallelize` alike).

A multimodal model (``MuseGlimmerModel``, ``MuseSparkModel``, …) keeps its language model's settings in
``config.text_config``: the top-level config has no ``layer_types`` or ``sliding_window``, so they are read from
the text config too. Missing them let sliding-window layers run as full causal
attention (muse_glimmer: loss 41 % off at cp 2, float64).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError

__all__ = ["check_hf_attention"]

_WITHOUT_CP = ("leave cp out of the layout (its ranks then go to data parallelism, layout.dp_shard, which "
               "does not split the sequence)")


def _configs(config: Any) -> list[tuple[str, Any]]:
    """``(key, config)``: the config, and its language model's config when that is another one (``text_config``
    of a multimodal model; its vision or audio towers' attention is not split along the sequence)."""
    found = [("config", config)]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        key = next((k for k in (getattr(config, "sub_configs", None) or {}) if getattr(config, k, None) is text),
                   "text_config")
        found.append((f"config.{key}", text))
    return found


def check_hf_attention(model: nn.Module, where: str) -> None:
    """Refuse a transformers ``model`` whose attention context parallelism cannot make exact.

    Refused: an attention implementation other than SDPA, layer types other than full attention, a sliding
    window, attention logit soft-capping, and Doge's dynamic mask attention (a learned, content-dependent bias per
    key plus a top-k over keys: a mask that is neither causal nor empty).

    Args:
        model: the model; not a transformers model (no ``config.to_dict``): nothing is checked.
        where: the plan key, for errors.

    Raises:
        PlanError: naming the model, the config key and its value, and what to do instead.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    name = type(model).__name__
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise PlanError(f"{where}: {name} runs attention_implementation={impl!r}; context parallelism makes "
                        f"scaled_dot_product_attention exact across shards: {_sdpa_fix(model)}")
    for key, cfg in _configs(config):
        _check_one(name, key, cfg, where)


def _sdpa_fix(model: nn.Module) -> str:
    """What to do about a non-SDPA attention: load the model with SDPA where its class takes it; else (attention
    sinks, soft-capping: the class refuses SDPA) leave cp out — suggesting SDPA there would fail at load."""
    if getattr(type(model), "_supports_sdpa", True):
        return "load it with attn_implementation='sdpa'"
    return f"{type(model).__name__} does not take attn_implementation='sdpa' (_supports_sdpa is False); {_WITHOUT_CP}"


def _check_one(name: str, key: str, config: Any, where: str) -> None:
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise PlanError(f"{where}: {name} has layer types {sorted(kinds)} ({key}.layer_types); context parallelism "
                        f"supports layers of full causal attention only: {_WITHOUT_CP}")
    window = getattr(config, "sliding_window", None)
    if not kinds and window and getattr(config, "use_sliding_window", True):  # layer_types, when given, decide
        raise PlanError(f"{where}: {name} has a sliding window of {window} tokens ({key}.sliding_window); the "
                        f"local mask of a sequence shard cannot express it: not supported with context "
                        f"parallelism: {_WITHOUT_CP}")
    if getattr(config, "attn_logit_softcapping", None):
        raise PlanError(f"{where}: {name} sets attn_logit_softcapping ({key}); SDPA cannot soft-cap logits: not "
                        f"supported with context parallelism: {_WITHOUT_CP}")
    if getattr(config, "keep_window_size", None) is not None:
        raise PlanError(f"{where}: {name} uses dynamic mask attention ({key}.keep_window_size="
                        f"{config.keep_window_size}: a learned bias per key and a top-k over the keys, a mask that "
                        f"is neither causal nor empty); context parallelism supports plain causal attention only: "
                        f"{_WITHOUT_CP}")
