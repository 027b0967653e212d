"""Final gradients after backward: no pending ``Partial`` grads, reduced in one collective.

With sequence parallelism the norm weights are ``Replicate`` DTensors whose
gradients come out ``Partial`` (each tp rank saw a different part of the
sequence). Stock DTensor leaves them so; AdamW then issues several
all-reduces per weight. meshplan queues one callback at the end of each
backward that all-reduces every such gradient in a single flat buffer per
(mesh, dtype) and stores it back as ``Replicate``, so optimizers and gradient
clipping see final gradients.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["PartialGradFinalizer", "finalize_partial_grads"]


def finalize_partial_grads(params) -> int:
    """All-reduce the ``Partial`` placements of these parameters' gradients, coalesced.

    Returns:
        The number of collectives issued (one per mesh and dtype that had any).
    """
    buckets: dict = defaultdict(list)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Partial))
            buckets[(g.device_mesh, dims, g.dtype)].append(p)
    for (mesh, dims, _), ps in buckets.items():
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in ps])
        for d in dims:  # one all-reduce per partial mesh dim (one in the 1-D tp case)
            flat = funcol.all_reduce(flat, "sum", (mesh, d))
        flat = funcol.wait_tensor(flat) if isinstance(flat, funcol.AsyncCollectiveTensor) else flat
        offset = 0
        for p in ps:
            local = p.grad.to_local()
            n = local.numel()
            placements = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in p.grad.placements)
            p.grad = DTensor.from_local(flat[offset:offset + n].view_as(local).clone(), mesh, placements,
                                        run_check=False, shape=p.grad.shape, stride=p.grad.stride())
            offset += n
    return len(buckets)


class PartialGradFinalizer:
    """Runs :func:`finalize_partial_grads` once at the end of every backward that touches ``params``.

    Args:
        params: the DTensor parameters whose gradients may come out ``Partial``.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self._queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params if p.requires_grad]

    def _on_grad(self, _p) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        self._queued = False
        finalize_partial_grads(self.params)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
