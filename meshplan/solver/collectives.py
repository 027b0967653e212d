"""Every collective one rank issues in one training step, by mesh axis, with its bytes. Torch-free.

Counted as meshplan runs them (``tests/test_solver_estimate.py`` checks each count against a fake-process-group
step recorded op by op; ``docs/tensor-parallel.md`` states the tensor-parallel ones):

* the axes that are units (:data:`meshplan.solver.units.UNITS`): each unit's ``costs.collectives``, under its own
  name (tensor parallelism's per-block conversions, the stage boundaries' sends, the all-to-alls of an MoE block,
  K|V's all-gathers: each unit's ``costs.py``).
* **dp**: FSDP2 per unit (each block, an MoE block's experts over edp, the embedding, and the final norm with the
  head, which is not resharded after forward; a tied embedding and head: the root): all-gathers before forward
  and, resharded, before backward; one reduce-scatter of its gradients (HSDP: then an all-reduce over the
  replicas); parameters stay gathered between accumulated microbatches (``accumulate_unsharded``). Under a
  pipeline schedule a resharded block gathers for every forward and once more for the first backward that
  follows forwards (``m + 1``: backwards keep it gathered until the step's last); with ``accumulate_unsharded:
  false`` it gathers and reduce-scatters every microbatch, as without a pipeline. DDP: one all-reduce per step.
  the plan's ``ends: vocab_parallel``: the embedding and head are no FSDP2 unit (the root holds the final
  norm); each microbatch their activations move instead (:func:`vocab_end_collectives`).
* **step**: the global token count and the clipping norm, one all-reduce each over the world.
"""

from __future__ import annotations

from meshplan.solver.units import COST_UNITS, UNITS
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.memory import _block_tensors, end_units, experts_even, shard_sizes
from meshplan.solver.placement import Group, Placement
from meshplan.solver.shape import ModelShape
from meshplan.solver.terms import Collective, block_kinds

__all__ = ["Collective", "step_collectives", "fsdp_units", "vocab_end_collectives"]


def step_collectives(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int = 0,
                     memo: dict | None = None) -> list[Collective]:
    """The collectives of pipeline rank ``pp_rank`` in one step (its peers in the other axes issue the same); ``memo``
    shares per-block sizes between the ranks of one candidate."""
    out: list[Collective] = []
    memo = {} if memo is None else memo
    for axis in COST_UNITS:  # the axes that are units (their own cost terms), in parallelize's order
        if axis.degree(c) > 1:
            out += axis.costs.collectives(s, c, tr, place, pp_rank, memo)
    out += _per_step(s, c, tr, place, pp_rank, memo)
    shard = place.groups["dp_shard"]
    if c.vocab_ends and shard.size > 1:  # the vocab-parallel ends' activations, each microbatch
        out += vocab_end_collectives(s, c, tr, shard, *place.ends_of(pp_rank))
    world = place.groups["world"]
    if world.size > 1:
        out += [Collective("step", "all_reduce", world, 8, 1, "global token count"),
                Collective("step", "all_reduce", world, 8 * (1 + (1 if tr.clip else 0)), 1, "gradient norm and "
                                                                                             "loss sum")]
    return [x for x in out if x.count > 0]


def fsdp_units(s: ModelShape, c: Candidate, place: Placement, pp_rank: int, memo: dict) -> list[tuple[str, int, int, int]]:
    """FSDP units of a pipeline rank: ``(kind, unsharded elements (padded), shard size, units of the kind)``."""
    d_dense, d_expert = shard_sizes(c, place)
    pad = lambda tensors, d: sum(-(-r // d) * d * p for r, p in tensors)  # noqa: E731
    units = []
    for moe, n in _moe_counts(block_kinds(s, c, place, pp_rank, memo)).items():
        key = ("unit", moe, d_dense, d_expert)
        if key not in memo:
            dense, expert = _block_tensors(s, moe, c)
            even = experts_even(s, c, d_expert)  # sharded on an inner dim: no padding
            memo[key] = (pad(dense, d_dense), sum(r * p for r, p in expert) if even else pad(expert, d_expert))
        units.append(("block", memo[key][0], d_dense, n))
        if memo[key][1]:
            units.append(("experts", memo[key][1], d_expert, n))
    for kind, tensors in end_units(s, c, place, pp_rank):  # the embedding, the head (or a tied root)
        units.append((kind, pad(tensors, d_dense), d_dense, 1))
    return units


def vocab_end_collectives(s: ModelShape, c: Candidate, tr: Training, group: Group, first: bool,
                          last: bool) -> list[Collective]:
    """The activation collectives of the plan's ``ends: vocab_parallel`` (torch's RowwiseParallel embedding and
    ColwiseParallel head over FSDP2's data mesh, the batch as their sharded input), each microbatch.

    Args:
        s: the model's shape. c: the candidate (microbatches, tokens). tr: the training (activation bytes).
        group: FSDP2's data-shard group (``n`` ranks). first / last: the rank holds the embedding / the head.

    Returns:
        :class:`~meshplan.solver.terms.Collective` s on the ``dp`` axis, ``nbytes`` the full buffer: the
        embedding's all-gather of the token ids and reduce-scatter of its output (forward), all-gather of the
        output's gradient (backward); the head's all-gather of its input, all-to-all of the logits from vocabulary
        shards to batch shards (forward, and its gradient back: on a CPU mesh DTensor runs an all-gather of the
        local logits instead), reduce-scatter of its input's gradient (backward).
    """
    n, m, b = group.size, c.microbatches, tr.act_bytes
    tokens, h = c.rank_tokens(tr.seq), s.hidden
    rows = n * tokens * h * b  # [n·tokens, hidden] in the compute dtype
    out = []
    if first:
        out += [Collective("dp", "all_gather", group, n * tokens * 8, m, "token ids (vocab-parallel embedding)"),
                Collective("dp", "reduce_scatter", group, rows, m, "embedding output (vocab-parallel)"),
                Collective("dp", "all_gather", group, rows, m, "embedding output gradient (vocab-parallel)")]
    if last:
        out += [Collective("dp", "all_gather", group, rows, m, "head input (vocab-parallel head)"),
                Collective("dp", "all_to_all", group, tokens * s.vocab * b, 2 * m,
                           "logits and their gradient, vocabulary to batch shards (vocab-parallel head)"),
                Collective("dp", "reduce_scatter", group, rows, m, "head input gradient (vocab-parallel)")]
    return out


def _moe_counts(kinds: dict) -> dict[bool, int]:
    out: dict[bool, int] = {}
    for (moe, _), n in kinds.items():
        out[moe] = out.get(moe, 0) + n
    return out


def _per_step(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int,
              memo: dict) -> list[Collective]:
    """The collectives the axes issue once per step over this rank's parameter units (FSDP2/DDP's gradient
    reduction: :attr:`~meshplan.axis.AxisCosts.step_collectives`)."""
    units = fsdp_units(s, c, place, pp_rank, memo)
    return [x for axis in UNITS if axis.costs.step_collectives is not None
            for x in axis.costs.step_collectives(c, tr, place, units)]
