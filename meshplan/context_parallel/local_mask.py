"""The model's own mask of a shard, read: is it the causal mask, nothing, or exactly what an
:class:`~meshplan.context_parallel.masks.AttentionMask` builds over the local tokens? What the context-parallel
attention checks before it replaces the mask with the whole sequence's (:mod:`meshplan.context_parallel.attention`).
"""

from __future__ import annotations

import torch

from meshplan.context_parallel.masks import AttentionMask
from meshplan.errors import PlanError

__all__ = ["mask_is_causal", "causal_from_mask", "check_local_mask"]


def mask_is_causal(mask: torch.Tensor, length: int) -> bool | None:
    """True: ``mask`` is the causal mask of ``length`` queries and keys (bool or additive); False: it masks
    nothing; None: anything else."""
    if mask.shape[-2:] != (length, length):
        return None
    keep = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if mask.dtype != torch.bool and bool((mask[keep] != 0).any()):
        return None  # an additive bias, not a mask
    tril = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    if bool((keep == tril).all()):
        return True
    return False if bool(keep.all()) else None


def causal_from_mask(attn_mask: torch.Tensor | None, is_causal: bool, length: int, where: str) -> bool:
    """Whether the call is causal, given the model's mask (local-causal or empty; anything else refused).

    Raises:
        PlanError: a mask that is neither causal nor empty.
    """
    if attn_mask is None:
        return is_causal
    causal = mask_is_causal(attn_mask, length)
    if causal is None:
        raise PlanError(f"context_parallel: {where} passes scaled_dot_product_attention a mask that is neither "
                        f"causal nor empty (padding, a sliding window or a bias); context parallelism supports "
                        f"causal and full attention over whole sequences")
    return causal


def _keep_of(attn_mask: torch.Tensor) -> torch.Tensor | None:
    """The boolean keep of a bool or additive mask, or None when it is an additive bias (finite nonzero values)."""
    if attn_mask.dtype == torch.bool:
        return attn_mask
    keep = attn_mask > torch.finfo(attn_mask.dtype).min / 2
    return None if bool((attn_mask[keep] != 0).any()) else keep


def check_local_mask(attn_mask: torch.Tensor | None, is_causal: bool, mask: AttentionMask, length: int,
                     where: str) -> None:
    """Check the model's own mask of a shard is what ``mask`` builds for ``length`` local tokens (none, causal, or
    causal within the same window): the mask meshplan applies over the whole sequence is then the model's.

    Raises:
        PlanError: the model masks otherwise (padding, a bias, another window): naming the layer and both.
    """
    pos = torch.arange(length, device=attn_mask.device if attn_mask is not None else None)
    want = mask.keep(pos, pos)
    if attn_mask is None:
        plain = torch.ones(length, length, dtype=torch.bool, device=pos.device)
        ok = bool((plain.tril() if is_causal else plain).eq(True if want is None else want).all())
        got = "no mask" + (" (is_causal)" if is_causal else "")
    else:
        keep = _keep_of(attn_mask) if attn_mask.shape[-2:] == (length, length) else None
        ok = keep is not None and bool((keep == (want if want is not None else True)).all())
        got = f"a mask of shape {tuple(attn_mask.shape)}" if keep is None or attn_mask.shape[-2:] != (length, length) \
            else "a mask that differs"
    if not ok:
        raise PlanError(f"context_parallel: {where} passes scaled_dot_product_attention {got}; expected the mask of "
                        f"{mask} for its {length} local tokens (none, causal, or causal within the window): a "
                        f"padding mask, a bias or another window cannot be made exact across shards")
