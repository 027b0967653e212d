"""The ``experts`` style: a grouped-experts module's weights sharded over ``ep`` on dim 0, its rows dispatched.

The module keeps its own forward. The style wraps it, as torch's styles wrap a module:

* every parameter becomes a DTensor ``Shard(0)`` on the ``ep`` mesh: rank ``r`` holds experts
  ``r·E/ep … (r+1)·E/ep − 1``; during the forward the module sees their local shards (plain tensors, so code
  that indexes ``weight[e]`` works), and gradients flow to the DTensors;
* before the forward the rows go to their experts' ranks
  (:func:`~meshplan.expert_parallel.dispatch.dispatch`), after it the outputs come back in the order they left
  (:func:`~meshplan.expert_parallel.dispatch.combine`).

Two call interfaces (the plan's ``interface``):

* ``sorted``: ``forward(x_sorted, counts)``, rows sorted by global expert, ``counts[E]`` rows each; the module
  gets this rank's experts' rows and ``counts[E_local]``;
* ``topk``: ``forward(hidden, top_k_index, top_k_weights)`` with one row per token (transformers'
  ``MixtralExperts``); the style sorts the token copies by expert, and the module gets one row per copy, its
  local expert index and weight 1; the gate weights are applied where the copies return, and the copies are summed
  per token. An index ``≥ E`` (transformers' "no expert") contributes zero;
* ``dense``: ``forward(x)`` with every token once per expert, expert-major (``E`` equal blocks of rows, each row
  pre-scaled by its router weight: Llama 4's ``Llama4TextExperts``); the ``sorted`` path with ``counts[e]`` =
  rows / E, the module called with its experts' rows only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshplan._torch import module_parameters
from meshplan.errors import PlanError
from meshplan.expert_parallel.dispatch import combine, dispatch, plan_routes
from meshplan.expert_parallel.etp import MODEL_SIDE, EtpCopy, EtpOnce, EtpSum
from meshplan.tensor_parallel.packed import packed_order, packed_placement

__all__ = ["ExpertParallel", "sort_copies", "shared_inside"]


def sort_copies(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token copies of a ``(T, k)`` expert choice sorted by expert (stable): ``(copies, counts)``.

    ``copies[i]`` indexes the flattened ``(T·k)`` choices (token ``copies[i] // k``); ``counts[e]`` copies go to
    expert ``e``. Choices ``≥ experts`` are left out."""
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat.clamp(max=experts), minlength=experts + 1)
    kept = int(counts[:experts].sum())
    return torch.argsort(flat, stable=True)[:kept], counts[:experts]


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module over a 1-D ``ep`` mesh and route its rows there and back.

    Keyword Args:
        interface (str): ``"sorted"`` (``forward(x_sorted, counts)``), ``"topk"``
            (``forward(hidden, top_k_index, top_k_weights)``) or ``"dense"`` (``forward(x)``, ``E`` equal
            expert-major blocks of rows). Default: ``"sorted"``.
        ffn (dict): on an ``(ep, etp)`` mesh, ``{parameter: (FFN dim, packed parts)}``: each expert's FFN dim is
            split over etp (see :mod:`meshplan.expert_parallel.etp`) and the outputs summed over etp.

    Example::

        >>> parallelize_module(model.layers[0].moe.experts, topo["ep"], ExpertParallel())
    """

    def __init__(self, *, interface: str = "sorted", ffn: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        if interface not in ("sorted", "topk", "dense"):
            raise ValueError(f"interface must be 'sorted', 'topk' or 'dense', got {interface!r}")
        self.interface = interface
        self.ffn = dict(ffn or {})

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(interface={self.interface!r}, ffn={self.ffn!r})"

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        if name:
            return  # a submodule's parameters (MuseSpark's post_expert_norm, shared by the experts) stay whole:
            # dense parameters of the MoE block, like its router
        ep = mesh.size(0)
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 0 or p.shape[0] % ep:
                raise PlanError(f"experts: ep({ep}) does not divide the {p.shape[0] if p.dim() else 0} "
                                f"experts (dim 0) of {name or type(module).__name__}.{pname} {tuple(p.shape)}")
            if mesh.ndim == 1:
                t = distribute_tensor(p, mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            elif self.ffn[pname] == MODEL_SIDE:  # a bias on the model side: whole on every etp rank
                t = distribute_tensor(p, mesh, [Shard(0), Replicate()], src_data_rank=self.src_data_rank)
            else:  # (ep, etp): the experts over ep, each expert's FFN dim over etp (packed parts separately)
                dim, packed = self.ffn[pname]
                order = packed_order(p.detach(), dim, packed, mesh.size(1))
                local = distribute_tensor(order, mesh, [Shard(0), Shard(dim)], src_data_rank=self.src_data_rank)
                t = DTensor.from_local(local.to_local(), mesh, [Shard(0), packed_placement(dim, packed)],
                                       run_check=False, shape=p.shape, stride=p.stride())
            module.register_parameter(pname, nn.Parameter(t, p.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if device_mesh.ndim not in (1, 2) or (device_mesh.ndim == 2 and not self.ffn):
            raise PlanError(f"experts: expected a 1-D ep mesh, or an (ep, etp) mesh with the FFN dims given; got "
                            f"{device_mesh}")
        ep_mesh = device_mesh if device_mesh.ndim == 1 else device_mesh["ep"]
        etp_group = device_mesh["etp"].get_group() if device_mesh.ndim == 2 else None
        group, ep, pending = ep_mesh.get_group(), ep_mesh.size(), []
        first = device_mesh.ndim == 1 or device_mesh.get_local_rank("etp") == 0
        once = {n for n, d in self.ffn.items() if d == MODEL_SIDE} if etp_group is not None else set()
        topk = self.interface == "topk"

        def before(mod: nn.Module, inputs: tuple, _mesh: Any) -> tuple:
            _inputs(inputs, *_SIGNATURES[self.interface])  # before anything changes
            _swap_local(mod, pending, once, first)
            experts = max(p.shape[0] for p in pending[-1].values())  # the DTensors' global experts dim: E
            computing = min(p.shape[0] for p in pending[-1].values())
            if topk and computing < experts:  # zero-computation experts (ep 1): the module's own routing
                rows, *rest = _weightless_once(inputs, computing, etp_group)
                pending.append(None)
            elif topk:
                rows, *rest = _dispatch_topk(inputs, experts, group, ep, pending)
            else:
                x_sorted, counts, more = _sorted_inputs(inputs, self.interface, experts)
                routes = plan_routes(counts, group, ep)
                pending.append(routes)
                rows = dispatch(x_sorted, routes, group)
                rest = [*more] if self.interface == "dense" else [routes.local_counts, *more]
            return (EtpCopy.apply(rows, etp_group) if etp_group is not None else rows, *rest)

        def after(mod: nn.Module, outputs: torch.Tensor, _mesh: Any) -> torch.Tensor:
            state = pending.pop()
            _restore(mod, pending.pop())
            if etp_group is not None:  # partial sums over the FFN's etp shards: whole rows before they return
                outputs = EtpSum.apply(outputs, etp_group)
            if state is None:
                return outputs
            if not topk:
                return combine(outputs, state, group)
            routes, copies, weights, tokens, k = state
            y = combine(outputs, routes, group)
            y = (y * weights.reshape(-1).index_select(0, copies).unsqueeze(-1)).to(y.dtype)  # as transformers
            return y.new_zeros(tokens, y.shape[-1]).index_add(0, torch.div(copies, k, rounding_mode="floor"), y)

        module = distribute_module(module, device_mesh, self._partition, before, after)
        for owner in list(module.modules())[1:]:  # torch replicated its submodules' parameters: plain again
            for pname, p in list(owner.named_parameters(recurse=False)):
                owner.register_parameter(pname, nn.Parameter(p.to_local(), p.requires_grad))
        return module


def shared_inside(module: nn.Module, path: str, ep: int) -> str | None:
    """Why ``ep`` > 1 cannot shard an experts module that runs a module with parameters of its own for every expert
    (MuseSpark's ``post_expert_norm``), or None. Those parameters stay whole beside the sharded experts and are
    data-parallel with them over edp; under ep > 1 each ep rank's gradient would cover only its experts' rows."""
    inner = [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    if ep == 1 or not inner:
        return None
    return (f"experts module {path} ({type(module).__name__}) runs {inner[0]} "
            f"({type(module.get_submodule(inner[0])).__name__}, with parameters shared by every expert) inside it; "
            f"with ep({ep}) > 1 its gradient would cover one ep rank's experts only; set layout.ep: 1")


#: interface → (positional tensors the module takes, its signature)
_SIGNATURES = {"sorted": (2, "forward(x_sorted, counts)"), "topk": (3, "forward(hidden, top_k_index, top_k_weights)"),
               "dense": (1, "forward(x)")}


def _sorted_inputs(inputs: tuple, interface: str, experts: int) -> tuple:
    """``(rows sorted by expert, counts[E], the other inputs)`` of the ``sorted`` and ``dense`` interfaces."""
    if interface == "sorted":
        x_sorted, counts, *more = inputs
        return x_sorted, counts, more
    x, *more = inputs
    if x.shape[0] % experts:
        raise PlanError(f"experts (interface dense): {x.shape[0]} input rows are not {experts} (the expert count) "
                        f"equal blocks; expected every token once per expert, expert-major")
    return x, torch.full((experts,), x.shape[0] // experts, dtype=torch.int64, device=x.device), more


def _inputs(inputs: tuple, n: int, signature: str) -> tuple:
    if len(inputs) < n or not all(isinstance(t, torch.Tensor) for t in inputs[:n]):
        raise PlanError(f"experts: the module must be called with {n} positional tensors ({signature}); got "
                        f"{len(inputs)} positional inputs (keyword arguments are not seen by the style)")
    return inputs


def _dispatch_topk(inputs: tuple, experts: int, group: Any, ep: int, pending: list) -> tuple:
    """``(hidden, top_k_index, top_k_weights)`` → this rank's experts' rows, local expert index, weight 1."""
    hidden, index, weights, *rest = _inputs(inputs, 3, "forward(hidden, top_k_index, top_k_weights)")
    tokens, k = index.shape
    copies, counts = sort_copies(index, experts)
    routes = plan_routes(counts, group, ep)
    rows = dispatch(hidden.index_select(0, torch.div(copies, k, rounding_mode="floor")), routes, group)
    local = torch.repeat_interleave(torch.arange(routes.local_counts.numel(), device=rows.device),
                                    routes.local_counts.to(rows.device)).unsqueeze(-1)
    pending.append((routes, copies, weights, tokens, k))
    return (rows, local, torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device), *rest)


def _weightless_once(inputs: tuple, computing: int, etp_group: Any) -> tuple:
    """``(hidden, top_k_index, top_k_weights)`` of a module with zero-computation experts (LongCat's identity
    experts: indices ``≥ computing``, the smallest dim 0 of its parameters, which ``down_proj`` has no rows for),
    passed to the module's own routing (ep is 1: every expert is here). Under etp their rows involve no FFN shard,
    so every etp rank computes the same whole rows: etp ranks other than 0 weigh them 0 (exact zeros, and no
    gradient), and the sum over etp counts them once. The module weighs its rows itself, before the sum: each etp
    rank's gradient of the weights covers its FFN shard, so they are summed over etp (``EtpCopy``), as the rows'."""
    import torch.distributed as dist
    hidden, index, weights, *rest = inputs
    if etp_group is not None:
        weights = EtpCopy.apply(weights, etp_group)
        weights = weights if dist.get_rank(etp_group) == 0 else weights.masked_fill(index >= computing, 0)
    return (hidden, index, weights, *rest)


def _swap_local(module: nn.Module, pending: list, once: set[str], first: bool) -> None:
    """During the forward the module's parameters are their local shards (gradients flow to the DTensors); those
    in ``once`` (model-side biases under etp) are added by the ``first`` etp rank only (:class:`EtpOnce`)."""
    held, slots = {}, module_parameters(module)
    for name, p in list(slots.items()):
        if isinstance(p, DTensor):
            held[name] = p
            slots[name] = EtpOnce.apply(p.to_local(), first) if name in once else p.to_local()
    if not held:
        raise PlanError(f"experts: {type(module).__name__} has no expert-sharded parameters")
    pending.append(held)


def _restore(module: nn.Module, held: dict) -> None:
    module_parameters(module).update(held)
