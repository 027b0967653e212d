"""Every collective one rank issues in one training step, by mesh axis, with its bytes. Torch-free.

Counted as meshplan runs them (``tests/test_solver_estimate.py`` checks each count against a fake-process-group
step recorded op by op; ``docs/tensor-parallel.md`` states the tensor-parallel ones):

* **tp**, per microbatch and block: sequence parallel: forward one all-gather per block input (2 in a dense
  block, 1 in an MoE block whose experts are not tp-split) and one reduce-scatter per row-parallel output;
  backward the reverse, plus the re-gather of each block input (``save_gathered_inputs: false``) unless the
  block is checkpointed, whose recompute repeats the forward's collectives up to the last one it needs. Without
  sequence parallelism all-reduces take their place. The embedding reduces its output, the head gathers its
  input; ``loss_parallel`` adds three small all-reduces; replicated parameters' gradients are summed once per
  step.
* the axes that are units (:data:`meshplan.solver.units.UNITS`): each unit's ``costs.collectives``, under its own
  name (the stage boundaries' sends, the all-to-alls of an MoE block, K|V's all-gathers: each unit's ``costs.py``).
* **dp**: FSDP2 per unit (each block, an MoE block's experts over edp, and the root): all-gathers before forward
  and, resharded, before backward; one reduce-scatter of its gradients (HSDP: then an all-reduce over the
  replicas); parameters stay gathered between accumulated microbatches (``accumulate_unsharded``). Under a
  pipeline schedule a resharded block gathers for every forward and once more for the first backward that
  follows forwards (``m + 1``: backwards keep it gathered until the step's last). DDP: one all-reduce per step.
* **step**: the global token count and the clipping norm, one all-reduce each over the world.
"""

from __future__ import annotations

from meshplan.solver.units import COST_UNITS, UNITS
from meshplan.solver.candidate import DTYPE_BYTES, Candidate, Training
from meshplan.solver.memory import _block_tensors, _end_tensors, shard_sizes
from meshplan.solver.placement import Group, Placement
from meshplan.solver.shape import ModelShape
from meshplan.solver.terms import Collective, block_kinds

__all__ = ["Collective", "step_collectives"]




def _tp_block(c: Candidate, tr: Training, moe: bool, ckpt: bool, g: Group, nbytes: float) -> list[Collective]:
    """One block's tensor-parallel collectives for one microbatch."""
    n_in = 1 if moe and c.etp == 1 else 2
    n_out, trailing = n_in, 0 if moe and c.etp == 1 else 1
    if not (tr.sequence_parallel):
        out = [Collective("tp", "all_reduce", g, nbytes, n_out, "row-parallel outputs (forward)"),
               Collective("tp", "all_reduce", g, nbytes, n_in, "block input gradients (backward)")]
        return out + ([Collective("tp", "all_reduce", g, nbytes, n_out - trailing, "recompute")] if ckpt else [])
    out = [Collective("tp", "all_gather", g, nbytes, n_in, "block inputs (forward)"),
           Collective("tp", "reduce_scatter", g, nbytes, n_out, "row-parallel outputs (forward)"),
           Collective("tp", "reduce_scatter", g, nbytes, n_in, "block input gradients (backward)"),
           Collective("tp", "all_gather", g, nbytes, n_out, "row-parallel output gradients (backward)")]
    if ckpt:
        out += [Collective("tp", "all_gather", g, nbytes, n_in, "recompute: block inputs"),
                Collective("tp", "reduce_scatter", g, nbytes, n_out - trailing, "recompute: row-parallel outputs")]
    elif not tr.save_gathered_inputs:
        out.append(Collective("tp", "all_gather", g, nbytes, n_in, "re-gather of saved block inputs (backward)"))
    return out


def _tp(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int,
        memo: dict) -> list[Collective]:
    g, m = place.groups["tp"], c.microbatches
    tokens = c.rank_tokens(tr.seq)
    stream = tokens * s.hidden * tr.act_bytes
    out = []
    kinds = block_kinds(s, c, place, pp_rank, memo)
    for (moe, ckpt), n in kinds.items():
        out += [Collective(x.axis, x.kind, x.group, x.nbytes, x.count * n, x.what)
                for x in _tp_block(c, tr, moe, ckpt, g, stream)]
    first, last = place.ends_of(pp_rank)
    sp = tr.sequence_parallel
    if first:
        out += ([Collective("tp", "reduce_scatter", g, stream, 1, "embedding output (forward)"),
                 Collective("tp", "all_gather", g, stream, 1, "embedding output gradient (backward)")] if sp else
                [Collective("tp", "all_reduce", g, stream, 1, "embedding output (forward)")])
    if last:
        if sp:
            out += [Collective("tp", "all_gather", g, stream, 1, "head input (forward)"),
                    Collective("tp", "reduce_scatter", g, stream, 1, "head input gradient (backward)")]
        out.append(Collective("tp", "all_reduce", g, tokens * 4, 3, "loss_parallel: max, sum, loss") if tr.loss_parallel
                   else Collective("tp", "all_gather", g, tokens * s.vocab * tr.act_bytes, 1, "logits (forward)"))
    out = [Collective(x.axis, x.kind, x.group, x.nbytes, x.count * m, x.what) for x in out if x.count]
    norms = sum(r * p for r, p in _block_tensors(s, False, c)[0] if p == 1) * sum(kinds.values())
    out.append(Collective("tp", "all_reduce", g, norms * DTYPE_BYTES[tr.reduce_dtype], 1,
                          "replicated parameters' gradients (once per step)"))
    return out


def step_collectives(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int = 0,
                     memo: dict | None = None) -> list[Collective]:
    """The collectives of pipeline rank ``pp_rank`` in one step (its peers in the other axes issue the same); ``memo``
    shares per-block sizes between the ranks of one candidate."""
    out: list[Collective] = []
    memo = {} if memo is None else memo
    if c.tp > 1:
        out += _tp(s, c, tr, place, pp_rank, memo)
    for axis in COST_UNITS:  # the axes that are units (their own cost terms), in parallelize's order
        if axis.degree(c) > 1:
            out += axis.costs.collectives(s, c, tr, place, pp_rank, memo)
    out += _per_step(s, c, tr, place, pp_rank, memo)
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


def _per_step(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int,
              memo: dict) -> list[Collective]:
    """The collectives the axes issue once per step over this rank's parameter units (FSDP2/DDP's gradient
    reduction: :attr:`~meshplan.axis.AxisCosts.step_collectives`)."""
    units = _units(s, c, place, pp_rank, memo)
    return [x for axis in UNITS if axis.costs.step_collectives is not None
            for x in axis.costs.step_collectives(c, tr, place, units)]
