"""Parameters indexed by attention head that are not in a projection: gpt-oss's attention sinks.

A module whose colwise children shard its heads computes on this rank's heads only; a parameter of its own that
holds one entry per head (``sinks``: one learned logit per head, shape ``[num_heads]``) must be split with the heads.
:class:`HeadParamsParallel` shards such parameters ``Shard(dim)`` over tp and, while the module's forward runs,
shows the forward this rank's slice as a plain tensor (``to_local``: its gradient flows back to the DTensor
parameter as that slice's gradient, no communication). Parameters shared by every head (DiffLlama's
``lambda_q1``) are the ``summed`` names of the same rule; they stay plain and join the tp gradient sum
(:class:`~meshplan.gradients.GradFinalizer`), nothing here.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["HeadParamsParallel", "head_params_style"]


class HeadParamsParallel(ParallelStyle):
    """Shard a module's own per-head parameters with the heads; its forward sees this rank's slices.

    Keyword Args:
        names (tuple[str, ...]): the module's own parameters indexed by head.
        dim (int): their head dim. Default: 0.
        use_local_output (bool): show the forward this rank's slices as plain tensors (else the DTensors).
            Default: True.
        prepare (ParallelStyle, optional): a style for the same module applied after this one (the one input
            conversion of a block whose colwise children share the input: both live on the attention module).

    Example::

        >>> parallelize_module(model.layers[0].self_attn, tp_mesh, HeadParamsParallel(names=("sinks",)))
        >>> model.layers[0].self_attn.sinks.placements
        (Shard(dim=0),)

    .. note::
        Unlike torch's styles it does not go through ``distribute_module``, which would also turn every other
        parameter of the module (its children's included) into a ``Replicate`` DTensor; only ``names`` change.
        The forward reads ``module.<name>`` as a plain tensor of this rank's heads: the slice shadows the
        parameter in the module's ``__dict__`` from the forward pre-hook to the forward hook (also when the
        forward raises), so ``parameters()``, ``state_dict()`` and optimizers see the DTensor.
    """

    def __init__(self, *, names: tuple[str, ...], dim: int = 0, use_local_output: bool = True,
                 prepare: ParallelStyle | None = None):
        super().__init__()
        self.names = tuple(names)
        self.dim = dim
        self.use_local_output = use_local_output
        self.prepare = prepare

    def _own(self, module: nn.Module) -> list[str]:
        """The names this module has (a wildcard rule may cover layers without, e.g. sinks on some layers only)."""
        own = dict(module.named_parameters(recurse=False))
        return [n for n in self.names if n in own]

    def _partition(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name in self._own(module):
            param = getattr(module, name)
            if isinstance(param, DTensor):
                continue
            shard = distribute_tensor(param.data, mesh, [Shard(self.dim)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))

    def _show_local(self, module: nn.Module, *_: Any) -> None:
        for name in self._own(module):
            module.__dict__.pop(name, None)  # a slice left by a forward that never finished
            param = getattr(module, name)
            module.__dict__[name] = param.to_local() if isinstance(param, DTensor) else param

    def _hide_local(self, module: nn.Module, *_: Any) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._partition(module, device_mesh)  # not distribute_module: it would replicate every other parameter
        if self.use_local_output:
            module.register_forward_pre_hook(self._show_local)
            module.register_forward_hook(self._hide_local, always_call=True)
        if self.prepare is not None:
            self.prepare.src_data_rank = self.src_data_rank
            self.prepare._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(names={self.names}, dim={self.dim}, use_local_output={self.use_local_output}, "
                f"prepare={self.prepare})")


def head_params_style(overrides: dict[str, Any]) -> HeadParamsParallel | None:
    """The style of a ``head_params`` rule (its fields ``overrides``); None when it shards nothing (``summed``
    only: those parameters stay plain and join the tp gradient sum)."""
    names = tuple(overrides.get("sharded") or ())
    return HeadParamsParallel(names=names, dim=overrides.get("dim", 0),
                              use_local_output=overrides.get("use_local_output", True)) if names else None
