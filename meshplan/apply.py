"""``meshplan.parallelize``: apply a plan's sections to a model, in torchtitan's order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan.errors import PlanError
from meshplan.faults.watch import translating
from meshplan.gradients import GradFinalizer
from meshplan.mesh.topology import Topology, build_mesh, current_topology
from meshplan.plan_file.data_parallel import DataParallel
from meshplan.plan_file.document import Plan, as_plan
from meshplan.state import attach_state

__all__ = ["parallelize"]


def parallelize(model: nn.Module, plan: Plan | Mapping[str, Any] | str | Path | None = None,
                mesh: Topology | DeviceMesh | None = None) -> nn.Module:
    """Turn ``model`` into a parallel model as ``plan`` says, in place; returns it.

    Order as torchtitan found right: tensor parallelism (``tensor_parallel``), then the ``blocks`` section
    (activation checkpointing, compile per block), then FSDP2 (``data_parallel``: each block, then the root).
    What was applied is recorded in the model's :func:`~meshplan.parallel_state`.

    Args:
        model: an ordinary ``nn.Module`` (on the meta device, CPU or CUDA).
        plan: a path, a dict of a file's content, or a :class:`Plan`; default: the
            plan attached by ``@meshplan.plan`` to the model's class.
        mesh: a :class:`Topology` or a torch ``DeviceMesh`` with a ``tp`` dim; it wins
            over the plan's ``layout``. Default: the active topology (``with meshplan.init(...):``),
            else one built from the plan's layout.

    Returns:
        ``model``, parallelized, with its :class:`~meshplan.state.ParallelState` attached.

    Raises:
        PlanError: the plan does not fit the model or the mesh; the message names the plan
            file, the rule and the module path.

    Example::

        with meshplan.init("plans/llama.yaml") as topo:
            model = meshplan.parallelize(Transformer(args), "plans/llama.yaml", topo)
            loss = meshplan.cross_entropy(model(tokens), labels)
    """
    if plan is None:
        plan = getattr(type(model), "__meshplan_plan__", None)
        if plan is None:
            raise PlanError(f"no plan given and {type(model).__name__} has none attached (@meshplan.plan)")
    p = as_plan(plan)
    if mesh is None:
        mesh = current_topology() or build_mesh(p.layout or {})
    from meshplan.axes import axis_meshes
    meshes = axis_meshes(mesh)  # the axes' own meshes (a bare DeviceMesh: its tp dim); PlanError for a bad mesh
    from meshplan.mesh.runtime import check_same_plan
    # a rank with another plan, model or torch fails, not hangs (a bare DeviceMesh: over its axis' ranks)
    check_same_plan(p, mesh if isinstance(mesh, Topology) else next(iter(meshes.values())), model)
    watch = getattr(mesh, "faults", None)
    with translating(watch):
        return _apply_sections(model, p, mesh if isinstance(mesh, Topology) else None, meshes)


def _apply_sections(model: nn.Module, p: Plan, topology: Topology | None, meshes: dict[str, Any]) -> nn.Module:
    """:func:`parallelize` once the plan and the mesh are settled and every rank agrees."""
    data_parallel = p.data_parallel is not None or (topology is not None and topology.layout.dp * topology.layout.cp > 1)
    pipelined = p.pipeline is not None or (topology is not None and topology.layout.pp > 1)
    if (data_parallel or pipelined) and topology is None:
        raise PlanError(f"the {'data_parallel' if data_parallel else 'pipeline'} section needs a meshplan Topology "
                        f"(meshplan.init or build_mesh), not a bare DeviceMesh")
    from meshplan.axes import apply_axes, prepare_axes
    prepared = prepare_axes(model, p, topology, meshes)  # every axis' check and resolution, before anything changes
    from meshplan.blocks import blocks_problem
    from meshplan.data_parallel.fsdp import data_parallel_problem
    lay = topology.layout if topology is not None else None
    problem = blocks_problem(model, p, lay, p.source) or (data_parallel_problem(p, lay) if lay is not None else None)
    if problem is not None:  # `meshplan check` reports the same (checks/data.py); raised before anything changes
        raise problem
    split = _split_stages(model, p, topology) if pipelined else None
    # train_step's topology (also without data parallelism); the model's one gradient finaliser, handed to the axes
    attach_state(model, plan=p, topology=topology, gradients=GradFinalizer())
    # each axis' record attached here alone, in parallelize's order (the next axis reads the record so far)
    data_parallel = apply_axes(model, p, topology, prepared, lambda: attach_state(model),
                               lambda **record: attach_state(model, **record)) or data_parallel
    if data_parallel:
        from meshplan.data_parallel.fsdp import check_data_parallel
        section = p.data_parallel or DataParallel()
        check_data_parallel(model, section, topology)  # before the blocks step changes the model
    if data_parallel or p.blocks is not None:
        from meshplan.blocks import apply_blocks
        apply_blocks(model, p.blocks)  # checkpointing, compile per block
    if split is not None:
        from meshplan.pipeline import build_stages
        state = attach_state(model)
        build_stages(model, state.pipeline, split, topology, state.sequence_parallel,
                     tensor_parallel=state.tensor_parallel is not None)
    if data_parallel:
        from meshplan.data_parallel.fsdp import apply_data_parallel
        apply_data_parallel(model, section, topology)  # fully_shard each block, then the root (each stage)
    return model


def _split_stages(model: nn.Module, p: Plan, topology: Topology) -> Any:
    """The pipeline step's first half: stages assigned, the model pruned to this rank's (before anything else
    touches it), the record attached. ``split: trace``: checked and recorded only (None: no eager split)."""
    if p.pipeline is None:
        raise PlanError(f"{p.source or '<plan>'}: layout.pp({topology.layout.pp}) > 1 needs a pipeline section "
                        f"(schedule, microbatches)")
    where = f"{p.source}: pipeline" if p.source else "pipeline"
    if p.pipeline.split == "trace":  # traced on the first train_step (shapes); nothing else to build here
        from meshplan.pipeline.traced import plan_traced
        attach_state(model, pipeline=plan_traced(model, p, topology, where))
        return None
    from meshplan.pipeline import split_pipeline
    pattern = p.blocks.pattern if p.blocks is not None else "layers.*"
    from meshplan.axes import opaque_modules
    opaque = opaque_modules(model, p)  # the split probe's stand-ins
    record, split = split_pipeline(model, p.pipeline, pattern, topology, where, opaque)
    attach_state(model, pipeline=record)
    return split
