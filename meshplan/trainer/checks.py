"""The trainer's shape checks: what the layout needs of ``seq_len``, ``global_batch`` and ``microbatches``, asked
before any process group exists (torch-free). Each problem is one ``PlanError`` naming the setting and the valid
values."""

from __future__ import annotations

from meshplan.context_parallel.chunks import check_seq_len
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan

__all__ = ["check_shapes"]


def _valid(n: int, unit: int) -> str:
    lo, hi = n // unit * unit, (n // unit + 1) * unit
    return f"{lo}, {hi}" if lo else f"{hi}"


def check_shapes(plan: Plan, world: int) -> None:
    """Refuse a ``training`` section the layout cannot split on ``world`` processes.

    Raises:
        PlanError: the layout does not fit ``world``; ``seq_len`` not divisible by what cp and sequence
            parallelism cut it into; ``global_batch`` not divisible by the data-parallel ranks; a rank's batch not
            divisible by the microbatches (the pipeline's or gradient accumulation's).
    """
    tr = plan.training
    assert tr is not None
    from meshplan.plan_file.layout import Layout
    lay = (plan.layout or Layout()).resolve(world)
    tp_plan = plan.tensor_parallel
    sp = lay.tp if tp_plan is not None and tp_plan.sequence_parallel is True else 1
    cp_plan = plan.context_parallel
    if lay.cp > 1:
        why = check_seq_len(tr.seq_len, lay.cp, cp_plan.load_balance if cp_plan else True, sp)
        if why:
            raise PlanError(f"training.seq_len: {why}")
    elif sp > 1 and tr.seq_len % sp:
        raise PlanError(f"training.seq_len: {tr.seq_len} is not divisible by tp = {sp} (sequence parallelism "
                        f"splits each sequence over the tp ranks); valid: multiples of {sp}, e.g. "
                        f"{_valid(tr.seq_len, sp)}")
    dp = lay.dp
    if tr.global_batch % dp:
        raise PlanError(f"training.global_batch: {tr.global_batch} is not divisible by the {dp} data-parallel ranks "
                        f"of {world} processes; valid: multiples of {dp}, e.g. {_valid(tr.global_batch, dp)}")
    local = tr.global_batch // dp
    micro = plan.pipeline.microbatches if lay.pp > 1 and plan.pipeline is not None else tr.microbatches
    key = "pipeline.microbatches" if lay.pp > 1 else "training.microbatches"
    if local % micro:
        raise PlanError(f"{key}: each data-parallel rank's batch of {local} (global_batch {tr.global_batch} / "
                        f"{dp}) is not divisible by {micro} microbatches; make global_batch a multiple of "
                        f"{dp * micro}")
