"""Pipeline stage arithmetic, torch-free: blocks per stage, the stages a pp rank runs, and which schedule, ``vpp``
and microbatch counts work together.

:mod:`meshplan.pipeline` applies these rules to a model; :mod:`meshplan.solver` applies the same functions to every
candidate layout, so a layout the solver rejects fails ``meshplan.parallelize`` with the same words.
"""

from __future__ import annotations

from meshplan.errors import PlanError
from meshplan.plan_file.pipeline import MULTI_STAGE_SCHEDULES, V_SCHEDULES, Pipeline

__all__ = ["balanced", "local_stage_ids", "schedule_problem", "check_schedule", "SPLIT_BACKWARD", "other_degrees"]

#: schedules that split each backward into its input and weight halves (I, W)
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def balanced(n_blocks: int, n_stages: int, fewer_first: int = 0, fewer_last: int = 0) -> list[int]:
    """Blocks per stage: as equal as possible, the first/last stage given ``fewer_*`` fewer.

    As torchtitan's ``first_stage_less_layers``: the embedding (head) weighs ``fewer_first`` (``fewer_last``)
    blocks and the ``n_blocks + fewer_first + fewer_last`` slots are spread evenly. The slots left over go to
    the stages without an end module first, so a stage asked for fewer blocks has fewer than every other one.
    A size below 1 is the caller's error to raise.

    Example::

        >>> balanced(10, 4)
        [3, 3, 2, 2]
        >>> balanced(8, 3, fewer_first=1, fewer_last=1)
        [2, 4, 2]
    """
    slots = n_blocks + fewer_first + fewer_last
    reduced = {0: fewer_first, n_stages - 1: fewer_last if n_stages > 1 else fewer_first + fewer_last}
    order = sorted(range(n_stages), key=lambda s: (reduced.get(s, 0) > 0, s))  # extra slots: plain stages first
    extra = set(order[:slots % n_stages])
    sizes = [slots // n_stages + (s in extra) for s in range(n_stages)]
    sizes[0] -= fewer_first
    sizes[-1] -= fewer_last
    return sizes


def local_stage_ids(pp_rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """The stages this pp rank runs: ``r, r+pp, …`` (loop), or ``r, 2pp−1−r`` for the V-shaped schedules."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(vpp)]


def other_degrees(layout) -> dict[str, int]:
    """The degrees of a resolved layout besides the pipeline's: tp, cp, ep, and ``data``, the ranks a gradient is
    reduced over by data parallelism (the dense data axes with cp; the experts' edp)."""
    data = max(layout.dp_replicate * layout.dp_shard * layout.cp, layout.edp if layout.ep > 1 else 1)
    return {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "data": data}


def schedule_problem(schedule: str, microbatches: int, pp: int, vpp: int, where: str = "pipeline",
                     others: dict[str, int] | None = None) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` over ``pp`` ranks of ``vpp`` stages each (beside the
    ``others`` degrees, :func:`other_degrees`), or None.

    Rejects every combination torch 2.13's schedule classes reject when they are built (checked over a fake
    process group for pp ≤ 4, vpp ≤ 3, m ≤ 12) and, for a pipeline that fills, a few more (m ≥ pp for all but
    GPipe; rounds of pp microbatches for the loop schedules with vpp > 1, as Megatron). The split-backward
    schedules run with pipeline parallelism alone: with FSDP2 torch 2.13 leaves some blocks' gradients unreduced
    (parameters 6.5e-3 to 1.5e-2 from one device after 3 steps at pp 2 × dp 2), and tensor-parallel stages fail
    in ``backward_weight_one_chunk`` (pp 2 × tp 2); cp and ep were not tried and are refused alike.

    Example::

        >>> schedule_problem("1f1b", 2, 4, 1)
        'pipeline.microbatches: 1f1b needs at least pp(4) microbatches to fill the pipeline; found 2, expected >= 4 (or schedule: gpipe)'
    """
    s, m = schedule, microbatches
    busy = {k: v for k, v in (others or {}).items() if v > 1}
    if s in SPLIT_BACKWARD and busy:
        found = ", ".join(f"{k}({v})" if k != "data" else f"data parallelism over {v} ranks" for k, v in busy.items())
        return (f"{where}.schedule: {s} splits each backward into input and weight gradients, which runs with "
                f"pipeline parallelism alone in torch 2.13 (FSDP2 leaves some gradients unreduced; tensor-parallel "
                f"stages fail in backward_weight_one_chunk); found {found}, expected none, or schedule: 1f1b, "
                f"interleaved_1f1b, looped_bfs or gpipe")
    if s in V_SCHEDULES and vpp != 2:
        return f"{where}.schedule: {s} runs two stages per rank in a V; found layout.vpp({vpp}), expected vpp = 2"
    if s not in MULTI_STAGE_SCHEDULES and vpp != 1:
        return (f"{where}.schedule: {s} runs one stage per rank; found layout.vpp({vpp}), expected vpp = 1 "
                f"or a multi-stage schedule ({', '.join(MULTI_STAGE_SCHEDULES)})")
    if s == "dualpipev" and m < 2 * pp:
        return (f"{where}.microbatches: dualpipev needs at least one microbatch per stage (torch's "
                f"ScheduleDualPipeV), 2·pp({pp}) = {2 * pp} stages; found {m}, expected >= {2 * pp}")
    if s != "gpipe" and m < pp:
        return (f"{where}.microbatches: {s} needs at least pp({pp}) microbatches to fill the pipeline; "
                f"found {m}, expected >= {pp} (or schedule: gpipe)")
    if s in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble") and vpp > 1 and m % pp:
        return (f"{where}.microbatches: {s} with vpp({vpp}) runs microbatches in rounds of pp({pp}); "
                f"found {m}, expected a multiple of {pp}")
    if s in ("interleaved_1f1b", "interleaved_zero_bubble") and m % (m // pp):
        valid = ", ".join(str(k) for k in range(pp, 4 * pp + 1) if k % (k // pp) == 0)
        return (f"{where}.microbatches: torch's {s} cuts the microbatches into m // pp({pp}) = {m // pp} "
                f"rounds of equal size; found {m}, not a multiple of {m // pp}; expected one of {valid}, …")
    return None


def check_schedule(section: Pipeline, pp: int, vpp: int, where: str = "pipeline",
                   others: dict[str, int] | None = None) -> None:
    """Schedule, ``vpp``, microbatches and data parallelism fit together (the valid values in the message).

    Args:
        section: the plan's ``pipeline`` section.
        pp: pipeline ranks (``layout.pp``).
        vpp: stages per rank (``layout.vpp``).
        where: prefix of the error messages (plan file and key).
        others: the layout's other degrees (:func:`other_degrees`).

    Raises:
        PlanError: :func:`schedule_problem`'s reason: a one-stage schedule with vpp > 1, a V-shaped one without
            vpp = 2, too few microbatches (``dualpipev``: fewer than its 2·pp stages, torch's
            ``ScheduleDualPipeV``), a microbatch count torch's interleaved schedules cannot cut into rounds, or a
            split-backward schedule beside other parallelism.
    """
    why = schedule_problem(section.schedule, section.microbatches, pp, vpp, where, others)
    if why is not None:
        raise PlanError(why)
