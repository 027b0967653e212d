"""Expert parallelism: dispatch/combine bytes vs the minimum, routing imbalance and aux loss, tokens/s vs ep = 1.

Run: ``python benchmarks/ep.py [--world 2 4] [--tokens 2048] [--dim 256] [--hidden 512] [--experts 8]`` from the
repo root (≈1 min on 2 idle cores). For each world size the script launches itself under ``torchrun --standalone``
(gloo, CPU, one thread per rank) and builds one MoE layer of ``examples/moe.py`` (top-2 softmax router, grouped
SwiGLU experts, no capacity limit) from one seed on every rank; every rank routes its own ``--tokens`` tokens.

Columns, per world size and routing (*uniform*: random tokens; *skewed*: every token carries a common direction
that the router's row of expert 0 amplifies, so expert 0 is in nearly every token's top-2):

* **a2a bytes / minimum**: the rows this rank's all-to-alls send to OTHER ranks in one forward (dispatch +
  combine, ``all_to_all_single`` input split sizes × row bytes; rows a rank keeps are not sent), over the minimum:
  2 × (token copies whose expert lives on another ep rank, read from the router's choice) × dim × 4 bytes.
  1.00 means nothing moves that need not. *counts a2a*: the per-expert counts exchanged first (E int64 per rank).
* **imbalance**: max over experts / mean of the global tokens per expert; **aux loss**: the layer's
  load-balancing loss (E · Σ f·P; 1.00 = perfectly uniform), mean over ranks.
* **tokens/s ep=world / ep=1**: forward + backward of the layer, ep = world (experts sharded, tokens dispatched)
  vs ep = 1 (every rank holds every expert and computes its own tokens), the same tokens per rank, median of
  ``--iters`` after warm-up, each from a barrier to the slowest rank. On a 2-core machine world 4 is
  oversubscribed: read its bytes, not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Counting:
    """Stands for ``funcol`` inside ``meshplan.expert_parallel.dispatch``: counts what the all-to-alls send."""

    def __init__(self, funcol, rank: int):
        self._f, self.rank, self.rows_bytes, self.count_bytes = funcol, rank, 0, 0

    def __getattr__(self, name):
        return getattr(self._f, name)

    def all_to_all_single_autograd(self, x, out_splits, in_splits, group):
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        me = __import__("torch").distributed.get_group_rank(group, self.rank)
        self.rows_bytes += sum(n for i, n in enumerate(in_splits) if i != me) * row
        return self._f.all_to_all_single_autograd(x, out_splits, in_splits, group)

    def all_to_all_single(self, x, out_splits, in_splits, group):
        self.count_bytes += x.numel() * x.element_size()
        return self._f.all_to_all_single(x, out_splits, in_splits, group)


def _layer(args, ep: int):
    """The MoE layer (same seed everywhere) with its experts over ``ep`` ranks (ep 1: untouched)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import moe
    from meshplan.expert_parallel.experts import ExpertParallel
    cfg = moe.tiny_args(dim=args.dim, moe_hidden=args.hidden, n_experts=args.experts, top_k=2, capacity_factor=None)
    torch.manual_seed(0)
    layer = moe.MoE(cfg)
    layer.init_weights(0.02, 0.02)
    if ep > 1:
        parallelize_module(layer.experts, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)), ExpertParallel())
    return layer


def _tokens(args, rank: int, skewed: bool, layer):
    import torch
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, args.tokens, args.dim, generator=g)
    if skewed:
        u = torch.nn.functional.normalize(torch.ones(args.dim), dim=0)
        x = x + 3.0 * u
        with torch.no_grad():
            layer.router.gate.weight[0] += 2.0 * u
    return x


def _routing(args, skewed: bool) -> dict:
    """Bytes, imbalance and aux loss of one forward at ep = world."""
    import torch
    import torch.distributed as dist

    import meshplan.expert_parallel.dispatch as dispatch_mod
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _layer(args, world)
    x = _tokens(args, rank, skewed, layer)
    counter, original = _Counting(dispatch_mod.funcol, rank), dispatch_mod.funcol
    dispatch_mod.funcol = counter
    try:
        with torch.no_grad():
            _, topk_idx, _ = layer.router(x.reshape(-1, args.dim))
            layer(x)
    finally:
        dispatch_mod.funcol = original
    local = args.experts // world
    leaving = int((topk_idx // local != rank).sum())
    minimum = 2 * leaving * args.dim * 4
    per_expert = layer.tokens_per_expert.clone().float()
    dist.all_reduce(per_expert)
    aux = layer.aux_loss.detach().clone()
    dist.all_reduce(aux)
    return {"sent": counter.rows_bytes, "minimum": minimum, "counts": counter.count_bytes,
            "imbalance": float(per_expert.max() / per_expert.mean()), "aux": float(aux) / world}


def _speed(args, ep: int) -> float:
    """Median seconds of forward + backward (slowest rank), ep = ``ep``."""
    import torch
    import torch.distributed as dist
    layer = _layer(args, ep)
    x = _tokens(args, dist.get_rank(), False, layer)
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        t = time.perf_counter()
        layer(x).square().mean().backward()
        took = torch.tensor(time.perf_counter() - t)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(float(took))
    return statistics.median(times)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {r: _routing(args, r == "skewed") for r in ("uniform", "skewed")}
    out["seconds"] = {"ep1": _speed(args, 1), "ep": _speed(args, dist.get_world_size())}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(gathered))
    dist.destroy_process_group()


def _launch(args, world: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--worker", *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"world {world} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="each expert's FFN size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"MoE layer: dim {args.dim}, {args.experts} experts (FFN {args.hidden}), top-2, {args.tokens} tokens per "
          f"rank, fp32, gloo CPU, one thread per rank\n")
    print("| world | routing | a2a bytes sent / minimum | counts a2a bytes | imbalance (max/mean) | aux loss | "
          "tokens/s ep=world / ep=1 |")
    print("|---|---|---|---|---|---|---|")
    for world in args.world:
        ranks = _launch(args, world)
        speed = ranks[0]["seconds"]["ep1"] / ranks[0]["seconds"]["ep"]
        for routing in ("uniform", "skewed"):
            rows = [r[routing] for r in ranks]
            sent, minimum = sum(r["sent"] for r in rows), sum(r["minimum"] for r in rows)
            print(f"| {world} | {routing} | {sent / 2**20:.2f} MiB / {minimum / 2**20:.2f} MiB = "
                  f"{sent / minimum:.2f} | {rows[0]['counts']} | {rows[0]['imbalance']:.2f} | "
                  f"{statistics.mean(r['aux'] for r in rows):.3f} | {speed:.2f} |")


if __name__ == "__main__":
    main()
