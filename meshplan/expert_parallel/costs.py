"""Expert parallelism's terms in the solver's cost model (torch-free; :mod:`meshplan.solver` reaches them through
:data:`TERMS` (listed in :data:`meshplan.solver.units.UNITS`), the rest of meshplan through
:data:`meshplan.expert_parallel.unit.AXIS`).

* collectives: per MoE block and microbatch, one all-to-all of the token counts per expert (again in a recompute)
  and four of token rows (dispatch and combine, forward and backward; two more in a recompute); with etp 1 each
  tp rank routes its own tokens (1/tp of them); the rows are the busiest ep rank's (the model's ``expert_loads``:
  :func:`meshplan.solver.moe_costs.expert_imbalance`), whose transfer the all-to-all waits for;
* activations and refusals: none of its own (an MoE block's routing activations and the expert counts ep must
  divide are the model's: :mod:`meshplan.solver.memory`, :mod:`meshplan.solver.rules`).
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import AxisCosts, AxisTerms

__all__ = ["TERMS", "ep_collectives", "ep_block_activations", "ep_first_stage_activations", "ep_sequence_problem",
           "ep_run_problem"]


def ep_collectives(s: Any, c: Any, tr: Any, place: Any, pp_rank: int, memo: dict) -> list:
    """The ep collectives of pipeline rank ``pp_rank`` in one step
    (:class:`~meshplan.solver.collectives.Collective`)."""
    from meshplan.solver.moe_costs import expert_imbalance
    from meshplan.solver.terms import Collective, block_kinds
    g = place.groups["ep"]
    tokens = c.rank_tokens(tr.seq) / (c.tp if c.etp == 1 else 1)
    rows = tokens * s.top_k * s.hidden * tr.act_bytes * expert_imbalance(s, c.ep)  # the busiest rank's rows
    kinds = block_kinds(s, c, place, pp_rank, memo)
    moe = sum(n for (is_moe, _), n in kinds.items() if is_moe)
    ckpt, m = sum(n for (is_moe, ck), n in kinds.items() if is_moe and ck), c.microbatches
    return [Collective("ep", "all_to_all", g, s.experts * 8, (moe + ckpt) * m, "tokens per expert (forward)"),
            Collective("ep", "all_to_all", g, rows, (4 * moe + 2 * ckpt) * m, "token rows: dispatch and combine, "
                                                                             "forward and backward")]


def ep_block_activations(s: Any, c: Any, tr: Any, kv_width: float) -> float:
    """Nothing beyond the MoE block's own activations (the solver's memory model counts those at any ep)."""
    return 0


def ep_first_stage_activations(c: Any) -> float:
    """Nothing on the first stage."""
    return 0


def ep_sequence_problem(seq: int, ep: int, tp_sequence: int) -> str | None:
    """None: ep splits no sequence."""
    return None


def ep_run_problem(c: Any, tr: Any, device: str) -> tuple[str, str] | None:
    """None: the all-to-alls run on every device (gloo included)."""
    return None


#: the unit as the solver sees it (the same terms as :data:`meshplan.expert_parallel.unit.AXIS`)
TERMS = AxisTerms(name="ep", section="expert_parallel", training=lambda plan: {}, example_plan="plans/moe.yaml",
                  costs=AxisCosts(collectives=ep_collectives, block_activations=ep_block_activations,
                                  first_stage_activations=ep_first_stage_activations,
                                  sequence_problem=ep_sequence_problem, run_problem=ep_run_problem, blocking=True))
