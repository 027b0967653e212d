"""Checkpoints: bytes each rank writes vs its parameter + optimizer bytes, save and load time, sync vs async.

Run: ``python benchmarks/ckpt.py [--world 2] [--plans tp fsdp pp] [--dim 512] [--layers 4] [--repeat 3]
[--json PATH]`` from the repo root (≈1 min on 2 idle cores). For each plan the script launches itself under
``torchrun --standalone`` (gloo, CPU, ``OMP_NUM_THREADS=1``), builds the examples' Llama (vocab 256, ffn 4·dim,
8 heads) under the plan, takes one AdamW step (so the optimizer holds its moments) and measures, on every rank:

* **state MiB/rank**: the parameter + AdamW bytes this rank holds (its shards of parameters, ``exp_avg``,
  ``exp_avg_sq``, the step counts); **written MiB/rank**: the bytes of the shard files it wrote (its
  ``__<rank>_*.distcp``); **× state**: written / state, max over ranks (1.00: each rank writes what it holds,
  nothing more; replicated tensors are written by one rank, so a rank may write less). **total ×**: all ranks'
  files + DCP's ``.metadata`` + the manifest over the unique bytes of the model (each parameter, moment and step
  count once): the cost of the format itself.
* **sync s**: ``meshplan.save`` from a barrier until it returns (the checkpoint complete on disk), max over ranks.
* **async blocked s**: ``CheckpointManager(async_save=True).save`` until it returns (the copy of the shards to
  CPU memory and DCP's planning): the time the training loop waits; **async total s**: until ``wait()`` returns
  (complete on disk). **step s**: one training step, for scale.
* **load s**: ``meshplan.load`` into a fresh model under the same plan; **reshard s**: under the other plan of the
  same world (tp ↔ fsdp, pp → fsdp).

Medians of ``--repeat`` saves/loads. On a 2-core machine world 2 gives each rank one core; the background thread
of an asynchronous save shares it with the loop, so async total includes time the loop also wanted.
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

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20
RULES = {"tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
         "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
         "layers.*.ffn_norm": "norm", "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
         "layers.*.feed_forward.w2": "rowwise", "norm": "norm", "output": "lm_head"}
PIPE = {"blocks": {"pattern": "layers.*"}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}


def plans(world: int) -> dict:
    tp = {"sequence_parallel": True, "loss_parallel": True, "rules": RULES}
    return {"tp": {"layout": {"tp": world}, "tensor_parallel": tp}, "fsdp": {"layout": {}},
            "pp": {"layout": {"pp": world}, **PIPE}}


OTHER = {"tp": "fsdp", "fsdp": "tp", "pp": "fsdp"}


def _state_bytes(model, opt) -> tuple[int, dict[str, int]]:
    """(this rank's parameter + optimizer bytes, {parameter name: its full bytes with its AdamW state}): the
    names of all ranks together count each tensor of the model once (pipeline stages hold different ones)."""
    import torch
    from meshplan._torch import local_tensor
    mine, full = 0, {}
    for name, p in model.named_parameters():
        tensors = [p, *(v for v in opt.state[p].values() if isinstance(v, torch.Tensor))]
        mine += sum(local_tensor(t).numel() * t.element_size() for t in tensors)
        full[name] = sum(t.numel() * t.element_size() for t in tensors)
    return mine, full


def _timed(fn, barrier) -> float:
    barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _build(args, name, seed=0):
    import llama
    import meshplan
    import torch
    cfg = llama.ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=8, vocab_size=256,
                          ffn_dim=4 * args.dim, max_seq_len=args.seq)
    torch.manual_seed(seed)
    plan = meshplan.Plan.from_data(plans(int(os.environ["WORLD_SIZE"]))[name])
    model = meshplan.parallelize(llama.build(cfg), plan, meshplan.build_mesh(plan.layout))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, args) -> float:
    import meshplan
    import torch
    topo = meshplan.parallel_state(model).topology
    g = torch.Generator().manual_seed(0)
    rows = 4 // topo.data_world_size or 1
    x = torch.randint(0, 256, (rows, args.seq), generator=g)
    t = time.perf_counter()
    meshplan.train_step(model, (x, x), meshplan.cross_entropy, opt)
    return time.perf_counter() - t


def worker(args) -> None:
    """Under torchrun: one plan's measurements; rank 0 writes every rank's record to ``args.out``."""
    import meshplan
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, barrier = dist.get_rank(), dist.barrier
    model, opt = _build(args, args.plan)
    step_s = min(_step(model, opt, args) for _ in range(2))
    mine, full = _state_bytes(model, opt)
    root = [tempfile.mkdtemp(prefix="meshplan-bench-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    root = Path(root[0])
    sync = [_timed(lambda i=i: meshplan.save(root / f"sync{i}", model, opt, step=1), barrier)
            for i in range(args.repeat)]
    written = sum(f.stat().st_size for f in (root / "sync0").glob(f"__{rank}_*.distcp"))
    total = sum(f.stat().st_size for f in (root / "sync0").iterdir())
    mgr = meshplan.CheckpointManager(root / "async", async_save=True)
    blocked, whole = [], []
    for i in range(args.repeat):
        barrier()
        t = time.perf_counter()
        mgr.save(i + 1, model, opt, force=True)
        blocked.append(time.perf_counter() - t)
        mgr.wait()
        whole.append(time.perf_counter() - t)
    mgr.close()
    fresh, fresh_opt = _build(args, args.plan, seed=1)
    load = [_timed(lambda: meshplan.load(root / "sync0", fresh, fresh_opt), barrier) for _ in range(args.repeat)]
    other, other_opt = _build(args, OTHER[args.plan], seed=1)
    reshard = [_timed(lambda: meshplan.load(root / "sync0", other, other_opt), barrier) for _ in range(args.repeat)]
    med = statistics.median
    record = {"rank": rank, "state": mine, "unique": full, "written": written, "total": total, "step": step_s,
              "sync": med(sync), "blocked": med(blocked), "async": med(whole), "load": med(load),
              "reshard": med(reshard)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    if rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def launch(args, plan: str) -> list[dict]:
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
           __file__, "--worker", "--plan", plan, "--out", out, "--dim", str(args.dim), "--layers", str(args.layers),
           "--seq", str(args.seq), "--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"torchrun ({plan}) failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(Path(out).read_text())


def table(rows: dict[str, list[dict]], world: int) -> str:
    head = ("| plan (world {w}) | state MiB/rank | written MiB/rank | × state | total × | sync s | async blocked s "
            "| async total s | step s | load s | reshard s |").format(w=world)
    lines = [head, "|" + "---|" * 11]
    for plan, recs in rows.items():
        mx = lambda k: max(r[k] for r in recs)  # noqa: E731
        ratio = max(r["written"] / r["state"] for r in recs)
        unique = {k: v for r in recs for k, v in r["unique"].items()}
        total = recs[0]["total"] / sum(unique.values())
        lines.append(f"| {plan} → {OTHER[plan]} | {mx('state') / MiB:.1f} | {mx('written') / MiB:.1f} | "
                     f"{ratio:.2f} | {total:.3f} | {mx('sync'):.2f} | {mx('blocked'):.2f} | {mx('async'):.2f} | "
                     f"{mx('step'):.2f} | {mx('load'):.2f} | {mx('reshard'):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--plans", nargs="+", default=["tp", "fsdp", "pp"], choices=sorted(OTHER))
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the records here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="tp", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = {plan: launch(args, plan) for plan in args.plans}
    print(f"Llama dim {args.dim}, {args.layers} layers, AdamW; load average {os.getloadavg()[0]:.1f}")
    print(table(rows, args.world))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
