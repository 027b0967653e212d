"""Tensor parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

Torch-free (the solver imports it): each callable imports this folder's torch code when called.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.errors import PlanError
from meshplan.tensor_parallel.costs import TERMS

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


def _check(model: Any, plan: Any, layout: Any, report: Any, token_regions: Any = set) -> None:
    """``meshplan check``'s static tensor-parallel checks
    (:func:`~meshplan.tensor_parallel.check.validate.static_checks`, the ones ``prepare`` runs), their resolution
    (matched rules, the checker the rehearsals add to) in ``report``."""
    from meshplan.tensor_parallel.check.validate import static_checks
    before = len(report.errors)
    matched, checker = static_checks(model, plan, layout.tp, report, token_regions)
    report.sharding.update(matched=matched, checker=checker, ok=len(report.errors) == before)


def _prepare(model: Any, plan: Any, mesh: Any, token_regions: Any = set) -> Any:
    """``(tp mesh, section)`` after the checks ``meshplan check`` runs (before anything changes), or None: no
    section, or tp 1 (the rules are checked, nothing is applied: styles over one rank shard nothing and cost every
    parameter a DTensor and every block its hooks, 10-22% of a data-parallel step measured; as torchtitan and
    Megatron, tp 1 is no tensor parallelism); ``mesh``: the unit's own (:func:`tp_mesh`, handed by
    ``parallelize``), or a Topology."""
    if plan.tensor_parallel is None:
        return None
    from meshplan.tensor_parallel.check.validate import validate_plan
    mesh = tp_mesh(mesh)
    validate_plan(model, plan, mesh.size(), token_regions)  # what `meshplan check` checks, before anything changes
    return (mesh, plan.tensor_parallel) if mesh.size() > 1 else None


def _apply(model: Any, plan: Any, topology: Any, prepared: tuple, state: Any) -> Any:
    """The section on the (pruned) model: ``plan`` is the one the axes before narrowed (a split leaves out the
    rules naming only modules it removed: :attr:`~meshplan.axis.Axis.narrow`); the model's gradient finaliser
    (``state.gradients``) tracks the replicated parameters."""
    from meshplan.hf.styles import install_hf_loss
    from meshplan.tensor_parallel.apply import apply_tensor_parallel
    mesh, section = prepared[0], plan.tensor_parallel
    applied = apply_tensor_parallel(model, section, mesh, plan.source, state.gradients if state else None)
    install_hf_loss(model, plan.tensor_parallel)  # transformers' own loss on vocab-sharded logits
    return applied


def _shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                 ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """Every tp rank takes the whole batch (smp's batch mode: its data rank's own, cut by ``train_step``)."""
    return inputs, targets, shift


#: tensor parallelism: each module's weights split over ``tp`` as its rule's style says (Megatron's layouts)
AXIS = Axis(name="tp", section="tensor_parallel", title="tensor parallelism", mesh_dims=("tp",),
            state_field="tensor_parallel", report_key="sharding", check=_check, prepare=_prepare,
            apply=_apply, shard_batch=_shard_batch, report_lines=lambda summary: [],
            terms=TERMS, mesh=tp_mesh,
            dtensor=True, hears_regions=True)
