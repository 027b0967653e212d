"""The experts style: a grouped-experts module's weights sharded over ``ep`` on dim 0, its rows dispatched.

The module keeps its own forward (``forward(x_sorted, counts)``: rows sorted by expert, ``counts[e]`` rows per
expert, the expert count read from its weights). The style wraps it, as torch's styles wrap a module:

* the weights become DTensors ``Shard(0)`` on the ``ep`` mesh: rank ``r`` holds experts
  ``r·E/ep … (r+1)·E/ep − 1`` (the module takes their local shards);
* before the forward the rows go to their experts' ranks (:func:`~meshplan.expert_parallel.dispatch.dispatch`)
  and the counts become the local experts' counts; after it the outputs come back in the order they left
  (:func:`~meshplan.expert_parallel.dispatch.combine`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshplan.errors import PlanError
from meshplan.expert_parallel.dispatch import combine, dispatch, plan_routes

__all__ = ["ExpertParallel"]


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module over a 1-D ``ep`` mesh and route its rows there and back.

    Keyword Args:
        dim (int): the experts dim of every parameter. Default: 0.

    Example::

        >>> parallelize_module(model.layers[0].moe.experts, topo["ep"], ExpertParallel())
    """

    def __init__(self, *, dim: int = 0) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(dim={self.dim})"

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.shape[self.dim] % mesh.size():
                raise PlanError(f"experts: ep({mesh.size()}) does not divide the {p.shape[self.dim]} experts of "
                                f"{name or type(module).__name__}.{pname}")
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(self.dim)]),
                                                          p.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, ep, pending = device_mesh.get_group(), device_mesh.size(), []

        def before(_mod: nn.Module, inputs: tuple, _mesh: Any) -> tuple:
            x_sorted, counts, *rest = inputs
            routes = plan_routes(counts, group, ep)
            pending.append(routes)
            return (dispatch(x_sorted, routes, group), routes.local_counts, *rest)

        def after(_mod: nn.Module, outputs: torch.Tensor, _mesh: Any) -> torch.Tensor:
            return combine(outputs, pending.pop(), group)

        return distribute_module(module, device_mesh, self._partition, before, after)
