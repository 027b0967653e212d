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
``gate|up`` pair, whose halves are split separately (``_StridedShard``, as meshplan's packed colwise), unless
the module interleaves the pairs (transformers' ``is_concatenated = False``: gpt-oss), which a contiguous split
keeps whole. Biases ``[E, n]`` follow their projection: on the FFN side they are split with it; on the model side
(gpt-oss' ``down_proj_bias``) they stay whole and one etp rank adds them before the sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan._torch import funcol
from meshplan.errors import PlanError

__all__ = ["ffn_dims", "model_dim", "EtpSum", "EtpCopy", "EtpOnce", "MODEL_SIDE"]


def model_dim(router: nn.Module, experts: int) -> int | None:
    """The model dim: the input size of the router's ``[experts, dim]`` weight, or of its one ``[n, dim]`` weight
    with more rows (Inkling's scores its shared experts too); None: no such weight."""
    sizes = {p.shape[1] for p in router.parameters() if p.dim() == 2 and p.shape[0] == experts}
    wider = [p.shape[1] for p in router.parameters() if p.dim() == 2 and p.shape[0] > experts]
    if not sizes and len(wider) == 1:
        sizes = set(wider)
    return sizes.pop() if len(sizes) == 1 else None


def ffn_dims(module: nn.Module, dim: int | None, etp: int, where: str) -> dict[str, tuple[int, int]]:
    """``{parameter: (FFN dim, packed parts)}`` of a grouped-experts module with parameters ``[E, a, b]`` (weights)
    or ``[E, n]`` (biases).

    A bias ``[E, dim]`` on the model side has no FFN dim: it maps to ``(0, 0)`` (:data:`MODEL_SIDE`), whole on
    every etp rank and added by one (:class:`EtpOnce`). A module that says its ``gate|up`` pairs are interleaved
    (transformers' ``is_concatenated = False``, gpt-oss: ``gate = [..., ::2]``) is split contiguously (packed
    parts 1): each shard then holds whole pairs, for the FFN rows the down projection's shard holds.

    Raises:
        PlanError: the model dim is unknown or equal to the FFN size, a parameter that is neither ``[E, a, b]`` nor
            ``[E, n]``, or ``etp`` (times the packed parts) not dividing an FFN dim; the message gives the valid etp.
    """
    inner = [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    if inner:
        raise PlanError(f"{where}: etp({etp}) splits each expert's FFN, but {type(module).__name__} also runs "
                        f"{inner[0]} ({type(module.get_submodule(inner[0])).__name__}, with parameters) inside the "
                        f"experts, on outputs that etp would leave partial; set layout.etp: 1")
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    dim = _experts_dim(shapes, dim)
    if dim is None:
        raise PlanError(f"{where}: etp({etp}) needs the model dim, read from the router's [experts, dim] weight; "
                        f"the router has none; set layout.etp: 1")
    found = {}
    for name, shape in shapes.items():
        hidden = [i for i in range(1, len(shape)) if shape[i] != dim]
        if len(shape) == 2 and not hidden:
            continue  # a bias on the model side: no FFN dim
        if len(shape) not in (2, 3) or len(hidden) != 1:
            raise PlanError(f"{where}: cannot tell the FFN dim of {name} {shape} from the model dim ({dim}): "
                            f"expected [experts, ffn, {dim}], [experts, {dim}, ffn] or a bias [experts, ffn] / "
                            f"[experts, {dim}] with ffn != {dim}; set layout.etp: 1")
        found[name] = hidden[0]
    return {**{n: MODEL_SIDE for n in shapes if n not in found}, **_split(module, shapes, found, etp, where)}


def _experts_dim(shapes: dict[str, tuple], dim: int | None) -> int | None:
    """The dim the experts take and give: the router's when an expert weight has it, else the one size every
    ``[E, a, b]`` weight shares (MuseSpark's experts run on ``moe_hidden_size``, behind a projection)."""
    weights = [set(s[1:]) for s in shapes.values() if len(s) == 3]
    if dim is None or not any(dim in w for w in weights):
        common = set.intersection(*weights) if weights else set()
        return common.pop() if len(common) == 1 else None
    return dim


#: ``(FFN dim, packed parts)`` of an expert parameter without an FFN dim (a bias ``[E, dim]``)
MODEL_SIDE = (0, 0)


def _split(module: nn.Module, shapes: dict, found: dict[str, int], etp: int, where: str) -> dict:
    from meshplan.mesh.ranks import divisors_text
    if not found:
        raise PlanError(f"{where}: no parameter of {type(module).__name__} {shapes} has an FFN dim to split over "
                        f"etp({etp}); set layout.etp: 1")
    smallest = min(shapes[n][d] for n, d in found.items())
    interleaved = getattr(module, "is_concatenated", True) is False
    out = {}
    for name, d in found.items():
        n = shapes[name][d]
        packed = n // smallest if n % smallest == 0 else 1
        if n % (etp * packed):
            raise PlanError(f"{where}: etp({etp}) does not divide the FFN size {n // packed} of {name} {shapes[name]}"
                            f"{f' ({packed} packed parts)' if packed > 1 else ''}; valid etp: "
                            f"{divisors_text(n // packed)}")
        out[name] = (d, 1 if interleaved else packed)
    return out


class EtpOnce(torch.autograd.Function):
    """A parameter without an FFN dim (a bias on the model side) as one etp rank adds it: itself there, zeros on
    the others, so the sum over etp adds it once; the backward passes the gradient unchanged (every etp rank holds
    the whole gradient of the summed rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, first: bool) -> torch.Tensor:
        return x.clone() if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


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
