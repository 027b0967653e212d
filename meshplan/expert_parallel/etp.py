"""Tensor parallelism inside the experts (``etp`` = ``tp`` > 1): each expert's FFN split over the etp ranks.

With ``etp`` equal to ``tp`` the etp groups are the tp groups. The MoE block then runs on the tp group's whole
token set (the sequence-parallel stream is all-gathered at its input, as for a dense MLP), every tp rank routes
the same tokens, and the experts module holds, for its ep rank's experts, 1/etp of the FFN: the "in" projections
split on their hidden (output) dim, the "out" projection on its hidden (input) dim (Megatron's column- and
row-parallel experts). Its outputs are partial sums over etp: one all-reduce of the expert rows makes them whole
before they return to their tokens; its backward passes the (identical) gradient through unchanged. Conversely
the rows' gradient from each etp rank covers its FFN shard only: they are summed over etp in the backward of the
experts' input (Megatron's f and g operators of a tensor-parallel MLP).

Which dim of each expert parameter is the FFN's is read from the shapes: the dim (besides the experts dim 0) whose
size is not the model dim (read from the router's ``[E, dim]`` weight); an FFN dim twice the others' is a packed
``gate|up`` pair, whose halves are split separately (``_StridedShard``, as meshplan's packed colwise).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan._torch import funcol
from meshplan.errors import PlanError

__all__ = ["ffn_dims", "model_dim", "EtpSum", "EtpCopy"]


def model_dim(router: nn.Module, experts: int) -> int | None:
    """The model dim: the input size of the router's ``[experts, dim]`` weight (None: no such weight)."""
    sizes = {p.shape[1] for p in router.parameters() if p.dim() == 2 and p.shape[0] == experts}
    return sizes.pop() if len(sizes) == 1 else None


def ffn_dims(module: nn.Module, dim: int | None, etp: int, where: str) -> dict[str, tuple[int, int]]:
    """``{parameter: (FFN dim, packed parts)}`` of a grouped-experts module with 3-D parameters ``[E, a, b]``.

    Raises:
        PlanError: the model dim is unknown or equal to the FFN size, a parameter that is not ``[E, a, b]``, or
            ``etp`` (times the packed parts) not dividing an FFN dim; the message gives the valid etp.
    """
    from meshplan.mesh.ranks import divisors_text
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    if dim is None:
        raise PlanError(f"{where}: etp({etp}) needs the model dim, read from the router's [experts, dim] weight; "
                        f"the router has none; set layout.etp: 1")
    found = {}
    for name, shape in shapes.items():
        hidden = [i for i in (1, 2) if len(shape) == 3 and shape[i] != dim]
        if len(shape) != 3 or len(hidden) != 1:
            raise PlanError(f"{where}: cannot tell the FFN dim of {name} {shape} from the model dim ({dim}): "
                            f"expected [experts, ffn, {dim}] or [experts, {dim}, ffn] with ffn != {dim}; set "
                            f"layout.etp: 1")
        found[name] = hidden[0]
    smallest = min(shapes[n][d] for n, d in found.items())
    out = {}
    for name, d in found.items():
        n = shapes[name][d]
        packed = n // smallest if n % smallest == 0 else 1
        if n % (etp * packed):
            raise PlanError(f"{where}: etp({etp}) does not divide the FFN size {n // packed} of {name} {shapes[name]}"
                            f"{f' ({packed} packed parts)' if packed > 1 else ''}; valid etp: "
                            f"{divisors_text(n // packed)}")
        out[name] = (d, packed)
    return out


class EtpSum(torch.autograd.Function):
    """Sum partial expert outputs over etp; the backward passes the gradient unchanged (every etp rank holds the
    same, whole gradient of the summed rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class EtpCopy(torch.autograd.Function):
    """The expert rows as the FFN shards take them (forward unchanged); the backward sums each etp rank's input
    gradient, which covers its FFN shard only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None
