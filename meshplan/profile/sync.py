"""What a collective that blocks the compute costs beyond its own time: the ranks of its group wait for the
slowest to arrive. Measured by the ``meshplan profile`` job (every rank at once), priced by
:func:`meshplan.solver.overheads.sync_overhead` for the axes whose collectives sit between computes (those whose
unit sets :attr:`meshplan.axis.AxisCosts.blocking`).

A rank's compute between two such collectives (a *segment*) does not take the same time on every rank, nor twice
alike on one: the host schedules other threads and processes onto its cores, and ranks sharing a core take turns.
Without a collective the differences average out over a step; a collective ends every segment at the slowest
rank's pace. The loss per collective is measured as the ``(segment, seconds)`` curve of: groups of ``g``
consecutive ranks (all groups at once, ``g`` = 2, 4, … up to the world) running ``n`` segments of matmuls each
ended by a one-element all-reduce in the group, minus the same segments without it, minus the ``n`` all-reduces
back to back; per segment length (wall seconds with every rank computing, as the model prices compute).

Measured on the 2-core host of 2026-11-28 (one-off probes, noisy: ±50% between runs): world 2, segments of 5-23 ms
lost 9-28% of a segment per collective; world 4, 9-26 ms, 31-37%; world 8, 2 ms, 7-65% (groups of 2) to
105-174% (groups of 8). A training step of tp 2 at world 2 issues 48 such collectives about 27 ms apart.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["SEGMENTS", "consecutive_group", "measure_sync_loss"]

#: the segment lengths timed (wall seconds with every rank computing)
SEGMENTS = (0.003, 0.012, 0.048)
#: segments per timed run
RUN = 8


def consecutive_group(g: int):
    """This rank's group of ``g`` consecutive ranks (``g`` divides the world; every rank makes every such group, as
    ``new_group`` requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + g))) for start in range(0, world, g)]
    return groups[rank // g]


def _groups() -> dict[int, object]:
    """This rank's group of ``g`` consecutive ranks for every ``g`` = 2, 4, … dividing the world."""
    world, out, g = dist.get_world_size(), {}, 2
    while g <= world and world % g == 0:
        out[g] = consecutive_group(g)
        g *= 2
    return out


def _run(work, units: int, group, tiny: torch.Tensor, sync: bool) -> float:
    """Wall seconds of :data:`RUN` segments of ``units`` work calls, each ended by an all-reduce when ``sync``."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(RUN):
        for _ in range(units):
            work()
        if sync:
            dist.all_reduce(tiny, group=group)
    if tiny.device.type == "cuda":  # kernels and NCCL calls return before they end
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_sync_loss(mean, device: torch.device, reps: int = 3) -> dict:
    """``{"sync_loss": [[group, segment, seconds], ...]}``: the seconds a blocking collective over ``group`` ranks
    costs beyond its own time after a segment of ``segment`` seconds of compute (the mean over ranks of the median
    over ``reps`` interleaved runs); empty on one rank.

    Example::

        >>> measure_sync_loss(mean, torch.device("cpu"))   # world 2, 2 cores
        {'sync_loss': [[2, 0.003, 0.0004], [2, 0.012, 0.0021], [2, 0.048, 0.0090]]}
    """
    if dist.get_world_size() < 2:
        return {"sync_loss": []}
    a = torch.randn(128, 128, device=device)
    work = lambda: a @ a  # noqa: E731
    tiny = torch.zeros(1, device=device)
    per_unit = mean(_run(work, 20, None, tiny, False) / (20 * RUN))  # every rank computing
    out = []
    groups = _groups()
    for g, group in groups.items():
        for segment in SEGMENTS:
            units = max(1, round(segment / max(per_unit, 1e-9)))
            losses, segments = [], []
            for _ in range(reps):
                free = _run(work, units, group, tiny, False)
                alone = _run(work, 0, group, tiny, True)  # the all-reduces back to back
                synced = _run(work, units, group, tiny, True)
                losses.append((synced - free - alone) / RUN)
                segments.append(free / RUN)
            out.append([g, mean(statistics.median(segments)), max(mean(statistics.median(losses)), 0.0)])
    for group in groups.values():
        dist.destroy_process_group(group)
    return {"sync_loss": out}
