"""What a tensor-parallel step pays beyond its DTensor ops and its collectives' fits, measured by the ``meshplan
profile`` job (every rank at once), priced by :func:`meshplan.solver.overheads.tp_overhead`:

* **style hooks** (``tp_hook_overhead``): seconds per forward hook call of a tensor-parallel style (the input and
  output hooks ``distribute_module`` installs: ``DTensor.from_local``, the layout check, ``to_local``), with its
  autograd nodes in backward, beyond the DTensor ops it dispatches (priced as ops); measured on a style whose
  layouts need no communication (``Shard(0)`` in and out), forward and backward, minus the same module unstyled;
* **collectives between computes** (``collective_busy``): seconds a gloo/NCCL collective takes beyond the same
  collective back to back (what the fits measure) when every rank computes between calls, as a training step
  runs them (its threads wake, the ranks arrive apart); the mean over all-gather, reduce-scatter and all-reduce
  of a 1 MiB buffer over the world.

Measured on 2 cores (``benchmarks/tp_residual.py``, docs/solver.md): tp2's 144 hook calls per step cost 5 ms of
CPU beyond their collectives; a collective between matmuls 1-3 ms beyond its back-to-back time at world 2.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["measure_tp_overheads"]

#: the buffer of the collectives timed between computes (bytes)
BUSY_BYTES = 1 << 20


def _hook_overhead(timed: Callable, mean: Callable, mesh, device: torch.device, per_op: float,
                   count: Callable) -> float:
    """Seconds per style hook call (forward and its backward) beyond the DTensor ops it dispatches (``count``ed,
    ``per_op`` seconds each: the profile's ``view``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module
    units = 8
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(units)]).to(device)
    styled = nn.Sequential(*[nn.Linear(16, 16) for _ in range(units)]).to(device)
    style = {str(i): PrepareModuleInputOutput(input_layouts=(Shard(0),), desired_input_layouts=(Shard(0),),
                                              output_layouts=(Shard(0),), desired_output_layouts=(Shard(0),),
                                              use_local_input=True, use_local_output=True) for i in range(units)}
    parallelize_module(styled, mesh, style)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    ops = count(lambda: styled(x).sum().backward())  # priced as DTensor ops already
    with_hooks = timed(lambda: styled(x).sum().backward(), reps=3, window=0.1)
    without = timed(lambda: plain(x).sum().backward(), reps=3, window=0.1)
    return mean(max(with_hooks - without - ops * per_op, 0.0) / (2 * units))


def _collective_busy(timed: Callable, mean: Callable, device: torch.device) -> float:
    """Seconds a collective takes beyond its back-to-back time when every rank computes before each call."""
    world = dist.get_world_size()
    if world < 2:
        return 0.0
    numel = BUSY_BYTES // 4
    full, shard = torch.ones(numel, device=device), torch.ones(numel // world, device=device)
    a = torch.randn(128, 128, device=device)
    calls = (lambda: dist.all_gather_into_tensor(full, shard), lambda: dist.reduce_scatter_tensor(shard, full),
             lambda: dist.all_reduce(full))

    def work():
        for _ in range(8):
            a @ a
    alone = timed(work, reps=3, window=0.1)
    extra = []
    for call in calls:
        idle = timed(call, reps=3, window=0.1)
        busy = timed(lambda: (work(), call()), reps=3, window=0.1)
        extra.append(max(busy - alone - idle, 0.0))
    return mean(sum(extra) / len(extra))


def measure_tp_overheads(timed: Callable, mean: Callable, mesh, device: torch.device, per_op: float,
                         count: Callable) -> dict:
    """The measurements above as the worker's JSON keys (``mesh``: the world's one-dim mesh; ``per_op``: the
    profile's seconds per DTensor ``view`` op; ``count(fn)``: the DTensor ops ``fn`` dispatches)."""
    return {"tp_hook_overhead": _hook_overhead(timed, mean, mesh, device, per_op, count),
            "collective_busy": _collective_busy(timed, mean, device)}
