"""Token dispatch and combine for experts sharded over ``ep``: all-to-all with uneven splits.

Rank ``r`` of an ``ep`` group holds experts ``r·E_local … (r+1)·E_local − 1`` (``E = ep·E_local``). Each rank has
its token copies sorted by expert (``x_sorted``, ``counts[e]`` rows for expert ``e``, as a top-k router's stable
sort makes them). :func:`plan_routes` exchanges the counts (one small all-to-all), :func:`dispatch` sends every
row to the rank holding its expert and orders what arrives expert by expert (``local_counts`` rows each, the
input a grouped-experts module takes), :func:`combine` sends the expert outputs back to where the rows came from,
in the order they left. Both move rows with ``all_to_all_single`` and explicit split sizes (DTensor's
redistribute would all-gather on gloo); the backward of each is the reverse all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshplan._torch import funcol
from meshplan.errors import PlanError

__all__ = ["Routes", "plan_routes", "dispatch", "combine", "expert_major_order"]


@dataclass(frozen=True)
class Routes:
    """One dispatch's split sizes and orders.

    Attributes:
        send: rows this rank sends to each ep rank (its token copies per destination).
        recv: rows it receives from each ep rank.
        recv_counts: ``(ep, E_local)`` rows received from each source for each local expert.
        order: index putting the received rows (source-major) in expert-major order; ``inverse`` undoes it.
        local_counts: rows per local expert after :func:`dispatch` (``recv_counts`` summed over sources).
    """

    send: list[int]
    recv: list[int]
    recv_counts: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    local_counts: torch.Tensor


def expert_major_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation from source-major rows (``src 0: e0 e1 …, src 1: e0 e1 …``) to expert-major rows
    (``e0: src 0 src 1 …, e1: …``), for ``recv_counts`` of shape ``(sources, experts)``."""
    sources, experts = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # first row of each (source, expert) block in the received order
    by_expert = recv_counts.t().reshape(-1)
    block_starts = starts.view(sources, experts).t().reshape(-1)
    # each expert-major block b covers rows block_starts[b] … + by_expert[b]
    offsets = torch.arange(int(by_expert.sum()), device=recv_counts.device)
    first = torch.cumsum(by_expert, 0) - by_expert
    block = torch.repeat_interleave(torch.arange(by_expert.numel(), device=recv_counts.device), by_expert)
    return block_starts[block] + offsets - first[block]


def plan_routes(counts: torch.Tensor, group: Any, ep: int) -> Routes:
    """Exchange the per-expert counts of every rank's token copies over ``group`` (one all-to-all of ``E`` ints).

    Args:
        counts: ``(E,)`` rows this rank has for each (global) expert, ``E`` divisible by ``ep``.
        group: the ``ep`` process group; ep: its size.

    Returns:
        :class:`Routes`.

    Raises:
        PlanError: ``E`` not divisible by ``ep``.
    """
    experts = counts.numel()
    if experts % ep:
        raise PlanError(f"expert_parallel: ep({ep}) does not divide the number of experts ({experts})")
    counts = counts.to(torch.int64)
    recv_counts = funcol.all_to_all_single(counts.contiguous(), None, None, group).wait() if ep > 1 else counts
    recv_counts = recv_counts.view(ep, experts // ep)
    send = counts.view(ep, experts // ep).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    order = expert_major_order(recv_counts)
    return Routes(send=send, recv=recv, recv_counts=recv_counts, order=order, inverse=torch.argsort(order),
                  local_counts=recv_counts.sum(0))


def dispatch(x_sorted: torch.Tensor, routes: Routes, group: Any) -> torch.Tensor:
    """Send each row of ``x_sorted`` (``(N, …)``, sorted by global expert) to its expert's rank; returns the
    rows of this rank's experts, expert-major (``routes.local_counts`` rows each)."""
    if len(routes.send) > 1:
        x_sorted = funcol.all_to_all_single_autograd(x_sorted.contiguous(), routes.recv, routes.send, group)
    return x_sorted.index_select(0, routes.order)


def combine(y_local: torch.Tensor, routes: Routes, group: Any) -> torch.Tensor:
    """The inverse of :func:`dispatch`: the expert outputs back on the ranks their rows came from, in the order
    of ``x_sorted``."""
    y = y_local.index_select(0, routes.inverse)
    if len(routes.send) > 1:
        y = funcol.all_to_all_single_autograd(y.contiguous(), routes.send, routes.recv, group)
    return y
