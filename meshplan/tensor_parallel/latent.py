"""Multi-head Latent Attention (DeepSeek V2/V3's MLA) under tensor parallelism: a replicated latent, heads split
after it.

MLA computes small latents from the block input on every rank (``q_a_proj`` → ``q_a_layernorm``,
``kv_a_proj_with_mqa`` → ``kv_a_layernorm``; the last ``qk_rope_head_dim`` features of ``kv_a_proj_with_mqa`` are
the rope key shared by every head) and up-projects them per head (``q_b_proj``, ``kv_b_proj``: split by head,
colwise); ``o_proj`` is rowwise. Every rank computes its own heads from the same latent, so the latent's gradient on a
rank is its heads' part: a partial sum over tp.

The two styles keep that gradient partial instead of all-reducing it at each consumer (transformers all-reduces
the input gradient of each up-projection and of the rope key: three all-reduces per layer). Backward is linear in
the gradient and the latent's forward values agree on every rank, so the partial gradient flows back through the
replicated latent modules unchanged, reaches the block input as a ``Partial`` DTensor beside the other colwise
projections' gradients, and is reduced there by the block's one input conversion (a reduce-scatter under sequence
parallelism, an all-reduce without). The latent modules' parameter gradients, partial as well, join the one
coalesced tp sum of :class:`~meshplan.gradients.GradFinalizer`. Nothing needs the rope split.

Per layer that is the collectives of any attention block (one conversion in, one rowwise reduction out) and no more.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from meshplan._torch import local_tensor
from meshplan.tensor_parallel.styles import ColwiseParallel

__all__ = ["LatentParallel", "LatentColwiseParallel", "latent_local", "latent_input"]


class _LatentLocal(torch.autograd.Function):
    """A replicated DTensor's local value; its gradient goes back ``Partial`` (each rank's heads' part)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        local = local_tensor(x)
        if hasattr(local, "wait") and callable(local.wait):  # an async collective's result: wait for it
            local = local.wait()
        ctx.spec = (x.device_mesh, x.shape, x.stride())
        return local.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        mesh, shape, stride = ctx.spec
        grad = grad.contiguous()
        if grad.stride() != stride:  # torch takes shape and stride together, or neither
            return DTensor.from_local(grad, mesh, (Partial(),), run_check=False)
        return DTensor.from_local(grad, mesh, (Partial(),), run_check=False, shape=shape, stride=stride)


class _LatentInput(torch.autograd.Function):
    """A latent (a plain tensor, the same on every rank) as a ``Replicate`` DTensor; the gradient that comes back
    (``Partial``: this rank's heads' part) is handed on unreduced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.mesh = mesh
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad: Any) -> tuple[torch.Tensor, None]:
        if isinstance(grad, DTensor):
            if grad.placements != (Partial(),):
                grad = grad.redistribute(ctx.mesh, (Partial(),))
            grad = local_tensor(grad)
        return grad, None


def latent_local(x: Any) -> Any:
    """The block input of a latent module as a plain tensor whose gradient goes back ``Partial``.

    A DTensor (the block's converted input) is made replicated first; a plain tensor (another latent module's
    output) is already a latent value and passes unchanged."""
    if not isinstance(x, DTensor):
        return x
    if x.placements != (Replicate(),):
        x = x.redistribute(x.device_mesh, (Replicate(),))
    return _LatentLocal.apply(x)


def latent_input(x: Any, mesh: DeviceMesh) -> Any:
    """A latent (plain) as the ``Replicate`` DTensor a colwise projection takes, its gradient left ``Partial``."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, (Replicate(),)) if x.placements != (Replicate(),) else x
    return _LatentInput.apply(x, mesh)


class LatentParallel(ParallelStyle):
    """A module of the latent path, replicated over tp: MLA's ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms
    after them (``q_a_layernorm``, ``kv_a_layernorm``).

    Its parameters stay plain replicated tensors and it runs whole. Tensor inputs that are DTensors (the block's
    converted input) become local, their gradient returned ``Partial``; plain inputs are latents already. Its
    parameters' gradients (each rank's heads' part) are summed over tp by meshplan's post-backward reduction.

    Example::

        >>> parallelize_module(attn, tp_mesh, {"kv_a_proj_with_mqa": LatentParallel(),
        ...                                    "kv_a_layernorm": LatentParallel(),
        ...                                    "kv_b_proj": LatentColwiseParallel()})

    .. note:: Every consumer of its output must leave the gradient partial: :class:`LatentColwiseParallel`, the
       local heads (the rope key), other latent modules. A plain ``ColwiseParallel`` all-reduces its input's
       gradient, which the tp sum of the parameters' gradients would then count tp times.
    """

    def __init__(self) -> None:
        super().__init__()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(_m, args, kwargs):
            return (tuple(latent_local(a) for a in args),
                    {k: latent_local(v) for k, v in kwargs.items()})
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class LatentColwiseParallel(ColwiseParallel):
    """A per-head up-projection of a latent (MLA's ``q_b_proj``, ``kv_b_proj``): weight split by output features
    (heads) like ``ColwiseParallel``; its input, a latent, is taken as replicated with no collective either way
    (the input gradient stays ``Partial``, see :class:`LatentParallel`).

    Keyword Args:
        output_layouts (Placement): the output's layout. Default: ``Shard(-1)`` (this rank's heads).
        use_local_output (bool): return a plain tensor. Default: True.
    """

    def __init__(self, *, output_layouts=None, use_local_output: bool = True) -> None:
        super().__init__(output_layouts=output_layouts, use_local_output=use_local_output)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        return latent_input(inputs[0], device_mesh)
