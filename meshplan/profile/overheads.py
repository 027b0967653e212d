"""What the cost model's FLOP and byte counts leave out, measured by the ``meshplan profile`` job (every rank at
once, as in training: on a host with more ranks than cores the times are the time-shared ones training gets):

* **DTensor dispatch**: seconds a DTensor op takes beyond its local op, per op kind the model counts
  (:data:`meshplan.solver.overheads.DTENSOR_KINDS`: ``mm``, ``view``, ``pointwise``), on a tiny tensor sharded over
  the world, forward and backward under autograd as a training step runs them (no communication: sharding
  propagation, the Python dispatch, the wrapping and the autograd nodes; measured without autograd it was
  5-9 µs per op where a tp step pays ~40-130), and per redistribution beyond its collective (``redistribute``);
* **FSDP2 hooks**: seconds per unit and step of ``fully_shard``'s pre/post forward and backward hooks, a forward
  and backward of units over one rank each minus the same unsharded (collectives are priced by their fits), a
  fixed part and one per parameter byte (units of two widths);
* **pipeline actions**: seconds per forward or backward action of a torch schedule beyond the stage's own compute
  (one stage over one rank: the schedule's bookkeeping, chunking and loss; sends are priced by their fit);
* **uneven all-to-all** (``all_to_all_v``): ``all_to_all_single`` with skewed split sizes (as an MoE dispatch);
* **effective parallelism**: cores per rank, the share of its wall time a rank's CPU seconds fill while every rank
  runs a compute loop (1 with a core per rank; ``1/4`` for 8 ranks on 2 cores);
* **the style hooks' rest** (:mod:`meshplan.profile.tp_overheads`): a style hook call, and a collective's time
  between computes beyond its fit;
* **the wait at a blocking collective** (:mod:`meshplan.profile.sync`): the ranks of its group arriving apart.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["measure_overheads"]


def _rank_mesh(device: torch.device):
    """A mesh over the world whose last dim holds one rank: ``(world mesh, this rank's one-rank mesh)``."""
    from torch.distributed.device_mesh import DeviceMesh
    world = dist.get_world_size()
    mesh = DeviceMesh(device.type, torch.arange(world).reshape(world, 1), mesh_dim_names=("world", "self"))
    return mesh["world"], mesh["self"]


def _dtensor_ops(fn, at_least: int = 1) -> int:
    """DTensor ops one call of ``fn`` dispatches (forward and backward; at least ``at_least``)."""
    from torch.distributed.tensor import DTensor
    from meshplan._torch import TorchDispatchMode, tree_leaves

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {})))
            return func(*args, **(kwargs or {}))
    with Count() as mode:
        fn()
    return max(mode.n, at_least)


def _dtensor(timed: Callable, mean: Callable, mesh, device: torch.device) -> dict[str, float]:
    """Seconds per DTensor op beyond its local op, by kind (mean over ranks), WITH autograd as in training: each
    kind's forward on parameters that require grad and its backward (an explicit output gradient: no reduction),
    over the DTensor ops both dispatch (counted); placements that need no communication either way."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    n = mesh.size()
    x, w = torch.randn(16 * n, 16, device=device), torch.randn(16, 16 * n, device=device)
    dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    drep = distribute_tensor(x[:16], mesh, [Replicate()])
    dw = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()  # colwise: mm(Replicate, Shard(1)) -> Shard(1)
    lx, lrep, lw = dx.to_local().detach().requires_grad_(), x[:16].clone(), dw.to_local().detach().requires_grad_()
    ops = {"mm": (lambda a, b: torch.mm(a, b), (drep, dw), (lrep, lw)),
           "view": (lambda a: a.view(-1).view(a.shape).t(), (dx,), (lx,)),
           "pointwise": (lambda a: a * 1.5 + a, (dx,), (lx,))}
    out = {}
    for kind, (fn, dargs, largs) in ops.items():
        dgrad, lgrad = torch.ones_like(fn(*dargs)), torch.ones_like(fn(*largs))
        reps = 10
        run_d = lambda: [fn(*dargs).backward(dgrad) for _ in range(reps)]  # noqa: E731
        run_l = lambda: [fn(*largs).backward(lgrad) for _ in range(reps)]  # noqa: E731
        fn(*dargs).backward(dgrad)  # the gradient exists: the counted call accumulates into it, as the timed ones
        count = _dtensor_ops(lambda: fn(*dargs).backward(dgrad))
        d, loc = timed(run_d, reps=3, window=0.1), timed(run_l, reps=3, window=0.1)
        out[kind] = mean(max(d - loc, 0.0) / (reps * count))
    out["redistribute"] = _redistribute(timed, mean, mesh, device)
    return out


def _redistribute(timed: Callable, mean: Callable, mesh, device: torch.device) -> float:
    """Seconds a DTensor redistribution (``Shard(0)`` to ``Replicate``, the sequence-parallel all-gather, its
    input requiring grad) takes beyond the same plain all-gather: the planning, wrapping and autograd around each
    tensor-parallel collective (its bytes are priced by the collective's fit)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    n = mesh.size()
    if n == 1:
        return 0.0
    dx = distribute_tensor(torch.randn(16 * n, 16, device=device), mesh, [Shard(0)]).requires_grad_()
    full, shard = torch.empty(16 * n, 16, device=device), dx.to_local().detach()
    group = mesh.get_group()
    d = timed(lambda: dx.redistribute(mesh, [Replicate()]), reps=3, window=0.1)
    raw = timed(lambda: dist.all_gather_into_tensor(full, shard, group=group), reps=3, window=0.1)
    return mean(max(d - raw, 0.0))


def _fsdp_unit(timed: Callable, mean: Callable, one, device: torch.device) -> dict[str, float]:
    """Seconds of FSDP2's hooks per unit and step, forward and backward: a fixed part (``fsdp_unit_overhead``) and
    one per byte of the unit's parameters (``fsdp_byte_overhead``: the copies into and out of the all-gather and
    reduce-scatter buffers, which a one-rank mesh makes too; 4.2 ms per MiB with 8 ranks on 2 cores, 2026-11-27),
    from units of two widths."""
    from torch.distributed.fsdp import fully_shard
    units, costs = 8, []
    for width in (16, 512):
        torch.manual_seed(0)
        plain = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).to(device)
        sharded = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).to(device)
        for layer in sharded:
            fully_shard(layer, mesh=one)
        fully_shard(sharded, mesh=one)
        x = torch.randn(4, width, device=device)
        with_hooks, without = [], []
        for _ in range(3):  # alternating, so that drift lands on both
            with_hooks.append(timed(lambda: sharded(x).sum().backward(), reps=1, window=0.2))
            without.append(timed(lambda: plain(x).sum().backward(), reps=1, window=0.2))
        rest = statistics.median(with_hooks) - statistics.median(without)
        per_unit = mean(max(rest, 0.0) / (units + 1))  # the units and the root
        costs.append((4.0 * width * (width + 1) * units / (units + 1), per_unit))
    (b0, t0), (b1, t1) = costs
    per_byte = max((t1 - t0) / (b1 - b0), 0.0)
    return {"fsdp_unit_overhead": max(t0 - per_byte * b0, 0.0), "fsdp_byte_overhead": per_byte}


def _pipeline_action(timed: Callable, mean: Callable, one, device: torch.device) -> float:
    """Seconds per forward or backward action of a torch pipeline schedule beyond the stage's compute."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    m = 4
    torch.manual_seed(0)
    stage_module = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).to(device)
    stage = PipelineStage(stage_module, 0, 1, device, group=one.get_group())
    loss = lambda out, target: out.sum()  # noqa: E731
    schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=loss)
    x = torch.randn(4 * m, 16, device=device)
    pieces = x.chunk(m)
    scheduled = timed(lambda: schedule.step(x, target=x), reps=3, window=0.1)
    bare = timed(lambda: [stage_module(p).sum().backward() for p in pieces], reps=3, window=0.1)
    return mean(max(scheduled - bare, 0.0) / (2 * m))


def _uneven_all_to_all(timed: Callable, mean: Callable, fit: Callable, sizes, device: torch.device) -> dict:
    """Fits of ``all_to_all_single`` with skewed splits over the world (rank ``r`` sends ``r+1`` shares to its
    right neighbour), by group size (the world's)."""
    world = dist.get_world_size()
    if world < 2:
        return {}
    points = []
    for nbytes in sizes:
        share, rank = max(nbytes // 4 // (2 * world), 1), dist.get_rank()
        send = [share * (world if j == (rank + 1) % world else 1) for j in range(world)]
        recv = [share * (world if rank == (j + 1) % world else 1) for j in range(world)]
        out, inp = torch.empty(sum(recv), device=device), torch.ones(sum(send), device=device)
        sec = timed(lambda: dist.all_to_all_single(out, inp, recv, send), reps=3, window=0.1)
        points.append((sum(send) * 4, mean(sec)))
    return {str(world): fit(points)}


def _parallelism(device: torch.device, seconds: float = 0.3) -> float:
    """Cores per rank: the share of its wall time a rank's CPU seconds fill while every rank runs a compute loop
    (``time.process_time`` over ``time.perf_counter``, mean over ranks and three windows of ``seconds``); 1 on a
    GPU. The loop's timing alone over together, measured on rank 0 before, read 0.64-1.0 at 4 ranks on 2 cores
    (0.50 by this measure, three windows within 0.02): the first rank scheduled after the barrier finished a short
    loop before the others ran."""
    if device.type != "cpu":
        return 1.0
    a = torch.randn(96, 96, device=device)
    shares = []
    for _ in range(3):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - wall < seconds:
            for _ in range(20):
                a @ a
        shares.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    t = torch.tensor([statistics.median(shares)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(min(1.0, float(t) / dist.get_world_size()))


def measure_overheads(timed: Callable, mean: Callable, fit: Callable, sizes, device: torch.device) -> dict:
    """The measurements above as the worker's JSON keys (``timed``, ``mean``, ``fit``: the worker's helpers)."""
    from meshplan.profile.sync import measure_sync_loss
    from meshplan.profile.tp_overheads import measure_tp_overheads
    world_mesh, one = _rank_mesh(device)
    dtensor = _dtensor(timed, mean, world_mesh, device)
    return {"dtensor_overheads": dtensor, **measure_tp_overheads(timed, mean, world_mesh, device, dtensor["view"],
                                                                  lambda fn: _dtensor_ops(fn, at_least=0)),
            **_fsdp_unit(timed, mean, one, device),
            "pipeline_action_overhead": _pipeline_action(timed, mean, one, device),
            "all_to_all_v": _uneven_all_to_all(timed, mean, fit, sizes, device),
            "parallelism": _parallelism(device), "cores": os.cpu_count(), **measure_sync_loss(mean, device)}
