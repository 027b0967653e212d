"""One candidate's step: time, throughput, MFU and memory per rank. Torch-free.

Step time = the pipeline (each microbatch's compute and exposed tp and axis-unit communication on the slowest rank,
times the microbatches, stretched by the schedule's idle fraction) + the exposed pipeline sends + the exposed
data-parallel traffic (what does not hide behind compute, per the cluster's ``overlap``) + the optimizer step +
the step's small all-reduces + what the FLOP and byte counts leave out (:mod:`meshplan.solver.overheads`:
DTensor dispatch and FSDP2 hooks per microbatch, the optimizer's DTensor ops and the pipeline schedule's actions
per step, each a count times a time ``meshplan profile`` measured) (with CPU offload the optimizer step and the parameter and gradient copies run at
the host's bandwidth). On a host running more ranks than cores (``Cluster.oversubscription`` o > 1) the
bubble costs only what the busy ranks cannot take over, slot by slot of the fill and drain
(:func:`meshplan.pipeline.costs.stretch`). Idle
fractions (``docs/pipeline.md``, measured there by replaying each torch
schedule): ``(p−1)/(m+p−1)`` for GPipe and 1F1B, ``(p−1)/(v·m+p−1)`` interleaved, ``(p−1)/(3v·m+p−1)`` for the
zero-bubble and V schedules (a split backward fills the bubble).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.solver.units import COST_UNITS as UNITS  # the units the per-microbatch terms take (in_solver)
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.collectives import Collective, fsdp_units, step_collectives
from meshplan.solver.compute import block_time, end_time, model_flops_per_token
from meshplan.solver.host_step import clip_time, optimizer_time
from meshplan.solver.memory import Memory, block_kinds, rank_memory, shard_sizes
from meshplan.solver.moe_costs import moe_block_time
from meshplan.solver.overheads import (microbatch_overhead, replicate_units, step_overhead, sync_overhead,
                                       tp_overhead)
from meshplan.solver.placement import Placement
from meshplan.solver.shape import ModelShape

__all__ = ["Estimate", "evaluate", "peak_memory"]

#: the collective axes exposed in each microbatch: the axes that are units (in order) but those with a part of their
#: own (:attr:`~meshplan.axis.AxisCosts.exposed`)
_PER_MICROBATCH = tuple(axis.name for axis in UNITS if axis.costs.per_microbatch)
_BLOCKING = tuple(axis.name for axis in UNITS if axis.costs.blocking)


@dataclass(frozen=True)
class Estimate:
    """What one candidate costs.

    Attributes:
        candidate: the layout. step_time: seconds per optimizer step. tokens_per_s: over the whole job.
        tokens_per_s_device: per device. mfu: model FLOPs utilisation (of the compute dtype's peak).
        tflops_device: model TFLOP/s per device. memory: the most loaded rank's. memory_rank: its pipeline rank.
        parts: seconds by part (``compute``, ``bubble``, ``tp``, each axis unit's name, ``pp``, ``dp``,
            ``optimizer``, ``clip``, ``step``, ``overheads``: DTensor dispatch and FSDP2 hooks, ``tp_overheads``: the
            tensor-parallel style hooks and collectives between computes, ``optimizer_dispatch``, ``pp_actions``,
            ``moe_microbatch``: an eager expert loop's per-microbatch cost, :mod:`meshplan.solver.moe_costs`,
            ``sync``: the ranks' wait at blocking collectives, :func:`meshplan.solver.overheads.sync_overhead`).
        collectives: pipeline rank 0's collectives per step.
    """

    candidate: Candidate
    step_time: float
    tokens_per_s: float
    tokens_per_s_device: float
    mfu: float
    tflops_device: float
    memory: Memory
    memory_rank: int
    parts: dict = field(default_factory=dict)
    collectives: list = field(default_factory=list)


def _comm(colls: list[Collective], cl: Cluster, axes: tuple[str, ...], times: dict) -> dict[str, float]:
    """Seconds of the collectives on ``axes``, by axis (``times`` memoises :meth:`Cluster.comm_time`)."""
    out = {a: 0.0 for a in axes}
    for x in colls:
        if x.axis in out:
            key = ("send" if x.kind == "recv" else x.kind, x.group.size, x.group.nodes, x.nbytes)
            if key not in times:
                times[key] = cl.comm_time(*key)
            out[x.axis] += x.count * times[key]
    return out


def _rank_microbatch(s: ModelShape, c: Candidate, tr: Training, cl: Cluster, place: Placement, r: int,
                     memo: dict, times: dict) -> tuple[float, float, dict]:
    """``(compute seconds, executed FLOPs, {axis: comm seconds, "colls": collectives})`` of pipeline rank ``r`` per
    microbatch."""
    secs = flops = loop = 0.0
    for (moe, ckpt), n in block_kinds(s, c, place, r, memo).items():
        key = ("time", moe, ckpt)
        if key not in memo:
            memo[key] = block_time(s, c, tr, cl, moe, ckpt)
        secs += n * memo[key][0]
        flops += n * memo[key][1]
        loop += n * moe_block_time(s, c, tr.act_bytes, cl, ckpt) if moe else 0.0
    secs += end_time(s, c, tr, cl, *place.ends_of(r))
    colls = step_collectives(s, c, tr, place, r, memo)
    comm = {a: v / c.microbatches for a, v in _comm(colls, cl, _PER_MICROBATCH, times).items()}
    held = fsdp_units(s, c, place, r, memo)
    roots = replicate_units(c)  # DDP: torch's replicate, one FSDP2 unit per root holding all its parameters
    units = sum(n for _, _, d, n in held if d > 1) + roots  # FSDP2's
    unit_bytes = tr.act_bytes * sum(p * n for _, p, d, n in held if d > 1 or roots)  # their copies
    redist = sum(x.count for x in colls if x.axis == "tp") / c.microbatches  # each a DTensor redistribution
    over = microbatch_overhead(s, c, cl, place, r, units, memo, redist, unit_bytes)
    tp_over = tp_overhead(s, c, cl, place, r, redist, memo)
    sync = sync_overhead(colls, _BLOCKING, secs + loop, c.microbatches, cl)
    return secs, flops, {**comm, "overheads": over, "tp_overheads": tp_over, "moe_microbatch": loop, "sync": sync,
                         "colls": colls}


def _ranks(s: ModelShape, c: Candidate, place: Placement, memo: dict) -> list[int]:
    """One pipeline rank per distinct ``(blocks by kind, ends)``: the lowest, which holds the most microbatches
    (kept on the placement per checkpointing choice: the same for every microbatching)."""
    key = ("ranks", c.ac, c.ac_every, c.ac_ops, c.ac_policy)
    if key in place.memo:
        ranks, kinds = place.memo[key]
        memo.update(kinds)
        return ranks
    seen: dict = {}
    for r in range(c.pp):
        sig = (tuple(sorted(block_kinds(s, c, place, r, memo).items())), place.ends_of(r))
        seen.setdefault(sig, r)
    ranks = sorted(seen.values())
    place.memo[key] = (ranks, {("kinds", r): memo[("kinds", r)] for r in ranks})
    return ranks


def peak_memory(s: ModelShape, c: Candidate, tr: Training, place: Placement,
                memo: dict | None = None) -> tuple[Memory, int]:
    """``(memory, pipeline rank)`` of the most loaded rank (cheaper than :func:`evaluate`: the search rejects
    candidates that do not fit before timing them)."""
    memo = {} if memo is None else memo
    mems = {r: rank_memory(s, c, tr, place, r, memo) for r in _ranks(s, c, place, memo)}
    worst = max(mems, key=lambda r: mems[r].total)
    return mems[worst], worst


def evaluate(s: ModelShape, c: Candidate, tr: Training, cl: Cluster, place: Placement | None = None,
             times: dict | None = None, memo: dict | None = None) -> Estimate:
    """Time and memory of candidate ``c`` (assumed valid: see :mod:`meshplan.solver.rules`).

    Args:
        place: the candidate's :class:`Placement` (default: built here). times: a dict memoising collective
            times across candidates (:func:`meshplan.solver.search.search` passes one per search).
    """
    place = place or Placement(c, s.layers, cl.gpus_per_node)
    memo = {} if memo is None else memo
    times = {} if times is None else times
    per_rank = {r: _rank_microbatch(s, c, tr, cl, place, r, memo, times) for r in _ranks(s, c, place, memo)}
    t_mb = {r: sum((v[2][a] for a in _PER_MICROBATCH),
                   v[0] + v[2]["overheads"] + v[2]["tp_overheads"] + v[2]["moe_microbatch"] + v[2]["sync"])
            for r, v in per_rank.items()}
    slow = max(t_mb, key=t_mb.get)
    m = c.microbatches
    mem, worst = peak_memory(s, c, tr, place, memo)
    extra = step_overhead(c, cl, mem.tensors, max(shard_sizes(c, place)) > 1)
    busy = m * t_mb[slow] + extra["pp_actions"]
    pipeline = busy
    for axis in UNITS:  # the axes' bubbles (idle ranks' cores go to the busy ones while more are busy than cores)
        pipeline *= axis.costs.stretch(c, cl.oversubscription)
    colls = per_rank[slow][2]["colls"]
    comm = _comm(colls, cl, ("dp", "step"), times)
    compute = m * per_rank[slow][0]
    own = {axis.name: axis.costs.exposed(colls, cl, c) for axis in UNITS if axis.costs.exposed is not None}
    dp_calls = sum(x.count for x in colls if x.axis == "dp")
    ends = 2 * comm["dp"] / dp_calls if dp_calls else 0.0  # the first gather and the last reduction stay exposed
    dp_exposed = (1 - cl.overlap) * comm["dp"] + cl.overlap * max(ends, comm["dp"] - compute)
    optimizer = optimizer_time(cl, tr, mem.numel, mem.tensors)
    clip = clip_time(cl, tr, mem.numel, mem.tensors)
    step = pipeline + sum(own.values()) + dp_exposed + optimizer + clip + extra["optimizer_dispatch"] + comm["step"]
    tokens = tr.tokens / step
    model = model_flops_per_token(s, tr.seq) * tokens / c.world
    parts = {"compute": compute, "bubble": pipeline - busy, **{a: m * per_rank[slow][2][a] for a in _PER_MICROBATCH},
             **own, "dp": dp_exposed, "optimizer": optimizer, "clip": clip, "step": comm["step"],
             "overheads": m * per_rank[slow][2]["overheads"], "tp_overheads": m * per_rank[slow][2]["tp_overheads"],
             "moe_microbatch": m * per_rank[slow][2]["moe_microbatch"], "sync": m * per_rank[slow][2]["sync"],
             **extra}
    colls0 = per_rank[0][2]["colls"] if 0 in per_rank else step_collectives(s, c, tr, place, 0, memo)
    return Estimate(c, step, tokens, tokens / c.world, model / cl.peak(tr.dtype), model / 1e12, mem, worst,
                    parts, colls0)
