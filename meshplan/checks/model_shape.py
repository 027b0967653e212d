"""The :class:`~meshplan.solver.shape.ModelShape` of a built model (``meshplan estimate|solve --model``).

The sizes come from the model's configuration: a transformers ``config`` (its ``to_dict()``), or a dataclass of
arguments the model keeps (``args``, ``params``, ``config``: the examples' ``ModelArgs``). The shape's parameter
count is then compared with the module's own, so a model the shape does not describe (an architecture that is
not a decoder of this kind) is reported instead of estimated silently wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.solver.shape import ModelShape, shape_from_config

__all__ = ["shape_of_model", "parameter_count"]


def _config_dict(model: nn.Module) -> dict[str, Any] | None:
    for attr in ("config", "args", "params", "model_args"):
        cfg = getattr(model, attr, None)
        if cfg is None or isinstance(cfg, nn.Module):
            continue
        if hasattr(cfg, "to_dict"):  # transformers
            return cfg.to_dict()
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            return dataclasses.asdict(cfg)
        if isinstance(cfg, dict):
            return dict(cfg)
    return None


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model`` (a tied weight once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shape_of_model(model: nn.Module, where: str = "--model") -> tuple[ModelShape, str | None]:
    """``(shape, warning)``: the model's shape, and a warning when its parameter count differs from the model's.

    Raises:
        PlanError: the model keeps no configuration meshplan can read.
    """
    cfg = _config_dict(model)
    if cfg is None:
        raise PlanError(f"{where}: cannot read the sizes of {type(model).__name__}: it has no config, args or params "
                        f"attribute; pass the sizes with --config (layers, hidden, heads, kv_heads, ffn, vocab)")
    cfg.setdefault("name", type(model).__name__)
    shape = dataclasses.replace(shape_from_config(cfg, where), name=type(model).__name__)
    have, want = parameter_count(model), shape.parameters()
    warning = None
    if have != want:
        warning = (f"{where}: the shape read from {type(model).__name__}'s config counts {want:,} parameters, the "
                   f"module has {have:,}; its blocks differ from the decoder the cost model describes, so the "
                   f"estimates are approximate")
    return shape, warning
