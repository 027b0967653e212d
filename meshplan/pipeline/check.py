"""The ``pipeline`` section in ``meshplan check``: the schedule against the layout, the split against the model.

:func:`check_pipeline` runs what :func:`meshplan.parallelize` runs before it prunes a rank's model
(:func:`~meshplan.plan_file.stages.check_schedule`, then :func:`~meshplan.pipeline.split.plan_split` on a
meta-device copy; for ``split: trace``, :func:`~meshplan.pipeline.traced.plan_traced`, which traces nothing),
collects the errors into the report, and records one row per stage: the pp rank that runs it, its end modules
and blocks, and its (global) parameter count. :func:`stage_lines` renders those rows for the text report::

    pipeline: 1f1b, 4 microbatches, 2 stages (pp 2 x vpp 1)
    stage 0 (pp rank 0): tok_embeddings, layers.0-1  (82,176 parameters)
    stage 1 (pp rank 1): layers.2-3, norm, output  (82,240 parameters)

A traced split's stages are named by their split points (``stage 1 (pp rank 1): traced from layer3 to the
output``): what each runs is known only once the first step traces the model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch.nn as nn

from meshplan.model_copies import meta_copy
from meshplan.errors import PlanError
from meshplan.pipeline.probe import probe_split
from meshplan.pipeline.split import StageSplit, local_stage_ids, plan_split, stage_view
from meshplan.plan_file.stages import check_schedule
from meshplan.plan_file.stages import other_degrees

__all__ = ["check_pipeline", "stage_rows", "stage_lines"]


def check_pipeline(model: nn.Module, plan: Any, layout: Any, report: Any) -> None:
    """Validate ``plan``'s pipeline section for ``layout`` against ``model``.

    Args:
        model: the model checked (not changed: the split is computed on a meta copy).
        plan: the :class:`~meshplan.plan_file.document.Plan`.
        layout: the resolved layout (``pp`` ranks of ``vpp`` stages each; world size and the other degrees for
            ``split: trace``).
        report: the :class:`~meshplan.checks.report.Report`; its ``errors`` get every problem, its
            ``pipeline`` the schedule and the stage rows (when the split succeeds).
    """
    section, pp, vpp = plan.pipeline, layout.pp, layout.vpp
    if section is None:
        if pp > 1:
            report.errors.append(PlanError(
                f"{report.source}: layout.pp({pp}) > 1 needs a pipeline section; found none, expected e.g. "
                f"`pipeline: {{schedule: 1f1b, microbatches: {2 * pp}}}`"))
        return
    where = f"{plan.source}: pipeline" if plan.source else "pipeline"  # as meshplan.parallelize says it
    summary = {"schedule": section.schedule, "microbatches": section.microbatches, "pp": pp, "vpp": vpp}
    if getattr(section, "split", "blocks") == "trace":
        _check_traced(model, plan, layout, where, report, summary)
        return
    try:
        check_schedule(section, pp, vpp, where, other_degrees(layout))
    except PlanError as e:
        report.errors.append(e)
    pattern = plan.blocks.pattern if plan.blocks is not None else "layers.*"
    meta = meta_copy(model)
    try:
        split = plan_split(meta, section, pattern, pp * vpp, where)
        probe_split(model, split, where)  # what parallelize refuses: a later stage would compute otherwise
    except PlanError as e:
        report.errors.append(e)
        return
    report.pipeline = {**summary, "stages": stage_rows(meta, split, pp, vpp, section.schedule)}


def _check_traced(model: nn.Module, plan: Any, layout: Any, where: str, report: Any, summary: dict) -> None:
    """``split: trace``: what :func:`meshplan.parallelize` checks before the first step traces (the sections
    beside it, the layout, the schedule, the split points); the stages are named by their split points."""
    from meshplan.pipeline.traced import plan_traced
    try:
        plan_traced(meta_copy(model), plan, SimpleNamespace(layout=layout, pp_rank=0), where)
    except PlanError as e:
        report.errors.append(e)
        return
    points, owners = list(plan.pipeline.split_points), _owners(layout.pp, layout.vpp, plan.pipeline.schedule)
    bounds = ["the input", *points, "the output"]
    report.pipeline = {**summary, "split": "trace", "stages": [
        {"stage": s, "pp_rank": owners.get(s), "first_modules": [], "blocks": [], "last_modules": [],
         "blocks_text": [f"traced from {bounds[s]} to {'before ' if s < len(points) else ''}{bounds[s + 1]}"],
         "parameters": None} for s in range(len(points) + 1)]}


def _owners(pp: int, vpp: int, schedule: str) -> dict[int, int]:
    return {s: r for r in range(pp) for s in local_stage_ids(r, pp, vpp, schedule)}


def _blocks_text(container: str, keys: list[str]) -> list[str]:
    """``layers.0-3`` for consecutive integer keys, else every block's path."""
    paths = [f"{container}.{k}" if container else k for k in keys]
    if len(keys) > 1 and all(k.isdigit() for k in keys) and \
            [int(k) for k in keys] == list(range(int(keys[0]), int(keys[-1]) + 1)):
        return [f"{paths[0]}-{keys[-1]}"]
    return paths


def stage_rows(model: nn.Module, split: StageSplit, pp: int, vpp: int, schedule: str) -> list[dict]:
    """One row per stage: ``{stage, pp_rank, first_modules, blocks, blocks_text, last_modules, parameters}``
    (the end modules the first stage runs before its blocks and the last after them; ``parameters``: the
    stage's global parameter count, not divided by tp or dp)."""
    owners, n = _owners(pp, vpp, schedule), split.num_stages
    rows = []
    for s in range(n):
        view = stage_view(model, split, s)
        rows.append({"stage": s, "pp_rank": owners.get(s), "first_modules": list(split.first) if s == 0 else [],
                     "blocks": [f"{split.container}.{k}" if split.container else k for k in split.keys[s]],
                     "blocks_text": _blocks_text(split.container, list(split.keys[s])),
                     "last_modules": list(split.last) if s == n - 1 else [],
                     "parameters": sum(p.numel() for p in view.parameters())})
    return rows


def stage_lines(pipeline: dict) -> list[str]:
    """The text report's pipeline lines: the schedule, then one line per stage (none without a section)."""
    if not pipeline:
        return []
    rows = pipeline["stages"]
    out = [f"pipeline: {pipeline['schedule']}, {pipeline['microbatches']} microbatches, {len(rows)} stages "
           f"(pp {pipeline['pp']} x vpp {pipeline['vpp']})"]
    for r in rows:
        parts = [*r["first_modules"], *r["blocks_text"], *r["last_modules"]]
        count = f"  ({r['parameters']:,} parameters)" if r["parameters"] is not None else ""
        out.append(f"stage {r['stage']} (pp rank {r['pp_rank']}): {', '.join(parts)}{count}")
    return out
