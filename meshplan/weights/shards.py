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


def local_slices(shape: tuple[int, ...], placements, mesh) -> list[list[tuple[int, int]]]:
    """This rank's index ranges per tensor dim: ``[[(start, stop), ...], ...]`` (several for a packed dim).

    ``Shard(d)`` follows ``torch.chunk``; ``_StridedShard(d, split_factor=k)`` gives one range in each
    of the k chunks (meshplan's packed weights). Replicate/Partial keep the whole dim.
    """
    out = [[(0, n)] for n in shape]
    coord = mesh.get_coordinate()
    for i, pl in enumerate(placements):
        if not isinstance(pl, (Shard, StridedShard)):
            continue
        d, size, c = pl.dim % len(shape), mesh.size(i), coord[i]
        k = getattr(pl, "split_factor", 1)
        new = []
        for lo, hi in out[d]:
            n = (hi - lo) // k  # each of the k packed chunks is chunked over the mesh dim like torch.chunk
            chunk = -(-n // size)
            a, b = min(n, c * chunk), min(n, c * chunk + chunk)
            new += [(lo + j * n + a, lo + j * n + b) for j in range(k)]
        out[d] = new
    return out


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
