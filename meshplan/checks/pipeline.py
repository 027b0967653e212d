"""The ``pipeline`` section in ``meshplan check``: the schedule against the layout, the split against the model.

:func:`check_pipeline` runs what :func:`meshplan.parallelize` runs before it prunes a rank's model
(:func:`~meshplan.pipeline.stages.check_schedule`, then :func:`~meshplan.pipeline.split.plan_split` on a
meta-device copy), collects the errors into the report, and records one row per stage: the pp rank that runs
it, its end modules and blocks, and its parameter count. :func:`stage_lines` renders those rows for the text
report::

    pipeline: 1f1b, 4 microbatches, 2 stages (pp 2 x vpp 1)
    stage 0 (pp rank 0): tok_embeddings, layers.0-1  (82,048 parameters)
    stage 1 (pp rank 1): layers.2-3, norm, output  (82,112 parameters)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.checks.dry_run import meta_copy
from meshplan.errors import PlanError
from meshplan.pipeline.split import StageSplit, local_stage_ids, plan_split, stage_view
from meshplan.pipeline.stages import check_schedule

__all__ = ["check_pipeline", "stage_rows", "stage_lines"]


def check_pipeline(model: nn.Module, plan: Any, pp: int, vpp: int, report: Any) -> None:
    """Validate ``plan``'s pipeline section for ``pp`` ranks of ``vpp`` stages against ``model``.

    Args:
        model: the model checked (not changed: the split is computed on a meta copy).
        plan: the :class:`~meshplan.plan_file.document.Plan`.
        pp: pipeline ranks of the resolved layout; ``vpp``: stages per rank.
        report: the :class:`~meshplan.checks.report.Report`; its ``errors`` get every problem, its
            ``pipeline`` the schedule and the stage rows (when the split succeeds).
    """
    section = plan.pipeline
    if section is None:
        if pp > 1:
            report.errors.append(PlanError(
                f"{report.source}: layout.pp({pp}) > 1 needs a pipeline section; found none, expected e.g. "
                f"`pipeline: {{schedule: 1f1b, microbatches: {2 * pp}}}`"))
        return
    where = f"{plan.source}: pipeline" if plan.source else "pipeline"  # as meshplan.parallelize says it
    try:
        check_schedule(section, pp, vpp, where)
    except PlanError as e:
        report.errors.append(e)
    pattern = plan.blocks.pattern if plan.blocks is not None else "layers.*"
    meta = meta_copy(model)
    try:
        split = plan_split(meta, section, pattern, pp * vpp, where)
    except PlanError as e:
        report.errors.append(e)
        return
    report.pipeline = {"schedule": section.schedule, "microbatches": section.microbatches, "pp": pp, "vpp": vpp,
                       "stages": stage_rows(meta, split, pp, vpp, section.schedule)}


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
    """One row per stage: ``{stage, pp_rank, modules, blocks, parameters}`` (``modules``: what the stage runs
    besides the blocks, in order: the first stage's end modules before them, the last's after)."""
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
        out.append(f"stage {r['stage']} (pp rank {r['pp_rank']}): {', '.join(parts)}  ({r['parameters']:,} parameters)")
    return out
