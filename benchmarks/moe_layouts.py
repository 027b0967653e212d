"""The MoE model's world-2 layouts in CPU seconds per rank (``time.process_time``: robust to other jobs' load on a
shared host, where calibrate.py's wall times are not), the solver's first choice among them.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/moe_layouts.py

One launch; calibrate.py's MoE (8 experts, top-2, dim 256, 4 layers) and global batch (16 x 256) under
``meshplan.train_step``; every layout in each of ``REPEATS`` interleaved passes, 1 warm-up + 2 timed steps; printed:
the rank mean's median, the wall median (meaningful on a quiet host only) and each CPU measurement. At 2 ranks on
2 cores with both ranks busy a rank's CPU seconds are its step.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
    sys.path.insert(0, str(p))

import meshplan  # noqa: E402
from _calibrate_worker import _examples_train, _model  # noqa: E402
from calibrate import LAYOUTS, MOE  # noqa: E402

REPEATS = 2
PLANS = {**{k: LAYOUTS[2][k][1] for k in ("moe_ddp2", "moe_ep2", "moe_fsdp2")},
         "ep2_ddp2 (solver's first choice)": {"layout": {"ep": 2, "dp_replicate": 2},
                                               "expert_parallel": MOE["expert_parallel"]}}


def _steps(plan: dict, ex) -> list[tuple[float, float]]:
    """``(CPU seconds (rank mean), wall seconds)`` of two timed steps after one warm-up."""
    plan = {"version": 1, **plan}
    out = []
    with meshplan.init(plan) as topo:
        model = meshplan.parallelize(_model("moe", 256, 4, 256), plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = ex.batches(256, 256, 16, topo.data_rank, topo.data_world_size, 0)
        for step in range(3):
            batch = next(data)
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            meshplan.train_step(model, batch, meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
            t = torch.tensor([time.process_time() - c], dtype=torch.float64)
            dist.barrier()
            wall = time.perf_counter() - w
            dist.all_reduce(t)
            if step:
                out.append((float(t) / dist.get_world_size(), wall))
        del model, opt, data
        gc.collect()
    return out


def main() -> None:
    dist.init_process_group("gloo")
    ex = _examples_train()
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in PLANS}
    for _ in range(REPEATS):
        for name, plan in PLANS.items():
            got[name] += _steps(plan, ex)
    if dist.get_rank() == 0:
        print(f"load average {os.getloadavg()[0]:.2f}\n")
        print("| layout | CPU s/step per rank (median) | wall s/step (median) | CPU measurements |\n|---|---|---|---|")
        for name, v in got.items():
            cpu, wall = statistics.median(c for c, _ in v), statistics.median(w for _, w in v)
            print(f"| {name} | {cpu:.3f} | {wall:.3f} | {', '.join(f'{c:.3f}' for c, _ in v)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
