"""This rank's slices of a full tensor for any DTensor placements: how checkpoints load and meta-device models
materialize shard by shard (:mod:`meshplan.weights.load`, :mod:`meshplan.weights.materialize`).

``Shard(d)`` follows ``torch.chunk``; a strided shard (meshplan's packed weights,
:mod:`meshplan.tensor_parallel.packed`) takes one range in each of its fused parts.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import Shard

from meshplan._torch import StridedShard

__all__ = ["local_slices", "take_slices"]


def _chunk(idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``torch.chunk`` into exactly ``n`` pieces (trailing ones empty when it gives fewer), as DTensor shards."""
    pieces = list(torch.chunk(idx, n)) if idx.numel() else []
    return pieces + [idx[:0]] * (n - len(pieces))


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted-or-not indices → their contiguous ``(start, stop)`` runs, in order."""
    if idx.numel() == 0:
        return [(0, 0)]
    breaks = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, idx.numel()]
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(bounds, bounds[1:])]


def local_slices(shape: tuple[int, ...], placements, mesh) -> list[list[tuple[int, int]]]:
    """This rank's index ranges per tensor dim: ``[[(start, stop), ...], ...]`` (several for a strided dim).

    The placements apply left to right over the mesh dims, each to what the previous ones left, as DTensor
    shards: ``Shard(d)`` follows ``torch.chunk``; ``_StridedShard(d, split_factor=k)`` cuts the rest into k
    pieces, each chunked over the mesh dim, and keeps its chunk of every piece (meshplan's packed weights).
    Replicate/Partial keep the dim.

    A ``_StridedShard`` with a later placement on the same dim is FSDP2's data-parallel shard over a tensor- or
    expert-parallel one: FSDP2 chunks the shard those later placements leave (its local tensor), so it applies
    after them, as a plain chunk. For a ``Shard`` after it that is what DTensor's label says; for a packed
    ``_StridedShard`` after it (FSDP2 over a packed projection) DTensor's label (split factor tp) describes
    other rows than the ones the rank holds, and this function follows the data.
    """
    idx = [torch.arange(n) for n in shape]
    coord = mesh.get_coordinate()
    shards = [(i, pl) for i, pl in enumerate(placements) if isinstance(pl, (Shard, StridedShard))]
    dims = [pl.dim % len(shape) for _, pl in shards]
    fsdp = {i for n, (i, pl) in enumerate(shards) if isinstance(pl, StridedShard) and dims[n] in dims[n + 1:]}
    order = [(i, pl) for i, pl in shards if i not in fsdp] + [(i, pl) for i, pl in reversed(shards) if i in fsdp]
    for i, pl in order:
        d, size, c = pl.dim % len(shape), mesh.size(i), coord[i]
        k = getattr(pl, "split_factor", 1) if i not in fsdp else 1
        idx[d] = torch.cat([_chunk(piece, size)[c] for piece in _chunk(idx[d], k)])
    return [_runs(t) for t in idx]


def take_slices(read: Callable[[tuple[slice, ...]], torch.Tensor], ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Read the blocks of ``ranges`` with ``read(slices)`` and concatenate them (at most one multi-range dim)."""
    multi = [d for d, r in enumerate(ranges) if len(r) > 1]
    if not multi:
        return read(tuple(slice(a, b) for (a, b), in ranges))
    d = multi[0]
    parts = []
    for a, b in ranges[d]:
        sl = tuple(slice(x, y) if i != d else slice(a, b) for i, ((x, y), *_) in enumerate(ranges))
        parts.append(read(sl))
    return torch.cat(parts, dim=d)
