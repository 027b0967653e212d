"""Colwise/rowwise for packed (fused) weights and for transformers' transposed ``Conv1D``.

A packed projection stores k projections in one weight: Phi-3's ``gate_up_proj``
(k = 2), GPT-2's ``c_attn`` (q|k|v, k = 3). Sharding its output features as one
block would give rank 0 all of q and half of k; each of the k chunks must be
sharded separately, so every rank holds ``[q_r | k_r | v_r]`` and the model's own
``split``/``chunk`` of the local output still works. The parameter is a DTensor
with torch's ``_StridedShard(dim, split_factor=k)`` placement: its local shard is
exactly that, while ``full_tensor()``, ``state_dict()`` and gradients keep the
original (unpermuted) layout, so checkpoints load unchanged. DTensor's ``mm`` /
``addmm`` / ``view`` rules propagate the placement, so forward and backward are
plain DTensor math with the same collectives as an unpacked colwise/rowwise.

transformers' ``Conv1D`` (GPT-2) computes ``x @ W + b`` with ``W`` stored
``(in, out)``: colwise shards ``W`` on dim 1, rowwise on dim 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from meshplan._torch import StridedShard, style_prepare_fns
from meshplan.tensor_parallel.styles import ColwiseParallel, RowwiseParallel

__all__ = ["PackedColwiseParallel", "PackedRowwiseParallel", "is_conv1d", "features", "packed_placement",
           "shard_packed", "uses_packed_style", "packed_order"]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: weight stored ``(in_features, out_features)``, forward ``x @ W + b``."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(w, torch.Tensor) and w.ndim == 2


def features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or ``Conv1D``, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def packed_placement(dim: int, packed: int) -> Placement:
    """``Shard(dim)``, or ``_StridedShard(dim, split_factor=packed)`` for a packed dim."""
    return Shard(dim) if packed == 1 else StridedShard(dim, split_factor=packed)


def packed_order(t: torch.Tensor, dim: int, packed: int, shards: int) -> torch.Tensor:
    """``t`` with ``dim`` reordered so that an ordinary ``Shard(dim)`` over ``shards`` ranks hands each rank its
    slice of every one of the ``packed`` chunks (``_StridedShard(dim, split_factor=packed)``'s local shards).

    Raises:
        ValueError: ``packed * shards`` does not divide ``t.shape[dim]``.
    """
    n = t.shape[dim]
    if n % (packed * shards):
        raise ValueError(f"packed({packed}) x tp({shards}) does not divide size {n} of dim {dim}")
    return t.unflatten(dim, (packed, shards, n // (packed * shards))).transpose(dim, dim + 1).flatten(dim, dim + 2)


def shard_packed(t: torch.Tensor, mesh: DeviceMesh, dim: int, packed: int, src_data_rank: int | None = 0) -> DTensor:
    """Shard ``dim`` of ``t`` over ``mesh`` with each of ``packed`` chunks sharded separately.

    The rows are reordered so that torch's ordinary ``Shard`` scatter (from
    ``src_data_rank``, as in ``distribute_tensor``) hands each rank its slice of
    every chunk; the result is labelled ``_StridedShard`` so its global view is ``t``.

    Raises:
        ValueError: ``packed * mesh.size()`` does not divide ``t.shape[dim]``.
    """
    t = t.detach()
    if packed == 1:
        return distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=src_data_rank)
    order = packed_order(t, dim, packed, mesh.size())
    local = distribute_tensor(order, mesh, [Shard(dim)], src_data_rank=src_data_rank).to_local()
    return DTensor.from_local(local, mesh, [packed_placement(dim, packed)], run_check=False,
                              shape=t.shape, stride=t.stride())


def _param(t: DTensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


class _PackedApply:
    """``_apply`` and ``__repr__`` shared by the packed styles (torch's, with ``Conv1D`` admitted and
    ``self._partition`` sharding each fused part separately)."""

    packed: int

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if features(module) is None:
            raise NotImplementedError(f"{type(self).__name__} needs nn.Linear or Conv1D, got {type(module).__name__}")
        return distribute_module(module, device_mesh, self._partition, *style_prepare_fns(self))

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(packed={self.packed}, input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class PackedColwiseParallel(_PackedApply, ColwiseParallel):
    """``ColwiseParallel`` for packed weights and ``Conv1D`` (also plain ``nn.Linear``).

    Keyword Args:
        packed (int): number of fused projections in the output features. Default: 1.
        input_layouts (Placement, optional): layout of the input. Default: ``Replicate()``.
        output_layouts (Placement, optional): layout of the output. Default: the packed
            ``Shard(-1)`` (``_StridedShard(-1, split_factor=packed)``), which is local: no collective.
        use_local_output (bool): return the local ``[p0_r | p1_r | …]`` tensor. Default: True.
    """

    def __init__(self, *, packed: int = 1, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts or packed_placement(-1, packed),
                         use_local_output=use_local_output)
        self.packed = packed

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        out_dim = 1 if is_conv1d(module) else 0
        for pname, p in list(module.named_parameters(recurse=False)):
            dim = out_dim if p.ndim == 2 else 0
            module.register_parameter(pname, _param(shard_packed(p, mesh, dim, self.packed, self.src_data_rank), p))


class PackedRowwiseParallel(_PackedApply, RowwiseParallel):
    """``RowwiseParallel`` for packed input features and ``Conv1D`` (also plain ``nn.Linear``).

    The bias is replicated and added once, after the reduction (DTensor's ``addmm``).

    Keyword Args:
        packed (int): number of fused inputs in the input features. Default: 1.
        input_layouts (Placement, optional): layout of the input. Default: the packed ``Shard(-1)``.
        output_layouts (Placement, optional): layout of the reduced output. Default: ``Replicate()``.
        use_local_output (bool): return a plain tensor. Default: True.
    """

    def __init__(self, *, packed: int = 1, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts or packed_placement(-1, packed), output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.packed = packed
        self.desired_input_layouts = (packed_placement(-1, packed),)  # torch's _apply would pick it per module type

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        in_dim = 0 if is_conv1d(module) else 1
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.ndim == 2:
                d = shard_packed(p, mesh, in_dim, self.packed, self.src_data_rank)
            else:
                d = distribute_tensor(p.detach(), mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, _param(d, p))


def uses_packed_style(module: nn.Module, packed: int) -> bool:
    """Does a colwise/rowwise rule on ``module`` build the packed style (``packed > 1``, or a ``Conv1D``)?"""
    return packed > 1 or is_conv1d(module)
