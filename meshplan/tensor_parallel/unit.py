"""Tensor parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

Torch-free (the solver imports it): each callable imports this folder's torch code when called.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis, AxisCosts
from meshplan.errors import PlanError
from meshplan.tensor_parallel.costs import tp_block_activations, tp_collectives, tp_first_stage_activations, \
    tp_run_problem, tp_sequence_problem

__all__ = ["AXIS", "tp_mesh"]


def tp_mesh(given: Any) -> Any:
    """The 1-D tp mesh of what :func:`meshplan.parallelize` was given: a meshplan Topology's ``tp`` dim, or a torch
    ``DeviceMesh``'s (a 1-D unnamed one is taken as tp).

    Raises:
        PlanError: a ``DeviceMesh`` without a ``tp`` dim, or neither a Topology nor a ``DeviceMesh``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from meshplan.mesh.topology import Topology
    if isinstance(given, Topology):
        return given["tp"]
    if isinstance(given, DeviceMesh):
        names = given.mesh_dim_names or ()
        if given.ndim == 1 and (not names or names == ("tp",)):
            return given
        if "tp" in names:
            return given["tp"]
        raise PlanError(f"the mesh has dims {names}; meshplan needs a 'tp' dim (or pass a meshplan Topology)")
    raise PlanError(f"mesh must be a meshplan Topology or a torch DeviceMesh, got {type(given).__name__}")


def _check(model: Any, plan: Any, layout: Any, report: Any) -> None:
    """``meshplan check``'s static tensor-parallel checks (:func:`~meshplan.checks.validate.static_checks`, the ones
    ``prepare`` runs), their resolution (matched rules, the checker the rehearsals add to) in ``report``."""
    from meshplan.checks.validate import static_checks
    before = len(report.errors)
    matched, checker = static_checks(model, plan, layout.tp, report)
    report.sharding.update(matched=matched, checker=checker, ok=len(report.errors) == before)


def _prepare(model: Any, plan: Any, mesh: Any) -> Any:
    """``(tp mesh, section)`` after the checks ``meshplan check`` runs (before anything changes), or None; ``mesh``:
    the unit's own (:func:`tp_mesh`, handed by ``parallelize``), or a Topology."""
    if plan.tensor_parallel is None:
        return None
    from meshplan.checks.validate import validate_plan
    mesh = tp_mesh(mesh)
    validate_plan(model, plan, mesh.size())  # what `meshplan check` checks, before anything changes
    return mesh, plan.tensor_parallel


def _apply(model: Any, plan: Any, topology: Any, prepared: tuple, state: Any) -> Any:
    """The section on the (pruned) model: rules that name only modules a pipeline split removed are left out; the
    model's gradient finaliser (``state.gradients``) tracks the replicated parameters."""
    import torch.nn as nn

    from meshplan.hf.styles import install_hf_loss
    from meshplan.tensor_parallel.apply import apply_tensor_parallel
    mesh, section = prepared
    removed = {n for n, m in model.named_modules() if isinstance(m, nn.Identity)}
    if removed and state is not None and state.pipeline is not None:  # the split pruned other stages' modules
        from meshplan.pipeline import kept_rules
        section = section.model_copy(update={"rules": kept_rules(model, section.rules, removed)})
    applied = apply_tensor_parallel(model, section, mesh, plan.source, state.gradients if state else None)
    install_hf_loss(model, plan.tensor_parallel)  # transformers' own loss on vocab-sharded logits
    return applied


def _shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                 ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """Every tp rank takes the whole batch (smp's batch mode: its data rank's own, cut by ``train_step``)."""
    return inputs, targets, shift


def _training(plan: Any) -> dict:
    """The solver's sequence-parallel, loss-parallel and saved-input settings of the section."""
    section, tp = plan.tensor_parallel, plan.layout.tp if plan.layout is not None else 1
    return {"sequence_parallel": bool(section is not None and section.sequence_parallel is True and tp > 1),
            "loss_parallel": bool(section is not None and section.loss_parallel),
            "save_gathered_inputs": bool(section is not None and section.save_gathered_inputs)}


#: tensor parallelism: each module's weights split over ``tp`` as its rule's style says (Megatron's layouts)
AXIS = Axis(name="tp", section="tensor_parallel", title="tensor parallelism", mesh_dims=("tp",),
            state_field="tensor_parallel", report_key="sharding", check=_check, prepare=_prepare,
            apply=_apply, shard_batch=_shard_batch, report_lines=lambda summary: [],
            costs=AxisCosts(collectives=tp_collectives, block_activations=tp_block_activations,
                            first_stage_activations=tp_first_stage_activations,
                            sequence_problem=tp_sequence_problem, run_problem=tp_run_problem),
            training=_training, example_plan="plans/llama.yaml", mesh=tp_mesh)
