"""The ``meshplan profile`` job, one process per device under torchrun: what this machine computes and moves.

Every rank measures at once and for long enough (~0.2 s windows) that ranks sharing cores contend as in training
(on a CPU host with more ranks than cores the rates are the oversubscribed ones training gets):

* matmul rates: a ``[n, n] @ [n, n]`` forward and its two backward matmuls, by size ``n``;
* memory bandwidth: an element-wise add over tensors of 256 KiB (in cache) to 64 MiB (in memory);
* operator overhead: a chain of tiny autograd ops, forward and backward, per op;
* attention: causal ``scaled_dot_product_attention`` forward and backward (the attention efficiency);
* what the counts leave out (:mod:`meshplan.profile.overheads`): DTensor dispatch per op kind, FSDP2 hooks per
  unit, pipeline schedule actions, uneven all-to-all, and the cores each rank gets (effective parallelism); an
  eager MoE expert loop's weight-slice gradients and host sync (:mod:`meshplan.profile.moe`);
* the optimizer step and gradient clipping per tensor and element (:mod:`meshplan.profile.step_costs`);
* a reference eager block forward and backward at two batch sizes: its element-wise work and launches beyond the
  matmuls and attention (:mod:`meshplan.profile.block`);
* the repeat spread: the median relative spread of the timing windows (``estimate``'s ± band);
* collectives: all-gather, reduce-scatter, all-reduce and all-to-all in groups of consecutive ranks of every
  size dividing the world (all groups at once), and paired send/recv; each fitted as ``latency + bytes /
  bandwidth`` over three sizes (bytes as :meth:`meshplan.solver.cluster.Cluster.comm_time` takes them).

Rank 0 writes the fits as JSON (``--out``); :mod:`meshplan.profile.run` turns them into a cluster file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshplan.mesh.ranks import divisors
from meshplan.profile.block import REFERENCE, measure_block
from meshplan.profile.moe import measure_moe
from meshplan.profile.overheads import measure_overheads
from meshplan.profile.step_costs import measure_step_costs
from meshplan.profile.sync import consecutive_group

SIZES = (64, 128, 256, 512, 1024)
CUDA_SIZES = (2048, 4096, 8192)  # a GPU's matmul rate still climbs past 1024 (H100 bf16: 24 TFLOP/s at 1024)
MESSAGE_BYTES = (1 << 13, 1 << 18, 1 << 22, 1 << 24)  # 16 MiB: a DDP bucket, FSDP's largest units


def _timed(fn, reps: int, window: float = 0.2, spread: list | None = None) -> float:
    """Median seconds per call of ``fn`` over ``reps`` windows of about ``window`` seconds each, every rank starting
    together and running the same number of calls (a window long enough for ranks sharing cores to contend as
    training makes them: a short burst runs each rank alone on a core); ``spread`` collects the windows' relative
    spread ``(max − min) / median``.

    A window ends when the LAST rank is done (a barrier), as a training step waits for its slowest rank: ranks
    sharing cores need not be served evenly (on the 2026-11-27 host it moved the world-4 matmul rates by under 2%)."""
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    home = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    fn()
    if cuda:  # a kernel launch returns before the kernel ends: time the call, not the launch
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    calls = torch.tensor([max(1, int(window / max(time.perf_counter() - t, 1e-7)))], dtype=torch.float64,
                         device=home)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    calls_n = int(calls)
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls_n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()  # the window ends with the last rank's, as a synchronous step does (see above)
        times.append((time.perf_counter() - t) / calls_n)
    if spread is not None:
        spread.append((max(times) - min(times)) / max(statistics.median(times), 1e-12))
    return statistics.median(times)


def _mean_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _compute(device: torch.device, dtype: torch.dtype) -> dict:
    rates, spread = [], []
    for n in SIZES + (CUDA_SIZES if device.type == "cuda" else ()):
        a = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, n, device=device, dtype=dtype, requires_grad=True)
        sec = _timed(lambda: (a @ w).sum().backward(), reps=3, spread=spread)
        rates.append((n, _mean_over_ranks(3 * 2 * n ** 3 / sec, device)))
    bandwidths = []
    for n in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24):  # 256 KiB (in cache) … 64 MiB (memory) per tensor
        x, y = torch.randn(n, device=device), torch.randn(n, device=device)
        sec = _timed(lambda: torch.add(x, y), reps=3, spread=spread)
        bandwidths.append((n * 4, _mean_over_ranks(3 * n * 4 / sec, device)))
    tiny = torch.ones(8, device=device, requires_grad=True)

    def chain():
        h = tiny
        for _ in range(50):
            h = h * 1.0001
        h.sum().backward()
    overhead = _mean_over_ranks(_timed(chain, reps=3, spread=spread) / 100, device)  # 50 forward, 50 backward
    return {"matmul_rates": rates, "memory_rates": bandwidths, "hbm_bandwidth": bandwidths[-1][1],
            "op_overhead": overhead, "attention_rate": _attention(device, dtype, spread),
            "repeat_spread": _mean_over_ranks(statistics.median(spread), device)}


def _attention(device: torch.device, dtype: torch.dtype, spread: list) -> float:
    """FLOP/s of causal ``scaled_dot_product_attention`` forward and backward (64 heads of 64 over 256 positions;
    on a GPU 32 heads of 128 over 4,096, where its fused kernels run at their rate),
    its FLOPs counted as the cost model counts them (``QKᵀ`` and ``AV`` over the causal half, backward 2×): the
    attention efficiency is this over the matmul peak (on this host ~0.3, not the 0.5 assumed before)."""
    heads, seq, dim = (32, 4096, 128) if device.type == "cuda" else (64, 256, 64)  # a GPU's kernels need a size
    q, k, v = (torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.ones(1, heads, seq, dim, device=device, dtype=dtype)
    f = torch.nn.functional.scaled_dot_product_attention
    sec = _timed(lambda: f(q, k, v, is_causal=True).backward(grad), reps=3, spread=spread)
    return _mean_over_ranks(3 * 2 * seq * seq * heads * dim / sec, device)


def _collective(kind: str, group, n: int, nbytes: int, device: torch.device):
    """A callable running one ``kind`` collective of ``nbytes`` (the full buffer) over ``group``."""
    numel = max(nbytes // 4 // n * n, n)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


def _fit(points: list[tuple[float, float]]) -> dict:
    """Least squares ``t = latency + bytes / bandwidth`` (a non-negative latency), with the measured ``points``
    (:class:`meshplan.solver.cluster.Fit` follows them: the time per byte grows past the caches)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    slope = max(slope, 1e-15)
    return {"latency": max(my - slope * mx, 0.0), "bandwidth": 1.0 / slope, "points": [list(p) for p in points]}


def _collectives(device: torch.device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, dict] = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}, "all_to_all": {}, "send": {}}
    for n in (d for d in divisors(world) if d > 1):
        mine = consecutive_group(n)
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            points = [(b, _mean_over_ranks(_timed(_collective(kind, mine, n, b, device), reps=3, window=0.1),
                                           device)) for b in MESSAGE_BYTES]
            out[kind][str(n)] = _fit(points)
    if world % 2 == 0:
        peer = rank ^ 1
        points = []
        for b in MESSAGE_BYTES:
            buf = torch.ones(b // 4, device=device)

            def pingpong():
                ops = [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, torch.empty_like(buf), peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            points.append((b, _mean_over_ranks(_timed(pingpong, reps=3, window=0.1), device)))
        out["send"]["2"] = _fit(points)
    return out


def _axes_measurements(mean, device: torch.device, dtype: torch.dtype) -> dict:
    """What each axis unit measures for its own cost terms (:attr:`meshplan.axis.Axis.profile`), at the reference
    block's shape."""
    from meshplan.axes import AXES
    shape = REFERENCE["cuda" if device.type == "cuda" else "cpu"]
    return {k: v for axis in AXES if axis.profile for k, v in axis.profile(_timed, mean, device, dtype, shape).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    backend = os.environ.get("MESHPLAN_PROFILE_BACKEND") or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # as meshplan.init sets a CPU job's allocator: the rates of the runs it prices
        from meshplan.mesh.host_memory import keep_freed_memory
        keep_freed_memory()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mean = lambda x: _mean_over_ranks(x, device)  # noqa: E731
    result = {"backend": backend, "device": device.type, "world": dist.get_world_size(),
              "dtype": str(dtype).removeprefix("torch."), **_compute(device, dtype),
              "collectives": _collectives(device), "threads": torch.get_num_threads(),
              **measure_overheads(_timed, mean, _fit, MESSAGE_BYTES, device),
              **measure_step_costs(_timed, mean, device),
              **measure_moe(_timed, mean, device, dtype),
              **measure_block(_timed, mean, device, dtype),
              **_axes_measurements(mean, device, dtype),
              "memory": (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)}
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
