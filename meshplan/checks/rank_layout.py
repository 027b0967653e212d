"""What each axis gives one rank, as data for the rank view (``check --rank R``) and the model picture: the
data-parallel wrapping (which modules FSDP2 wraps or DDP replicates, over which ranks), the stages (which
blocks on which stage, the rank's marked), and what every other axis gives the rank of its own (its
:attr:`~meshplan.axis.Axis.rank_share`: the experts it holds, its chunks of each sequence).

The wrapping is the one the data axis' wrap makes (its late phase): the experts over ``edp`` first, then each
block the ``blocks`` section names (:func:`meshplan.blocks.block_paths`), then each root (the model, or each of the
rank's stages); the mode is the candidate's (the section's mode, else the default from the degrees). Nothing
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
    out = {"mode": mode, "over": over, "over_axes": place.wrap_axes(), "ranks": place.group_ranks(over, rank),
           "blocks": [] if mode == "ddp" else blocks, "roots": stages or ["(the model)"],
           "experts": [], "experts_over": None, "experts_ranks": []}
    if experts and place.layout.edp > 1 and mode != "ddp":
        out.update(experts=[e for e in experts if held(e)], experts_over="edp",
                   experts_ranks=place.group_ranks("edp", rank))
    return out


def _stage_entries(rows: list[dict] | None, stage_rank: int) -> list[dict]:
    """One entry per stage: ``{stage, pp_rank, text, mine}``."""
    return [{"stage": r["stage"], "pp_rank": r["pp_rank"], "mine": r["pp_rank"] == stage_rank,
             "text": ", ".join([*r["first_modules"], *r["blocks_text"], *r["last_modules"]])} for r in rows or []]


def _shares(model: Any, plan: Any, report: Any, coords: dict, sizes: dict, held: Any) -> list[dict]:
    """Each axis' :attr:`~meshplan.axis.Axis.rank_share` (``{axis, text, label, cells, data}``), where it gives
    the rank something of its own."""
    from meshplan.axes import AXES
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.errors import PlanError
    try:
        shape = shape_of_model(model)[0]
    except PlanError:
        shape = None
    out = []
    for axis in AXES:
        own = axis.tp_exempt(model, plan, getattr(report, axis.report_key, None) or {})
        share = axis.rank_share(plan, coords, sizes, shape, sorted(m for m in own.modules if held(m)) if own else [])
        if share is not None:
            out.append({"axis": axis.name, **share})
    return out


def rank_layout(model: Any, plan: Any, report: Any, cand: Any, place: Any, rank: int, rows: list[dict] | None,
                held: Any, exempt: list, sizes: dict) -> dict:
    """What each axis gives global ``rank`` (see the module docstring).

    Args:
        model: the model checked. plan: the plan (its layout the one checked). report: the checked report (each
            axis' summary). cand: the solver's candidate of it. place: its :class:`~meshplan.solver.placement.Placement`. rank: the global rank.
        rows: the stage rows of the axis that splits the model (each ``{stage, pp_rank, first_modules, blocks, blocks_text,
            last_modules}``), or None without stages. held: is the module at a path on this rank's stages.
        exempt: the axes' :class:`~meshplan.axis.TpExempt` (modules an axis shards itself: FSDP2 wraps them over
            their own data group first). sizes: the resolved degrees.

    Returns:
        ``{stages, wrapping, shares}``: :func:`_stage_entries`' entries, :func:`_wrapping`'s (None without data
        parallelism) and :func:`_shares`'.
    """
    coords = place.coordinates(rank)
    stages = _stage_entries(rows, place.pp_rank_of(rank))
    roots = [f"stage {s['stage']}" for s in stages if s["mine"]]
    own = sorted(m for e in exempt if e.degree > 1 for m in e.modules if held(m))
    return {"stages": stages, "shares": _shares(model, plan, report, coords, sizes, held),
            "wrapping": _wrapping(model, plan, cand, place, rank, held, roots, own)}
