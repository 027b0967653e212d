"""Torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``'s SDPA handlers), the plan's
``method: torch_ring``: the same pass-K/V schedule as meshplan's ``ring``
(:mod:`~meshplan.context_parallel.ring`), but each block runs torch's fused flash/efficient/cuDNN kernels. Kept
for CUDA, where those kernels are faster than meshplan's explicit block math; torch 2.13 runs it on CUDA only (the
plan check refuses it elsewhere), for causal or full attention (no window, soft-cap or documents) and equal head
counts (GQA's K/V are repeated first). The layout is the same head-tail one (torch's ``_HeadTailLoadBalancer``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from meshplan._torch import ring_attention_dispatch
from meshplan.context_parallel.attention import causal_from_mask, on_local_heads

__all__ = ["torch_ring_attention"]


@on_local_heads
def torch_ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, *, mesh: Any, load_balance: bool,
                   where: str = "attention") -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's shards, exact over the sequence, by torch's ring attention.

    Args: as :func:`~meshplan.context_parallel.attention.allgather_kv_attention`, with ``mesh`` the ``cp`` mesh.

    Returns:
        The output for this rank's queries (a DTensor when ``query`` is one).

    Raises:
        PlanError: a mask other than causal or none.
    """
    is_causal = causal_from_mask(attn_mask, is_causal, query.shape[-2], where)
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # the ring handlers take equal head counts
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    seq = Shard(query.dim() - 2)
    with ring_attention_dispatch(load_balance):
        q, k, v = (DTensor.from_local(t, mesh, [seq], run_check=False) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out.to_local()
