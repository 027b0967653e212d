"""Train the example Llama with a meshplan plan under torchrun (CPU/gloo or CUDA/nccl).

    torchrun --standalone --nproc-per-node 4 examples/train.py --plan plans/llama.yaml

Synthetic data with a learnable rule (each token is the previous one plus a
per-sequence stride, mod vocab), so the loss visibly falls. Prints loss and
tokens/s. The model code (examples/llama.py) knows nothing of meshplan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402

import meshplan  # noqa: E402


def batches(vocab: int, batch: int, seq: int, rank: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seqs = (start + stride * torch.arange(seq + 1)) % vocab
        yield seqs[:, :-1], seqs[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="plans/llama.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="per data-parallel rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    plan = meshplan.load_plan(args.plan)
    with meshplan.init(plan) as topo:
        cfg = llama.ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, vocab_size=256,
                              ffn_dim=4 * args.dim, max_seq_len=args.seq)
        torch.manual_seed(0)
        model = llama.build(cfg)  # same seed on every rank: each keeps its shards of one single-device init
        meshplan.parallelize(model, plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        data = batches(cfg.vocab_size, args.batch, args.seq, topo.data_rank)
        if topo.rank == 0:
            print(f"{topo!r}\nplan {args.plan}: {sum(p.numel() for p in model.parameters())} local parameters on rank 0",
                  flush=True)
        tokens_per_step = args.batch * args.seq * topo.data_world_size
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            x, y = next(data)
            result = meshplan.train_step(model, (x, y), meshplan.cross_entropy, opt, topology=topo, max_grad_norm=1.0)
            if topo.rank == 0 and (step == 1 or step % 5 == 0 or step == args.steps):
                dt = time.perf_counter() - t0
                print(f"step {step:3d}  loss {float(result.loss):.4f}  grad_norm {float(result.grad_norm):.3f}  "
                      f"tokens/s {tokens_per_step * step / dt:,.0f}", flush=True)


if __name__ == "__main__":
    main()
