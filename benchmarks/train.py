"""Does ``meshplan train`` cost anything over a hand-written loop? Tokens/s of the trainer's loop vs the same model
trained by a loop over meshplan's public API, and data loading's share of the step.

Run: ``python benchmarks/train.py [--plan plans/train.yaml] [--steps 20] [--repeats 3]`` from the repo root, after
``bash scripts/demo.sh`` (or ``python examples/tiny_model.py runs/tiny-llama --vocab 4096 --hidden 128 --layers 4``)
made the model folder. It launches itself under torchrun at world 1 (tp 1) and world 4 (tp 2 × dp 2). In each launch
ONE model is built as the trainer builds it (``meshplan.init`` → ``parallelize`` → ``load_safetensors``) and trained
alternately by

* **trainer**: ``meshplan.trainer.loop._loop``, the loop ``meshplan train`` runs (lr schedule, per-step seed,
  ``PackedTokens.batch``, ``train_step`` with clipping, the metrics line and JSONL on rank 0), no eval/checkpoints;
* **hand**: ``data.batch`` → ``meshplan.train_step(model, batch, loss, AdamW, max_grad_norm=...)``, nothing else;

``--repeats`` times each, ``--steps`` steps a time, after one warm-up of each. Tokens/s is the wall clock of the
whole loop (barriers around it); the table shows medians, the trainer/hand ratio (target ≥ 0.95) and the share of
the hand loop's wall clock spent in ``PackedTokens.batch``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ((1, 1), (4, 2))  # (world, tp): tp 1 on one process, tp 2 × dp 2 on four


def _hand_loop(model, opt, data, tr, topo) -> tuple[float, float]:
    """The hand-written loop: (wall seconds, seconds in data.batch)."""
    import torch.distributed as dist

    import meshplan

    def loss_fn(out, targets):
        return meshplan.cross_entropy(out.logits, targets, reduction="sum")

    in_data = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(tr.steps):
        d0 = time.perf_counter()
        b = data.batch(step, tr.global_batch, topo.data_rank, topo.data_world_size)
        in_data += time.perf_counter() - d0
        meshplan.train_step(model, (b["input_ids"], b["labels"]), loss_fn, opt, topology=topo,
                            max_grad_norm=tr.max_grad_norm)
    dist.barrier()
    return time.perf_counter() - t0, in_data


def _trainer_loop(model, opt, data, tr, topo, flops, jsonl: str) -> float:
    """The trainer's own loop (rank 0 prints its lines into a buffer and writes the JSONL): wall seconds."""
    import torch.distributed as dist

    import meshplan
    from meshplan.trainer.loop import _loop
    from meshplan.trainer.metrics import MetricsLog

    log = MetricsLog(tr.log.every, tr.steps, jsonl, out=io.StringIO(), active=topo.rank == 0)
    dist.barrier()
    t0 = time.perf_counter()
    _loop(model, opt, data, tr, topo, log, None, 0, meshplan.DataState(tr.global_batch, tr.seed), flops)
    dist.barrier()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """One launch: build the model once, then alternate the two loops; rank 0 prints one ``BENCH {json}`` line."""
    import torch

    import meshplan
    from meshplan.plan_file.document import load_plan
    from meshplan.trainer.loop import _corpus, _flops_per_token, prepare
    from meshplan.trainer.settings import with_overrides

    world = int(os.environ["WORLD_SIZE"])
    plan = with_overrides(load_plan(args.plan), {"steps": args.steps, "layout.tp": args.tp, "eval.every": None,
                                                 "checkpoint.folder": None, "export": None})
    plan, source, tok, vocab, _ = prepare(plan, world)
    tr = plan.training
    with meshplan.init(plan) as topo:
        data = _corpus(tr, tok, vocab, topo)
        flops = _flops_per_token(source.model, tr.seq_len)
        model = meshplan.parallelize(source.model, plan, topo)
        meshplan.load_safetensors(model, source.weights)
        opt = torch.optim.AdamW(model.parameters(), lr=tr.optimizer.lr, betas=tr.optimizer.betas,
                                eps=tr.optimizer.eps, weight_decay=tr.optimizer.weight_decay)
        tokens = tr.steps * tr.global_batch * tr.seq_len
        got = {"trainer": [], "hand": [], "data_share": []}
        with tempfile.TemporaryDirectory() as tmp:
            jsonl = str(Path(tmp) / "metrics.jsonl")
            for rep in range(args.repeats + 1):  # rep 0 warms up
                t_trainer = _trainer_loop(model, opt, data, tr, topo, flops, jsonl)
                t_hand, t_data = _hand_loop(model, opt, data, tr, topo)
                if rep:
                    got["trainer"].append(tokens / t_trainer)
                    got["hand"].append(tokens / t_hand)
                    got["data_share"].append(t_data / t_hand)
        if topo.rank == 0:
            print("BENCH " + json.dumps({"world": world, "tp": args.tp, **got}), flush=True)


def launch(args: argparse.Namespace, world: int, tp: int) -> dict:
    """Run this script's worker under torchrun at ``world`` processes; rank 0's BENCH record."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--worker", "--tp", str(tp), "--plan", args.plan, "--steps", str(args.steps), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not lines:
        sys.exit(f"benchmarks/train.py: world {world} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="plans/train.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(f"{args.plan}: {args.steps} steps × {args.repeats} repeats (medians; tokens/s = wall clock of the loop)")
    print("| world | layout | trainer tokens/s | hand loop tokens/s | trainer / hand | data share of the step |")
    print("|---|---|---|---|---|---|")
    for world, tp in LAYOUTS:
        r = launch(args, world, tp)
        t, h = statistics.median(r["trainer"]), statistics.median(r["hand"])
        layout = f"tp {tp} × dp {world // tp}" if world > 1 else "one process"
        print(f"| {world} | {layout} | {t:,.0f} | {h:,.0f} | {t / h:.3f} | "
              f"{100 * statistics.median(r['data_share']):.2f}% |", flush=True)


if __name__ == "__main__":
    main()
