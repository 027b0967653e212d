"""The eager split applied to a block-stack model: resolved, pruned, built (the unit's prepare, apply, finish).

:func:`resolve_split` runs in the unit's ``prepare`` (nothing changes); :func:`split_pipeline` is its ``apply``, the
first axis :func:`meshplan.parallelize` applies (the model is pruned to this rank's stages, so tensor parallelism
and FSDP only touch what this rank runs); :func:`build_stages` is its ``finish``, after the ``blocks`` section
(the stage views are made after tensor parallelism and checkpointing changed the modules, and are FSDP's roots).
Each returns a record; ``parallelize`` attaches it. :func:`meshplan.train_step` runs the schedule (:mod:`.step`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.pipeline.split import StageSplit, local_stage_ids, plan_split, prune, stage_view
from meshplan.pipeline.stages import PipelineApplied, boundary_hooks, check_schedule
from meshplan.plan_file.stages import other_degrees
from meshplan.plan_file.pipeline import Pipeline

__all__ = ["resolve_split", "split_pipeline", "build_stages", "PipelineApplied", "kept_rules", "sync_tied",
           "Resolved", "prepare_pipeline", "apply_pipeline", "finish_pipeline", "tp_rules"]


def _tied(model: nn.Module, split: StageSplit) -> list[tuple[str, str]]:
    """``(first stage's name, last stage's name)`` of parameters both ends hold (tied embeddings)."""
    first = {id(p): f"{m}.{n}" for m in split.first
             for n, p in model.get_submodule(m).named_parameters(remove_duplicate=False)}
    return [(first[id(p)], f"{m}.{n}") for m in split.last
            for n, p in model.get_submodule(m).named_parameters(remove_duplicate=False) if id(p) in first]


def resolve_split(model: nn.Module, section: Pipeline, block_pattern: str, topology: Any, where: str = "pipeline",
                  opaque: tuple[str, ...] = ()) -> tuple[StageSplit, list[int]]:
    """Check the schedule and assign stages, without changing ``model`` (``parallelize``'s resolution).

    ``opaque``: modules the split probe runs as shape-preserving stand-ins (MoE blocks: data-dependent routing
    has no meta kernels); see :func:`~meshplan.pipeline.probe.probe_split`.

    Returns:
        ``(split, stage ids)``: every stage's modules, and the stages this rank runs.

    Raises:
        PlanError: see :func:`~meshplan.plan_file.stages.check_schedule` and
            :func:`~meshplan.pipeline.split.plan_split`.
    """
    lay = topology.layout
    check_schedule(section, lay.pp, lay.vpp, where, other_degrees(lay))
    split = plan_split(model, section, block_pattern, lay.pp * lay.vpp, where)
    from meshplan.pipeline.probe import probe_split
    probe_split(model, split, where, opaque=opaque)  # refuse a model a later stage would compute differently
    return split, local_stage_ids(topology.pp_rank, lay.pp, lay.vpp, section.schedule)


def split_pipeline(model: nn.Module, section: Pipeline, split: StageSplit, ids: list[int],
                   topology: Any) -> PipelineApplied:
    """Prune ``model`` to this rank's stages ``ids`` of ``split`` (in place); returns the record (its views and
    stages come from :func:`build_stages`). Creates the embedding groups of tied parameters (every rank, in order)."""
    from meshplan.pipeline.whole import removed_parts
    tied = _tied(model, split)
    record = PipelineApplied(section=section, stage_ids=ids, num_stages=split.num_stages,
                             full_keys=tuple(model.state_dict()), removed=removed_parts(model, split, ids, tied))
    if tied:
        names, group = _embedding_group(topology, record, tied)
        record = dataclasses.replace(record, tied=names, embedding_group=group)
    prune(model, split, ids)
    return record


def _embedding_group(topology: Any, record: PipelineApplied, tied: list[tuple[str, str]]) -> tuple[list[str], Any]:
    """This rank's names of the tied parameters and the process group summing their gradients (Megatron's
    embedding group: the first and last stage's ranks). Every rank creates every group, in the same order;
    a rank running both ends (V-shaped schedules) sums them in autograd and needs none."""
    import torch.distributed as dist
    embd = topology.layout.groups("embd")
    groups = [dist.new_group(g, group_desc="pp_embedding") for g in embd]
    mine = next((g for g, ranks in zip(groups, embd) if topology.rank in ranks), None)
    if mine is not None:  # the plan's timeout, reports name it, and the topology's end destroys it
        topology.adopt_group(mine, "pp_embedding")
    if record.has_first == record.has_last:
        return [], None
    return [f if record.has_first else last for f, last in tied], mine

def kept_rules(model: nn.Module, rules: dict, removed: set[str]) -> dict:
    """The tensor-parallel rules that still match a module of the pruned model (others name modules of stages
    this rank does not run)."""
    from meshplan.plan_file.patterns import match_rules
    kept = {}
    for pattern, rule in rules.items():
        hits = match_rules(model, {pattern: rule}, "", errors=[])
        if any(path not in removed for path in hits):
            kept[pattern] = rule
    return kept


def build_stages(model: nn.Module, record: PipelineApplied, split: StageSplit, topology: Any,
                 sequence_parallel: bool | str, stream_dim: str | None,
                 reduce_each_microbatch: bool = False) -> PipelineApplied:
    """Make this rank's stage views (boundary conversions hooked) and their ``PipelineStage`` objects; returns
    ``record`` with them (a new record: ``parallelize`` attaches it).
    ``stream_dim``: the mesh dim the residual stream is a DTensor over (``ParallelState.stream_dim``), or None.
    ``reduce_each_microbatch``: FSDP2 reduce-scatters every microbatch (:class:`.reducing.ReducingStage`;
    ``data_parallel.accumulate_unsharded: false``) instead of once per step."""
    from torch.distributed.pipelining import PipelineStage

    from meshplan.pipeline.reducing import ReducingStage
    make = ReducingStage if reduce_each_microbatch else PipelineStage
    tp_mesh = topology[stream_dim] if stream_dim is not None else None
    device = torch.device(topology.dense.device_type, torch.cuda.current_device()) \
        if topology.dense.device_type == "cuda" else torch.device("cpu")
    views = []
    for s in record.stage_ids:
        view = stage_view(model, split, s)
        boundary_hooks(view, tp_mesh, sequence_parallel, first=s == 0, last=s == split.num_stages - 1,
                       loss=record.loss)
        views.append(view)
    group = topology["pp"].get_group()
    stages = [make(v, s, split.num_stages, device, group=group) for v, s in zip(views, record.stage_ids)]
    return dataclasses.replace(record, views=views, stages=stages)


def sync_tied(model: nn.Module, record: PipelineApplied) -> None:
    """Sum the gradients of tied parameters over the embedding group (first and last stage)."""
    if record.embedding_group is None:
        return
    import torch.distributed as dist
    from meshplan._torch import local_tensor
    for name in record.tied:
        try:
            p = model.get_parameter(name)
        except AttributeError:
            raise PlanError(f"pipeline: tied parameter {name!r} is not on this rank's stages") from None
        if p.grad is not None:
            dist.all_reduce(local_tensor(p.grad), group=record.embedding_group)


@dataclass(frozen=True)
class Resolved:
    """The eager split ``parallelize`` resolved before anything changed: every stage's modules and this rank's."""

    split: StageSplit
    stage_ids: list[int]


def prepare_pipeline(model: nn.Module, plan: Any, topology: Any, opaque: Any = tuple) -> Any:
    """The unit's ``prepare``: None when the plan and the layout have no pipeline; else the resolved split
    (:class:`Resolved`), or for ``split: trace`` this rank's record (checked, not traced). Nothing changes.
    ``opaque()``: the modules the split probe stands in for (:func:`resolve_split`).

    Raises:
        PlanError: a bare ``DeviceMesh``, ``layout.pp > 1`` without a pipeline section, or what
            :func:`resolve_split` / :func:`~meshplan.pipeline.traced.plan_traced` refuse.
    """
    if plan.pipeline is None and (topology is None or topology.layout.pp == 1):
        return None
    if topology is None:
        raise PlanError("the pipeline section needs a meshplan Topology (meshplan.init or build_mesh), not a bare "
                        "DeviceMesh")
    if plan.pipeline is None:
        raise PlanError(f"{plan.source or '<plan>'}: layout.pp({topology.layout.pp}) > 1 needs a pipeline section "
                        f"(schedule, microbatches)")
    where = f"{plan.source}: pipeline" if plan.source else "pipeline"
    if plan.pipeline.split == "trace":  # traced on the first train_step (shapes); nothing else to build here
        from meshplan.pipeline.traced import plan_traced
        return plan_traced(model, plan, topology, where)
    pattern = plan.blocks.pattern if plan.blocks is not None else "layers.*"
    return Resolved(*resolve_split(model, plan.pipeline, pattern, topology, where, opaque()))


def apply_pipeline(model: nn.Module, plan: Any, topology: Any, prepared: Any) -> PipelineApplied:
    """The unit's ``apply``, the first axis applied: this rank's stages pruned (eager split); the record."""
    if not isinstance(prepared, Resolved):
        return prepared  # split: trace: the record plan_traced made
    return split_pipeline(model, plan.pipeline, prepared.split, prepared.stage_ids, topology)


def finish_pipeline(model: nn.Module, topology: Any, prepared: Any, state: Any,
                    reduce_each_microbatch: bool = False) -> PipelineApplied | None:
    """The unit's ``finish``, after the ``blocks`` section: the stage objects (eager split), a new record;
    ``reduce_each_microbatch``: ``data_parallel.accumulate_unsharded`` false (see :func:`build_stages`)."""
    if not isinstance(prepared, Resolved):
        return None
    return build_stages(model, state.pipeline, prepared.split, topology, state.sequence_parallel,
                        stream_dim=state.stream_dim, reduce_each_microbatch=reduce_each_microbatch)


def tp_rules(model: nn.Module, rules: dict, record: PipelineApplied) -> dict:
    """The tensor-parallel rules of the pruned ``model`` (an eager split's record): rules naming only modules of
    stages this rank does not run are left out."""
    from meshplan.pipeline.traced import TracedPipeline
    if isinstance(record, TracedPipeline):
        return rules  # split: trace: nothing pruned yet (and no tensor parallelism beside it)
    removed = {n for n, m in model.named_modules() if isinstance(m, nn.Identity)}
    return kept_rules(model, rules, removed)
