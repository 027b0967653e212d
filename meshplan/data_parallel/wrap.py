"""FSDP2 / HSDP / DDP wrapped around a model whose other axes and blocks are applied: the unit's late phase
(:attr:`meshplan.axis.Axis.finish`), in torchtitan's order: the experts over ``edp``, each block, then each root (the
model, or each pipeline stage). Reads the model's record as handed in; returns its own (:class:`.mode.DataParallelState`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshplan.data_parallel.mode import DataParallelState
from meshplan.plan_file.data_parallel import DataParallel

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["wrap"]


def wrap(model: "nn.Module", section: DataParallel, topology: "Topology", resolved: tuple, state: Any,
         grad_sync: Any, others: tuple = (), roots: "list[nn.Module] | None" = None) -> DataParallelState:
    """Shard ``model`` as :func:`.mode.check_data_parallel` resolved it (``resolved``: mode, shard axes, replicate
    axes); the checks ran before anything changed.

    Args:
        state: the model's record so far (read only): the blocks' paths, the expert modules, the
            sequence-parallel mode.
        grad_sync: the model's one gradient finaliser (:class:`meshplan.gradients.GradFinalizer`, which
            ``parallelize`` handed to the axes) when it tracks anything, or None: one is made here for
            DTensor parameters that tensor parallelism outside meshplan left (or smp's batch mode).
        others: the other axes (:class:`meshplan.axis.Axis`); those whose record ``state`` holds and that shard
            modules over a data mesh of their own (:attr:`~meshplan.axis.Axis.data_shard`: the experts over edp)
            wrap them first, and wrapping runs for them even in mode ``"none"`` when their
            :attr:`~meshplan.axis.Axis.data_parallel` holds.
        roots: the modules that run as their own roots (:func:`meshplan.axes.roots`, handed in: a pipeline's
            stage views); None: the model.

    Returns:
        The record; its ``grad_sync`` is the finaliser made here, else None (the model's is re-installed on
        FSDP2's parameters).
    """
    mode, shard_axes, rep_axes = resolved
    sync = grad_sync or _new_grad_sync(model, topology, state.sequence_parallel)
    own = [a for a in others if a.data_shard is not None and getattr(state, a.state_field) is not None]
    ends: tuple = ()
    if mode != "none" or any(a.data_parallel(topology.layout) for a in own):
        roots = roots if roots is not None else [model]  # a pipeline stage runs as its own root
        ends = _shard(model, state, roots, state.blocks.paths, section, topology, mode, (shard_axes, rep_axes), own)
    if sync is not None:
        sync.install(model)  # on FSDP2's parameters: the ones tensor parallelism made are gone
    return DataParallelState(mode=mode, section=section, grad_sync=sync if sync is not grad_sync else None,
                             ends=ends)


def _new_grad_sync(model: "nn.Module", topology: "Topology", sequence_parallel: bool | str) -> Any:
    """A grad sync for DTensor parameters (or smp batch mode) that no meshplan tensor parallelism recorded."""
    from torch.distributed.tensor import DTensor

    from meshplan.gradients import finalizer_for
    batch = sequence_parallel == "batch" and topology.layout.tp > 1
    if not batch and not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    return finalizer_for(model, topology["tp"], sequence_parallel)


def _shard(model, state, roots, blocks, section, topology, mode, axes, own) -> tuple:
    """FSDP2 (or DDP) on the modules ``own`` axes shard over a data mesh of their own (the experts over ``edp``),
    on each block, on each root's embedding and head (:func:`.ends.end_units`), then on each root (the model, or
    each pipeline stage); returns the end units as ``(modules, kept gathered after forward)``."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from meshplan.data_parallel.ends import end_units, reads_ids_only, shard_vocab_ends
    dt = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    mp = MixedPrecisionPolicy(param_dtype=dt[section.param_dtype], reduce_dtype=dt[section.reduce_dtype])
    offload = CPUOffloadPolicy() if section.cpu_offload else OffloadPolicy()
    shard_axes, rep_axes = axes
    ends: list = []
    for axis in own:
        axis.data_shard(model, state, topology, mode, dict(mp_policy=mp, offload_policy=offload),
                        section.reshard_after_forward)
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
        for root in roots:  # the embedding and the head as units of their own first (ends.py: why)
            if section.ends == "vocab_parallel":  # or their rows on each data rank for good (ends.py)
                mean = section.gradient_reduction == "mean"
                fully_shard(root, ignored_params=shard_vocab_ends(root, mesh, mesh.size() if mean else 1), **kw)
                continue
            for mods, keep in end_units(root):
                fully_shard(mods if len(mods) > 1 else mods[0],
                            reshard_after_forward=False if keep else section.reshard_after_forward, **kw)
                ends.append((tuple(mods), keep))  # each module of a list is a handle of the one unit
                if not keep:  # the embedding's backward is the last: nothing to prefetch. Implicit prefetching
                    # would re-gather the head, already resharded, in a later microbatch's backward (torch keeps
                    # the forward order across accumulated microbatches); prefetching itself is a no-op.
                    mods[0].set_modules_to_backward_prefetch([mods[0]])
                    if reads_ids_only(mods[0]):  # its backward needs the token ids, not the weight: no re-gather
                        mods[0].set_unshard_in_backward(False)
            fully_shard(root, **kw)  # the root: torch keeps its parameters gathered after forward
    from torch.distributed.fsdp import FSDPModule

    from meshplan._torch import unshard_in_place
    from meshplan.data_parallel.chunked import ChunkedReduceScatter
    for m in {id(m): m for r in [model, *roots] for m in r.modules()}.values():
        if isinstance(m, FSDPModule):
            if section.reduce_scatter == "chunked":  # gloo: no input-sized buffers kept (chunked.py)
                m.set_custom_reduce_scatter(ChunkedReduceScatter())
            if not section.prefetch and mode != "ddp":  # prefetching itself: a no-op (an empty list is torch's
                m.set_modules_to_backward_prefetch([m])  # implicit prefetch); no all-gather result kept in forward
                unshard_in_place(m)
            if section.gradient_reduction == "sum":
                m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo lacks AVG/PREMUL_SUM; "mean" post-divides
    return tuple(ends)
