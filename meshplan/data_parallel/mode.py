"""Data parallelism resolved, torch-free: the mode and mesh keys a layout gives (:func:`resolve_mode`), every check
that needs no model change (:func:`check_layout`, :func:`check_data_parallel`, :func:`data_parallel_problem`), and
the frozen record :class:`DataParallelState` (what :func:`meshplan.parallelize` attaches as
``ParallelState.data_parallel``). The unit (:mod:`.unit`) runs these in ``prepare`` and ``meshplan check``.
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

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["DataParallelState", "check_data_parallel", "check_layout", "resolve_mode", "data_parallel_problem",
           "needed", "sections"]


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
        ends: each root's embedding and head units (:func:`meshplan.data_parallel.ends.end_units`) as
            ``(modules, kept gathered after forward)`` (a list unit's modules are each an ``FSDPModule`` of the
            one unit): the head's True, the embedding's False (it follows
            ``reshard_after_forward``).
    """

    mode: str
    section: DataParallel
    grad_sync: Any = None
    ends: tuple = ()


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


def sections(section: DataParallel | Mapping[str, Any] | None,
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
    if section.reduce_scatter == "chunked" and topology.dense.device_type != "cpu":
        raise PlanError(f"data_parallel.reduce_scatter: chunked is for CPU (gloo) meshes, got mesh device "
                        f"{topology.dense.device_type!r}: its reduces and freed buffers would race the GPU's "
                        f"collective streams; use reduce_scatter: collective")
    return check_layout(section, topology.layout, any(isinstance(p, DTensor) for p in model.parameters()))


def check_layout(section: DataParallel, layout: Any, has_dtensor: bool
                 ) -> tuple[str, tuple[str, ...] | None, tuple[str, ...] | None]:
    """The checks of :func:`check_data_parallel` that need only the resolved layout (``meshplan check`` runs them
    through :func:`data_parallel_problem`): the mode fits the layout, ``reshard_after_forward`` fits the shard size
    and the parameters (``has_dtensor``: an axis made them DTensors)."""
    mode, shard_axes, rep_axes = resolve_mode(section, layout)
    if mode in ("fsdp", "hsdp"):
        _check_reshard(section, math.prod(getattr(layout, a) for a in shard_axes), has_dtensor)
    if section.ends == "vocab_parallel":
        _check_vocab_ends(mode, layout)
    return mode, shard_axes, rep_axes


def _check_vocab_ends(mode: str, layout: Any) -> None:
    """``ends: vocab_parallel`` shards the ends over FSDP2's one data mesh, where no other axis shards them."""
    got = f"got mode {mode} with dp_replicate({layout.dp_replicate}) dp_shard({layout.dp_shard}) cp({layout.cp})"
    if mode != "fsdp":
        raise PlanError(f"data_parallel.ends: vocab_parallel shards the embedding and head over FSDP2's data ranks "
                        f"and needs mode fsdp; {got}: use ends: fsdp, or mode: fsdp")
    if layout.tp > 1:
        raise PlanError(f"data_parallel.ends: vocab_parallel is for tp 1, got tp({layout.tp}): tensor "
                        f"parallelism shards the embedding and head already (its embedding and lm_head rules); "
                        f"use ends: fsdp")


def data_parallel_problem(plan: Any, layout: Any, asked: bool = False, dtensor: bool = False) -> PlanError | None:
    """The error :func:`meshplan.parallelize` raises for ``plan``'s data parallelism on the resolved ``layout``
    before any device is involved (:func:`check_layout`), else None; ``meshplan check`` reports it. It applies when
    parallelize applies data parallelism: a ``data_parallel`` section, dp·cp > 1, or ``asked`` (an axis of the plan
    sums its gradients over data ranks of its own: :attr:`meshplan.axis.Axis.data_parallel`).

    Args:
        dtensor: an axis of the plan makes DTensor parameters (:attr:`meshplan.axis.Axis.dtensor`).
    """
    if not needed(plan, layout, asked):
        return None
    try:
        check_layout(plan.data_parallel or DataParallel(), layout, dtensor)
    except PlanError as e:
        return e
    return None


def needed(plan: Any, layout: Any, asked: bool = False) -> bool:
    """Whether :func:`meshplan.parallelize` applies data parallelism: a ``data_parallel`` section, dp·cp > 1 in the
    resolved ``layout`` (None: a bare DeviceMesh), or ``asked`` by an axis of the plan."""
    return plan.data_parallel is not None or (layout is not None and (layout.dp * layout.cp > 1 or asked))
