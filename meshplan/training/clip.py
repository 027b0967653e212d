"""Mesh-aware gradient clipping: the total L2 norm over every rank and mesh with ONE all-reduce.

Each gradient's local ‖g‖² is weighted by ``(product of its Shard mesh sizes) / world``, i.e. divided by how
many ranks hold the same values, so no ``Replicate`` copy is double counted and any number of meshes
(FSDP×TP, HSDP, plain) shares the collective. :func:`meshplan.train_step` adds its loss sum to the same buffer.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshplan._torch import StridedShard, foreach_mul_, local_tensor

__all__ = ["clip_grad_norm_", "clip_with", "comm_device"]


def _grad_norm_parts(params: Iterable[nn.Parameter], ranks_per_stage: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """Σ local‖g‖² weighted by 1/(number of ranks holding the same values): a float64 scalar on ``device``."""
    norms, weights = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
            sharded = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements)
                                if isinstance(pl, (Shard, StridedShard)))
            g = local_tensor(g)
        else:
            sharded = 1
        at = torch.promote_types(g.dtype, torch.float32)  # bf16/fp16 accumulate in fp32; fp64 stays fp64
        norms.append(torch.linalg.vector_norm(g.detach(), dtype=at).double().to(device or g.device))
        weights.append(sharded / ranks_per_stage)
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return (torch.stack(norms) ** 2 * torch.tensor(weights, dtype=torch.float64, device=norms[0].device)).sum()


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, *, distributed: bool = True,
                    pp: int | None = None) -> float:
    """Clip gradients by their total L2 norm over every rank, with ONE all-reduce.

    Each gradient's local ‖g‖² is weighted by ``(product of its Shard mesh sizes) / world``, i.e.
    divided by how many ranks hold the same values (Replicate dims and dims outside its mesh), and
    everything is summed with a single all-reduce over WORLD: no Replicate copy is double counted and
    any number of meshes (FSDP×TP, HSDP, plain) costs one collective.

    Args:
        params: the parameters (plain tensors or DTensors).
        max_norm: the maximum total norm.
        distributed: sum over WORLD (False: local only).
        pp: pipeline stages the parameters are spread over (each stage's are held by world/pp ranks);
            default: the active topology's pp, else 1.

    Returns:
        The total norm before clipping (as ``torch.nn.utils.clip_grad_norm_``, but a float).

    Example::

        >>> norm = clip_grad_norm_(model.parameters(), 1.0)
    """
    if pp is None:
        from meshplan.mesh.topology import current_topology
        topo = current_topology()
        pp = topo.layout.pp if topo is not None else 1
    return clip_with(params, max_norm, distributed, None, pp=pp)[0]


def clip_with(params: Iterable[nn.Parameter], max_norm: float, distributed: bool,
              extra: torch.Tensor | None, *, pp: int = 1,
              uncounted: Iterable[nn.Parameter] = ()) -> tuple[float, torch.Tensor | None]:
    """:func:`clip_grad_norm_`, all-reducing ``extra`` (float64, SUM) in the same collective.

    Args:
        params: the parameters (plain tensors or DTensors).
        max_norm: the maximum total norm.
        distributed: sum over WORLD (False, or no process group: local only).
        extra: values to sum over WORLD with the norm (``train_step``'s loss sum), or None.
        pp: pipeline stages: a parameter lives on world/pp ranks, not world.
        uncounted: parameters clipped but left out of the norm (the last stage's copy of a tied embedding:
            the first stage counts it).

    Returns:
        ``(total norm before clipping, extra summed over WORLD on the CPU)``.

    Example::

        >>> norm, (loss_sum,) = clip_with(model.parameters(), 1.0, True, local_loss_sum.reshape(1))
    """
    params = [p for p in params if p.grad is not None]
    dist_on = distributed and dist.is_initialized()
    world = dist.get_world_size() if dist_on else 1
    device = comm_device() if dist_on else torch.device("cpu")
    skip = {id(p) for p in uncounted}
    counted = [p for p in params if id(p) not in skip]
    buf = _grad_norm_parts(counted, world // pp if world % pp == 0 else world, device).reshape(1)
    if extra is not None:
        buf = torch.cat([buf, extra.reshape(-1).double().to(device)])
    if dist_on:
        dist.all_reduce(buf)
    buf = buf.cpu()  # the one host sync of clipping
    total = float(buf[0].sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0) if math.isfinite(total) else float("nan")
    grads = [local_tensor(p.grad) for p in params]
    if grads:
        foreach_mul_(grads, coef)
    return total, (buf[1:] if extra is not None else None)


def comm_device() -> torch.device:
    """The device the default process group communicates on."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
