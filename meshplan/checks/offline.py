"""``meshplan.check``: every check of a plan against a model without running it, the rehearsals included.

The static checks are each axis' own (:mod:`meshplan.tensor_parallel.check.validate`: the ones
``meshplan.parallelize`` runs first); the rehearsals apply the plan: the cross-shard shadow run (:mod:`meshplan.checks.shadow`, simulated ranks) and, when
all of that passes, the plan applied for real to a meta-device copy under a ``fake`` process group (nothing
allocated, nothing communicated), which gives the local parameter shapes of the explain table
(:mod:`meshplan.checks.explain`). The axes that are units check their own sections (:func:`meshplan.axes.check_axes`,
in parallelize's order). This module sits above ``meshplan.parallelize``: parallelize never imports it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch.nn as nn

from meshplan.checks.rank_view import check_rank, rank_view
from meshplan.checks.report import Report, fold_errors, per_rank_totals
from meshplan.tensor_parallel.check.validate import smallest_world
from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan, as_plan
from meshplan.plan_file.layout import Layout

__all__ = ["check", "Report", "smallest_world"]


def check(model: nn.Module, plan: Plan | Mapping[str, Any] | str, world_size: int | None = None,
          layout: Layout | Mapping[str, Any] | None = None, *, dry_run: bool = True, rank: int = 0) -> Report:
    """Validate ``plan`` against ``model`` without running it; collect every problem.

    Args:
        model: the model (any device; a meta-device copy is used, the model is not changed).
        plan: a path, a dict of a file's content, or a :class:`Plan`.
        world_size: ranks to check for; default: :func:`smallest_world` of the layout.
        layout: a :class:`Layout` or dict overriding the plan's ``layout`` section.
        dry_run: also apply the plan to a meta copy under a ``fake`` process group (exact
            local shapes); skipped when a real process group is initialized.
        rank: the global rank whose figures the report gives (``report.rank_view``: its coordinates, stages,
            parameter/gradient/optimizer bytes and collectives; :mod:`meshplan.checks.rank_view`).

    Returns:
        A :class:`Report`; ``report.ok`` is False when any check failed.

    Raises:
        PlanError: ``rank`` is outside the world (``0 <= rank < world_size``).

    Example::

        >>> with torch.device("meta"):
        ...     model = LlamaForCausalLM(config)
        >>> report = meshplan.check(model, "plans/hf_llama.yaml", world_size=8)
        >>> report.raise_if_errors()
    """
    from meshplan.checks.dry_run import meta_dry_run
    from meshplan.checks.explain import explain
    from meshplan.axes import check_axes
    from meshplan.checks.data import check_data
    p = as_plan(plan)
    lay = Layout.model_validate(dict(layout)) if isinstance(layout, Mapping) else layout or p.layout or Layout()
    report = Report(source=p.source or "<plan>", model=type(model).__name__, tp=lay.tp, world_size=world_size or 0)
    try:
        resolved = lay.resolve(world_size or smallest_world(lay))
    except PlanError as e:
        report.errors.append(PlanError(f"{report.source}: layout: {e}"))
        return report
    report.tp, report.world_size = resolved.tp, resolved.world_size
    check_rank(rank, resolved.world_size, report.source)
    if layout is None and p.layout is None:
        report.warnings.append(f"{report.source}: the plan has no layout and none was given: checked at tp=1, where "
                               f"nothing is sharded; add `layout: {{tp: N}}` (CLI: --tp N)")
    import torch.distributed as dist
    shadow = dry_run and (not dist.is_initialized() or dist.get_backend() == "fake")  # as the dry run
    check_data(model, p, resolved, report)  # the blocks section, as parallelize checks it before the axes
    check_axes(model, p, resolved, report)  # every axis' section: its static checks and resolution (a split: on a
    # meta copy)
    static = report.sharding  # the tensor axis' resolution: the rehearsals below apply it
    checker = static.get("checker")
    if checker is not None and static["ok"] and shadow:  # the shadow run needs a plan that applies
        from meshplan.checks.shadow import cross_shard_errors
        for msg in cross_shard_errors(model, p, resolved.tp, checker.where, report.warnings):
            checker.err(msg)
    applied = None
    if report.ok and p.tensor_parallel is not None and dry_run:
        applied = meta_dry_run(model, p, resolved.tp, report)
    explain(report, model, p, resolved.tp, static.get("matched", {}), getattr(checker, "fanout", set()), applied)
    if report.ok and (applied is not None or p.tensor_parallel is None):
        with_layout = p if p.layout is lay else p.model_copy(update={"layout": lay})  # the layout checked
        report.rank_view = rank_view(report, model, with_layout, resolved, rank, applied)
    per_rank_totals(report)
    report.errors = fold_errors(report.errors)
    return report
