"""Stored head counts of modules that see this rank's heads: checked against tp and divided by it.

Models reshape with the head counts they store (``n_heads``, ``num_key_value_heads``, …). A module whose colwise
children hand it local shards (:func:`meshplan.plan_file.style_semantics.gives_local_shards`) sees
``heads / tp`` heads, so its counts are divided (and those of its own ``config``: Phi-3 splits its fused qkv at
``config.num_attention_heads · head_dim``); modules fed gathered or DTensor outputs keep the global counts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.mesh.ranks import not_dividing

__all__ = ["HEAD_ATTRS", "adjust_heads", "head_count_errors", "safe_attr", "sees_heads"]

#: stored head counts that models reshape with; divided by tp on modules that own colwise projections
HEAD_ATTRS = ("n_heads", "n_kv_heads", "n_head", "num_heads", "num_kv_heads", "num_key_value_heads",
              "num_attention_heads", "n_local_heads", "n_local_kv_heads", "split_size")
_CONFIG_DIVISIBLE = ("num_attention_heads", "num_key_value_heads", "n_head")


def safe_attr(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, also when the object refuses the name (transformers' per-layer config
    attributes raise an error of their own)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def adjust_heads(model: nn.Module, local_heads: list[str], tp: int, where: str, adjust: bool,
                  modules: dict[str, nn.Module]) -> dict:
    """Divide the stored head counts of the modules that really see local heads (``local_heads``: parents of
    colwise layers whose local outputs they reshape), and of their own ``config`` (a per-module copy: Phi-3
    splits its fused qkv at ``config.num_attention_heads · head_dim``). Modules fed gathered or DTensor
    outputs keep the global counts."""
    changed: dict[str, dict[str, tuple[int, int]]] = {}
    local_heads = [p for p in local_heads if sees_heads(modules[p] if p else model)]
    if not local_heads:
        return changed
    config = getattr(model, "config", None)
    for name in _CONFIG_DIVISIBLE:
        n = safe_attr(config, name)
        why = not_dividing("tp", tp, name, n) if isinstance(n, int) else None
        if why:
            raise PlanError(f"{where}: model config: {why}")
    copies: dict[int, Any] = {}  # one adjusted copy per original config object
    for parent in local_heads:
        mod = modules[parent] if parent else model
        errors = head_count_errors(mod, parent, tp, where)
        if errors:
            raise PlanError(errors[0])
        for attr, n in _head_counts(mod).items():
            if adjust:
                setattr(mod, attr, n // tp)
                changed.setdefault(parent, {})[attr] = (n, n // tp)
        cfg = mod.__dict__.get("config")
        if adjust and parent and cfg is not None and not isinstance(cfg, nn.Module) and \
                any(isinstance(safe_attr(cfg, a), int) for a in _CONFIG_DIVISIBLE):
            if id(cfg) not in copies:
                local = copy.copy(cfg)
                for a in _CONFIG_DIVISIBLE:
                    n = safe_attr(cfg, a)
                    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                        setattr(local, a, n // tp)
                copies[id(cfg)] = local
            mod.config = copies[id(cfg)]
            changed.setdefault(parent, {})["config"] = (0, 0)
    return changed


def _head_counts(mod: nn.Module) -> dict[str, int]:
    """The stored head counts (:data:`HEAD_ATTRS`) of ``mod``."""
    out = {}
    for attr in HEAD_ATTRS:
        # instance attributes first; a miss through nn.Module.__getattr__ raises (slow for 9 x 126 layers)
        n = mod.__dict__[attr] if attr in mod.__dict__ else getattr(mod, attr, None) if hasattr(type(mod), attr) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            out[attr] = n
    return out


def sees_heads(mod: nn.Module) -> bool:
    """Is ``mod`` an attention module (it stores a ``head_dim`` or head counts), not e.g. an MLP?"""
    return isinstance(getattr(mod, "head_dim", None), int) or bool(_head_counts(mod))


def head_count_errors(mod: nn.Module, path: str, tp: int, where: str) -> list[str]:
    """Head counts of a module that sees local heads which tp does not divide (with the valid tp values)."""
    return [f"{where}: module {path or '(root)'!r}: {not_dividing('tp', tp, attr, n)}"
            for attr, n in _head_counts(mod).items() if n % tp]
