"""Every collective one rank issues in one training step, by mesh axis, with its bytes. Torch-free.

Counted as meshplan runs them (``tests/test_solver_estimate.py`` checks each count against a fake-process-group
step recorded op by op; ``docs/tensor-parallel.md`` states the tensor-parallel ones):

* the axes that are units (:mod:`meshplan.axes`): each unit's ``costs.collectives``, under its own name (tensor
  parallelism's per-block conversions, the all-to-alls of an MoE block, K|V's all-gathers: each unit's
  ``costs.py``).
* **pp**: a send or receive per stage boundary a rank's stages touch, per microbatch and direction.
* **dp**: FSDP2 per unit (each block, an MoE block's experts over edp, and the root): all-gathers before forward
  and, resharded, before backward; one reduce-scatter of its gradients (HSDP: then an all-reduce over the
  replicas); parameters stay gathered between accumulated microbatches (``accumulate_unsharded``). Under a
  pipeline schedule a resharded block gathers for every forward and once more for the first backward that
  follows forwards (``m + 1``: backwards keep it gathered until the step's last). DDP: one all-reduce per step.
* **step**: the global token count and the clipping norm, one all-reduce each over the world.
"""

from __future__ import annotations

from meshplan.axes import AXES
from meshplan.solver.candidate import DTYPE_BYTES, Candidate, Training
from meshplan.solver.memory import _block_tensors, _end_tensors, shard_sizes
from meshplan.solver.placement import Group, Placement
from meshplan.solver.shape import ModelShape
from meshplan.solver.terms import Collective, block_kinds

__all__ = ["Collective", "step_collectives"]




def _pp(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int,
        memo: dict) -> list[Collective]:
    g = place.groups["pp"]
    sh = c.tp if tr.sequence_parallel and c.tp > 1 else 1
    act = c.rank_tokens(tr.seq) * s.hidden / sh * tr.act_bytes
    last = c.pp * c.vpp - 1
    sends = recvs = 0
    for st in place.stages_of(pp_rank):
        sends += (st < last) + (st > 0)  # forward to the next, gradient to the previous
        recvs += (st > 0) + (st < last)
    out = [Collective("pp", "send", g, act, sends * c.microbatches, "activations and their gradients", True),
           Collective("pp", "recv", g, act, recvs * c.microbatches, "activations and their gradients", True)]
    if s.tied_embeddings and c.pp > 1 and any(place.ends_of(pp_rank)):
        out.append(Collective("pp", "all_reduce", place.groups["embd"], s.vocab * s.hidden / c.tp * 4, 1,
                              "tied embedding gradient (first and last stage)"))
    return out


def step_collectives(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int = 0,
                     memo: dict | None = None) -> list[Collective]:
    """The collectives of pipeline rank ``pp_rank`` in one step (its peers in the other axes issue the same); ``memo``
    shares per-block sizes between the ranks of one candidate."""
    out: list[Collective] = []
    memo = {} if memo is None else memo
    for axis in AXES:  # the axes that are units (their own cost terms), in parallelize's order
        if axis.degree(c) > 1:
            out += axis.costs.collectives(s, c, tr, place, pp_rank, memo)
    if c.pp > 1:
        out += _pp(s, c, tr, place, pp_rank, memo)
    out += _dp(s, c, tr, place, pp_rank, memo)
    world = place.groups["world"]
    if world.size > 1:
        out += [Collective("step", "all_reduce", world, 8, 1, "global token count"),
                Collective("step", "all_reduce", world, 8 * (1 + (1 if tr.clip else 0)), 1, "gradient norm and "
                                                                                             "loss sum")]
    return [x for x in out if x.count > 0]


def _units(s: ModelShape, c: Candidate, place: Placement, pp_rank: int, memo: dict) -> list[tuple[str, int, int, int]]:
    """FSDP units of a pipeline rank: ``(kind, unsharded elements (padded), shard size, units of the kind)``."""
    d_dense, d_expert = shard_sizes(c, place)
    pad = lambda tensors, d: sum(-(-r // d) * d * p for r, p in tensors)  # noqa: E731
    units = []
    for moe, n in _moe_counts(block_kinds(s, c, place, pp_rank, memo)).items():
        key = ("unit", moe, d_dense, d_expert)
        if key not in memo:
            dense, expert = _block_tensors(s, moe, c)
            memo[key] = (pad(dense, d_dense), pad(expert, d_expert))
        units.append(("block", memo[key][0], d_dense, n))
        if memo[key][1]:
            units.append(("experts", memo[key][1], d_expert, n))
    ends = _end_tensors(s, c, place, pp_rank)
    if ends:
        units.append(("root", pad(ends, d_dense), d_dense, 1))
    return units


def _moe_counts(kinds: dict) -> dict[bool, int]:
    out: dict[bool, int] = {}
    for (moe, _), n in kinds.items():
        out[moe] = out.get(moe, 0) + n
    return out


def _dp(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int, memo: dict) -> list[Collective]:
    mode, m = c.mode, c.microbatches
    red, gat = DTYPE_BYTES[tr.reduce_dtype], tr.act_bytes
    units = _units(s, c, place, pp_rank, memo)
    if mode == "ddp":
        grads = sum(n * k for _, n, _, k in units)
        syncs = 1 if c.accumulate_unsharded or c.pp > 1 else m
        return [Collective("dp", "all_reduce", place.groups["dp"], grads * red, syncs, "gradients (DDP)", True)]
    out = []
    accumulate = m > 1 and c.pp == 1
    for kind, n, d, k in units:
        if d == 1:
            continue
        g = place.groups["edp" if kind == "experts" else "dp_shard"]
        reshard = tr.reshard_after_forward and kind != "root"
        if accumulate and c.accumulate_unsharded:
            gathers, syncs = 1, 1
        elif accumulate:
            gathers, syncs = m * (1 + reshard), m
        elif c.pp > 1:  # forwards gather, the first backward after them too; kept until the step's last backward
            gathers, syncs = (m + 1 if reshard else 1), 1
        else:
            gathers, syncs = 1 + reshard, 1
        out += [Collective("dp", "all_gather", g, n * gat, gathers * k, f"{kind} parameters", True),
                Collective("dp", "reduce_scatter", g, n * red, syncs * k, f"{kind} gradients", True)]
        if mode == "hsdp" and kind != "experts":
            out.append(Collective("dp", "all_reduce", place.groups["dp_replicate"], n / d * red, syncs * k,
                                  f"{kind} gradients over replicas (HSDP)", True))
    return out
