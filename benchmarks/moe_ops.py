"""Where an MoE block's per-microbatch time goes: aten ops per call (forward and backward), by expert count and
tokens, and CPU seconds per call (``time.process_time``: robust to other jobs on a shared host).

    python benchmarks/moe_ops.py            # examples/moe.py's MoE (calibrate.py's shape) and transformers' Mixtral

Printed per model and local expert count ``E`` (ep 1/2/4 of 8 experts: 8/4/2 local) and tokens: the aten ops one
forward and backward of the block dispatches, the host syncs that dispatch an aten op (``_local_scalar_dense``:
``item()``, a tensor in an ``if``; ``tolist()`` syncs without one, so examples/moe.py shows 0), the autograd nodes,
and the CPU seconds per call; then the ops per expert (the slope over ``E``) and the fixed part (the router, top-k,
sort, gather and scatter-add): what :func:`meshplan.solver.moe_costs.moe_block_ops` counts.

Measured (2026-11-26, load 9-26, ~4 minutes): examples/moe.py 71 + 40 per local expert, transformers' Mixtral with
eager experts 48 + 55; docs/solver.md has the table.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from meshplan._torch import TorchDispatchMode  # noqa: E402

DIM, HIDDEN, TOP_K = 256, 512, 2


class _Count(TorchDispatchMode):
    """Counts aten ops, and host syncs among them."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += "_local_scalar_dense" in str(func)
        return func(*args, **(kwargs or {}))


def _nodes(t: torch.Tensor) -> int:
    seen, stack = set(), [t.grad_fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        stack.extend(g for g, _ in f.next_functions)
    return len(seen)


def _examples_block(experts: int):
    import moe
    args = moe.ModelArgs(dim=DIM, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=4 * DIM,
                         moe_hidden=HIDDEN, n_experts=experts, top_k=TOP_K, capacity_factor=None)
    torch.manual_seed(0)
    block = moe.MoE(args)
    block.init_weights(0.02, 0.02)
    return block


def _mixtral_block(experts: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=experts,
                        num_experts_per_tok=TOP_K, experts_implementation="eager")
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


def _run(block, x):
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    return y


def measure(make, experts: int, tokens: int) -> dict:
    """Ops, syncs, autograd nodes and CPU seconds of one forward and backward of ``make(experts)``."""
    block = make(experts)
    x = torch.randn(1, tokens, DIM, requires_grad=True)
    y = _run(block, x)
    nodes = _nodes(y)
    y.sum().backward()
    with _Count() as count:
        _run(block, x).sum().backward()
    reps, times = max(3, 8192 // tokens), []
    for _ in range(5):
        t = time.process_time()
        for _ in range(reps):
            _run(block, x).sum().backward()
        times.append((time.process_time() - t) / reps)
    return {"ops": count.ops, "syncs": count.syncs, "nodes": nodes, "cpu_s": statistics.median(times)}


def main() -> None:
    torch.set_num_threads(1)
    makers = {"examples/moe.py MoE": _examples_block, "transformers Mixtral (eager experts)": _mixtral_block}
    print("| model | local experts | tokens | aten ops fwd+bwd | host syncs | autograd nodes | CPU ms/call |")
    print("|---|---|---|---|---|---|---|")
    for name, make in makers.items():
        rows = {}
        for experts in (8, 4, 2):
            for tokens in (256, 1024, 4096):
                r = rows[experts, tokens] = measure(make, experts, tokens)
                print(f"| {name} | {experts} | {tokens} | {r['ops']} | {r['syncs']} | {r['nodes']} | "
                      f"{1e3 * r['cpu_s']:.2f} |", flush=True)
        slope = (rows[8, 256]["ops"] - rows[2, 256]["ops"]) / 6
        fixed = rows[8, 256]["ops"] - 8 * slope
        print(f"\n{name}: {slope:.1f} aten ops per local expert (forward and backward), {fixed:.1f} fixed "
              f"(router, top-k, sort, gather, combine); syncs per call {rows[8, 256]['syncs']}\n")


if __name__ == "__main__":
    main()
