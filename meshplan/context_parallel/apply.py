"""Apply the ``context_parallel`` section: check the model can be split along the sequence, then install the
runtime (:class:`~meshplan.context_parallel.runtime.CpRuntime`) that makes its attention exact across ``cp``.

What is refused, with the reason (before anything changes): an attention pattern that matches nothing, a model
that does not say how it learns positions, ``method: torch_ring`` off CUDA, and transformers models whose attention is
not SDPA that the all-gather attention can make exact (eager/flash kernels, layer types other than full and
sliding attention, logit soft-capping, dynamic mask attention); the per-layer sliding windows it honours are read
there too (:func:`~meshplan.context_parallel.hf_check.layer_masks`), read from the config and its sub-configs (:mod:`~meshplan.context_parallel.hf_check`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from meshplan.context_parallel.hf_check import check_hf_attention, layer_masks, reads_packing
from meshplan.context_parallel.runtime import CpRuntime
from meshplan.errors import PlanError
from meshplan.plan_file.context_parallel import ContextParallel, PositionsBuffer, PositionsKwarg
from meshplan.plan_file.patterns import match_pattern

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshplan.mesh.topology import Topology

__all__ = ["CpApplied", "check_context_parallel", "check_plan_context", "apply_context_parallel"]


@dataclass(frozen=True)
class CpApplied:
    """What the context-parallel step applied: the section, the ``cp`` mesh and the model's runtime."""

    section: ContextParallel
    mesh: "DeviceMesh"
    runtime: CpRuntime

    @property
    def cp(self) -> int:
        return self.runtime.cp

    def recompute_contexts(self, inner: Any) -> Any:
        """The checkpoint ``context_fn`` giving a recomputed block its forward's positions and documents, around
        ``inner`` (:func:`~meshplan.context_parallel.replay.checkpoint_contexts`)."""
        from meshplan.context_parallel.replay import checkpoint_contexts
        return checkpoint_contexts(self.runtime, inner)


@dataclass(frozen=True)
class _Resolved:
    paths: tuple[str, ...]
    kwarg: str | None
    buffer: str | None
    buffer_dim: int
    inject_mask: bool


def check_plan_context(model: nn.Module, plan: Any, cp: int, pp: int, device_type: str | None,
                       graphs: str = "") -> str | None:
    """The plan's ``context_parallel`` section against the layout and ``model`` (what :func:`meshplan.parallelize`
    and ``meshplan check`` check before anything changes).

    Args:
        model: the model; plan: the :class:`~meshplan.Plan`; cp, pp: the layout's degrees.
        device_type: the mesh's device type (None: unknown, as in ``meshplan check``: ``ring`` is not refused).
        graphs: the plan key with which another axis leaves graphs where the attention modules were (a traced
            pipeline's ``pipeline.split: trace``: :attr:`~meshplan.axis.Axis.graphs`, handed in by the unit), or "".

    Returns:
        The section's error prefix when cp > 1 (apply it), else None (nothing to apply).

    Raises:
        PlanError: cp > 1 without a section, with a traced pipeline or compiled blocks, or what
            :func:`check_context_parallel` refuses.
    """
    where = f"{plan.source}: context_parallel" if plan.source else "context_parallel"
    if plan.context_parallel is None:
        if cp > 1:
            raise PlanError(f"{plan.source or '<plan>'}: layout.cp({cp}) > 1 needs a context_parallel section "
                            f"(attention: <pattern of the attention modules>, positions)")
        return None
    check_context_parallel(model, plan.context_parallel, device_type, where)
    if cp > 1 and graphs:
        raise PlanError(f"{where}: not with {graphs} (a traced stage is a graph: no attention module to route); "
                        f"use split: blocks")
    if cp > 1 and plan.blocks is not None and plan.blocks.compile:
        raise PlanError(f"{where}: blocks.compile is not supported with context parallelism yet (the attention "
                        f"routing is a torch function mode that a compiled block would have to trace)")
    return where if cp > 1 else None


def check_context_parallel(model: nn.Module, section: ContextParallel, device_type: str | None,
                           where: str = "context_parallel") -> _Resolved:
    """Check ``section`` against ``model``; returns what :func:`apply_context_parallel` installs.

    Raises:
        PlanError: naming the plan key, the module path and what would be valid.
    """
    paths = tuple(dict.fromkeys(p for pattern in section.attention
                                for p in match_pattern(model, pattern, f"{where}.attention")))
    if section.method == "torch_ring" and device_type not in (None, "cuda"):
        raise PlanError(f"{where}.method: torch_ring is torch's ring attention, which torch 2.13 runs on CUDA only; "
                        f"this mesh is on {device_type}. Use method: ring or allgather_kv (any device)")
    check_hf_attention(model, where)
    kwarg, buffer, dim = _positions(model, section.positions, where)
    params = inspect.signature(model.forward).parameters
    return _Resolved(paths, kwarg, buffer, dim, kwarg is not None and "attention_mask" in params)


def _positions(model: nn.Module, positions: Any, where: str) -> tuple[str | None, str | None, int]:
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    name = type(model).__name__
    if positions is None:
        if "position_ids" in params:
            return "position_ids", None, 0
        raise PlanError(f"{where}.positions: {name}.forward takes no position_ids, so say how the model learns "
                        f"each token's position: {{kwarg: <forward argument>}}, {{buffer: <position-indexed "
                        f"buffer, e.g. a RoPE table>, dim: 0}}, or none (no positional encoding)")
    if positions == "none":
        return None, None, 0
    if isinstance(positions, PositionsKwarg):
        if positions.kwarg not in params and not takes_any:
            raise PlanError(f"{where}.positions.kwarg: {name}.forward has no argument {positions.kwarg!r}; its "
                            f"arguments: {', '.join(params)}")
        return positions.kwarg, None, 0
    assert isinstance(positions, PositionsBuffer)
    buffers = dict(model.named_buffers())
    if positions.buffer not in buffers:
        raise PlanError(f"{where}.positions.buffer: {name} has no buffer {positions.buffer!r}; its buffers: "
                        f"{', '.join(buffers) or 'none'}")
    if positions.dim >= buffers[positions.buffer].dim():
        raise PlanError(f"{where}.positions.dim: {positions.dim} but {positions.buffer} has "
                        f"{buffers[positions.buffer].dim()} dims")
    return None, positions.buffer, positions.dim


def apply_context_parallel(model: nn.Module, section: ContextParallel, topology: "Topology",
                           where: str = "context_parallel") -> CpApplied:
    """Install the context-parallel runtime on ``model`` for ``topology``'s ``cp`` axis.

    Args:
        model: the (tensor-parallel) model; its root receives this rank's share of every sequence.
        section: the plan's ``context_parallel`` section.
        topology: a :class:`~meshplan.Topology` with ``cp`` > 1.
        where: the plan file and key, for errors.

    Returns:
        :class:`CpApplied`; :func:`meshplan.train_step` shards batches with it
        (:func:`~meshplan.context_parallel.batch.shard_batch`).

    Raises:
        PlanError: what :func:`check_context_parallel` refuses.

    Example::

        >>> applied = apply_context_parallel(model, plan.context_parallel, topo)
    """
    mesh = topology["cp"]
    resolved = check_context_parallel(model, section, mesh.device_type, where)
    rank = mesh.get_local_rank()
    if section.method == "torch_ring":
        from meshplan.context_parallel.torch_ring import torch_ring_attention
        attend = functools.partial(torch_ring_attention, mesh=mesh, load_balance=section.load_balance)
    elif section.method == "ring":
        from meshplan.context_parallel.ring import ring_attention
        attend = functools.partial(ring_attention, group=mesh.get_group(), cp=mesh.size(), rank=rank,
                                   load_balance=section.load_balance)
    else:
        from meshplan.context_parallel.attention import allgather_kv_attention
        attend = functools.partial(allgather_kv_attention, group=mesh.get_group(), cp=mesh.size(), rank=rank,
                                   load_balance=section.load_balance, masks={})  # block masks shared by layers
    runtime = CpRuntime(group=mesh.get_group(), cp=mesh.size(), rank=rank, load_balance=section.load_balance,
                        seq_dim=section.seq_dim, attend=attend, positions_kwarg=resolved.kwarg,
                        buffer=resolved.buffer, buffer_dim=resolved.buffer_dim, patterns=section.attention,
                        attention_paths=resolved.paths, inject_mask=resolved.inject_mask,
                        packing=reads_packing(model),
                        layer_masks=layer_masks(model, resolved.paths), masked=section.method != "torch_ring")
    runtime.install(model)
    return CpApplied(section=section, mesh=mesh, runtime=runtime)
