"""Data parallelism's terms in the solver's cost model, torch-free: the collectives FSDP2/HSDP/DDP issue once per
step over the parameters of one pipeline rank (:attr:`meshplan.axis.AxisCosts.step_collectives`). The solver hands
in the parameter units it counted (:func:`meshplan.solver.collectives.step_collectives`). :data:`TERMS` is the unit
as the solver sees it (listed in :data:`meshplan.solver.units.UNITS`)."""

from __future__ import annotations

from typing import Any

from meshplan.axis import AxisCosts, AxisTerms

__all__ = ["TERMS", "dp_step_collectives", "UNGATHERED_IN_BACKWARD"]

#: FSDP2 unit kinds not gathered again for backward: the input embedding's backward reads only the token ids
#: (:func:`meshplan.data_parallel.ends.reads_ids_only`)
UNGATHERED_IN_BACKWARD = frozenset({"embedding"})


def dp_step_collectives(c: Any, tr: Any, place: Any, units: list) -> list:
    """The gradient reduction (and FSDP2's parameter gathers) of one step.

    Args:
        c: the solver's candidate (mode, microbatches, pp, accumulate_unsharded).
        tr: its training settings (reduce dtype, activation bytes, reshard_after_forward).
        place: the placement (the ``dp``, ``dp_shard``, ``dp_replicate`` and ``edp`` groups).
        units: ``(kind, parameters, shard degree, count)`` per wrapped unit (experts, blocks, the embedding, the
            head; a tied embedding and head: the root).

    Returns:
        :class:`~meshplan.solver.terms.Collective` s on the ``dp`` axis: DDP's one all-reduce, else per unit an
        all-gather and a reduce-scatter (HSDP: an all-reduce over the replicas too).
    """
    from meshplan.solver.candidate import DTYPE_BYTES
    from meshplan.solver.terms import Collective
    mode, m = c.mode, c.microbatches
    red, gat = DTYPE_BYTES[tr.reduce_dtype], tr.act_bytes
    if mode == "ddp":
        grads = sum(n * k for _, n, _, k in units)
        syncs = 1 if c.accumulate_unsharded or c.pp > 1 else m
        return [Collective("dp", "all_reduce", place.groups["dp"], grads * red, syncs, "gradients (DDP)", True)]
    out = []
    for kind, n, d, k in units:
        if d == 1:
            continue
        gathers, syncs = _counts(c, tr, kind)
        g = place.groups["edp" if kind == "experts" else "dp_shard"]
        out += [Collective("dp", "all_gather", g, n * gat, gathers * k, f"{kind} parameters", True),
                Collective("dp", "reduce_scatter", g, n * red, syncs * k, f"{kind} gradients", True)]
        if mode == "hsdp" and kind != "experts":
            out.append(Collective("dp", "all_reduce", place.groups["dp_replicate"], n / d * red, syncs * k,
                                  f"{kind} gradients over replicas (HSDP)", True))
    return out


def _counts(c: Any, tr: Any, kind: str) -> tuple[int, int]:
    """``(gathers, reductions)`` of one FSDP2 unit per step: accumulation, resharding and the pipeline decide."""
    m = c.microbatches
    reshard = bool(tr.reshard_after_forward) and kind not in ("root", "head")  # kept gathered after forward
    again = reshard and kind not in UNGATHERED_IN_BACKWARD  # re-gathered for backward
    if m > 1 and not c.accumulate_unsharded:  # reduce-scattered and resharded every microbatch (pipeline too)
        return m * (1 + again), m
    if m > 1 and c.pp == 1:  # accumulated unsharded: one gather, one reduction
        return 1, 1
    if c.pp > 1:  # forwards gather, the first backward after them too; kept until the step's last backward
        return (m + again if reshard else 1), 1
    return 1 + again, 1


#: data parallelism's collectives run once per step, none per microbatch; its degree is no Candidate field (the
#: solver enumerates dp_replicate × dp_shard itself): not in the per-microbatch loops (``in_solver=False``)
TERMS = AxisTerms(name="dp", section="data_parallel", training=lambda plan: {}, example_plan="plans/llama_3d.yaml",
                  costs=AxisCosts(collectives=lambda *a: [], block_activations=lambda *a: 0.0,
                                  first_stage_activations=lambda c: 0.0, sequence_problem=lambda seq, d, t: None,
                                  run_problem=lambda c, tr, device: None, step_collectives=dp_step_collectives),
                  in_solver=False)
