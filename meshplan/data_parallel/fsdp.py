"""The ``data_parallel`` plan section: FSDP2 / HSDP / replication, checkpointing, compile.

:func:`apply_data_parallel` runs after tensor parallelism, in torchtitan's
order: activation checkpointing → ``torch.compile`` per block → FSDP2
(``fully_shard`` per block, then at the root). The mode follows the layout
(``dp_shard``/``dp_replicate``/``cp``) unless the section's ``mode`` says
otherwise. Gradients are SUMMED over the data axes by default: meshplan's loss
is normalised by the global token count (see :mod:`meshplan.training.step`).

The section's models live in :mod:`meshplan.plan_file.data_parallel` (torch-free).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from meshplan.plan_file.data_parallel import ActivationCheckpointing, DataParallel
from meshplan.errors import PlanError

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["DataParallelState", "apply_data_parallel",
           "resolve_mode", "data_parallel_state"]

_STATE_ATTR = "_meshplan_dp"


@dataclass
class DataParallelState:
    """What :func:`apply_data_parallel` did; stored on the model, read by :func:`meshplan.training.step.train_step`.

    Attributes:
        mode: ``fsdp``, ``hsdp``, ``ddp`` or ``none``.
        section: the validated section.
        topology: the topology it was applied on.
        data_axes: mesh keys whose ranks hold different data (``dp_replicate``, ``dp_shard``, ``cp``, + ``tp`` in
            smp's batch mode); the token count is summed over them.
        blocks: paths of the blocks.
        grad_sync: the live :class:`meshplan.tensor_parallel.grad_sync.TpGradSync` (coalesced tp reductions of replicated grads,
            re-installed on FSDP2's parameters), or None when nothing needs one.
    """

    mode: str
    section: DataParallel
    topology: Any
    data_axes: tuple[str, ...]
    blocks: list[str] = field(default_factory=list)
    grad_sync: Any = None


def data_parallel_state(model: "nn.Module") -> DataParallelState | None:
    """The :class:`DataParallelState` that :func:`apply_data_parallel` attached to ``model``, or None."""
    return getattr(model, _STATE_ATTR, None)


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


_KEYS = {(): "dp_shard", ("dp_replicate",): "dp_replicate", ("dp_shard",): "dp_shard", ("cp",): "dp_shard_cp",
         ("dp_shard", "cp"): "dp_shard_cp", ("dp_replicate", "dp_shard"): "dp", ("dp_replicate", "cp"): "dp_cp",
         ("dp_replicate", "dp_shard", "cp"): "dp_cp"}


def _mesh(topology: "Topology", axes: tuple[str, ...]):
    """The 1-D topology mesh spanning ``axes`` (the simplest key; size-1 axes dropped)."""
    return topology[_KEYS[tuple(a for a in axes if getattr(topology.layout, a) > 1)]]


def _match_blocks(model: "nn.Module", pattern: str) -> list[str]:
    rx = re.compile(r"\.".join(re.escape(s).replace(r"\*", "[^.]+") for s in pattern.split(".")))
    names = [n for n, _ in model.named_modules() if n and rx.fullmatch(n)]
    if not names:
        top = ", ".join(n for n, _ in model.named_children()) or "none"
        raise PlanError(f"data_parallel.blocks: pattern {pattern!r} matched no module of {type(model).__name__} "
                        f"(top-level children: {top})")
    return names


def _resolve_ops(ac: ActivationCheckpointing) -> list:
    import torch
    ops = []
    for i, name in enumerate(ac.ops):
        parts = name.split(".")
        try:
            op = getattr(getattr(torch.ops, parts[0]), parts[1])
            ops.append(getattr(op, parts[2] if len(parts) == 3 else "default"))
        except (AttributeError, RuntimeError):
            raise PlanError(f"data_parallel.activation_checkpointing.ops[{i}]: unknown op {name!r} "
                            f"(torch.ops.{name} does not exist)") from None
    return ops


def _checkpoint(model: "nn.Module", blocks: list[str], ac: ActivationCheckpointing, ops: list) -> None:
    if ac.mode == "none":
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, ops)} if ops else {}
    for k, path in enumerate(blocks, start=1):
        if ac.mode == "full" or k % ac.every == 0:
            parent, _, name = path.rpartition(".")
            wrapped = checkpoint_wrapper(model.get_submodule(path), preserve_rng_state=True, **kwargs)
            model.get_submodule(parent).register_module(name, wrapped)


def _check_reshard(section: DataParallel, shard_size: int, has_dtensor: bool) -> None:
    k = section.reshard_after_forward
    if isinstance(k, bool) or k is None:
        return
    if has_dtensor:
        raise PlanError(f"data_parallel.reshard_after_forward: {k} (an int) does not work with tensor-parallel "
                        f"(DTensor) parameters in torch 2.13; use true or false")
    if k >= shard_size or shard_size % k:
        valid = [d for d in range(2, shard_size) if shard_size % d == 0]
        raise PlanError(f"data_parallel.reshard_after_forward: {k} must divide the shard size ({shard_size}) and be "
                        f"smaller; valid: {', '.join(map(str, valid)) or 'none (use true/false)'}")


def apply_data_parallel(model: "nn.Module", section: DataParallel | Mapping[str, Any] | None = None,
                        topology: "Topology | None" = None, *,
                        sequence_parallel: bool | str = False) -> "nn.Module":
    """Apply the ``data_parallel`` section to ``model`` in place (after tensor parallelism).

    Args:
        model: the (tensor-parallel) model.
        section: a :class:`DataParallel`, its dict, or None (defaults from the layout).
        topology: the :class:`~meshplan.Topology`; default: the active one.
        sequence_parallel: the plan's ``tensor_parallel.sequence_parallel``. ``"batch"`` (smp) means every tp
            rank holds its own part of the batch: plain (non-DTensor) parameters then reduce over tp·dp·cp and
            tokens are counted over tp too.

    Returns:
        ``model``, with FSDP2/HSDP/replicate applied and a :class:`DataParallelState` attached.

    Raises:
        PlanError: an invalid section, a mode that does not fit the layout, a blocks pattern that matches
            nothing, an unknown checkpoint op, CPU offload without an accelerator, or a bad
            ``reshard_after_forward``.

    Example::

        with meshplan.init({"dp_shard": 4}) as topo:
            model = apply_data_parallel(build(args), {"param_dtype": "bfloat16"}, topo)
    """
    import torch
    from torch.distributed.tensor import DTensor

    from meshplan.mesh.topology import current_topology
    from meshplan.tensor_parallel.grad_sync import TpGradSync, grad_sync
    if section is None:
        section = DataParallel()
    elif not isinstance(section, DataParallel):
        try:
            section = DataParallel.model_validate(dict(section))
        except ValidationError as e:
            from meshplan.plan_file.reading import pydantic_message
            raise PlanError(f"data_parallel: {pydantic_message(e)}") from None
    topology = topology or current_topology()
    if topology is None:
        raise PlanError("apply_data_parallel needs a Topology (meshplan.init / build_mesh, or `with topo:`)")
    if getattr(model, _STATE_ATTR, None) is not None:
        raise PlanError(f"data_parallel was already applied to this {type(model).__name__}")
    layout = topology.layout
    mode, shard_axes, rep_axes = resolve_mode(section, layout)
    batch = sequence_parallel == "batch"
    if section.cpu_offload and (topology.dense.device_type == "cpu" or not torch.accelerator.is_available()):
        raise PlanError(f"data_parallel.cpu_offload: true needs an accelerator (mesh device "
                        f"{topology.dense.device_type!r}); torch 2.13's CPUOffloadPolicy copies between host and "
                        f"device memory. Set cpu_offload: false on CPU-only runs")
    blocks = _match_blocks(model, section.blocks)
    has_dtensor = any(isinstance(p, DTensor) for p in model.parameters())
    if mode in ("fsdp", "hsdp"):
        _check_reshard(section, math.prod(getattr(layout, a) for a in shard_axes), has_dtensor)
    ops = _resolve_ops(section.activation_checkpointing)  # every check before the model changes
    _checkpoint(model, blocks, section.activation_checkpointing, ops)
    if section.compile:
        for path in blocks:
            model.get_submodule(path).compile()
    sync = grad_sync(model) or (TpGradSync.for_model(model, topology["tp"], sequence_parallel)
                                if has_dtensor or (batch and layout.tp > 1) else None)
    data_axes = ("dp_replicate", "dp_shard", "cp") + (("tp",) if batch else ())
    state = DataParallelState(mode=mode, section=section, topology=topology, data_axes=data_axes, blocks=blocks)
    if mode != "none":
        _shard(model, blocks, section, topology, mode, shard_axes, rep_axes)
    if sync is not None:
        state.grad_sync = sync.install(model)  # on FSDP2's parameters: the ones tensor parallelism made are gone
    setattr(model, _STATE_ATTR, state)
    return model


def _shard(model, blocks, section, topology, mode, shard_axes, rep_axes) -> None:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    dt = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mp = MixedPrecisionPolicy(param_dtype=dt[section.param_dtype], reduce_dtype=dt[section.reduce_dtype])
    offload = CPUOffloadPolicy() if section.cpu_offload else OffloadPolicy()
    if mode == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        mesh = _mesh(topology, rep_axes)
        replicate(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    else:
        if mode == "hsdp":  # torch's 2-D (replicate, shard) mesh
            mesh = topology.dense["dp_replicate", "dp_shard_cp" if topology.layout.cp > 1 else "dp_shard"]
        else:
            mesh = _mesh(topology, shard_axes)
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
        for path in blocks:
            fully_shard(model.get_submodule(path), reshard_after_forward=section.reshard_after_forward, **kw)
        fully_shard(model, **kw)  # the root: torch keeps its parameters gathered after forward
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if section.gradient_reduction == "sum":
                m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo lacks AVG/PREMUL_SUM; "mean" post-divides
