"""Model config keys that take more than a rename to read (:func:`meshplan.solver.shape.shape_from_config` reads
the rest by alias). Torch-free.

* nested sections: DBRX keeps its experts in ``ffn_config`` (``moe_num_experts``, ``moe_top_k``,
  ``ffn_hidden_size``) and its KV heads in ``attn_config`` (``kv_n_heads``);
* per-modality expert sizes: ERNIE 4.5 VL lists ``moe_intermediate_size`` (and may list the expert count) per
  modality, text first: the text experts' are read;
* a range of MoE layers: ERNIE 4.5's experts start at ``moe_layer_start_index``, end at ``moe_layer_end_index``
  (−1: the last layer) and take every ``moe_layer_interval``-th layer in between;
* sliding windows: ``use_sliding_window`` off drops the window, ``layer_types`` counts the windowed layers.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["nested", "text_experts", "moe_layer_range", "windows", "NESTED"]

#: config sections whose keys are read as if they stood at the top (a key at the top wins)
NESTED = ("ffn_config", "attn_config")


def nested(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """``cfg`` with the keys of its :data:`NESTED` sections lifted to the top, where the top does not set them.

    Example::

        >>> nested({"d_model": 64, "ffn_config": {"moe_num_experts": 4, "d_model": 1}})["moe_num_experts"]
        4
    """
    inner = [cfg[k] for k in NESTED if isinstance(cfg.get(k), Mapping)]
    if not inner:
        return cfg
    out: dict[str, Any] = {}
    for section in inner:
        out.update({k: v for k, v in section.items() if k not in out})
    return {**out, **cfg}


def text_experts(out: dict) -> None:
    """The text modality's expert count, top-k and width where a config lists one per modality (text first).

    Example::

        >>> out = {"experts": 64, "moe_ffn": [1536, 512]}
        >>> text_experts(out); out["moe_ffn"]
        1536
    """
    for key in ("experts", "top_k", "moe_ffn"):
        if isinstance(out.get(key), (list, tuple)) and out[key]:
            out[key] = out[key][0]


def moe_layer_range(cfg: Mapping[str, Any], out: dict) -> None:
    """``out["dense_layers"]`` from an MoE layer range (ERNIE 4.5): the layers outside it. The cost model places
    dense layers first; with an interval above 1 the count is exact and their positions are not (a stage's
    share of experts may differ by a layer)."""
    start = cfg.get("moe_layer_start_index")
    layers = out.get("layers")
    if not isinstance(start, int) or not isinstance(layers, int) or "dense_layers" in out:
        return
    end = cfg.get("moe_layer_end_index")
    end = layers - 1 if not isinstance(end, int) or end < 0 else min(end, layers - 1)
    every = cfg.get("moe_layer_interval") if isinstance(cfg.get("moe_layer_interval"), int) else 1
    moe = sum(1 for i in range(layers) if start <= i <= end and (i + 1) % max(every, 1) == 0)
    out["dense_layers"] = layers - moe


def windows(cfg: Mapping[str, Any], out: dict) -> None:
    """The sliding window and how many layers use it (transformers: ``use_sliding_window`` off drops it,
    ``layer_types`` counts the ``sliding_attention`` layers)."""
    if not isinstance(out.get("window"), int) or cfg.get("use_sliding_window") is False:
        out.pop("window", None)
        return
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)) and "window_layers" not in out:
        n = sum(t == "sliding_attention" for t in types)
        if n == 0:
            out.pop("window")
        elif n < out.get("layers", n):
            out["window_layers"] = n
