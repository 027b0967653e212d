"""Train the example Llama with a meshplan plan under torchrun (CPU/gloo or CUDA/nccl).

    torchrun --standalone --nproc-per-node 4 examples/train.py --plan plans/llama.yaml
    torchrun --standalone --nproc-per-node 1 examples/train.py --plan plans/single.yaml --global-batch 16 --json
    torchrun --standalone --nproc-per-node 4 examples/train.py --plan plans/llama_cp.yaml --seq 256   # cp 2 × tp 2
    torchrun --standalone --nproc-per-node 4 examples/train.py --model moe --plan plans/moe.yaml  # tp 2 × ep 2
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train.py --checkpoint-dir ckpt --checkpoint-every 10

Synthetic data with a learnable rule (each token is the previous one plus a
per-sequence stride, mod vocab), so the loss visibly falls. Prints loss and
tokens/s. The model code (examples/llama.py) knows nothing of meshplan.

``--model moe`` trains the mixture-of-experts decoder of examples/moe.py (8 experts, top-2, no token dropped).
Its load-balancing loss is a statistic of the tokens each rank routes, so it is reported, not trained: adding it
would make the loss depend on how the batch is split (see docs/expert-parallel.md).

Layout invariance: sample ``i`` of the run (step ``s`` holds samples
``s·G … s·G + G - 1`` of a global batch of ``G``) is a function of
``(seed, i)`` alone; each rank takes its data-parallel slice of the global batch
(``topo.data_rank`` of ``topo.data_world_size``; tp/cp/pp peers share one: with a context_parallel plan
``meshplan.train_step`` cuts the shared sequences into each cp rank's chunks), and
the model is built from one seed on every rank before it is sharded. So the same
command with any plan and a matching ``--nproc-per-node`` prints the same losses
as one process with ``plans/single.yaml``, to fp32 noise. ``--json`` prints them
exactly: one object per step on rank 0, ``{"step", "loss", "grad_norm", "tokens_per_s"}``
(``tokens_per_s`` of that step alone); the banner goes to stderr then.

Checkpoints (``--checkpoint-dir D --checkpoint-every N``, docs/checkpoints.md): every N steps and after the last
one, ``meshplan.CheckpointManager`` saves the model, AdamW and the data position (samples seen, global batch,
seed) into ``D/step-0000000N``; a run started with the same ``D`` resumes from the latest complete checkpoint by
itself, on any plan and world size, and prints the losses the uninterrupted run printed (another global batch
size is refused unless ``--allow-batch-change``). Each step reseeds torch's RNG from ``(seed, step)``, so any
randomness in a step (dropout) repeats too. Under ``torchrun --max-restarts N`` a killed worker restarts the
group, which resumes the same way.

Exit status: 0 done; 1 bad input (one line ``train.py: error: …``); :data:`EXIT_RANK_FAILURE` (3) a peer died or
stopped answering: the one line ``meshplan: rank 2 died (…); rank 0 was waiting in …`` (meshplan's
:class:`~meshplan.RankFailure`, logged the moment it is known, docs/faults.md) and no traceback; 143 stopped by
SIGTERM (torchrun stopping the group; a silent peer is still named on the one line first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402
import moe  # noqa: E402

import meshplan  # noqa: E402
from meshplan.data.order import splitmix64, step_seed  # noqa: E402


def sample(vocab: int, seq: int, seed: int, index: int) -> torch.Tensor:
    """Global sample ``index`` of the run: ``seq + 1`` tokens, a function of ``(seed, index)`` only.

    A counter-based hash (splitmix64 of ``seed·2³² + index``) picks the start token and the stride, so no rank,
    layout or RNG state enters.
    """
    h = splitmix64(((seed & 0xFFFFFFFF) << 32) | (index & 0xFFFFFFFF))
    start, stride = h % vocab, 1 + (h >> 32) % 3
    return (start + stride * torch.arange(seq + 1)) % vocab


def batches(vocab: int, seq: int, global_batch: int, data_rank: int = 0, data_world_size: int = 1,
            seed: int = 0, start_sample: int = 0):
    """Yield ``(inputs, targets)`` of this rank's slice of every step's global batch.

    Step ``s`` (from 0) holds the global samples ``start_sample + s·global_batch …``; data rank ``r`` of ``d``
    takes the contiguous ``global_batch / d`` of them starting at ``r·global_batch / d``. A resumed run passes
    the samples its checkpoint had seen as ``start_sample``.
    """
    if global_batch % data_world_size:
        raise ValueError(f"--global-batch {global_batch} is not divisible by the data-parallel size "
                         f"{data_world_size}")
    local = global_batch // data_world_size
    step = 0
    while True:
        first = start_sample + step * global_batch + data_rank * local
        seqs = torch.stack([sample(vocab, seq, seed, i) for i in range(first, first + local)])
        yield seqs[:, :-1], seqs[:, 1:]
        step += 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="plans/llama.yaml")
    ap.add_argument("--model", choices=("llama", "moe"), default="llama",
                    help="examples/llama.py, or the mixture-of-experts decoder of examples/moe.py")
    ap.add_argument("--experts", type=int, default=8, help="--model moe: routed experts per layer (top-2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per optimizer step over all data-parallel ranks (default: --batch × dp)")
    ap.add_argument("--batch", type=int, default=8, help="per data-parallel rank, when --global-batch is not given")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0, help="seeds the model init and the data")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="the model's parameters and compute (float64: exact parity checks, tests/_float64.py)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save checkpoints here (step-N folders) and resume from the latest complete one")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="save every N steps (and after the last step); default: only after the last step")
    ap.add_argument("--keep", type=int, default=3, help="complete checkpoints kept: the latest K (0: all)")
    ap.add_argument("--async-checkpoint", action="store_true",
                    help="write checkpoints in the background (the loop waits only for a CPU copy)")
    ap.add_argument("--allow-batch-change", action="store_true",
                    help="resume with another --global-batch than the checkpoint's (from its sample index)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="seconds a collective may wait for a silent rank before every rank stops with the rank's "
                         "name (overrides the plan's faults.init_timeout_s and faults.timeout_s)")
    ap.add_argument("--json", action="store_true",
                    help='print one JSON object per step on rank 0: {"step", "loss", "grad_norm", "tokens_per_s"}')
    return ap


def _model(args: argparse.Namespace) -> torch.nn.Module:
    common = dict(dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, vocab_size=256,
                  ffn_dim=4 * args.dim, max_seq_len=args.seq, dropout=0.0)
    cfg = (moe.ModelArgs(**common, moe_hidden=2 * args.dim, n_experts=args.experts, top_k=2,
                         capacity_factor=None, aux_loss_coef=0.0)
           if args.model == "moe" else llama.ModelArgs(**common))
    torch.manual_seed(args.seed)
    model = (moe if args.model == "moe" else llama).build(cfg)  # same seed on every rank: each keeps its shards
    return model.to(getattr(torch, args.dtype))  # of one single-device init


def _resume(args, ckpt, model, opt, data_state, rank) -> tuple[int, "meshplan.DataState"]:
    """``(steps done, data position)``: from the latest complete checkpoint, else a fresh start."""
    if ckpt is None:
        return 0, data_state
    try:
        saved = ckpt.load_latest(model, opt, data=data_state, allow_batch_change=args.allow_batch_change)
    except meshplan.PlanError as e:
        sys.exit(f"train.py: error: {e}")
    if saved is None:
        return 0, data_state
    if rank == 0:
        print(f"resumed from {saved.path} (step {saved.step}, sample {saved.data.samples_seen})",
              file=sys.stderr, flush=True)
    return saved.step, saved.data


def _report(args, topo, model, step, result, tokens_per_s) -> None:
    if topo.rank != 0:
        return
    if args.json:
        print(json.dumps({"step": step, "loss": float(result.loss), "grad_norm": float(result.grad_norm),
                          "tokens_per_s": tokens_per_s}), flush=True)
    elif step == 1 or step % 5 == 0 or step == args.steps:
        layers = [m.aux_loss.detach() for m in model.modules() if isinstance(m, moe.MoE) and m.aux_loss is not None]
        aux = f"  aux {float(sum(layers)):.3f} (rank 0's layers, not trained)" if layers else ""
        print(f"step {step:3d}  loss {float(result.loss):.4f}  grad_norm {float(result.grad_norm):.3f}  "
              f"tokens/s {tokens_per_s:,.0f}{aux}", flush=True)


#: the exit status of a rank that lost a peer (a RankFailure): its one line is already on stderr
EXIT_RANK_FAILURE = 3


def main() -> None:
    """Train; a lost peer ends this rank with its one RankFailure line and :data:`EXIT_RANK_FAILURE`."""
    try:
        _train()
    except meshplan.RankFailure:  # logged on the meshplan.faults logger when found: that line is the report
        sys.exit(EXIT_RANK_FAILURE)


def _train() -> None:
    args = _parser().parse_args()
    plan = meshplan.load_plan(args.plan)
    with meshplan.init(plan, timeout_s=args.timeout_s) as topo:
        global_batch = args.global_batch if args.global_batch is not None else args.batch * topo.data_world_size
        if global_batch < 1 or global_batch % topo.data_world_size:
            sys.exit(f"train.py: error: the global batch ({global_batch}) must be a positive multiple of the "
                     f"data-parallel size ({topo.data_world_size})")
        model = meshplan.parallelize(_model(args), plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        ckpt = meshplan.CheckpointManager(args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep or None,
                                          async_save=args.async_checkpoint) if args.checkpoint_dir else None
        done, position = _resume(args, ckpt, model, opt, meshplan.DataState(global_batch, args.seed),
                                 topo.rank)
        vocab = model.args.vocab_size
        data = batches(vocab, args.seq, global_batch, topo.data_rank, topo.data_world_size, args.seed,
                       start_sample=position.samples_seen)
        if topo.rank == 0:
            n_local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
            print(f"{topo}\nplan {args.plan}: {n_local:,} local parameters on "
                  f"rank 0; global batch {global_batch}", file=sys.stderr if args.json else sys.stdout, flush=True)
        last = time.perf_counter()
        for step in range(done + 1, args.steps + 1):
            torch.manual_seed(step_seed(args.seed, step))
            result = meshplan.train_step(model, next(data), meshplan.cross_entropy, opt, topology=topo,
                                         max_grad_norm=1.0)
            position = position.advanced()
            now = time.perf_counter()
            _report(args, topo, model, step, result, global_batch * args.seq / (now - last))
            last = now
            if ckpt is not None:
                ckpt.save(step, model, opt, data=position, force=step == args.steps)
        if ckpt is not None:
            ckpt.close()


if __name__ == "__main__":
    main()
