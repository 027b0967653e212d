"""The vocabulary-parallel embedding style (Megatron's VocabParallelEmbedding), wrapping the module's own forward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

from meshplan.errors import PlanError
from meshplan.tensor_parallel.styles import owned_local

__all__ = ["VocabParallelEmbedding"]


class _MaskedLookup(torch.autograd.Function):
    """Local lookup into this rank's vocabulary slice; ids outside it give zero rows."""

    @staticmethod
    def forward(ctx, ids, weight, lo, padding_idx):
        # lo is a 0-d tensor (a per-rank value under LocalTensorMode simulation)
        outside = (ids < lo) | (ids >= lo + weight.shape[0])
        local = (ids - lo).masked_fill(outside, 0)
        skip = outside if padding_idx is None else outside | (ids == padding_idx)
        ctx.save_for_backward(local, outside, skip)
        ctx.num_rows = weight.shape[0]
        return F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad):
        local, _, skip = ctx.saved_tensors
        grad = grad.masked_fill(skip.unsqueeze(-1), 0.0)
        dw = torch.zeros(ctx.num_rows, grad.shape[-1], dtype=grad.dtype, device=grad.device)
        dw.index_add_(0, local.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, dw, None, None


class _LookupMode(TorchFunctionMode):
    """Inside the wrapped embedding's own ``forward``: ``F.embedding`` on its vocab-sharded weight becomes the
    masked local lookup, returned as a ``Partial`` DTensor (what the subclass does next — a scale — is DTensor
    math on it, so any subclass behaviour survives)."""

    def __init__(self, style: "VocabParallelEmbedding", mesh: DeviceMesh, module: nn.Module):
        super().__init__()
        self.style, self.mesh, self.module = style, mesh, module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.embedding, torch.embedding) and len(args) >= 2 and args[1] is self.module.weight:
            ids, weight = args[0], args[1]
            if func is F.embedding:
                padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx")
            else:  # torch.embedding(weight, ids, padding_idx, ...)
                ids, weight = args[1], args[0]
                padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
                padding_idx = None if padding_idx is None or padding_idx < 0 else padding_idx
            return self.style._lookup(self.mesh, ids, weight, padding_idx)
        return func(*args, **kwargs)


class VocabParallelEmbedding(ParallelStyle):
    """Vocabulary-parallel ``nn.Embedding`` (Megatron's VocabParallelEmbedding).

    The weight is ``Shard(0)`` over tp. The module's own ``forward`` runs (a
    subclass that scales or adds to the lookup keeps doing so); inside it, the
    lookup of its weight looks the ids up in this rank's slice (others give zero
    rows) and yields a ``Partial`` DTensor, which the output hook reduces straight
    into ``output_layouts`` (a reduce-scatter to ``Shard(1)`` with sequence
    parallelism, an all-reduce to ``Replicate()`` without). Unlike
    ``RowwiseParallel`` on an embedding, the weight's gradient stays a local
    ``Shard(0)`` slice: no full-vocabulary replicated gradient.

    Keyword Args:
        input_layouts (Placement): layout of the ids. ``Shard(0)`` (smp's batch mode) all-gathers them first.
        output_layouts (Placement): layout of the output. Default: ``Shard(1)``.
        use_local_output (bool): return a plain tensor. Default: False.
    """

    def __init__(self, *, input_layouts=Replicate(), output_layouts=Shard(1), use_local_output: bool = False):
        super().__init__()
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.use_local_output = use_local_output

    def _partition(self, name, module, mesh):
        if name:  # a child the embedding's own forward runs on the lookup (MuseGlimmer's embed_norm): whole
            for pname, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(pname, nn.Parameter(distribute_tensor(
                    p, mesh, [Replicate()], src_data_rank=self.src_data_rank), p.requires_grad))
            return
        if not isinstance(module, nn.Embedding):
            raise PlanError(f"style embedding needs an nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.sparse:
            raise PlanError("style embedding: max_norm and sparse embeddings are not supported")
        vocab, tp = module.num_embeddings, mesh.size()
        if vocab % tp:
            raise PlanError(f"tp({tp}) does not divide num_embeddings({vocab})")
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)],
                                                                           src_data_rank=self.src_data_rank)))

    def _lookup(self, mesh: DeviceMesh, ids: torch.Tensor, weight: DTensor, padding_idx) -> DTensor:
        if isinstance(ids, DTensor):
            ids = ids.redistribute(mesh, (Replicate(),)).to_local()
        elif self.input_layouts != Replicate():
            ids = DTensor.from_local(ids, mesh, (self.input_layouts,), run_check=False).full_tensor()
        w = weight.to_local()
        lo = torch.ones((), dtype=ids.dtype, device=ids.device) * (mesh.get_local_rank() * w.shape[0])
        out = _MaskedLookup.apply(ids, w, lo, padding_idx)
        return DTensor.from_local(out, mesh, (Partial(),), run_check=False)

    def _output(self, mesh: DeviceMesh, out: Any) -> Any:
        if isinstance(out, DTensor):
            if out.placements != (self.output_layouts,):
                out = out.redistribute(mesh, (self.output_layouts,))
            return owned_local(out) if self.use_local_output else out
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = distribute_module(module, device_mesh, self._partition)
        modes: list[_LookupMode] = []

        def enter(mod, args):
            modes.append(_LookupMode(self, device_mesh, mod))
            modes[-1].__enter__()

        def leave(mod, args, out):
            modes.pop().__exit__(None, None, None)
            return self._output(device_mesh, out)
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")
