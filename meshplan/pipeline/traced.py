"""``pipeline: {split: trace}``: a model that is not a block stack, cut into stages by tracing, from a plan.

:func:`plan_traced` runs in :func:`meshplan.parallelize`: it refuses what traced stages do not support yet, checks
the schedule and the split points (no tracing) and records this rank's stages in a :class:`TracedPipeline`.
Tracing specialises shapes, so the stages are made on the first :func:`meshplan.train_step`
(:func:`prepare_traced`, which returns a new record that ``train_step`` attaches), from ONE microbatch of its batch (``batch[0]`` chunked by ``microbatches``):

* every rank traces the whole model (:func:`~meshplan.pipeline.trace.traced_stages`) and keeps its stages; their
  parameters are the model's tensors (shared, not copied), so the gradients land on the model's parameters;
* the model is pruned to this rank's stages, as the eager split prunes it: modules all of whose state-dict
  entries are on other ranks' stages become ``nn.Identity``, a single such tensor of a kept module ``None``.
  ``model.state_dict()`` is then this rank's part of the full one, under the original names (the ranks' keys
  together are the full model's); a tensor no stage uses stays on the rank holding stage 0;
* the pruned tensors are dropped from ``optimizer``'s param groups too (with any state it had for them): they
  never get a gradient here, and the optimizer would otherwise keep them alive;
* the ``_PipelineStage`` objects are built (:meth:`~meshplan.pipeline.trace.TracedStages.build`) and the plan's
  schedule runs them with :class:`~meshplan.pipeline.stages.StepLoss`, as for the eager split.

Every later step must bring microbatches of the traced shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.pipeline.split import local_stage_ids
from meshplan.pipeline.stages import PipelineApplied, check_schedule
from meshplan.plan_file.stages import other_degrees
from meshplan.pipeline.trace import check_split_points, stage_state_dict, traced_stages
from meshplan.plan_file.pipeline import SCHEDULES, V_SCHEDULES

__all__ = ["TracedPipeline", "plan_traced", "prepare_traced"]


@dataclass
class TracedPipeline(PipelineApplied):
    """A :class:`~meshplan.pipeline.stages.PipelineApplied` whose stages are traced on the first step.

    Attributes:
        where: prefix of error messages (the plan file's ``pipeline`` section).
        shapes: the microbatch input shapes the stages were traced with (None: not traced yet).
    """

    where: str = "pipeline"
    shapes: list[tuple[int, ...]] | None = field(default=None)


def _refuse_composition(plan: Any, layout: Any, where: str) -> None:
    """Traced stages are fx graphs of the whole forward: nothing else of the plan applies to them yet."""
    sections = [s for s in ("tensor_parallel", "data_parallel", "blocks") if getattr(plan, s) is not None]
    if sections:
        raise PlanError(f"{where}.split: trace with the {', '.join(sections)} section(s): not supported yet (traced "
                        f"stages are fx graphs the model's tensor-parallel, FSDP and checkpoint wrappers do not "
                        f"reach); expected split: trace alone, or split: blocks for a block-stack model")
    others = {k: v for k, v in layout.sizes().items() if k not in ("pp", "vpp", "etp", "edp") and v > 1}
    if layout.world_size != layout.pp or others:
        raise PlanError(f"{where}.split: trace runs on pp ranks only; found world size {layout.world_size} with pp="
                        f"{layout.pp} and {others or 'no other degree'}; expected world size = pp (run "
                        f"--nproc-per-node {layout.pp}, or use split: blocks to combine pp with tp or dp)")


def _refuse_v_schedule(schedule: str, where: str) -> None:
    """torch's traced stages (``_PipelineStage``) warm their links up by sending to the next stage's rank and
    receiving from the previous one's, even when that is the rank itself: the turn of a V (rank pp−1 holds
    stages pp−1 and pp) sends to itself, which no process group can (gloo: "Pair is not connected")."""
    if schedule in V_SCHEDULES:
        raise PlanError(f"{where}.schedule: {schedule} with split: trace is not supported: the V puts stages pp−1 "
                        f"and pp on one rank and torch {torch.__version__}'s traced stages open their links by "
                        f"sending to the next stage's rank, here the rank itself, which fails; expected one of "
                        f"{', '.join(s for s in SCHEDULES if s not in V_SCHEDULES)}, or split: blocks")


def plan_traced(model: nn.Module, plan: Any, topology: Any, where: str = "pipeline") -> TracedPipeline:
    """Check a ``split: trace`` plan against the model and the layout; return this rank's record (not traced yet).

    Raises:
        PlanError: another section beside the traced split (tensor_parallel, data_parallel, blocks), a layout
            with degrees other than pp/vpp, a V-shaped schedule (zbv_zero_bubble, dualpipev), a schedule that
            does not fit pp/vpp/microbatches, split points that are not ``pp·vpp − 1`` distinct module paths of
            ``model``.
    """
    section, lay = plan.pipeline, topology.layout
    _refuse_composition(plan, lay, where)
    _refuse_v_schedule(section.schedule, where)
    check_schedule(section, lay.pp, lay.vpp, where, other_degrees(lay))
    num_stages = lay.pp * lay.vpp
    check_split_points(model, section.split_points or (), num_stages, f"{where}.split_points")
    ids = local_stage_ids(topology.pp_rank, lay.pp, lay.vpp, section.schedule)
    return TracedPipeline(section=section, stage_ids=ids, num_stages=num_stages, where=where,
                          full_keys=tuple(model.state_dict()))  # a full checkpoint's keys (loading)


def _microbatch(inputs: Any, m: int, where: str) -> tuple[torch.Tensor, ...]:
    """The first microbatch of ``inputs`` (a tensor or a tuple of tensors), as positional arguments."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
    if bad:
        raise PlanError(f"{where}: split: trace traces the model on one microbatch of train_step's inputs; got "
                        f"inputs of type(s) {bad}; expected a tensor or a tuple of tensors (positional inputs)")
    return tuple(a.chunk(m)[0] for a in args)


def _keys_by_stage(modules: list[nn.Module], model: nn.Module) -> list[set[str]]:
    """Per stage module, its entries of ``model.state_dict()`` (original names)."""
    return [set(stage_state_dict(m, model)) for m in modules]


def _prune(model: nn.Module, drop: set[str]) -> set[int]:
    """Remove the state-dict entries ``drop`` from ``model`` (in place); returns the ids of the removed tensors.

    A module all of whose entries are dropped becomes ``nn.Identity``; a single dropped tensor of a module that
    keeps others becomes ``None`` (``register_parameter``/``register_buffer``)."""
    state = model.state_dict(keep_vars=True)
    removed = {id(state[k]) for k in drop}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            path = prefix + name + "."
            keys = [k for k in state if k.startswith(path)]
            if keys and all(k in drop for k in keys):
                setattr(module, name, nn.Identity())
            elif any(k in drop for k in keys):
                visit(path, child)
        for name, _ in list(module.named_parameters(recurse=False)):
            if prefix + name in drop:
                module.register_parameter(name, None)
        for name, _ in list(module.named_buffers(recurse=False)):
            if prefix + name in drop:
                module.register_buffer(name, None)

    visit("", model)
    return removed


def _prune_optimizer(optimizer: Any, removed: set[int]) -> None:
    """Drop the removed tensors from ``optimizer``'s param groups, with their state."""
    for group in getattr(optimizer, "param_groups", ()):
        gone = [p for p in group["params"] if id(p) in removed]
        for p in gone:
            optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if id(p) not in removed]


def _device(topology: Any) -> torch.device:
    if topology.dense.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_shapes(record: TracedPipeline, example: tuple[torch.Tensor, ...]) -> None:
    shapes = [tuple(a.shape) for a in example]
    if shapes != record.shapes:
        raise PlanError(f"{record.where}: split: trace traced the stages on microbatches of shape(s) {record.shapes} "
                        f"(the first train_step's batch / microbatches({record.section.microbatches})); got "
                        f"{shapes}; expected every step to bring batches of the first step's shape")


def prepare_traced(model: nn.Module, record: PipelineApplied, inputs: Any, optimizer: Any,
                   topology: Any) -> PipelineApplied:
    """Trace and build this rank's stages on the first step (nothing for an eager split, or once built).

    Args:
        model: the parallelized model (pruned here to this rank's stages).
        record: the model's pipeline record.
        inputs: this rank's step inputs (``batch[0]``): its first microbatch is the tracing example.
        optimizer: the step's optimizer (the pruned tensors leave its param groups).
        topology: the model's topology (device, pp group).

    Returns:
        ``record`` itself (an eager split, or stages already traced), else a new record holding the traced views,
        stages and shapes (the caller attaches it; ``record`` is not changed).

    Raises:
        PlanError: inputs that are not tensors, an untraceable model or split points that cut other stages than
            asked (see :func:`~meshplan.pipeline.trace.traced_stages`), or, on a later step, microbatches of
            another shape than the traced ones.
    """
    if not isinstance(record, TracedPipeline):
        return record
    example = _microbatch(inputs, record.section.microbatches, record.where)
    if record.shapes is not None:
        _check_shapes(record, example)
        return record
    n = record.num_stages
    traced = traced_stages(model, example, record.section.split_points or (), n, list(range(n)),
                           where=f"{record.where}.split_points")
    keys = _keys_by_stage(traced.modules, model)
    full = set(model.state_dict())
    unused = full - set().union(*keys)  # on no stage: kept where stage 0 runs
    keep = set().union(*(keys[s] for s in record.stage_ids)) | (unused if record.has_first else set())
    removed = _prune(model, full - keep)
    _prune_optimizer(optimizer, removed)
    traced.modules = [traced.modules[s] for s in record.stage_ids]
    traced.stage_indices = list(record.stage_ids)
    return dataclasses.replace(record, views=traced.modules, shapes=[tuple(a.shape) for a in example],
                               stages=traced.build(_device(topology), topology["pp"].get_group()))
