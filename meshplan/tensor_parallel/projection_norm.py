"""A norm over a whole colwise projection whose output stays sharded (Olmo2's ``q_norm``/``k_norm``).

Olmo2 normalises ``q_proj``'s whole output (``num_heads · head_dim`` features) before splitting it into heads. With
the projection colwise each rank holds ``1/tp`` of those features; the norm's mean of squares needs all of them.
:class:`ProjectionNormParallel` runs the module's own forward on DTensors: the input is this rank's shard of the
last dim (``Shard(-1)``), the weight ``Shard(0)``, so the mean over the sharded dim is summed over tp by DTensor
(one all-reduce of a ``[b, s, 1]`` tensor forward, its transpose backward) and everything else stays local. Each
rank's weight gradient is its slice's; the output is this rank's shard again, as a plain tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ProjectionNormParallel", "normalized_features", "projection_norm_style"]


def normalized_features(module: nn.Module) -> int | None:
    """The size of a norm's 1-D ``weight`` (the features it normalises), or None."""
    w = getattr(module, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.ndim == 1 else None


class ProjectionNormParallel(ParallelStyle):
    """Run a norm over the last dim on that dim's tp shards: 1-D parameters ``Shard(0)``, input ``Shard(-1)``.

    Keyword Args:
        use_local_output (bool): return this rank's shard as a plain tensor. Default: True.

    Example::

        >>> parallelize_module(attn, tp_mesh, {"q_proj": ColwiseParallel(), "q_norm": ProjectionNormParallel()})
        >>> attn.q_norm.weight.placements
        (Shard(dim=0),)

    .. note::
        The module's forward must reduce the sharded dim with torch ops (``mean``, ``sum``, ``var``) that DTensor
        sums over tp; a kernel that takes the raw tensor cannot see the other ranks' features. An op DTensor cannot
        run sharded (``F.layer_norm`` over the sharded dim: ESMC's ``q_norm``) gathers its input; the output is
        then sliced back to this rank's shard.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _partition(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if param.ndim == 1 else Replicate()
            dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))

    @staticmethod
    def _input(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(x, mesh, (Shard(x.ndim - 1),), run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def _output(self, _module: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
        if isinstance(out, DTensor) and out.placements != (Shard(out.ndim - 1),):
            # DTensor gathers what it cannot shard (torch's layer_norm over a sharded normalized dim: ESMC's
            # LayerNorm q_norm): this rank's shard again, as the next op (the split into local heads) expects
            out = out.redistribute(out.device_mesh, (Shard(out.ndim - 1),))
        return out.to_local() if isinstance(out, DTensor) and self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, input_fn=self._input, output_fn=self._output)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(use_local_output={self.use_local_output})"


def projection_norm_style(args: Any) -> ProjectionNormParallel:
    """The style of a ``projection_norm`` rule (``args``: its :class:`~meshplan.tensor_parallel.layouts.StyleArgs`)."""
    return ProjectionNormParallel(use_local_output=args.overrides.get("use_local_output", True))
