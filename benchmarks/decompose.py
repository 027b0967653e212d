"""Where a calibration step's time goes: the plain model's compute alone (no collective), phase by phase, in one
process and in N concurrent processes, beside what the profile prices for the same work.

    python benchmarks/decompose.py --worlds 1,2,4,8      # each world: one torchrun launch of N plain replicas
    python benchmarks/decompose.py --worlds 2 --cluster cluster2.json   # and the profile's price beside it

Each rank builds calibrate.py's Llama (dim 256, 4 layers, seq 256) WITHOUT any parallelism and runs its share
of the global batch (16 / N samples: what ddp N computes) as ``--steps`` timed steps after one warm-up, every
rank at once (a barrier before each step, none inside it): forward and loss, backward, clip_grad_norm_, AdamW
step and zero_grad, each timed apart (rank 0's median printed, and the ranks' mean). ``--count`` also counts the
aten ops of one forward and backward (a TorchDispatchMode) and their split into matmuls and the rest; ``--split``
times rank 0's forward and backward in CPU seconds by where they go (matmuls, attention, the other aten ops,
outside aten: Python and the autograd engine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PHASES = ("forward", "backward", "clip", "optimizer")


def _count_ops(model, x, y, loss_fn) -> dict:
    """aten ops of one forward + backward, by kind: matmuls (mm/bmm/addmm/sdpa) and the rest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.n[name] = self.n.get(name, 0) + 1
            return func(*args, **(kwargs or {}))
    with Count() as c:
        loss_fn(model(x), y).backward()
    mm = sum(v for k, v in c.n.items() if k in ("mm", "bmm", "addmm", "matmul", "linear") or "attention" in k)
    return {"total": sum(c.n.values()), "matmul": mm, "by_op": dict(sorted(c.n.items(), key=lambda kv: -kv[1]))}


def _split(model, x, y, loss_fn) -> dict:
    """CPU seconds of one forward + backward by where they go: matmuls, attention, the other aten ops, and outside
    any aten op (Python, modules, the autograd engine; includes this timing's own per-op cost, ~10 µs an op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Split(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.t = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            c = time.process_time()
            out = func(*args, **(kwargs or {}))
            kind = "matmul" if name in ("mm", "bmm", "addmm") else "attention" if "attention" in name else "other_ops"
            self.t[kind] += time.process_time() - c
            return out
    runs = []
    for _ in range(3):
        with Split() as mode:
            c = time.process_time()
            loss_fn(model(x), y).backward()
            total = time.process_time() - c
        runs.append({**mode.t, "outside_ops": total - sum(mode.t.values()), "total": total})
    return sorted(runs, key=lambda r: r["total"])[1]


def _clock(cpu: bool) -> float:
    """Wall seconds, or with ``cpu`` this process's CPU seconds (all its threads: robust to other jobs' load)."""
    return time.process_time() if cpu else time.perf_counter()


def _layout_step(args, world: int) -> list[float]:
    """``[CPU seconds, wall seconds]`` (medians) of one ``meshplan.train_step`` of calibrate.py's layout
    ``args.layout`` (e.g. ``ddp``: dp_replicate over the world; ``tp2``) on the same model and global batch."""
    import torch
    import torch.distributed as dist
    import meshplan
    from _calibrate_worker import _examples_train, _model
    from calibrate import LAYOUTS
    plan = {"version": 1, **LAYOUTS[world][args.layout][1]}
    with meshplan.init(plan) as topo:
        model = meshplan.parallelize(_model("llama", 256, 4, 256), plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = _examples_train().batches(256, 256, args.batch, topo.data_rank, topo.data_world_size, 0)
        cpu, wall = [], []
        for step in range(1 + args.steps):
            batch = next(data)
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            meshplan.train_step(model, batch, meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
            dist.barrier()
            if step:
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
    return [statistics.median(cpu), statistics.median(wall)]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from _calibrate_worker import _examples_train, _model
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model("llama", 256, 4, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _examples_train().batches(256, 256, args.batch, rank, world, 0)
    loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")  # noqa: E731
    times = {p: [] for p in PHASES}
    for step in range(1 + args.steps):
        x, y = next(data)
        dist.barrier()
        marks = [_clock(args.cpu)]
        loss = loss_fn(model(x), y)
        marks.append(_clock(args.cpu))
        loss.backward()
        marks.append(_clock(args.cpu))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        marks.append(_clock(args.cpu))
        opt.step()
        opt.zero_grad()
        marks.append(_clock(args.cpu))
        if step:
            for p, a, b in zip(PHASES, marks, marks[1:]):
                times[p].append(b - a)
    med = torch.tensor([statistics.median(times[p]) for p in PHASES], dtype=torch.float64)
    if args.layout:
        med = torch.cat([med, torch.tensor(_layout_step(args, world), dtype=torch.float64)])
    mean = med.clone()
    dist.all_reduce(mean)
    names = PHASES + (("step_cpu", "step_wall") if args.layout else ())
    out = {"world": world, "rank0": dict(zip(names, med.tolist())),
           "mean": dict(zip(names, (mean / world).tolist())), "threads": torch.get_num_threads()}
    if args.count and rank == 0:
        x, y = next(data)
        out["ops"] = _count_ops(model, x, y, loss_fn)
    if args.split and rank == 0:
        x, y = next(data)
        out["split"] = _split(model, x, y, loss_fn)
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def priced(world: int, cluster_file: str) -> dict:
    """The profile's price of ddp ``world``'s compute and optimizer (``calibrate.py``'s estimate)."""
    from calibrate import estimate  # benchmarks/calibrate.py
    from meshplan.solver.cluster import load_cluster_file
    est = estimate({"layout": {"dp_replicate": world}}, "llama", world, load_cluster_file(cluster_file))
    return {k: v for k, v in est.parts.items() if abs(v) > 5e-4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=16, help="the global batch: each rank runs batch / N")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--split", action="store_true", help="rank 0's forward+backward CPU seconds by where they go")
    ap.add_argument("--layout", default=None, help="also time this calibrate.py layout's train_step (CPU and wall)")
    ap.add_argument("--cpu", action="store_true", help="CPU seconds per rank instead of wall seconds")
    ap.add_argument("--cluster", default=None, help="a profiled cluster file (CLUSTER{N} in it: one per world)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| N | per-rank batch | forward | backward | clip | optimizer | sum (rank mean) | priced |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for w in (int(x) for x in args.worlds.split(",")):
            out = Path(tmp) / f"w{w}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}",
                   __file__, "--worker", "--out", str(out), "--batch", str(args.batch), "--steps", str(args.steps)]
            cmd += (["--count"] if args.count else []) + (["--cpu"] if args.cpu else [])
            cmd += ["--split"] if args.split else []
            cmd += ["--layout", args.layout.replace("{N}", str(w))] if args.layout else []
            proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            r = json.loads(out.read_text())
            m = r["mean"]
            price = priced(w, args.cluster.replace("{N}", str(w))) if args.cluster and w > 1 else {}
            step = f" step CPU {m['step_cpu']:.3f}, wall {m['step_wall']:.3f}" if "step_cpu" in m else ""
            print(f"| {w} | {args.batch // w} | " + " | ".join(f"{m[p]:.3f}" for p in PHASES)
                  + f" | {sum(m[p] for p in PHASES):.3f}{step} | {', '.join(f'{k} {v:.3f}' for k, v in price.items())} |", flush=True)
            if "split" in r:
                print("  rank 0's forward+backward, CPU s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["split"].items()))
            if "ops" in r:
                print(f"  ops per forward+backward: {r['ops']['total']} ({r['ops']['matmul']} matmuls); top: "
                      + ", ".join(f"{k} {v}" for k, v in list(r['ops']['by_op'].items())[:12]))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
