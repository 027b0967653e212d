"""The order in which a model's forward first calls its modules, per rule pattern: the model picture draws its
modules in forward order (transformers registers a decoder layer's norms after its attention and MLP).

One forward of the small copy the cross-shard check runs (:func:`meshplan.model_copies.small_copy`: a
transformers model rebuilt from its shrunk config, another model copied empty), on
:func:`meshplan.checks.numerics.default_batch`, with a pre-hook on every module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan.plan_file.patterns import wildcard

__all__ = ["forward_order"]


def forward_order(model: nn.Module, tp: int, notes: list[str]) -> dict[str, int] | None:
    """``{wildcarded module path: rank of its first call}``, or None (with a note why) when the model cannot run.

    Args:
        model: the model checked (not changed).
        tp: the tensor-parallel degree (sizes of the small copy divisible by it).
        notes: gets one line when the order cannot be found.
    """
    from meshplan.model_copies import default_batch
    from meshplan.model_copies import small_copy
    try:
        small = small_copy(model, tp, notes)
        if small is None:
            return None
        batch = {k: v for k, v in default_batch(model, tp).items() if k != "labels"}
        order: dict[str, int] = {}
        handles = [m.register_forward_pre_hook(_recorder(wildcard(path), order))
                   for path, m in small.named_modules()]
        try:
            with torch.no_grad():
                small(**batch) if hasattr(small, "config") else small(*batch.values())
        finally:
            for h in handles:
                h.remove()
    except Exception as e:
        notes.append(f"modules drawn in registration order: the forward order is unknown ({type(e).__name__}: "
                     f"{' '.join(str(e).split())[:120]})")
        return None
    return order


def _recorder(path: str, order: dict[str, int]) -> Any:
    def hook(_m: nn.Module, _args: Any) -> None:
        order.setdefault(path, len(order))
    return hook
