"""Where a tensor-parallel step's CPU goes beyond the priced terms (issue 31): the style hooks, from_local/to_local,
the redistributions, and a gloo collective's cost with its peers computing vs idle. Prints one table per world.

    OMP_NUM_THREADS=1 python benchmarks/tp_residual.py --worlds 2,4

Per world N (one torchrun launch, calibrate.py's Llama: dim 256, 4 layers, seq 256, global batch 16, layout tp N):

* **hooks**: every forward pre/post hook parallelize installed (the styles' input and output hooks), wrapped with a
  ``time.process_time`` timer: calls and CPU seconds per step, per block; the same for ``DTensor.from_local`` and
  ``to_local`` (inside the hooks: not additive);
* **profiler**: one step under ``torch.profiler``: the CPU seconds of the from/to-local and redistribution autograd
  nodes (backward), and of the collectives;
* **count**: CommDebugMode's collectives per step vs the solver's tp collectives for the layout;
* **collectives**: an all-gather / reduce-scatter / all-reduce of the block's activation bytes, back to back
  (idle peers: what the profile fits) and each after a matmul of ~2 ms on every rank (peers computing), wall and
  CPU seconds per call beyond the matmuls alone.
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


def _timed_hooks(model, stats: dict) -> None:
    """Wrap every forward pre/post hook on ``model``'s modules with a CPU-second timer (``stats['hooks']``)."""
    def wrap(fn):
        def timed(*a, **k):
            t, c0, cs0 = time.process_time(), stats["colls"], stats["coll_s"]
            try:
                return fn(*a, **k)
            finally:
                quiet = stats["colls"] == c0  # a hook that issued no collective
                stats["hook_s"] += time.process_time() - t
                stats["hooks"] += 1
                stats["quiet_hooks"] += quiet
                stats["quiet_hook_s"] += (time.process_time() - t) if quiet else 0.0
                stats["hook_coll_s"] += stats["coll_s"] - cs0
        return timed
    for m in model.modules():
        for d in (m._forward_pre_hooks, m._forward_hooks):
            for k in list(d):
                d[k] = wrap(d[k])


def _patch_local(stats: dict):
    """Time DTensor.from_local and DTensor.to_local (CPU seconds, calls); returns an undo callable."""
    from torch.distributed.tensor import DTensor
    orig_from, orig_to = DTensor.from_local, DTensor.to_local

    def from_local(*a, **k):
        t = time.process_time()
        try:
            return orig_from(*a, **k)
        finally:
            stats["from_local_s"] += time.process_time() - t
            stats["from_local"] += 1

    def to_local(self, *a, **k):
        t = time.process_time()
        try:
            return orig_to(self, *a, **k)
        finally:
            stats["to_local_s"] += time.process_time() - t
            stats["to_local"] += 1
    DTensor.from_local = staticmethod(from_local)
    DTensor.to_local = to_local
    import torch.distributed._functional_collectives as funcol
    names = ("all_gather_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather_single", "reduce_scatter_single", "wait_tensor")
    origs = {n: getattr(funcol, n) for n in names}

    def counted(fn):
        def call(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                stats["coll_s"] += time.process_time() - t
                stats["colls"] += 1
        return call
    for n in names:
        setattr(funcol, n, counted(origs[n]))

    def undo():
        DTensor.from_local, DTensor.to_local = staticmethod(orig_from), orig_to
        for n in names:
            setattr(funcol, n, origs[n])
    return undo


def _collectives(world: int, nbytes: int) -> dict:
    """Wall and CPU seconds per collective, idle peers vs peers computing (a matmul before each)."""
    import torch
    import torch.distributed as dist
    numel = nbytes // 4
    full, shard = torch.ones(numel), torch.ones(numel // world)
    a = torch.randn(192, 192)
    calls = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
             "all_reduce": lambda: dist.all_reduce(full)}

    def clock(fn, n=20):
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        return (time.perf_counter() - w) / n, (time.process_time() - c) / n

    def work():
        for _ in range(4):
            a @ a
    out = {}
    for kind, call in calls.items():
        call()
        idle = min(clock(call) for _ in range(3))
        alone = min(clock(work) for _ in range(3))
        both = min(clock(lambda: (work(), call())) for _ in range(3))
        out[kind] = {"idle_wall": idle[0], "idle_cpu": idle[1], "busy_wall": both[0] - alone[0],
                     "busy_cpu": both[1] - alone[1], "work_wall": alone[0]}
    return out


def _profiled(step) -> dict:
    """CPU seconds (self, summed) of one step's autograd nodes and collectives by family, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    fam = {"from_local_bw": "FromTorchTensorBackward", "to_local_bw": "ToTorchTensorBackward",
           "redistribute_bw": "RedistributeBackward", "from_local_fw": "_FromTorchTensor",
           "to_local_fw": "_ToTorchTensor", "redistribute_fw": "Redistribute"}
    out = {k: [0, 0.0] for k in (*fam, "collective")}
    for ev in prof.key_averages():
        name = ev.key
        hit = next((k for k, v in fam.items() if v in name and not (k.endswith("_fw") and "Backward" in name)), None)
        if hit is None and any(s in name for s in ("c10d::", "gloo:", "allgather", "reduce_scatter", "allreduce")):
            hit = "collective"
        if hit:
            out[hit][0] += ev.count
            out[hit][1] += ev.cpu_time_total / 1e6
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    import meshplan
    from _calibrate_worker import _examples_train, _model
    from calibrate import TP
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    plan = {"version": 1, "layout": {"tp": world}, "tensor_parallel": TP}
    ex = _examples_train()
    res: dict = {}
    with meshplan.init(plan) as topo:
        model = meshplan.parallelize(_model("llama", 256, 4, 256), plan, topo)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = ex.batches(256, 256, 16, topo.data_rank, topo.data_world_size, 0)
        step = lambda: meshplan.train_step(model, next(data), meshplan.cross_entropy, opt,  # noqa: E731
                                           topology=topo, max_grad_norm=1.0)
        for _ in range(2):
            step()
        whole = []
        for _ in range(3):
            dist.barrier()
            t = time.process_time()
            step()
            whole.append(time.process_time() - t)
        res["step_cpu"] = statistics.median(whole)
        stats = dict.fromkeys(("hooks", "hook_s", "from_local", "from_local_s", "to_local", "to_local_s", "colls",
                               "coll_s", "quiet_hooks", "quiet_hook_s", "hook_coll_s"), 0)
        _timed_hooks(model, stats)
        undo = _patch_local(stats)
        steps = 3
        for _ in range(steps):
            step()
        undo()
        res.update({k: v / steps for k, v in stats.items()})
        res["profiled"] = _profiled(step)
        with CommDebugMode() as comm:
            step()
        res["comm"] = {str(k): v for k, v in comm.get_comm_counts().items()}
        res["hooked_modules"] = sum(bool(m._forward_pre_hooks or m._forward_hooks) for m in model.modules())
        res["block0_hooks"] = {n: [len(m._forward_pre_hooks), len(m._forward_hooks)] for n, m in
                               model.named_modules() if (m._forward_pre_hooks or m._forward_hooks) and
                               (n.startswith("layers.0") or "layers" not in n)}
    res["collectives"] = _collectives(world, 16 * 256 * 256 * 4 // world * world)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    for world in map(int, args.worlds.split(",")):
        out = Path(tempfile.mkdtemp()) / "r.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                        "--master-port", str(29700 + world), __file__, "--worker", "--out", str(out)],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        r = json.loads(out.read_text())
        print(f"\nworld {world} tp{world} (load {os.getloadavg()[0]:.1f}): step {r['step_cpu']:.3f} CPU s per rank, "
              f"{r['hooked_modules']} modules with hooks")
        print(f"  hooks {r['hooks']:.0f} calls {r['hook_s']:.4f} s (quiet: {r['quiet_hooks']:.0f} calls "
              f"{r['quiet_hook_s']:.4f} s; the collectives inside {r['hook_coll_s']:.4f} s); funcol collectives "
              f"{r['colls']:.0f} {r['coll_s']:.4f} s")
        print(f"  block 0 and ends hooks (pre, post): {r['block0_hooks']}")
        print(f"  from_local {r['from_local']:.0f} "
              f"{r['from_local_s']:.4f} s; to_local {r['to_local']:.0f} {r['to_local_s']:.4f} s")
        for k, (n, s) in r["profiled"].items():
            print(f"  profiler {k}: {n} events {s:.4f} CPU s")
        print(f"  CommDebugMode: {r['comm']}")
        print("  | collective | idle wall ms | idle CPU ms | busy wall ms | busy CPU ms | matmuls alone ms |")
        for k, v in r["collectives"].items():
            print(f"  | {k} | {v['idle_wall'] * 1e3:.2f} | {v['idle_cpu'] * 1e3:.2f} | {v['busy_wall'] * 1e3:.2f} "
                  f"| {v['busy_cpu'] * 1e3:.2f} | {v['work_wall'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
