"""Pipeline parallelism over the ``pp`` axis: the plan's ``pipeline`` section applied to a block-stack model.

:func:`split_pipeline` runs first in :func:`meshplan.parallelize` (the model is pruned to this rank's stages, so
tensor parallelism and FSDP only touch what this rank runs); :func:`build_stages` runs last (the stage views
are made after tensor parallelism and checkpointing changed the modules, and are FSDP's roots).
:func:`meshplan.train_step` runs the schedule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.pipeline.split import StageSplit, local_stage_ids, plan_split, prune, stage_view
from meshplan.pipeline.stages import PipelineApplied, boundary_hooks, check_schedule
from meshplan.plan_file.stages import other_degrees
from meshplan.plan_file.pipeline import Pipeline

__all__ = ["split_pipeline", "build_stages", "PipelineApplied", "kept_rules"]


def _tied(model: nn.Module, split: StageSplit) -> list[tuple[str, str]]:
    """``(first stage's name, last stage's name)`` of parameters both ends hold (tied embeddings)."""
    first = {id(p): f"{m}.{n}" for m in split.first
             for n, p in model.get_submodule(m).named_parameters(remove_duplicate=False)}
    return [(first[id(p)], f"{m}.{n}") for m in split.last
            for n, p in model.get_submodule(m).named_parameters(remove_duplicate=False) if id(p) in first]


def split_pipeline(model: nn.Module, section: Pipeline, block_pattern: str, topology: Any,
                   where: str = "pipeline", opaque: tuple[str, ...] = ()) -> tuple[PipelineApplied, StageSplit]:
    """Check the schedule, assign stages and prune ``model`` to this rank's (in place).

    ``opaque``: modules the split probe runs as shape-preserving stand-ins (MoE blocks: data-dependent routing
    has no meta kernels); see :func:`~meshplan.pipeline.probe.probe_split`.

    Returns:
        ``(record, split)``: the record gets its views and stages from :func:`build_stages`.

    Raises:
        PlanError: see :func:`~meshplan.plan_file.stages.check_schedule` and
            :func:`~meshplan.pipeline.split.plan_split`.
    """
    lay = topology.layout
    check_schedule(section, lay.pp, lay.vpp, where, other_degrees(lay))
    split = plan_split(model, section, block_pattern, lay.pp * lay.vpp, where)
    from meshplan.pipeline.probe import probe_split
    probe_split(model, split, where, opaque=opaque)  # refuse a model a later stage would compute differently
    ids = local_stage_ids(topology.pp_rank, lay.pp, lay.vpp, section.schedule)
    tied = _tied(model, split)
    record = PipelineApplied(section=section, stage_ids=ids, num_stages=split.num_stages,
                             full_keys=tuple(model.state_dict()))
    if tied:
        record.tied, record.embedding_group = _embedding_group(topology, record, tied)
    prune(model, split, ids)
    return record, split


def _embedding_group(topology: Any, record: PipelineApplied, tied: list[tuple[str, str]]) -> tuple[list[str], Any]:
    """This rank's names of the tied parameters and the process group summing their gradients (Megatron's
    embedding group: the first and last stage's ranks). Every rank creates every group, in the same order;
    a rank running both ends (V-shaped schedules) sums them in autograd and needs none."""
    import torch.distributed as dist
    embd = topology.layout.groups("embd")
    groups = [dist.new_group(g, group_desc="pp_embedding") for g in embd]
    if record.has_first == record.has_last:
        return [], None
    mine = next(g for g, ranks in zip(groups, embd) if topology.rank in ranks)
    topology.adopt_group(mine, "pp_embedding")  # the plan's timeout; reports name it
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
                 sequence_parallel: bool | str, tensor_parallel: bool) -> list[nn.Module]:
    """Make this rank's stage views (boundary conversions hooked) and their ``PipelineStage`` objects.
    ``tensor_parallel``: the model's styles were applied (at tp 1 too: its stream is then a one-rank DTensor)."""
    from torch.distributed.pipelining import PipelineStage
    tp_mesh = topology["tp"] if tensor_parallel else None
    device = torch.device(topology.dense.device_type, torch.cuda.current_device()) \
        if topology.dense.device_type == "cuda" else torch.device("cpu")
    record.views = []
    for s in record.stage_ids:
        view = stage_view(model, split, s)
        boundary_hooks(view, tp_mesh, sequence_parallel, first=s == 0, last=s == split.num_stages - 1,
                       loss=record.loss)
        record.views.append(view)
    group = topology["pp"].get_group()
    record.stages = [PipelineStage(v, s, split.num_stages, device, group=group)
                     for v, s in zip(record.views, record.stage_ids)]
    return record.views


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
