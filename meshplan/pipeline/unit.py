"""Pipeline parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

The first axis :func:`meshplan.parallelize` applies: ``prepare`` resolves the split (the schedule against the
layout, every stage's modules, this rank's stages; ``split: trace``: the checks and the record) without touching
the model; ``apply`` prunes the model to this rank's stages (before tensor parallelism and FSDP touch it) and
returns the record; ``finish`` builds the stage objects after the ``blocks`` section; ``run_step`` runs the
schedule in :func:`meshplan.train_step`. Torch-free (the solver imports it): each callable imports this folder's
torch code when called.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.pipeline.costs import TERMS

__all__ = ["AXIS"]


def _check(model: Any, plan: Any, layout: Any, report: Any) -> None:
    from meshplan.pipeline.check import check_pipeline
    check_pipeline(model, plan, layout, report)


def _prepare(model: Any, plan: Any, topology: Any, opaque: Any = tuple) -> Any:
    from meshplan.pipeline.apply import prepare_pipeline
    return prepare_pipeline(model, plan, topology, opaque)


def _apply(model: Any, plan: Any, topology: Any, prepared: Any, state: Any = None) -> Any:
    from meshplan.pipeline.apply import apply_pipeline
    return apply_pipeline(model, plan, topology, prepared)


def _finish(model: Any, plan: Any, topology: Any, prepared: Any, state: Any) -> Any:
    from meshplan.pipeline.apply import finish_pipeline
    dp = plan.data_parallel
    return finish_pipeline(model, topology, prepared, state,
                           reduce_each_microbatch=dp is not None and not dp.accumulate_unsharded)


def _narrow(model: Any, plan: Any, record: Any) -> Any:
    """The plan the later axes apply: tensor-parallel rules naming only other stages' (pruned) modules left out."""
    from meshplan.pipeline.apply import tp_rules
    section = plan.tensor_parallel
    rules = tp_rules(model, section.rules, record) if section is not None else None
    if section is None or rules is section.rules:
        return plan
    return plan.model_copy(update={"tensor_parallel": section.model_copy(update={"rules": rules})})


def _run_step(*args: Any, **options: Any) -> Any:
    from meshplan.pipeline.step import pipeline_step
    return pipeline_step(*args, **options)


def _shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                 ignore_index: int = -100) -> tuple[Any, Any, bool]:
    return inputs, targets, shift  # every rank of a stage group gets the whole batch; the schedule microbatches it


def _part(record: Any) -> tuple[str, tuple[str, ...]]:
    """This rank holds its stages only: how messages name them, and the full model's keys."""
    return f"pipeline stages {record.stage_ids}", tuple(record.full_keys)


def _whole(record: Any, model: Any) -> Any:
    """The full model's structure for a ``with`` block (the removed stages' meta modules back in place), or None
    when the rank holds every stage's modules or the model was pruned off the meta device."""
    if getattr(record, "removed", None) is None:
        return None
    from meshplan.pipeline.whole import whole_model
    return whole_model(model, record.removed)


def _timeline(*args: Any) -> Any:
    from meshplan.pipeline.timeline import schedule_view
    return schedule_view(*args)


def _report_lines(summary: dict) -> list[str]:
    from meshplan.pipeline.check import stage_lines
    return stage_lines(summary)


#: pipeline parallelism: the model's blocks split into stages over ``pp`` (``vpp`` per rank), run by a schedule
AXIS = Axis(name="pp", section="pipeline", title="pipeline parallelism", mesh_dims=("pp",), state_field="pipeline",
            report_key="pipeline", check=_check, prepare=_prepare, apply=_apply, shard_batch=_shard_batch,
            report_lines=_report_lines,
            terms=TERMS, finish=_finish,
            run_step=_run_step, narrow=_narrow, rehearses=True,
            roots=lambda record: record.views, part=_part, whole=_whole, timeline=_timeline,
            graphs=lambda plan: "pipeline.split: trace" if plan.pipeline.split == "trace" else "")
