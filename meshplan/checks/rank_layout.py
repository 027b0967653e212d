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

__all__ = ["rank_layout", "under", "stage_prefixes", "unit_texts"]


def stage_prefixes(row: dict) -> list[str]:
    """The module paths a stage row holds: its first modules, its blocks, its last modules."""
    return [*row["first_modules"], *row["blocks"], *row["last_modules"]]


def under(path: str, prefixes: list[str]) -> bool:
    """Is ``path`` one of ``prefixes`` or inside one."""
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def _root_views(rows: list[dict] | None, stage_rank: int) -> list[tuple[str, Any]]:
    """``(name, is the path outside that root)`` for each root the rank wraps: the model, or each of its stages'
    views (another stage's end modules and blocks are pass-throughs there, holding nothing)."""
    if not rows:
        return [("(the model)", lambda path: False)]
    out = []
    for r in (r for r in rows if r["pp_rank"] == stage_rank):
        own, other = stage_prefixes(r), [p for o in rows if o is not r for p in stage_prefixes(o)]
        out.append((f"stage {r['stage']}", lambda path, own=own, other=other: under(path, other)
                    and not under(path, own)))
    return out


def _unit(kind: str, root: str | None, modules: list[str], kept: bool = False) -> dict:
    return {"kind": kind, "root": root, "modules": modules, "kept": kept, "bytes": 0}


def _units(model: Any, mode: str, blocks: list[str], every_block: list[str], experts: list[str],
           roots: list[tuple[str, Any]], module_bytes: dict[str, int], vocab: bool = False) -> list[dict]:
    """The units the data axis' wrap makes on this rank, in its order, each ``{kind (experts, block, embedding unit,
    head unit, root), root, modules, kept (gathered after forward), bytes (this rank's)}``: the experts, each block,
    each root's end units (:func:`meshplan.model_copies.end_groups`, the rule ``fully_shard`` follows),
    then the root, which holds what is left (DDP: the root alone after the experts). ``vocab``
    (the plan's ``ends: vocab_parallel``): each root's embeddings and heads (:func:`meshplan.model_copies.vocab_ends`)
    are kind ``vocab-parallel embedding`` / ``vocab-parallel head`` instead, no FSDP2 unit (their rows sharded over
    the data ranks for good); the root keeps the rest (the final norm)."""
    from meshplan.model_copies import end_groups, vocab_ends
    out = [_unit("experts", None, [e]) for e in experts]
    out += [_unit("block", None, [b]) for b in blocks] if mode != "ddp" else []
    skip = set(every_block) | set(experts)
    for name, outside in roots:
        wrapped = lambda p, m: p in skip or outside(p)  # noqa: E731
        if vocab:
            out += [_unit(f"vocab-parallel {kind}", name, [path]) for path, kind in vocab_ends(model, wrapped)]
        else:
            groups = [] if mode == "ddp" else end_groups(model, wrapped)
            out += [_unit("head unit" if kept else "embedding unit", name, paths, kept) for paths, kept in groups]
        out.append(_unit("root", name, []))
    rooted = [(name, outside, next(u for u in out if u["kind"] == "root" and u["root"] == name))
              for name, outside in roots]
    for path, nbytes in module_bytes.items():
        owners = [(len(m), u) for u in out for m in u["modules"] if under(path, [m])]
        if not owners and not rooted:  # mode none, the experts' units alone: the rest is not wrapped
            continue
        owner = max(owners, key=lambda x: x[0])[1] if owners else next(
            (u for _, outside, u in rooted if not outside(path)), rooted[0][2])
        owner["bytes"] += nbytes
    return out


def _wrapping(model: Any, plan: Any, cand: Any, place: Any, rank: int, held: Any, roots: list[tuple[str, Any]],
              experts: list[str], module_bytes: dict[str, int], own_data: bool) -> dict | None:
    """``{mode, over (its group in :attr:`Placement.groups`), over_axes, ranks, blocks, roots, experts, experts_over,
    experts_ranks, units}`` or None without FSDP2/DDP (mode ``none``, unless ``own_data``: an axis sums its modules'
    gradients over a data group of its own, the experts over ``edp`` > 1, and the wrap makes only their units);
    ``units``: :func:`_units`."""
    from meshplan.blocks import block_paths
    from meshplan.errors import PlanError
    mode = cand.mode
    if mode == "none" and not (experts and own_data):
        return None
    try:
        every_block = block_paths(model, plan.blocks)
    except PlanError:  # no blocks: only the roots are wrapped (check reports the blocks problem)
        every_block = []
    blocks = [p for p in every_block if held(p)]
    over = "dp" if mode == "ddp" else "dp_shard"
    axes = place.wrap_axes()
    if mode == "none":  # the experts' units alone (the data axis' wrap), over edp: no block, no root
        blocks, roots, over, axes = [], [], "edp", ("edp",)
    out = {"mode": mode, "over": over, "over_axes": axes, "ranks": place.group_ranks(over, rank),
           "blocks": [] if mode == "ddp" else blocks, "roots": [name for name, _ in roots],
           "experts": [], "experts_over": None, "experts_ranks": []}
    if experts:  # the data axis' wrap shards (DDP: replicates) them over edp first, even a 1-rank edp
        out.update(experts=[e for e in experts if held(e)], experts_over="edp",
                   experts_ranks=place.group_ranks("edp", rank))
    vocab = cand.vocab_ends and mode == "fsdp"
    units = _units(model, mode, blocks, every_block, out["experts"], roots, module_bytes, vocab)
    out["units"] = [u for u in units if not u["kind"].startswith("vocab-parallel")]
    out["vocab_parallel"] = [u for u in units if u["kind"].startswith("vocab-parallel")]
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
                held: Any, exempt: list, resolved: Any, module_bytes: dict[str, int]) -> dict:
    """What each axis gives global ``rank`` (see the module docstring).

    Args:
        model: the model checked. plan: the plan (its layout the one checked). report: the checked report (each
            axis' summary). cand: the solver's candidate of it. place: its :class:`~meshplan.solver.placement.Placement`. rank: the global rank.
        rows: the stage rows of the axis that splits the model (each ``{stage, pp_rank, first_modules, blocks, blocks_text,
            last_modules}``), or None without stages. held: is the module at a path on this rank's stages.
        exempt: the axes' :class:`~meshplan.axis.TpExempt` (modules an axis shards itself: FSDP2 wraps them over
            their own data group first, whatever the axis' degree). resolved: the resolved layout. module_bytes: path → this rank's bytes of the
            module's own parameters (the rank view's, split among the wrapped units).

    Returns:
        ``{stages, wrapping, shares}``: :func:`_stage_entries`' entries, :func:`_wrapping`'s (None without data
        parallelism) and :func:`_shares`'.
    """
    from meshplan.axes import wraps_own_data
    coords, sizes = place.coordinates(rank), resolved.sizes()
    stages = _stage_entries(rows, place.pp_rank_of(rank))
    roots = _root_views(rows, place.pp_rank_of(rank))
    own = sorted(m for e in exempt for m in e.modules if held(m))
    own_data = wraps_own_data(resolved)
    return {"stages": stages, "shares": _shares(model, plan, report, coords, sizes, held),
            "wrapping": _wrapping(model, plan, cand, place, rank, held, roots, own, module_bytes, own_data)}


def unit_texts(w: dict, fmt_bytes: Any = None) -> list[str]:
    """One text per kind of unit the wrap makes on the rank (``w``: the rank layout's wrapping), in its order, each
    with this rank's bytes: the experts, the blocks (each one's bytes, or first … last and the sum), each root's
    embedding and head units and the root (what is left). ``fmt_bytes``: bytes as text (default: estimate's)."""
    from meshplan.mesh.ranks import ranks_text
    from meshplan.solver.report import fmt_bytes as estimate_bytes
    fmt_bytes = fmt_bytes or estimate_bytes
    units, out = w["units"], []
    experts = [u for u in units if u["kind"] == "experts"]
    if experts:
        out.append(f"{len(experts)} expert modules over {w['experts_over']} "
                   f"({ranks_text(w['experts_ranks'])}): {fmt_bytes(sum(u['bytes'] for u in experts))}")
    blocks = [u for u in units if u["kind"] == "block"]
    if len(blocks) == 1:
        out.append(f"block {blocks[0]['modules'][0]}: {fmt_bytes(blocks[0]['bytes'])}")
    elif blocks:
        each = {u["bytes"] for u in blocks}
        sizes = f"{fmt_bytes(blocks[0]['bytes'])} each" if len(each) == 1 else \
            f"{fmt_bytes(min(each))}-{fmt_bytes(max(each))} each, {fmt_bytes(sum(u['bytes'] for u in blocks))}"
        out.append(f"{len(blocks)} blocks ({blocks[0]['modules'][0]} … {blocks[-1]['modules'][0]}): {sizes}")
    for u in units:
        if u["kind"] in ("embedding unit", "head unit"):
            kept = ", kept gathered after forward" if u["kept"] else ""
            of = f" of {u['root']}" if u["root"].startswith("stage") else ""
            out.append(f"{u['kind'].split()[0]} [{', '.join(u['modules'])}]{of}: {fmt_bytes(u['bytes'])}{kept}")
        elif u["kind"] == "root":
            out.append(f"the root {u['root']}: {fmt_bytes(u['bytes'])}" + ("" if u["bytes"] else " (holds nothing)"))
    n = len(w["ranks"])
    for u in w.get("vocab_parallel", []):  # ends: vocab_parallel: no FSDP2 unit
        of = f" of {u['root']}" if u["root"].startswith("stage") else ""
        out.append(f"{u['kind'].split()[1]} [{u['modules'][0]}]{of}: vocab-parallel over {w['over']} (rows/{n} each, "
                   f"not an FSDP2 unit): {fmt_bytes(u['bytes'])}")
    return out
