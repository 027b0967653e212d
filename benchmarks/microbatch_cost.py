"""What one more microbatch costs, measured beside the cost model: calibrate.py's dense Llama and MoE in ONE process,
no parallelism, the global batch (16 x 256 tokens) cut into 1 / 4 / 16 microbatches (gradient accumulation, then
AdamW), CPU seconds per step (``time.process_time``: robust to other jobs on a shared host) next to ``estimate``'s
seconds with a profile of this machine (``meshplan profile`` at world 1, or ``--cluster FILE``).

    OMP_NUM_THREADS=1 python benchmarks/microbatch_cost.py            # ~2 minutes on a quiet 2-core host

Printed: per model and microbatch count the measured and priced step and the priced ``moe_microbatch`` part
(:mod:`meshplan.solver.moe_costs`), then per model the seconds per extra microbatch, measured and priced (the slope
from 1 to 16 microbatches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from calibrate import BATCH, SEQ, model_config  # noqa: E402
from meshplan.solver.candidate import Candidate, Training  # noqa: E402
from meshplan.solver.shape import shape_from_config  # noqa: E402
from meshplan.solver.step import evaluate  # noqa: E402

MICROBATCHES = (1, 4, 16)


def _model(kind: str) -> torch.nn.Module:
    import llama
    import moe
    cfg = {**model_config(kind), "max_seq_len": SEQ, "dropout": 0.0}
    torch.manual_seed(0)
    if kind == "moe":
        return moe.build(moe.ModelArgs(**cfg, capacity_factor=None, aux_loss_coef=0.0))
    return llama.build(llama.ModelArgs(**cfg))


def measure(kind: str, m: int, steps: int) -> float:
    """Median CPU seconds per step (one warm-up step first) with the batch in ``m`` microbatches."""
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(steps + 1):
        t = time.process_time()
        for piece in tokens.chunk(m):
            logits = model(piece[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), piece[:, 1:].flatten()) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.process_time() - t)
    return statistics.median(times)


def price(kind: str, m: int, cluster) -> tuple[float, float]:
    """``(step seconds, moe_microbatch part)`` by ``estimate`` for one rank running ``m`` microbatches."""
    train = Training(seq=SEQ, global_batch=BATCH, dtype="float32", reduce_dtype="float32")
    e = evaluate(shape_from_config(model_config(kind)), Candidate(micro_batch=BATCH // m, microbatches=m), train,
                 cluster)
    return e.step_time, e.parts.get("moe_microbatch", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=None, help="a `meshplan profile` file (default: profile world 1 now)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.cluster:
        from meshplan.solver.cluster import load_cluster_file
        cluster = load_cluster_file(args.cluster)
    else:
        from meshplan.profile.run import profile_cluster
        with tempfile.TemporaryDirectory() as tmp:
            cluster = profile_cluster(nproc=1, out=Path(tmp) / "cluster1.json")
    print(f"cluster: {cluster.source}; expert_grad_rate {cluster.expert_grad_rate / 1e9:.1f} GB/s, op_overhead "
          f"{cluster.op_overhead * 1e6:.1f} us\n")
    print("| model | microbatches | measured CPU s/step | priced s/step | error | priced moe_microbatch |")
    print("|---|---|---|---|---|---|")
    slopes = {}
    for kind in ("llama", "moe"):
        rows = {}
        for m in MICROBATCHES:
            got, (p, part) = measure(kind, m, args.steps), price(kind, m, cluster)
            rows[m] = (got, p)
            print(f"| {kind} | {m} | {got:.3f} | {p:.3f} | {100 * (p / got - 1):+.0f}% | {part:.3f} |", flush=True)
        lo, hi = MICROBATCHES[0], MICROBATCHES[-1]
        slopes[kind] = [(rows[hi][i] - rows[lo][i]) / (hi - lo) for i in (0, 1)]
    print()
    for kind, (got, p) in slopes.items():
        print(f"{kind}: per extra microbatch measured {1e3 * got:.1f} ms, priced {1e3 * p:.1f} ms")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
