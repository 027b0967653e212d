"""Tensor parallelism's terms in the solver's cost model (torch-free; :mod:`meshplan.solver` reaches them through
the unit, :mod:`meshplan.tensor_parallel.unit`).

Counted as meshplan runs them (``tests/test_solver_estimate.py`` checks each count against a fake-process-group
step recorded op by op; ``docs/tensor-parallel.md`` states them), per microbatch and block: sequence parallel:
forward one all-gather per block input (2 in a dense block, 1 in an MoE block whose experts are not tp-split) and
one reduce-scatter per row-parallel output; backward the reverse, plus the re-gather of each block input
(``save_gathered_inputs: false``) unless the block is checkpointed, whose recompute repeats the forward's
collectives up to the last one it needs; ``policy: megatron`` keeps the reduced outputs and repeats the
all-gathers only. Without sequence parallelism all-reduces take their place. The embedding
reduces its output, the head gathers its input; ``loss_parallel`` adds three small all-reduces; replicated
parameters' gradients are summed once per step. The dense model's sharding over tp (parameters, activations) is
the solver's own (:mod:`meshplan.solver.memory`): every term there divides by the degree.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import AxisCosts, AxisTerms

__all__ = ["TERMS", "tp_training", "tp_collectives", "tp_block_activations", "tp_first_stage_activations", "tp_sequence_problem",
           "tp_run_problem"]


def _tp_block(c: Any, tr: Any, moe: bool, ckpt: bool, g: Any, nbytes: float) -> list:
    """One block's tensor-parallel collectives for one microbatch."""
    from meshplan.solver.terms import Collective
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
    if c.ac == "selective" and c.ac_policy == "megatron":  # policy megatron keeps the reductions: gathers rerun
        out.append(Collective("tp", "all_gather", g, nbytes, n_in, "recompute: block inputs"))
    elif ckpt:
        out += [Collective("tp", "all_gather", g, nbytes, n_in, "recompute: block inputs"),
                Collective("tp", "reduce_scatter", g, nbytes, n_out - trailing, "recompute: row-parallel outputs")]
    elif not tr.save_gathered_inputs:
        out.append(Collective("tp", "all_gather", g, nbytes, n_in, "re-gather of saved block inputs (backward)"))
    return out


def tp_collectives(s: Any, c: Any, tr: Any, place: Any, pp_rank: int, memo: dict) -> list:
    """The tp collectives of pipeline rank ``pp_rank`` in one step
    (:class:`~meshplan.solver.collectives.Collective`)."""
    from meshplan.solver.candidate import DTYPE_BYTES
    from meshplan.solver.terms import Collective, block_kinds, block_tensors
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
    norms = sum(r * p for r, p in block_tensors(s, False, c)[0] if p == 1) * sum(kinds.values())
    out.append(Collective("tp", "all_reduce", g, norms * DTYPE_BYTES[tr.reduce_dtype], 1,
                          "replicated parameters' gradients (once per step)"))
    return out


def tp_block_activations(s: Any, c: Any, tr: Any, kv_width: float) -> float:
    """Nothing beyond the dense block: the solver's block already divides by tp."""
    return 0.0


def tp_first_stage_activations(c: Any) -> float:
    """Nothing beyond the dense first stage."""
    return 0.0


def tp_sequence_problem(seq: int, degree: int, tp_sequence: int) -> "str | None":
    """None: sequence parallelism's split of the sequence is checked with the sequence axes' own chunks."""
    return None


def tp_run_problem(c: Any, tr: Any, device: str) -> "tuple[str, str] | None":
    """None: tensor parallelism runs on every device."""
    return None


def tp_training(plan: Any) -> dict:
    """The solver's sequence-parallel, loss-parallel and saved-input settings of the section."""
    section, tp = plan.tensor_parallel, plan.layout.tp if plan.layout is not None else 1
    return {"sequence_parallel": bool(section is not None and section.sequence_parallel is True and tp > 1),
            "loss_parallel": bool(section is not None and section.loss_parallel),
            "save_gathered_inputs": bool(section is not None and section.save_gathered_inputs)}


#: the unit as the solver sees it (the same terms as :data:`meshplan.tensor_parallel.unit.AXIS`)
TERMS = AxisTerms(name="tp", section="tensor_parallel", training=tp_training, example_plan="plans/llama.yaml",
                  costs=AxisCosts(collectives=tp_collectives, block_activations=tp_block_activations,
                                  first_stage_activations=tp_first_stage_activations,
                                  sequence_problem=tp_sequence_problem, run_problem=tp_run_problem, blocking=True))
