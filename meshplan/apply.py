"""``meshplan.parallelize``: apply a plan's sections to a model, in torchtitan's order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan, as_plan
from meshplan.mesh.topology import Topology, build_mesh, current_topology

__all__ = ["parallelize"]


def _tp_mesh(mesh: Topology | DeviceMesh) -> DeviceMesh:
    if isinstance(mesh, Topology):
        return mesh["tp"]
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 1 and (not names or names == ("tp",)):
            return mesh
        if "tp" in names:
            return mesh["tp"]
        raise PlanError(f"the mesh has dims {names}; meshplan needs a 'tp' dim (or pass a meshplan Topology)")
    raise PlanError(f"mesh must be a meshplan Topology or a torch DeviceMesh, got {type(mesh).__name__}")


def parallelize(model: nn.Module, plan: Plan | Mapping[str, Any] | str | Path | None = None,
                mesh: Topology | DeviceMesh | None = None) -> nn.Module:
    """Turn ``model`` into a parallel model as ``plan`` says, in place; returns it.

    Order as torchtitan found right: tensor parallelism, then (the
    ``data_parallel`` section) activation checkpointing, compile and FSDP.

    Args:
        model: an ordinary ``nn.Module`` (on the meta device, CPU or CUDA).
        plan: a path, a dict of a file's content, or a :class:`Plan`; default: the
            plan attached by ``@meshplan.plan`` to the model's class.
        mesh: a :class:`Topology` or a torch ``DeviceMesh`` with a ``tp`` dim; it wins
            over the plan's ``layout``. Default: the active topology (``with meshplan.init(...):``),
            else one built from the plan's layout.

    Returns:
        ``model``, parallelized.

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
    tp_mesh = _tp_mesh(mesh)
    from meshplan.mesh.runtime import check_same_plan
    check_same_plan(p, mesh if isinstance(mesh, Topology) else tp_mesh)  # a rank with another plan fails, not hangs
    if isinstance(mesh, Topology):
        model._meshplan_topology = mesh  # train_step's default without a data_parallel section (tp only)
    if p.tensor_parallel is not None:
        from meshplan.tensor_parallel.generate import apply_tensor_parallel
        from meshplan.checks.validate import validate_plan
        validate_plan(model, p, tp_mesh.size())  # what `meshplan check` checks, before anything changes
        applied = apply_tensor_parallel(model, p.tensor_parallel, tp_mesh, p.source)
        model._meshplan_tp = applied  # the finaliser and RNG hooks live as long as the model
        from meshplan.hf.styles import install_hf_loss
        install_hf_loss(model, p.tensor_parallel)  # transformers' own loss on vocab-sharded logits
    dp = getattr(p, "data_parallel", None)
    if dp is not None or (isinstance(mesh, Topology) and mesh.layout.dp > 1 and "data_parallel" in Plan.model_fields):
        from meshplan.data_parallel.fsdp import apply_data_parallel
        if not isinstance(mesh, Topology):
            raise PlanError("the data_parallel section needs a meshplan Topology (meshplan.init or build_mesh), "
                            "not a bare DeviceMesh")
        apply_data_parallel(model, dp, mesh, sequence_parallel=p.tensor_parallel.sequence_parallel
                            if p.tensor_parallel is not None else False)
    return model
