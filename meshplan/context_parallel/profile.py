"""What a context-parallel rank's attention costs beyond its share of the unsharded attention, measured by the
``meshplan profile`` job (every rank at once; :attr:`meshplan.axis.Axis.profile`) and priced by
:func:`meshplan.context_parallel.costs.cp_attention_time`.

Under ``allgather_kv`` a cp rank attends its head-tail chunks to the gathered keys block by block
(:func:`~meshplan.context_parallel.attention.allgather_kv_attention`; on a CPU a mask-free prefix and a causal
diagonal per chunk, merged by their log-sum-exp, the backward the same blocks), where a rank without cp runs one
causal kernel over the sequence. Its FLOPs are ``1/cp`` of that kernel's; its time is more: twice the kernel
calls on smaller blocks, the merges, the GQA key copies per block. Measured in one process on the 2-core host
of 2026-11-27 (the reference shape, 4 sequences, two runs): a cp 2 rank 1.3×, cp 4 1.0-1.6×, cp 8 2.9-3.5× its
share (at 8 sequences 1.1-1.3×, 1.3-1.6×, 2.3×: the blocks' fixed costs weigh less).
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["DEGREES", "measure_sharded_attention"]

#: the cp degrees the profile times
DEGREES = (2, 4, 8)


def measure_sharded_attention(timed: Callable, mean: Callable, device: torch.device, dtype: torch.dtype,
                              shape: dict, batch: int = 4) -> dict:
    """``{"sharded_attention": [[cp, factor], ...]}``: a cp rank's attention (forward and backward, its queries
    against the whole sequence's keys, as it runs after the gather) over ``1/cp`` of the unsharded causal
    attention of the same sequences, both timed here (the mean of cp ranks 0 and ``cp − 1``; ``shape``: the
    profile's reference block, ``hidden``, ``heads``, ``kv_heads``, ``seq``).

    Example::

        >>> measure_sharded_attention(timed, mean, torch.device("cpu"), torch.float32, REFERENCE["cpu"])
        {'sharded_attention': [[2, 1.4], [4, 2.1], [8, ...]]}
    """
    from meshplan.context_parallel.attention import _causal
    heads, seq = shape["heads"], shape["seq"]
    d = shape["hidden"] // heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, d, device=device, dtype=dtype, requires_grad=True)
               for h in (heads, shape["kv_heads"], shape["kv_heads"]))
    gqa = heads != shape["kv_heads"]
    whole = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward(),
                  reps=3, window=0.1)
    kw = {"dropout_p": 0.0, "scale": None, "enable_gqa": gqa}
    factors = []
    for cp in (n for n in DEGREES if seq % (2 * n) == 0):
        local = q.detach()[..., : seq // cp, :].clone().requires_grad_()
        ranks = [timed(lambda: _causal(local, k, v, kw, cp, r, True, {}).sum().backward(), reps=3, window=0.1)
                 for r in (0, cp - 1)]
        factors.append([cp, mean(cp * statistics.fmean(ranks) / whole)])
    return {"sharded_attention": factors}
