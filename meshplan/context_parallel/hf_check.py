"""transformers models under context parallelism: the attention features a sequence shard cannot express, read
from the model's config before anything changes (``meshplan check`` and :func:`meshplan.parallelize` alike).

A multimodal model (``MuseGlimmerModel``, ``MuseSparkModel``, …) keeps its language model's settings in
``config.text_config``: the top-level config has no ``layer_types`` or ``sliding_window``, so they are read from
the text config too. Missing them let sliding-window layers run as full causal
attention (muse_glimmer: loss 41 % off at cp 2, float64).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch.nn as nn

from meshplan.context_parallel.masks import AttentionMask
from meshplan.errors import PlanError

__all__ = ["check_hf_attention", "layer_masks", "reads_packing"]

#: the transformers layer types the all-gather attention makes exact (a window per layer: ``sliding_window``)
LAYER_TYPES = ("full_attention", "sliding_attention")

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

    Refused: an attention implementation other than SDPA, layer types other than full and sliding attention,
    sliding layers without a window, attention logit soft-capping (transformers' SDPA refuses it), and Doge's dynamic mask attention (a learned, content-dependent bias per
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
    sinks = next((n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"), None)
    if sinks is not None:
        raise PlanError(f"{where}: {name} has attention sinks ({sinks}: a learned logit per head in the softmax's "
                        f"denominator, gpt-oss); SDPA has no sink term and the all-gather attention does not add "
                        f"one: {_WITHOUT_CP}")
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
    if kinds - set(LAYER_TYPES):
        raise PlanError(f"{where}: {name} has layer types {sorted(kinds)} ({key}.layer_types); context parallelism "
                        f"supports {' and '.join(LAYER_TYPES)} layers (got {sorted(kinds - set(LAYER_TYPES))}): "
                        f"{_WITHOUT_CP}")
    try:
        window = getattr(config, "sliding_window", None)
    except RuntimeError as e:  # transformers' per-layer configs refuse a global read (NeoMME's per_layer_config)
        raise PlanError(f"{where}: {name}'s {key}.sliding_window varies per layer ({type(e).__name__}); context "
                        f"parallelism reads a global or per-layer-type window only: {_WITHOUT_CP}") from None
    if "sliding_attention" in kinds and not window:
        raise PlanError(f"{where}: {name} has sliding_attention layers ({key}.layer_types) but {key}.sliding_window "
                        f"is {window!r}; expected the window in tokens")
    if getattr(config, "attn_logit_softcapping", None):
        raise PlanError(f"{where}: {name} sets attn_logit_softcapping={config.attn_logit_softcapping} ({key}); "
                        f"transformers' sdpa attention refuses soft-capping and its eager attention is written by "
                        f"hand, so context parallelism cannot route it: {_WITHOUT_CP}, or set "
                        f"{key}.attn_logit_softcapping=None (a different model)")
    if getattr(config, "keep_window_size", None) is not None:
        raise PlanError(f"{where}: {name} uses dynamic mask attention ({key}.keep_window_size="
                        f"{config.keep_window_size}: a learned bias per key and a top-k over the keys, a mask that "
                        f"is neither causal nor empty); context parallelism supports plain causal attention only: "
                        f"{_WITHOUT_CP}")


def _window(module: nn.Module, config: Any) -> int | None:
    """The sliding window of an attention module of a transformers model: its layer's type
    (``layer_types[layer_idx]``: Gemma 2/3, Qwen2, Cohere 2, gpt-oss, Exaone 4 alternate), else its own
    ``sliding_window``, else the config's window for every layer (Mistral, Phi-3, Starcoder2) unless
    ``use_sliding_window`` is False. The first forward checks the module's own mask agrees."""
    kinds, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if kinds and isinstance(idx, int) and idx < len(kinds):
        sliding = kinds[idx] == "sliding_attention"
        return (getattr(module, "sliding_window", None) or config.sliding_window) if sliding else None
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    if kinds:  # layer types without a layer index: only a model that slides everywhere
        return config.sliding_window if set(kinds) == {"sliding_attention"} else None
    if not getattr(config, "use_sliding_window", True) or not _passes_window(module):
        return None
    return getattr(config, "sliding_window", None)


def _passes_window(module: nn.Module) -> bool:
    """Whether the module's forward hands its attention a ``sliding_window`` (Mistral's does; Nemotron-H's config
    has a ``sliding_window`` its attention never reads)."""
    import inspect
    try:
        return "sliding_window" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source: trust the config
        return True


def layer_masks(model: nn.Module, paths: tuple[str, ...]) -> dict:
    """``{path: AttentionMask}`` of the attention modules at ``paths`` of a transformers ``model`` that slide
    (causal within a window); {} for a model without a config or without windows (their calls say causal or not).
    The first forward checks each module's own local mask agrees (:func:`~meshplan.context_parallel.attention.
    check_local_mask`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {}
    for path in paths:
        module = model.get_submodule(path)
        try:
            window = _window(module, text)
        except (AttributeError, RuntimeError) as e:  # per-layer configs refuse a global read (NeoMME)
            raise PlanError(f"context_parallel: cannot read the sliding window of {path} ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]}); context parallelism reads a global or per-layer-"
                            f"type window only; use cp 1 for {type(model).__name__}") from None
        if window and not getattr(module, "is_causal", True):
            raise PlanError(f"context_parallel: {path} slides a window of {int(window)} tokens over bidirectional "
                            f"attention (is_causal False: an encoder's window reaches both sides); context "
                            f"parallelism makes causal sliding windows exact, not two-sided ones; use cp 1 for "
                            f"{type(model).__name__}")
        if window:
            found[path] = AttentionMask(causal=getattr(module, "is_causal", True), window=int(window))
    return found


def _mask_calls_give_positions(tree: ast.AST) -> bool | None:
    """Whether the ``create_*mask`` calls in ``tree`` get ``position_ids`` (a keyword, or a key of the dict
    unpacked into them: ``mask_kwargs``), or None without such a call."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id.startswith("create_") and n.func.id.endswith("mask")]
    if not calls:
        return None
    dicts = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
             for t in n.targets if isinstance(t, ast.Name)}
    for call in calls:
        for kw in call.keywords:
            if kw.arg == "position_ids":
                return True
            unpacked = dicts.get(kw.value.id) if kw.arg is None and isinstance(kw.value, ast.Name) else None
            if unpacked is not None and any(isinstance(k, ast.Constant) and k.value == "position_ids"
                                            for k in unpacked.keys):
                return True
    return False


def reads_packing(model: nn.Module) -> bool:
    """Whether the model masks packed documents apart by their restarting position ids, as transformers does when
    its mask builders get ``position_ids`` (``masking_utils.find_packed_sequence_indices``). The first module whose
    ``forward`` calls a ``create_*mask`` builder decides: False when it does not hand them ``position_ids``
    (``AfmoeModel``: its ``mask_kwargs`` have none, so one device attends across documents and context
    parallelism must too); True for a model without such a call (its masks are not transformers')."""
    for module in model.modules():
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
        except (OSError, TypeError, SyntaxError):
            continue
        found = _mask_calls_give_positions(tree)
        if found is not None:
            return found
    return True
