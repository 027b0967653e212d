"""One rank's view in ``meshplan check`` (``--rank R``, ``meshplan.check(..., rank=R)``): its coordinates, the
stages and modules it holds, its parameter, gradient and optimizer bytes and the collectives it joins per step.

The bytes are counted on the model's own parameters (the dry run's meta copy: tensor-parallel local shapes), kept
to the modules of the rank's stages (the stage rows an axis' check summary holds), divided by the axes that shard
modules themselves (:func:`meshplan.axes.tp_exempt`: the experts), then cut as FSDP2 cuts dim 0 (this rank's chunk of
``ceil(rows / d)`` rows, the last ones short: ``d`` from :func:`meshplan.solver.memory.shard_sizes`; experts whose
local count edp does not divide: ``1/d`` of an inner dim): the figures ``meshplan estimate`` gives for the
same plan and model (``tests/test_rank_view.py``). The optimizer is AdamW: two states per parameter element and
one float32 step per tensor. Nothing is allocated: the model is a meta copy, the ranks are arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.checks.rank_layout import stage_prefixes as _prefixes
from meshplan.checks.rank_layout import under as _under
from meshplan.checks.rank_layout import unit_texts
from meshplan.errors import PlanError
from meshplan.mesh.ranks import ranks_text

__all__ = ["rank_view", "view_lines", "check_rank"]

#: the sequence length the per-step collectives are taken at (their counts do not depend on it, their bytes do:
#: one sequence of it per microbatch)
_SEQ = 8192


def check_rank(rank: int, world: int, where: str) -> None:
    """Raise a :class:`PlanError` unless ``0 <= rank < world``."""
    if not 0 <= rank < world:
        raise PlanError(f"{where}: rank {rank} is outside the world: expected 0 <= rank < {world}")


def _candidate(plan: Any, resolved: Any, layers: int) -> tuple[Any, Any, Any]:
    """``(candidate, training, placement)`` of ``plan`` on ``resolved`` (the solver's view of the layout)."""
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.units import COST_UNITS
    decided = {k: v for axis in COST_UNITS for k, v in axis.decides(plan, resolved).items()}
    batch = resolved.dp_replicate * resolved.dp_shard * decided.get("microbatches", 1)
    cand, train = candidate_from_plan(plan, resolved.world_size, _SEQ, batch)
    return cand, train, Placement(cand, layers, 8)


def _stage_rows(report: Any) -> list[dict] | None:
    """The stage rows of the axis whose check summary has them (each ``{stage, pp_rank, first_modules, blocks,
    last_modules, blocks_text}``), or None without stages."""
    from meshplan.axes import AXES
    return next((s["stages"] for axis in AXES
                 if isinstance(s := getattr(report, axis.report_key, None), dict) and s.get("stages")), None)


def _held(rows: list[dict] | None, stage_rank: int) -> tuple[Any, list[str]]:
    """``(is the module at a path held, one text per stage held)`` for the rank at stage position
    ``stage_rank``; a module outside every stage (none on a split model) is held by every rank."""
    if not rows:
        return (lambda path: True), []
    mine = [r for r in rows if r["pp_rank"] == stage_rank]
    own = [p for r in mine for p in _prefixes(r)]
    other = [p for r in rows if r["pp_rank"] != stage_rank for p in _prefixes(r)]
    texts = [f"stage {r['stage']}: " + ", ".join([*r["first_modules"], *r["blocks_text"], *r["last_modules"]])
             for r in mine]
    return (lambda path: _under(path, own) or not _under(path, other)), texts


def _count(mods: dict[str, nn.Module], held: Any, exempt: list, d_dense: int, d_expert: int,
           index: tuple) -> dict[str, Any]:
    """Local elements, tensors and bytes of the parameters the rank holds, after every axis' division (``index``:
    the rank's chunk of dim 0 in its dense and its expert FSDP2 group, :meth:`Placement.shard_index`), and the
    bytes of each module's own parameters (``modules``: path → bytes, held modules with parameters only; a shared
    parameter counts at its first module)."""
    from meshplan.solver.memory import chunk_rows
    seen, numel, tensors, nbytes, per_module = set(), 0, 0, 0, {}
    for path, mod in mods.items():
        if not held(path):
            continue
        own = next((e for e in exempt if path in e.modules), None)
        for _, prm in mod.named_parameters(recurse=False):
            if id(prm) in seen:
                continue
            seen.add(id(prm))
            local = prm.to_local() if hasattr(prm, "to_local") else prm
            rows = local.shape[0] if local.dim() else 1
            per = local.numel() // rows if rows else 0
            rows = rows // own.degree if own is not None else rows
            d, i = (d_expert, index[1]) if own is not None else (d_dense, index[0])
            n = chunk_rows(rows, d, i if d > 1 else None) * per
            if own is not None and d > 1 and rows % d and any(k % d == 0 for k in local.shape[1:]):
                n = rows * per // d  # edp shards an inner dim (expert_parallel/edp.py): 1/d on every rank
            numel, tensors, nbytes = numel + n, tensors + 1, nbytes + n * local.element_size()
            per_module[path] = per_module.get(path, 0) + n * local.element_size()
    return {"numel": numel, "tensors": tensors, "bytes": nbytes, "modules": per_module}


def _collectives(model: nn.Module, cand: Any, train: Any, rank: int) -> list[dict] | None:
    """The collectives global ``rank`` issues in one step: the solver's own terms
    (:func:`meshplan.solver.collectives.step_collectives`, what ``meshplan estimate`` times), summed by axis, kind
    and group, each with its group's ranks, its calls and bytes per step (``bytes``: the sum over calls of each
    call's buffer, as the cost model takes it). None when the model's sizes cannot be read (no config) or its
    blocks are not the decoder the cost model describes."""
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.solver.collectives import step_collectives
    from meshplan.solver.placement import Placement
    try:
        shape, approximate = shape_of_model(model)
    except PlanError:
        return None
    if approximate is not None:  # the cost model does not describe this model's blocks: no counts, not wrong ones
        return None
    place = Placement(cand, shape.layers, 8)
    out: dict[tuple, dict] = {}
    for x in step_collectives(shape, cand, train, place, place.pp_rank_of(rank)):
        if x.group.size > 1:
            row = out.setdefault((x.axis, x.kind, x.group.name), {
                "axis": x.axis, "kind": x.kind, "group": x.group.name, "group_size": x.group.size,
                "ranks": place.group_ranks(x.group.name, rank), "count": 0, "bytes": 0, "what": []})
            row["count"] += x.count
            row["bytes"] += int(x.count * x.nbytes)
            row["what"] += [x.what] if x.what not in row["what"] else []
    return list(out.values())


def rank_view(report: Any, model: nn.Module, plan: Any, resolved: Any, rank: int, applied: Any) -> dict:
    """One rank's view of ``plan`` on ``model`` (see the module docstring).

    Args:
        report: the checked :class:`~meshplan.checks.report.Report` (its stage rows, each axis' summary).
        model: the model checked. plan: the plan. resolved: its resolved layout. rank: the global rank.
        applied: the dry run's ``(meta copy, TpApplied)``, or None (no tensor-parallel section: whole tensors).

    Returns:
        ``{rank, coordinates, sizes, stages, parameters, tensors, parameter_bytes, module_bytes, gradient_bytes,
        optimizer_bytes, shards, collectives, layout}`` (``layout``: what each axis gives the rank,
        :func:`meshplan.checks.rank_layout.rank_layout`; ``module_bytes``: path → the bytes of the module's own
        parameters on this rank, held modules only); the counts are None (``reason`` says why) when the stages are
        known only at the first step (a traced split).
    """
    from meshplan.axes import tp_exempt
    from meshplan.model_copies import meta_copy
    from meshplan.solver.memory import shard_sizes
    rows = _stage_rows(report)
    cand, train, place = _candidate(plan, resolved, max(1, len(rows or [])))
    stage_rank = place.pp_rank_of(rank)
    view: dict[str, Any] = {"rank": rank, "coordinates": place.coordinates(rank), "sizes": resolved.sizes(),
                            "shards": place.shard_words(), "parameters": None,
                            "collectives": _collectives(model, cand, train, rank)}
    if rows and any(r["parameters"] is None for r in rows):
        view["reason"] = "the stages are known only once the first step traces the model"
        view["stages"] = [f"stage {r['stage']}: {r['blocks_text'][0]}" for r in rows if r["pp_rank"] == stage_rank]
        return view
    from meshplan.checks.rank_layout import rank_layout
    held, view["stages"] = _held(rows, stage_rank)
    mods = dict((applied[0] if applied else meta_copy(model)).named_modules())
    exempt = tp_exempt(model, plan, report)
    n = _count(mods, held, exempt, *shard_sizes(cand, place), place.shard_index(rank))
    view["layout"] = rank_layout(model, plan, report, cand, place, rank, rows, held, exempt, resolved, n["modules"])
    view.update(parameters=n["numel"], tensors=n["tensors"], parameter_bytes=n["bytes"], module_bytes=n["modules"],
                gradient_bytes=n["bytes"], optimizer_bytes=2 * n["bytes"] + 4 * n["tensors"])
    return view


def _layout_lines(lay: dict | None, fmt_bytes: Any) -> list[str]:
    """The wrapping (a line per kind of unit) and each axis' share of the rank
    (:attr:`~meshplan.axis.Axis.rank_share`), a line each."""
    if not lay:
        return []
    out, w = [], lay["wrapping"]
    if w is not None:
        kind = {"ddp": "DDP (replicate) wraps", "hsdp": "HSDP (fully_shard, dp_replicate x dp_shard) wraps"}.get(
            w["mode"], "FSDP2 (fully_shard) wraps")
        n = len(w["units"])
        out.append(f"  {kind} {n} unit{'s' if n != 1 else ''} over {' x '.join(w['over_axes'])} "
                   f"({ranks_text(w['ranks'])}), in this order (this rank's bytes):")
        out += [f"    {t}" for t in unit_texts(w, fmt_bytes)]
    out += [f"  {x['text']}" for x in lay["shares"]]
    return out


def view_lines(view: dict, fmt_bytes: Any) -> list[str]:
    """The text report's lines of one rank's view (``check --rank R``)."""
    c, s = view["coordinates"], view["sizes"]
    coords = ", ".join(f"{k} {v}/{s.get(k, 1)}" for k, v in c.items() if s.get(k, 1) > 1) or "the only rank"
    out = [f"rank {view['rank']}: {coords}"]
    out += [f"  {t}" for t in view.get("stages") or []]
    if view["parameters"] is not None:
        out.append(f"  parameters {view['parameters']:,} in {view['tensors']} tensors: "
                   f"{fmt_bytes(view['parameter_bytes'])}, gradients {fmt_bytes(view['gradient_bytes'])}, "
                   f"optimizer (AdamW) {fmt_bytes(view['optimizer_bytes'])}")
    else:
        out.append(f"  parameters not counted: {view['reason']}")
    out += [f"  {w}" for w in view["shards"]]
    out += _layout_lines(view.get("layout"), fmt_bytes)
    if view["collectives"] is None:
        out.append("  collectives per step: not counted (the model's sizes cannot be read, or its blocks are not "
                   "the decoder meshplan estimate describes)")
        return out
    out.append(f"  collectives per step (the solver's terms; bytes at sequence {_SEQ:,}, one sequence per "
               f"microbatch):" + ("" if view["collectives"] else " none"))
    for x in view["collectives"]:
        peers = "peers" if x["kind"] in ("send", "recv") else "ranks"
        out.append(f"    {x['kind']} over {x['group']} ({peers} {ranks_text(x['ranks'])}): {x['count']} calls, "
                   f"{fmt_bytes(x['bytes'])} ({x['axis']}: {', '.join(x['what'])})")
    return out
