"""meshplan's own ParallelStyles (the vocab-parallel embedding is in :mod:`meshplan.tensor_parallel.vocab_embedding`), shaped like torch's (keyword-only constructor,
``_apply`` through ``distribute_module``, ``__repr__``). Everything else is torch's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel as _TorchSequenceParallel

from meshplan._torch import local_tensor
from meshplan.errors import PlanError

__all__ = ["PrepareHiddenInput", "ReplicateParallel", "TableWiseEmbedding", "ColwiseParallel",
           "RowwiseParallel", "SequenceParallel", "owned_local", "hidden_arg_name"]


def hidden_arg_name(module: nn.Module) -> str | None:
    """Name of the first parameter of ``module.forward`` (the hidden states), or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def _to_dtensor(x: Any, mesh: DeviceMesh, layout, desired, use_local: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if x.placements != (desired,):
        x = x.redistribute(mesh, (desired,))
    return x.to_local() if use_local else x


class _OwnedLocal(torch.autograd.Function):
    """``DTensor.to_local()`` whose result is not an autograd view, so model code may modify it in place."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        local = local_tensor(x)
        if hasattr(local, "wait") and callable(local.wait):  # an async collective's result: wait for it
            local = local.wait()
        ctx.spec = (x.device_mesh, x.placements, x.shape, x.stride(), local.stride())
        return local.detach()  # a new tensor object on the same storage, not an autograd view

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        mesh, placements, shape, stride, local_stride = ctx.spec
        if grad.stride() != local_stride:  # torch takes shape and stride together, or neither
            grad = grad.contiguous()
            if grad.stride() != local_stride:
                return DTensor.from_local(grad, mesh, placements, run_check=False)
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def owned_local(x: Any) -> Any:
    """``x.to_local()`` for a DTensor (else ``x``), safe for in-place ops in model code (``clamp_``).

    torch's ``to_local`` returns a view created inside a custom Function, which autograd forbids
    modifying in place (Olmo's ``clip_qkv`` does ``q.clamp_(...)`` on a projection's output).
    """
    return _OwnedLocal.apply(x) if isinstance(x, DTensor) else x


def _owned_output(output_layouts, use_local_output, mod, outputs, device_mesh):
    """torch's colwise/rowwise output hook, with :func:`owned_local` in place of ``to_local``."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=True)
    return owned_local(outputs) if use_local_output else outputs


class ColwiseParallel(_TorchColwise):
    """torch's ``ColwiseParallel`` whose local outputs may be modified in place (see :func:`owned_local`)."""

    _prepare_output_fn = staticmethod(_owned_output)


class RowwiseParallel(_TorchRowwise):
    """torch's ``RowwiseParallel`` whose local outputs may be modified in place (see :func:`owned_local`)."""

    _prepare_output_fn = staticmethod(_owned_output)


class SequenceParallel(_TorchSequenceParallel):
    """torch's ``SequenceParallel`` for norms whose parameters sit in submodules too (AXK2's gated RMSNorm holds a
    gate MLP): torch replicates each module's parameters recursively, and fails on the dotted names."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for p_name, param in module.named_parameters(recurse=False):  # distribute_module visits each submodule
            if isinstance(param, DTensor):
                continue  # a norm inside a norm (AXK2's gated norm holds an RMSNorm with a rule of its own)
            module.register_parameter(p_name, nn.Parameter(
                DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)))


class PrepareHiddenInput(ParallelStyle):
    """Redistribute a module's hidden-states input once, however it is passed.

    Like ``PrepareModuleInput`` for one argument, but it finds the argument
    positionally (first) or by keyword (the name of ``forward``'s first
    parameter), so it works for ``attn(x)`` and ``attn(hidden_states=x)`` alike.

    Keyword Args:
        input_layout (Placement): layout of the input as it arrives (a plain tensor is taken as its local shard).
        desired_layout (Placement): layout the module needs. Default: ``Replicate()``.
        arg_name (str, optional): keyword name of the argument; default: read from ``forward``.
        use_local_output (bool): hand the module a plain tensor. Default: False (one conversion per block).
        save_gathered (bool): let autograd keep the gathered input for the module's backward (torch's behaviour).
            False: keep this rank's shard and gather it again in backward
            (:class:`~meshplan.tensor_parallel.regather.Regather`, Megatron-SP's memory). Default: True.
    """

    def __init__(self, *, input_layout=Shard(1), desired_layout=Replicate(), arg_name: str | None = None,
                 use_local_output: bool = False, save_gathered: bool = True):
        super().__init__()
        self.input_layout = input_layout
        self.desired_layout = desired_layout
        self.arg_name = arg_name
        self.use_local_output = use_local_output
        self.save_gathered = save_gathered

    def _convert(self, x: Any, mesh: DeviceMesh, regather: Any) -> Any:
        out = _to_dtensor(x, mesh, self.input_layout, self.desired_layout, self.use_local_output)
        if regather is not None:
            gathers = isinstance(out, torch.Tensor) and isinstance(self.input_layout, Shard) \
                and isinstance(self.desired_layout, Replicate) and local_tensor(out).numel() != local_tensor(x).numel()
            regather.enter(local_tensor(x) if gathers else None, out if gathers else None)
        return out

    def _hook(self, mesh, name, regather, _module, args, kwargs):
        if args:
            args = (self._convert(args[0], mesh, regather), *args[1:])
        elif name is not None and name in kwargs:
            kwargs = {**kwargs, name: self._convert(kwargs[name], mesh, regather)}
        elif regather is not None:
            regather.enter(None, None)
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = self.arg_name or hidden_arg_name(module)
        regather = None
        if not self.save_gathered:
            from meshplan.tensor_parallel.regather import Regather
            regather = Regather(device_mesh.get_group(), self.input_layout.dim if isinstance(
                self.input_layout, Shard) else 1)
            module.register_forward_hook(lambda m, a, out: regather.exit(out), always_call=True)
        module.register_forward_pre_hook(lambda m, a, k: self._hook(device_mesh, name, regather, m, a, k),
                                         with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layout={self.input_layout}, desired_layout={self.desired_layout}, "
                f"arg_name={self.arg_name}, use_local_output={self.use_local_output}, "
                f"save_gathered={self.save_gathered})")


class ReplicateParallel(ParallelStyle):
    """Parameters as ``Replicate`` DTensors; tensor inputs converted, outputs made local.

    Gradients that come out ``Partial`` (inputs that differ across tp ranks) are
    reduced by meshplan's post-backward finaliser, so optimizers see final grads.

    Keyword Args:
        input_layouts (Placement): layout of tensor inputs as they arrive. Default: ``Replicate()``.
        use_local_output (bool): return plain tensors. Default: True.
    """

    def __init__(self, *, input_layouts=Replicate(), use_local_output: bool = True):
        super().__init__()
        self.input_layouts = input_layouts
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inp(_m, args, mesh):
            return tuple(DTensor.from_local(a, mesh, (self.input_layouts,), run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def out(_m, o, mesh):
            if isinstance(o, DTensor) and self.use_local_output:
                return o.redistribute(mesh, (Replicate(),)).to_local() if o.placements != (Replicate(),) else o.to_local()
            return o
        return distribute_module(module, device_mesh, None, input_fn=inp, output_fn=out)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(input_layouts={self.input_layouts}, use_local_output={self.use_local_output})"


class TableWiseEmbedding(ParallelStyle):
    """Place whole embedding tables on tp ranks, round-robin (the seeds' table-wise split).

    Child ``nn.Embedding`` number ``i`` lives on tp rank ``i % tp``; the other ranks
    keep an empty ``(0, dim)`` weight. The owner looks the ids up and broadcasts
    the rows over tp (backward: the gradient is summed onto the owner), so every
    rank gets each table's full output, as with a replicated module.
    """

    def __init__(self) -> None:
        super().__init__()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.nn.functional import broadcast
        tables = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Embedding)]
        if not tables:
            raise PlanError(f"style embedding_tables needs nn.Embedding children, {type(module).__name__} has none")
        tp, me = device_mesh.size(), device_mesh.get_local_rank()
        group = device_mesh.get_group()
        for i, (_, table) in enumerate(tables):
            owner = i % tp
            dim, dtype = table.embedding_dim, table.weight.dtype
            if owner != me:
                table.weight = nn.Parameter(table.weight.new_empty(0, dim))

            def fwd(ids, _t=table, _owner=owner, _dim=dim, _dtype=dtype):
                if _owner == me:
                    rows = F.embedding(ids, _t.weight, _t.padding_idx)
                else:
                    rows = torch.empty(*ids.shape, _dim, dtype=_dtype, device=ids.device)
                return broadcast(rows, src=torch.distributed.get_global_rank(group, _owner), group=group)
            table.forward = fwd
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"
