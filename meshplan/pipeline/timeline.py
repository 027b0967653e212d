"""``meshplan check --schedule``: the executed schedule of a plan's ``pipeline`` section as a picture or text
(the pipeline unit's :attr:`~meshplan.axis.Axis.timeline`; the CLI writes what it returns)."""

from __future__ import annotations

import json
from typing import Any

from meshplan.errors import PlanError

__all__ = ["schedule_view"]


def schedule_view(plan: Any, resolved: Any, report: Any, name: str, fmt: str) -> Any:
    """The schedule torch runs for ``plan``'s pipeline section on the ``resolved`` layout.

    Args:
        plan: the :class:`~meshplan.Plan`; resolved: its resolved layout (``pp``, ``vpp``).
        report: ``meshplan check``'s :class:`~meshplan.checks.report.Report` (None without ``--model``): its stages
            name each stage's modules.
        name: the plan file, for messages and the title; fmt: ``svg``/``png`` (a drawing), ``json`` or ``table``.

    Returns:
        A :class:`~meshplan.viz.drawing.Drawing` for svg/png, else the text (a json document or a table per rank).

    Raises:
        PlanError: no pipeline section (with an example), the check's errors, or a schedule the layout cannot run.
    """
    from meshplan.pipeline.order import executed_steps
    from meshplan.viz.timeline import schedule_document, schedule_table, timeline
    if plan.pipeline is None:
        raise PlanError(f"{name}: check --schedule: the plan has no pipeline section; found none, expected "
                        f"e.g. `pipeline: {{schedule: 1f1b, microbatches: {2 * resolved.pp}}}`")
    if report is not None and not report.ok:
        raise PlanError(f"{name}: " + "; ".join(str(e) for e in report.errors))
    sec = plan.pipeline
    steps = executed_steps(sec.schedule, resolved.pp, resolved.vpp, sec.microbatches, f"{name}: pipeline")
    names = {r["stage"]: ", ".join([*r["first_modules"], *r["blocks_text"], *r["last_modules"]])
             for r in (report.pipeline.get("stages", []) if report is not None else [])}
    title = f"{name}: {sec.schedule}, pp {resolved.pp} × vpp {resolved.vpp}, {sec.microbatches} microbatches"
    if fmt in ("svg", "png"):
        return timeline(steps, title, names)
    if fmt == "json":
        return json.dumps(schedule_document(steps, sec.schedule), separators=(",", ":")) + "\n"
    return schedule_table(steps, title) + "\n"
