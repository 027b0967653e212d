"""``meshplan.parallelize``: apply a plan's sections to a model, in torchtitan's order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan.errors import PlanError
from meshplan.faults.one_error import install as install_one_error
from meshplan.faults.watch import translating
from meshplan.gradients import GradFinalizer
from meshplan.mesh.topology import Topology, build_mesh, current_topology
from meshplan.plan_file.document import Plan, as_plan
from meshplan.state import attach_state, parallel_state

__all__ = ["parallelize"]


def parallelize(model: nn.Module, plan: Plan | Mapping[str, Any] | str | Path | None = None,
                mesh: Topology | DeviceMesh | None = None) -> nn.Module:
    """Turn ``model`` into a parallel model as ``plan`` says, in place; returns it.

    Resolve, then apply: every axis of :data:`meshplan.axes.AXES` resolves and checks its section against the
    model first (nothing changes when one refuses, as ``meshplan check`` reports it); then each axis applies, in
    torchtitan's order (the stage split, tensor, context and expert sharding); then the ``blocks`` section
    (activation checkpointing, compile per block); then each axis' late phase (the stages built, FSDP2 on each
    block, then the root). Each axis' record is attached here alone, to the model's
    :func:`~meshplan.parallel_state`.

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
    install_one_error()  # under torchrun: an uncaught meshplan error is one line per job
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
    watch = getattr(getattr(mesh, "job", None), "watch", None)  # the job owns the watch (mesh.runtime.Job)
    with translating(watch):
        return _apply_sections(model, p, mesh if isinstance(mesh, Topology) else None, meshes)


def _apply_sections(model: nn.Module, p: Plan, topology: Topology | None, meshes: dict[str, Any]) -> nn.Module:
    """:func:`parallelize` once the plan and the mesh are settled and every rank agrees."""
    from meshplan.blocks import blocks_problem
    problem = blocks_problem(model, p, topology.layout if topology is not None else None, p.source)
    if problem is not None:  # `meshplan check` reports the same (checks/data.py); raised before anything changes
        raise problem
    from meshplan.axes import apply_axes, finish_axes, prepare_axes
    prepared = prepare_axes(model, p, topology, meshes)  # every axis resolved and checked, before anything changes
    # train_step's topology (also when no axis records one); the model's one gradient finaliser, handed to the axes
    attach_state(model, plan=p, topology=topology, gradients=GradFinalizer())
    state, attach = (lambda: attach_state(model)), (lambda **record: attach_state(model, **record))
    # each axis' record attached here alone, in parallelize's order (the next axis reads the record so far)
    apply_axes(model, p, topology, prepared, state, attach)
    from meshplan.blocks import apply_blocks, blocks_reason
    if blocks_reason(p, topology.layout if topology is not None else None):
        apply_blocks(model, p.blocks)  # checkpointing, compile per block: once, between the axes' apply and finish
    finish_axes(model, p, topology, prepared, state, attach)  # the late phase: stages, then FSDP2 on each block
    return model
