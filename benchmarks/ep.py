"""Expert parallelism: all-to-all bytes vs the minimum, routing imbalance and aux loss, tokens/s vs ep = 1.

Run: ``python benchmarks/ep.py [--world 2 4] [--tokens 2048] [--dim 256] [--hidden 512] [--experts 8] [--top-k 2]
[--dtype float32] [--skew 3] [--iters 9] [--json PATH]`` from the repo root (≈1 min on 2 idle cores). For each
world size the script launches itself under ``torchrun --standalone`` (gloo, CPU, ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` per rank) and builds one MoE layer of ``examples/moe.py`` (softmax top-k router,
grouped SwiGLU experts, ``capacity_factor=None``) from one seed on every rank; ep = world: its ``experts`` go through
``parallelize_module(layer.experts, ep_mesh, ExpertParallel())``. Every rank routes its own ``--tokens`` tokens:
``randn + 2·u`` (``u`` a fixed unit vector: hidden states share a mean direction), which require grad as a layer's
input in a model does. The router's gate rows are made orthogonal to ``u`` (the shared direction moves no logit), so
routing *uniform* is the router as initialised (N(0, 0.02²)) on random tokens; *skewed*: ``--skew · u`` added to the gate's row of expert 0, so its
logit is larger by ≈ skew · 2 and expert 0 is in nearly every token's top-k. Same tokens for both.

Columns, per world size and routing (one forward + backward of the layer, recorded on every rank):

* **fwd a2a MiB / minimum, fwd ×**: bytes the row all-to-alls (dispatch + combine) of one forward send to OTHER
  ranks, summed over ranks, as the collectives see them: a ``TorchDispatchMode`` records each
  ``_c10d_functional.all_to_all_single`` (input split sizes × row bytes; no patching), over the minimum: 2 × (token
  copies whose expert lives on another ep rank, from the router's top-k choice) × dim × dtype size. Self-sends: rows
  a rank "sends" to itself (``input_split_sizes[own rank]``, the copies for its own experts; a local copy in gloo)
  do not leave it and are in neither number: they are the column **self MiB**. The footer checks each rank alone:
  its sent bytes over ITS minimum, (its copies for other ranks' experts + other ranks' copies for its experts) ×
  row bytes. **bwd ×**: the same ratio for the backward's all-to-alls (the reverse of each).
* **counts a2a**: the per-expert counts exchanged before the rows, per rank: calls × bytes (E int64).
* **imbalance**: max / mean over experts of the global tokens per expert (``tokens_per_expert`` summed over ranks;
  top-k of E caps it at E/k); **rank load**: max / mean over ep ranks of the rows their experts compute.
* **aux loss**: the layer's load-balancing loss (E · Σ f·P over each rank's tokens; 1.00 = uniform), mean of ranks.
* **tok/s ep=1, ep=world, ×**: global tokens (world × tokens) per second of forward + backward (loss
  ``out.square().mean()``; gradients set to None before each step, as a training loop does), median of ``--iters``
  after ``--warmup``, each from a barrier to the slowest rank; ep=1 and ep=world steps alternate. ep=1: every rank holds all experts and computes its own tokens; ep=world: experts
  sharded, tokens dispatched. Same processes, same tokens per rank. World 4 on 2 cores is oversubscribed: read
  its bytes, not its speed.
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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20


class A2ALog(TorchDispatchMode):
    """Records every ``all_to_all_single`` one rank issues, split into the bytes that leave it and those it keeps.

    ``phase`` ("fwd"/"bwd") is set by the caller; ``totals[f"{phase} {kind}"]`` is ``[calls, leaving bytes,
    self bytes]``, kind "rows" (floating rows) or "counts" (integer counts). DTensor ops are declined so their
    decompositions come back here."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.totals = "fwd", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func._schema.name.endswith("all_to_all_single"):
            from torch.distributed.distributed_c10d import _resolve_process_group
            x, _out_splits, in_splits, group = args[:4]
            pg = _resolve_process_group(group)
            me, size = pg.rank(), pg.size()
            splits = list(in_splits) or [x.shape[0] // size] * size
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            kind = "rows" if x.is_floating_point() else "counts"
            entry = self.totals.setdefault(f"{self.phase} {kind}", [0, 0, 0])
            entry[0] += 1
            entry[1] += (sum(splits) - splits[me]) * row
            entry[2] += splits[me] * row
        return out


def _layer(args, ep: int, skewed: bool):
    """The MoE layer (same seed on every rank), skewed toward expert 0 or not, its experts over ``ep`` ranks."""
    import moe
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from meshplan.expert_parallel.experts import ExpertParallel
    cfg = moe.tiny_args(dim=args.dim, moe_hidden=args.hidden, n_experts=args.experts, top_k=args.top_k,
                        capacity_factor=None)
    torch.manual_seed(0)
    layer = moe.MoE(cfg)
    layer.init_weights(0.02, 0.02)
    with torch.no_grad():
        gate, u = layer.router.gate.weight, _direction(args.dim)
        gate -= torch.outer(gate @ u, u)  # the tokens' shared direction moves no logit …
        if skewed:
            gate[0] += args.skew * u  # … but expert 0's, when skewed
    layer.to(getattr(torch, args.dtype))
    if ep > 1:
        parallelize_module(layer.experts, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)), ExpertParallel())
    return layer


def _direction(dim: int) -> torch.Tensor:
    """The unit vector every token leans along (and the skewed router's expert 0 reads)."""
    return torch.nn.functional.normalize(torch.linspace(1.0, 2.0, dim), dim=0)


def _tokens(args, rank: int) -> torch.Tensor:
    """This rank's ``(1, tokens, dim)`` input: its own random tokens plus the shared direction. It requires grad,
    as a layer's input in a model does: without it the backward would skip dispatch's reverse all-to-all."""
    x = torch.randn(1, args.tokens, args.dim, generator=torch.Generator().manual_seed(100 + rank))
    return (x + 2.0 * _direction(args.dim)).to(getattr(torch, args.dtype)).requires_grad_()


def _measure(args, skewed: bool) -> dict:
    """One forward + backward at ep = world under :class:`A2ALog`: bytes moved vs the router's choice."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = _layer(args, world, skewed)
    chosen = []
    hook = layer.router.register_forward_hook(lambda _m, _i, out: chosen.append(out[1]))
    log = A2ALog()
    with log:
        out = layer(_tokens(args, rank))
        log.phase = "bwd"
        out.float().square().mean().backward()
    hook.remove()
    owner = chosen[0] // (args.experts // world)  # the ep rank holding each copy's expert
    return {"log": log.totals, "to_rank": torch.bincount(owner.reshape(-1), minlength=world).tolist(),
            "row_bytes": args.dim * getattr(torch, args.dtype).itemsize,
            "per_expert": layer.tokens_per_expert.tolist(), "aux": float(layer.aux_loss)}


def _minimum(recs: list[dict], rank: int) -> int:
    """The bytes ``rank`` must send in one forward: its token copies for other ranks' experts (dispatch), and the
    outputs of its experts for other ranks' copies (combine), from the router's choices."""
    out_copies = sum(n for d, n in enumerate(recs[rank]["to_rank"]) if d != rank)
    in_copies = sum(r["to_rank"][rank] for s, r in enumerate(recs) if s != rank)
    return (out_copies + in_copies) * recs[rank]["row_bytes"]


def _time(args, skewed: bool) -> dict:
    """Median seconds (slowest rank) of forward + backward at ep = 1 and ep = world, their steps alternating."""
    import torch.distributed as dist
    layers = {"ep1": _layer(args, 1, skewed), "ep": _layer(args, dist.get_world_size(), skewed)}
    x = _tokens(args, dist.get_rank())
    times = {name: [] for name in layers}
    for i in range(args.warmup + args.iters):
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            dist.barrier()
            start = time.perf_counter()
            layer(x).float().square().mean().backward()
            took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
            if i >= args.warmup:
                times[name].append(float(took))
    return {name: statistics.median(t) for name, t in times.items()}


def worker(args) -> None:
    """Under torchrun: measure both routings; rank 0 writes every rank's record to ``args.worker``."""
    import warnings
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mine = {}
    for routing in ("uniform", "skewed"):
        mine[routing] = _measure(args, routing == "skewed")
        mine[routing]["seconds"] = _time(args, routing == "skewed")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(args.worker, "w") as f:
            json.dump(everyone, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 + gloo: a rare abort at interpreter exit (see tests/_launch.py); the results are written


def _launch(args, world: int) -> list[dict]:
    """Run this script under torchrun with ``world`` gloo processes; every rank's record."""
    fd, path = tempfile.mkstemp(prefix="meshplan-ep-bench-", suffix=".json")
    os.close(fd)
    flags = _without_json(sys.argv[1:])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.abspath(__file__), *flags, "--worker", path]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode or not os.path.getsize(path):
            sys.exit(f"world {world} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _without_json(argv: list[str]) -> list[str]:
    """``argv`` less ``--json PATH`` (the launcher writes the JSON, not the workers)."""
    out, drop_next = [], False
    for a in argv:
        if not drop_next and not a.startswith("--json"):
            out.append(a)
        drop_next = a == "--json"
    return out


def row(world: int, routing: str, ranks: list[dict], args) -> dict:
    """One table row from every rank's record of one routing."""
    recs = [r[routing] for r in ranks]

    def total(key: str, i: int) -> int:
        return sum(r["log"].get(key, [0, 0, 0])[i] for r in recs)

    minimum = sum(_minimum(recs, rank) for rank in range(world))
    per_expert = [sum(col) for col in zip(*(r["per_expert"] for r in recs))]
    local = args.experts // world
    load = [sum(per_expert[d * local:(d + 1) * local]) for d in range(world)]
    counts = recs[0]["log"].get("fwd counts", [0, 0, 0])
    ep1, ep = recs[0]["seconds"]["ep1"], recs[0]["seconds"]["ep"]  # the slowest rank's, the same on every rank
    tokens = world * args.tokens
    ratios = [r["log"][f"{p} rows"][1] / _minimum(recs, i) for i, r in enumerate(recs) for p in ("fwd", "bwd")]
    return {"world": world, "routing": routing, "fwd_bytes": total("fwd rows", 1), "minimum": minimum,
            "fwd_ratio": total("fwd rows", 1) / minimum, "bwd_ratio": total("bwd rows", 1) / minimum,
            "self_bytes": total("fwd rows", 2), "row_calls": recs[0]["log"]["fwd rows"][0],
            "counts_calls": counts[0], "counts_bytes": (counts[1] + counts[2]) // max(counts[0], 1),
            "bwd_counts_calls": total("bwd counts", 0),
            "imbalance": max(per_expert) / statistics.mean(per_expert),
            "rank_load": max(load) / statistics.mean(load), "aux": statistics.mean(r["aux"] for r in recs),
            "tok_s_ep1": tokens / ep1, "tok_s_ep": tokens / ep, "speedup": ep1 / ep,
            "rank_ratios": [min(ratios), max(ratios)]}


#: the table's columns: header, and the cell of a row
COLUMNS = [
    ("world", lambda r: str(r["world"])), ("routing", lambda r: r["routing"]),
    ("fwd a2a MiB / minimum", lambda r: f"{r['fwd_bytes'] / MiB:.2f} / {r['minimum'] / MiB:.2f}"),
    ("fwd ×", lambda r: f"{r['fwd_ratio']:.2f}"), ("bwd ×", lambda r: f"{r['bwd_ratio']:.2f}"),
    ("self MiB", lambda r: f"{r['self_bytes'] / MiB:.2f}"),
    ("counts a2a", lambda r: f"{r['counts_calls']} × {r['counts_bytes']} B"),
    ("imbalance", lambda r: f"{r['imbalance']:.2f}"), ("rank load", lambda r: f"{r['rank_load']:.2f}"),
    ("aux loss", lambda r: f"{r['aux']:.3f}"), ("tok/s ep=1", lambda r: f"{r['tok_s_ep1']:,.0f}"),
    ("tok/s ep=world", lambda r: f"{r['tok_s_ep']:,.0f}"), ("×", lambda r: f"{r['speedup']:.2f}"),
]


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (:data:`COLUMNS`)."""
    lines = [[h for h, _ in COLUMNS], ["---"] * len(COLUMNS), *([cell(r) for _, cell in COLUMNS] for r in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def main() -> None:
    """Parse the flags; as the launcher, run every world size and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512, help="each expert's FFN size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skew", type=float, default=3.0, help="added to expert 0's gate row along the tokens' mean")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    rows = [row(world, routing, ranks, args) for world in args.world
            for ranks in [_launch(args, world)] for routing in ("uniform", "skewed")]
    print(f"Expert parallelism, torch {torch.__version__}, gloo on CPU, one thread per rank: examples/moe.py MoE "
          f"layer, dim {args.dim}, {args.experts} experts of FFN {args.hidden}, top-{args.top_k}, "
          f"{args.tokens} tokens per rank, {args.dtype}; bytes summed over ranks, one forward / backward.\n")
    print(table(rows))
    lo, hi = min(r["rank_ratios"][0] for r in rows), max(r["rank_ratios"][1] for r in rows)
    print(f"\nEach rank's own bytes / its minimum (fwd and bwd): {lo:.4f} … {hi:.4f}. self MiB: rows a rank sends "
          f"itself (forward), not in the ratios. Counts a2a in the backward: "
          f"{sum(r['bwd_counts_calls'] for r in rows)} calls. ({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
