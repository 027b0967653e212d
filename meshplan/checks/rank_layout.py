"""What each axis gives one rank, as data for the rank view (``check --rank R``) and the model picture: the
data-parallel wrapping (which modules FSDP2 wraps or DDP replicates, over which ranks), the pipeline stages (which
blocks on which stage, the rank's marked), the rank's experts (expert parallelism) and its sequence chunks
(context parallelism).

The wrapping is the one :func:`meshplan.data_parallel.wrap.wrap` makes: the experts over ``edp`` first, then each
block the ``blocks`` section names (:func:`meshplan.blocks.block_paths`), then each root (the model, or each of the
rank's pipeline stages); the mode is the candidate's (``data_parallel.mode``'s default from the degrees). Nothing
here allocates or imports torch's distributed code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_layout"]


def _wrapping(model: Any, plan: Any, cand: Any, place: Any, rank: int, held: Any, stages: list[str],
              experts: list[str]) -> dict | None:
    """``{mode, over (its group in :attr:`Placement.groups`), over_axes, ranks, blocks, roots, experts, experts_over, experts_ranks}`` or None without data
    parallelism (mode ``none``)."""
    from meshplan.blocks import block_paths
    from meshplan.errors import PlanError
    mode = cand.mode
    if mode == "none":
        return None
    try:
        blocks = [p for p in block_paths(model, plan.blocks) if held(p)]
    except PlanError:  # no blocks: only the roots are wrapped (check reports the blocks problem)
        blocks = []
    over = "dp" if mode == "ddp" else "dp_shard"
    axes = ("dp_shard", "dp_replicate", "cp") if mode == "ddp" else place.shard_axes(cand)
    out = {"mode": mode, "over": over, "over_axes": [a for a in axes if place.layout.sizes().get(a, 1) > 1], "ranks": place.group_ranks(over, rank),
           "blocks": [] if mode == "ddp" else blocks, "roots": stages or ["(the model)"],
           "experts": [], "experts_over": None, "experts_ranks": []}
    if experts and place.layout.edp > 1 and mode != "ddp":
        out.update(experts=[e for e in experts if held(e)], experts_over="edp",
                   experts_ranks=place.group_ranks("edp", rank))
    return out


def _pipeline(rows: list[dict] | None, stage_rank: int) -> list[dict]:
    """One entry per stage: ``{stage, pp_rank, text, mine}``."""
    return [{"stage": r["stage"], "pp_rank": r["pp_rank"], "mine": r["pp_rank"] == stage_rank,
             "text": ", ".join([*r["first_modules"], *r["blocks_text"], *r["last_modules"]])} for r in rows or []]


def _experts(exempt: list, coords: dict, held: Any, shape: Any) -> dict | None:
    """``{modules, ep, ep_rank, first, last, of}``: the experts this rank's ep coordinate holds (rank ``r`` of
    ``ep``: ``r·E/ep … (r+1)·E/ep − 1``), or None without expert parallelism."""
    own = [e for e in exempt if e.degree > 1]
    if not own or shape is None or not shape.experts:
        return None
    ep, r = own[0].degree, coords.get("ep", 0)
    k = shape.experts // ep
    return {"modules": sorted(m for e in own for m in e.modules if held(m)), "ep": ep, "ep_rank": r,
            "first": r * k, "last": (r + 1) * k - 1, "of": shape.experts}


def _sequence(plan: Any, coords: dict, sizes: dict) -> dict | None:
    """``{cp, cp_rank, chunks, of}``: the chunks of each sequence this rank holds, or None without cp."""
    from meshplan.context_parallel.chunks import n_chunks, rank_chunks
    cp = sizes.get("cp", 1)
    if cp <= 1:
        return None
    balance = bool(getattr(plan.context_parallel, "load_balance", True)) if plan.context_parallel else True
    return {"cp": cp, "cp_rank": coords["cp"], "chunks": list(rank_chunks(cp, coords["cp"], balance)),
            "of": n_chunks(cp, balance)}


def rank_layout(model: Any, plan: Any, cand: Any, place: Any, rank: int, rows: list[dict] | None, held: Any,
                exempt: list, sizes: dict) -> dict:
    """What each axis gives global ``rank`` (see the module docstring).

    Args:
        model: the model checked. plan: the plan (its layout the one checked). cand: the solver's candidate of
            it. place: its :class:`~meshplan.solver.placement.Placement`. rank: the global rank.
        rows: the pipeline's stage rows (each ``{stage, pp_rank, first_modules, blocks, blocks_text,
            last_modules}``), or None without stages. held: is the module at a path on this rank's stages.
        exempt: the axes' :class:`~meshplan.axis.TpExempt` (the experts). sizes: the resolved degrees.

    Returns:
        ``{stages, wrapping, experts, sequence}``: :func:`_pipeline`'s entries, :func:`_wrapping`'s,
        :func:`_experts`' and :func:`_sequence`'s (None where the axis is off).
    """
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.errors import PlanError
    coords = place.coordinates(rank)
    stages = _pipeline(rows, place.pp_rank_of(rank))
    try:
        shape = shape_of_model(model)[0]
    except PlanError:
        shape = None
    experts = _experts(exempt, coords, held, shape)
    roots = [f"stage {s['stage']}" for s in stages if s["mine"]]
    return {"stages": stages, "experts": experts, "sequence": _sequence(plan, coords, sizes),
            "wrapping": _wrapping(model, plan, cand, place, rank, held, roots,
                                  experts["modules"] if experts else [])}
