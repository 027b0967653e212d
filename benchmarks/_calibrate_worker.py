"""One torchrun launch of ``benchmarks/calibrate.py``: every layout of one world size, in this one process group.

    torchrun --nproc-per-node W benchmarks/_calibrate_worker.py --layouts layouts.json --out measured.json

Each repeat runs every layout in turn (interleaved, so a burst of load from elsewhere lands on all layouts
alike): the model is built and parallelized under the layout's plan, ``--warmup`` steps run unmeasured, then
``--steps`` steps are timed (barrier to barrier) and their median kept. Rank 0 writes, per layout, the median
seconds per step of each repeat, the 1-minute load average when it started, the reference block's time just before
it (``drift``: :func:`meshplan.profile.block.whole_block_time`, every rank at once, the host's state at that
moment, which ``calibrate.py`` sets beside the profile's own) and rank 0's thread count after it
(each layout's ``meshplan.init`` block destroys the groups it made: without that, 596 threads per rank piled up
over a world-4 launch).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import meshplan  # noqa: E402
from meshplan.profile.block import whole_block_time  # noqa: E402
from meshplan.profile.worker import _mean_over_ranks, _timed  # noqa: E402


def _examples_train():
    """examples/train.py (benchmarks/train.py would shadow it by name)."""
    spec = importlib.util.spec_from_file_location("examples_train", ROOT / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(kind: str, dim: int, layers: int, seq: int) -> torch.nn.Module:
    import llama
    import moe
    common = dict(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=4 * dim,
                  max_seq_len=seq, dropout=0.0)
    torch.manual_seed(0)
    if kind == "moe":
        return moe.build(moe.ModelArgs(**common, moe_hidden=2 * dim, n_experts=8, top_k=2, capacity_factor=None,
                                       aux_loss_coef=0.0))
    return llama.build(llama.ModelArgs(**common))


def run_layout(ex, layout: dict, args) -> float:
    """Median seconds per step of one layout (after its warm-up steps)."""
    plan = {"version": 1, **layout["plan"]}
    with meshplan.init(plan) as topo:
        model = meshplan.parallelize(_model(layout["kind"], args.dim, args.layers, args.seq), plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = ex.batches(256, args.seq, args.batch, topo.data_rank, topo.data_world_size, 0)
        times = []
        for step in range(args.warmup + args.steps):
            batch = next(data)
            dist.barrier()
            t = time.perf_counter()
            meshplan.train_step(model, batch, meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
            dist.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - t)
        for module in model.modules():  # examples/moe.py keeps its last aux loss, in the graph: with FSDP2's
            if getattr(module, "aux_loss", None) is not None:  # hooks in that graph the model, its groups' threads
                module.aux_loss = None  # and memory outlived the layout (+0.35 s per later ddp8 step per MoE pass)
        del model, opt, data
        gc.collect()  # FSDP2's and the pipeline's reference cycles hold the groups this block's end destroys
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--out", required=True)
    for name, default in (("repeats", 3), ("warmup", 2), ("steps", 3), ("dim", 256), ("layers", 4), ("seq", 256),
                          ("batch", 16)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    layouts = json.loads(Path(args.layouts).read_text())
    dist.init_process_group("gloo")
    ex = _examples_train()
    result = {ly["name"]: {"times": [], "load": [], "threads": [], "drift": []} for ly in layouts}
    cpu = torch.device("cpu")
    for _ in range(args.repeats):
        for ly in layouts:
            result[ly["name"]]["load"].append(os.getloadavg()[0])
            result[ly["name"]]["drift"].append(
                whole_block_time(_timed, lambda x: _mean_over_ranks(x, cpu), cpu, torch.float32))
            result[ly["name"]]["times"].append(run_layout(ex, ly, args))
            result[ly["name"]]["threads"].append(len(os.listdir("/proc/self/task")))  # flat: groups released
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
