"""The ``data_parallel`` plan section: FSDP2 / HSDP / replication.

:func:`apply_data_parallel` runs after tensor parallelism and the blocks step (:func:`meshplan.blocks.apply_blocks`:
activation checkpointing, ``torch.compile`` per block), in torchtitan's order: FSDP2 ``fully_shard`` on each block,
then on the root. The mode follows the layout (``dp_shard``/``dp_replicate``/``cp``) unless the section's ``mode``
says otherwise. Gradients are SUMMED over the data axes by default: meshplan's loss is normalised by the global
token count (see :mod:`meshplan.training.step`).

The section's model lives in :mod:`meshplan.plan_file.data_parallel` (torch-free); what was applied is recorded in
the model's :class:`~meshplan.state.ParallelState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text
from meshplan.plan_file.blocks import Blocks, split_legacy
from meshplan.plan_file.data_parallel import DataParallel
from meshplan.state import attach_state, parallel_state

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["DataParallelState", "apply_data_parallel", "check_data_parallel", "check_layout", "resolve_mode",
           "data_parallel_problem", "data_parallel_state"]


@dataclass(frozen=True)
class DataParallelState:
    """What :func:`apply_data_parallel` did; recorded as :attr:`meshplan.state.ParallelState.data_parallel`.

    Attributes:
        mode: ``fsdp``, ``hsdp``, ``ddp`` or ``none``.
        section: the validated section.
        grad_sync: a :class:`meshplan.gradients.GradFinalizer` this step made itself for DTensor
            parameters that tensor parallelism outside meshplan left (else None: the model's one, which
            ``parallelize`` handed to the axes, is re-installed on FSDP2's parameters). Read the model's one as
            :attr:`meshplan.state.ParallelState.grad_sync`.
    """

    mode: str
    section: DataParallel
    grad_sync: Any = None


def data_parallel_state(model: "nn.Module") -> DataParallelState | None:
    """The :class:`DataParallelState` in ``model``'s :func:`~meshplan.parallel_state`, or None."""
    state = parallel_state(model)
    return state.data_parallel if state is not None else None


def resolve_mode(section: DataParallel, layout) -> tuple[str, tuple[str, ...] | None, tuple[str, ...] | None]:
    """Mode and mesh keys: ``(mode, shard axes, replicate axes)`` for a resolved layout.

    Raises:
        PlanError: an explicit ``mode`` that does not fit the layout (with the degrees).
    """
    rep, shard, cp = layout.dp_replicate, layout.dp_shard, layout.cp
    sizes = f"dp_replicate({rep}) dp_shard({shard}) cp({cp})"
    mode = section.mode
    if mode is None:
        mode = ("hsdp" if rep > 1 and shard > 1 else "ddp" if rep > 1 and shard == 1
                else "fsdp" if shard * cp > 1 else "none")
    everything = ("dp_replicate", "dp_shard", "cp")
    if mode == "hsdp":
        if rep == 1 or shard * cp == 1:
            raise PlanError(f"data_parallel.mode: hsdp needs dp_replicate > 1 and dp_shard·cp > 1, got {sizes}")
        return mode, ("dp_shard", "cp"), ("dp_replicate",)
    if mode == "fsdp":
        return mode, (("dp_shard", "cp") if rep == 1 else everything), None
    if mode == "ddp":
        return mode, None, everything
    if rep * shard * cp > 1:
        raise PlanError(f"data_parallel.mode: none, but {sizes}: {rep * shard * cp} ranks hold different data and "
                        f"their gradients would never be reduced; use fsdp, hsdp or ddp")
    return mode, None, None


def _check_reshard(section: DataParallel, shard_size: int, has_dtensor: bool) -> None:
    k = section.reshard_after_forward
    if isinstance(k, bool) or k is None:
        return
    if has_dtensor:
        raise PlanError(f"data_parallel.reshard_after_forward: {k} (an int) does not work with tensor-parallel "
                        f"(DTensor) parameters in torch 2.13; use true or false")
    if k >= shard_size or shard_size % k:
        valid = divisors_text(shard_size, lambda d: 1 < d < shard_size)
        raise PlanError(f"data_parallel.reshard_after_forward: {k} must divide the shard size ({shard_size}) and be "
                        f"smaller; valid: {valid if valid != 'none' else 'none (use true/false)'}")


def _sections(section: DataParallel | Mapping[str, Any] | None,
              blocks: Blocks | Mapping[str, Any] | None) -> tuple[DataParallel, Blocks | Mapping[str, Any] | None]:
    """The validated section and the blocks section; the old spelling (blocks keys in ``section``) is mapped."""
    if section is None or isinstance(section, DataParallel):
        return section or DataParallel(), blocks
    section, blocks = split_legacy(section, blocks, "apply_data_parallel", function="apply_data_parallel")
    try:
        return DataParallel.model_validate(dict(section)), blocks
    except ValidationError as e:
        from meshplan.plan_file.reading import pydantic_message
        raise PlanError(f"data_parallel: {pydantic_message(e)}") from None


def check_data_parallel(model: "nn.Module", section: DataParallel, topology: "Topology"
                        ) -> tuple[str, tuple[str, ...] | None, tuple[str, ...] | None]:
    """Every check of :func:`apply_data_parallel` that needs no blocks; run before anything changes the model.

    Returns:
        :func:`resolve_mode`'s ``(mode, shard axes, replicate axes)``.

    Raises:
        PlanError: a mode that does not fit the layout, CPU offload without an accelerator, a bad
            ``reshard_after_forward``.
    """
    import torch
    from torch.distributed.tensor import DTensor
    if section.cpu_offload and (topology.dense.device_type == "cpu" or not torch.accelerator.is_available()):
        raise PlanError(f"data_parallel.cpu_offload: true needs an accelerator (mesh device "
                        f"{topology.dense.device_type!r}); torch 2.13's CPUOffloadPolicy copies between host and "
                        f"device memory. Set cpu_offload: false on CPU-only runs")
    return check_layout(section, topology.layout, any(isinstance(p, DTensor) for p in model.parameters()))


def check_layout(section: DataParallel, layout: Any, has_dtensor: bool
                 ) -> tuple[str, tuple[str, ...] | None, tuple[str, ...] | None]:
    """The checks of :func:`check_data_parallel` that need only the resolved layout (``meshplan check`` runs them
    through :func:`data_parallel_problem`): the mode fits the layout, ``reshard_after_forward`` fits the shard size
    and the parameters (``has_dtensor``: tensor or expert parallelism made them DTensors)."""
    mode, shard_axes, rep_axes = resolve_mode(section, layout)
    if mode in ("fsdp", "hsdp"):
        _check_reshard(section, math.prod(getattr(layout, a) for a in shard_axes), has_dtensor)
    return mode, shard_axes, rep_axes


def data_parallel_problem(plan: Any, layout: Any) -> PlanError | None:
    """The error :func:`meshplan.parallelize` raises for ``plan``'s data parallelism on the resolved ``layout``
    before any device is involved (:func:`check_layout`), else None; ``meshplan check`` reports it. It applies when
    parallelize applies data parallelism: a ``data_parallel`` section, dp·cp > 1, expert gradients over edp > 1."""
    if not (plan.data_parallel is not None or layout.dp * layout.cp > 1
            or (plan.expert_parallel is not None and layout.edp > 1)):
        return None
    try:
        check_layout(plan.data_parallel or DataParallel(), layout,
                     plan.tensor_parallel is not None or plan.expert_parallel is not None)
    except PlanError as e:
        return e
    return None


def apply_data_parallel(model: "nn.Module", section: DataParallel | Mapping[str, Any] | None = None,
                        topology: "Topology | None" = None, *,
                        blocks: Blocks | Mapping[str, Any] | None = None) -> "nn.Module":
    """Apply the ``data_parallel`` section to ``model`` in place (after tensor parallelism).

    The blocks step (:func:`meshplan.blocks.apply_blocks`) runs first unless it ran already (as in
    :func:`meshplan.parallelize`); FSDP2 then shards each of its blocks, then the root. Whether tp ranks hold
    different data (smp's ``sequence_parallel: batch``) is read from the model's :func:`~meshplan.parallel_state`.

    Args:
        model: the (tensor-parallel) model.
        section: a :class:`DataParallel`, its dict, or None (defaults from the layout). A dict in the old
            spelling (with ``blocks``/``activation_checkpointing``/``compile``) still works, with a
            ``FutureWarning``: pass those as ``blocks=``.
        topology: the :class:`~meshplan.Topology`; default: the active one.
        blocks: the ``blocks`` section (a :class:`~meshplan.plan_file.blocks.Blocks` or its dict) when the blocks
            step has not run; default ``layers.*`` with neither checkpointing nor compile.

    Returns:
        ``model``, with FSDP2/HSDP/replicate applied and recorded in its :class:`~meshplan.state.ParallelState`.

    Raises:
        PlanError: an invalid section, a mode that does not fit the layout, a blocks pattern that matches
            nothing, an unknown checkpoint op, CPU offload without an accelerator, a bad
            ``reshard_after_forward``, both spellings of the blocks, or data parallelism applied already.

    Example::

        with meshplan.init({"dp_shard": 4}) as topo:
            model = apply_data_parallel(build(args), {"param_dtype": "bfloat16"}, topo,
                                        blocks={"activation_checkpointing": {"mode": "full"}})
    """
    from meshplan.blocks import apply_blocks
    from meshplan.mesh.topology import current_topology
    section, blocks = _sections(section, blocks)
    topology = topology or current_topology()
    if topology is None:
        raise PlanError("apply_data_parallel needs a Topology (meshplan.init / build_mesh, or `with topo:`)")
    state = parallel_state(model)
    if state is not None and state.data_parallel is not None:
        raise PlanError(f"data_parallel was already applied to this {type(model).__name__}")
    mode, shard_axes, rep_axes = check_data_parallel(model, section, topology)
    if blocks is not None or state is None or state.blocks is None:
        apply_blocks(model, blocks)
    state = parallel_state(model)
    sync = state.grad_sync or _new_grad_sync(model, topology, state.sequence_parallel)
    if mode != "none" or (state.expert_parallel is not None and topology.layout.edp > 1):
        roots = state.pipeline.views if state.pipeline is not None else [model]  # a stage runs as its own root
        _shard(model, roots, state.blocks.paths, section, topology, mode, (shard_axes, rep_axes))
    if sync is not None:
        sync.install(model)  # on FSDP2's parameters: the ones tensor parallelism made are gone
    own = sync if sync is not state.grad_sync else None
    attach_state(model, topology=topology, data_parallel=DataParallelState(mode=mode, section=section, grad_sync=own))
    return model


def _new_grad_sync(model: "nn.Module", topology: "Topology", sequence_parallel: bool | str) -> Any:
    """A grad sync for DTensor parameters (or smp batch mode) that no meshplan tensor parallelism recorded."""
    from torch.distributed.tensor import DTensor

    from meshplan.gradients import finalizer_for
    batch = sequence_parallel == "batch" and topology.layout.tp > 1
    if not batch and not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    return finalizer_for(model, topology["tp"], sequence_parallel)


def _shard_experts(model: "nn.Module", topology: "Topology", mode: str, policies: dict, reshard: Any) -> None:
    """The expert-sharded modules of expert parallelism, data-parallel over ``edp`` on their own (before the
    dense blocks and roots, which then leave their parameters alone): :func:`~.experts.shard_experts`."""
    from meshplan.expert_parallel.edp import shard_experts
    state = parallel_state(model)
    if state is not None and state.expert_parallel is not None:
        modules = [model.get_submodule(b.experts) for b in state.expert_parallel.blocks]
        shard_experts(modules, topology["edp"], mode, policies, reshard)


def _shard(model, roots, blocks, section, topology, mode, axes) -> None:
    """FSDP2 (or DDP) on the experts over ``edp``, on each block, then on each root (the model, or each pipeline
    stage)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    dt = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mp = MixedPrecisionPolicy(param_dtype=dt[section.param_dtype], reduce_dtype=dt[section.reduce_dtype])
    offload = CPUOffloadPolicy() if section.cpu_offload else OffloadPolicy()
    shard_axes, rep_axes = axes
    _shard_experts(model, topology, mode, dict(mp_policy=mp, offload_policy=offload), section.reshard_after_forward)
    if mode == "ddp":
        from meshplan._torch import replicate
        mesh = topology.span(rep_axes)
        for root in roots:
            replicate(root, mesh=mesh, mp_policy=mp, offload_policy=offload)
    elif mode != "none":
        if mode == "hsdp":  # torch's 2-D (replicate, shard) mesh
            mesh = topology.dense["dp_replicate", "dp_shard_cp" if topology.layout.cp > 1 else "dp_shard"]
        else:
            mesh = topology.span(shard_axes)
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
        for path in blocks:
            fully_shard(model.get_submodule(path), reshard_after_forward=section.reshard_after_forward, **kw)
        for root in roots:
            fully_shard(root, **kw)  # the root: torch keeps its parameters gathered after forward
    from torch.distributed.fsdp import FSDPModule
    for m in {id(m): m for r in [model, *roots] for m in r.modules()}.values():
        if isinstance(m, FSDPModule):
            if section.gradient_reduction == "sum":
                m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo lacks AVG/PREMUL_SUM; "mean" post-divides
