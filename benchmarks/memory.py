"""Activation memory under tensor + sequence parallelism: meshplan vs stock DTensor TP+SP vs Megatron's formula.

Run: ``python benchmarks/memory.py [--seq 512] [--batch 2] [--hidden 256] [--heads 8] [--layers 2] [--only
selective]`` from the repo root (≈1 min on 2 cores). Everything runs in one process on ``fake`` process groups of world t (collectives move
nothing; shapes and bytes are exact) with :func:`meshplan.memory`, which counts the bytes of every tensor the step
creates that is still alive when the forward returns (what autograd keeps for the backward), per block.

**Table 1 — Megatron's formula.** Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models") count, per GPT layer with tensor and sequence parallelism, ``s·b·h·(34 + 5·a·s/h)/t`` bytes: 16-bit
activations, 1-byte dropout masks, attention not fused. :class:`GPT` below is exactly that layer (LayerNorm, q/k/v,
scores, softmax, dropout, ·V, output projection, dropout, LayerNorm, fc1 4h, GeLU, fc2, dropout) in bfloat16
with dropout 0.1. Columns: *stock*: ``save_gathered_inputs: true`` (autograd keeps each all-gathered block input,
stock DTensor TP+SP); *meshplan*: the default ``false`` (this rank's shard kept, gathered again in backward);
*formula*; the ratios. Checkpointing rows: *full* (every block; the formula: ``2·s·b·h/t``, the block input only),
*every 2*: every 2nd block (the mean of a checkpointed and a plain block), *ops mm*: meshplan's op-level policy
(``ops: [aten.mm.default, aten.addmm.default]``: keeps matmul outputs, recomputes the rest; not Megatron's selective recomputation,
which keeps ``34·s·b·h/t`` and recomputes the attention core: both are shown, nothing is forced to match; the
row-parallel matmuls' outputs are kept before their reduce-scatter, the whole sequence, so this policy's bytes do
not fall as 1/t). The GPT model uses bias (``addmm``), so the policy lists ``aten.addmm.default`` too.

torch's CPU dropout keeps its mask in the activation dtype (2 bytes; CUDA's fused kernel keeps a 1-byte bool
mask), so on this machine the formula's dropout terms are ``2·s·b·h`` and ``6·a·s²·b`` instead of ``s·b·h`` and
``5·a·s²·b``: the column *formula, 2-byte masks* is ``s·b·h·(36 + 6·a·s/h)/t``, what this machine can reach.

**Table 1b — selective recomputation at Megatron's level** (``activation_checkpointing: {mode: selective, policy:
megatron}``, :mod:`meshplan.recompute`): the saved bytes per layer MEASURED with the real policy on the fake group
(``meshplan.memory``: every storage the block created that is alive when the forward returns: autograd's saved
tensors, the selective-checkpoint cache, the block's output), next to Megatron's selective formula ``34·s·b·h/t``
(the attention core recomputed, the rest kept sharded) and to meshplan's estimate
(:func:`meshplan.solver.memory.block_activations`); the ``ops mm`` policy beside it. Goal: ≤ 1.00× the formula at
every t.

**Table 2 — the example Llama** (``examples/llama.py``: RMSNorm, SwiGLU, fused SDPA on CPU, fp32): per-layer bytes
stock vs meshplan vs (t = 1 bytes) / t, and the peak of the step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

GPT_RULES = {"wte": "embedding", "drop": "norm", "h.*.ln_1": "norm", "h.*.attn.q": "colwise", "h.*.attn.k": "colwise",
             "h.*.attn.v": "colwise", "h.*.attn.proj": "rowwise", "h.*.drop_attn": "norm", "h.*.ln_2": "norm",
             "h.*.mlp.fc1": "colwise", "h.*.mlp.fc2": "rowwise", "h.*.drop_mlp": "norm", "ln_f": "norm",
             "lm_head": "lm_head"}
LLAMA_RULES = {"tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
               "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
               "layers.*.attention.wo": "rowwise", "layers.*.ffn_norm": "norm", "layers.*.feed_forward.w1": "colwise",
               "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise", "norm": "norm",
               "output": "lm_head"}
CHECKPOINTING = {"none": None, "full": {"mode": "full"}, "every 2": {"mode": "selective", "every": 2},
                 "ops mm": {"mode": "selective", "ops": ["aten.mm.default", "aten.addmm.default"]},
                 "megatron": {"mode": "selective", "policy": "megatron"}}


class Attention(nn.Module):
    """Unfused causal attention: scores, softmax, dropout, ·V (heads read from ``n_heads``, adjusted by tp)."""

    def __init__(self, h: int, heads: int, p: float):
        super().__init__()
        self.n_heads, self.head_dim = heads, h // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
        probs = self.drop(scores.masked_fill(mask[:s, :s], float("-inf")).softmax(-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Megatron's GPT layer: pre-LayerNorm attention and MLP, dropout on each branch."""

    def __init__(self, h: int, heads: int, p: float):
        super().__init__()
        self.ln_1, self.attn, self.drop_attn = nn.LayerNorm(h), Attention(h, heads, p), nn.Dropout(p)
        self.ln_2, self.mlp, self.drop_mlp = nn.LayerNorm(h), MLP(h), nn.Dropout(p)

    def forward(self, x, mask):
        x = x + self.drop_attn(self.attn(self.ln_1(x), mask))
        return x + self.drop_mlp(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, h: int, heads: int, layers: int, p: float = 0.1, seq: int = 4096):
        super().__init__()
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)  # causal
        self.wte, self.drop = nn.Embedding(vocab, h), nn.Dropout(p)
        self.h = nn.ModuleList(Block(h, heads, p) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.drop(self.wte(ids))
        for block in self.h:
            x = block(x, self.mask)
        return self.lm_head(self.ln_f(x))


def measure(build, rules: dict, blocks: str, tp: int, save: bool, ckpt, ids) -> tuple[float, int]:
    """(saved bytes per layer, peak bytes) of one step at ``tp`` on a fake group."""
    import meshplan
    from meshplan.checks.dry_run import fake_group
    torch.manual_seed(0)
    model = build()
    plan = {"layout": {"tp": tp}, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True,
                                                      "rules": rules, "save_gathered_inputs": save}}
    if ckpt:
        plan["blocks"] = {"pattern": blocks, "activation_checkpointing": ckpt}
    with fake_group(tp):
        meshplan.parallelize(model, plan, meshplan.build_mesh(plan["layout"]))
        mem = meshplan.memory(model, lambda: meshplan.cross_entropy(model(ids), ids), blocks=blocks)
    return mem.per_layer(), mem.peak


def gpt_table(args) -> None:
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads

    def build():
        return GPT(args.vocab, h, a, args.layers, seq=s).to(torch.bfloat16).train()
    ids = torch.randint(0, args.vocab, (b, s))
    print(f"GPT layer (Megatron's): s {s}, b {b}, h {h}, a {a}, {args.layers} layers, bf16, dropout 0.1; "
          f"MiB per layer\n")
    print("| t | checkpointing | stock | meshplan | formula | stock / formula | meshplan / formula | formula, 2-byte "
          "masks | meshplan / it | peak stock / meshplan (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in args.tp:
        for name, ckpt in CHECKPOINTING.items():
            if (t == 1 and name != "none") or name == "megatron":  # megatron: selective_table
                continue
            (stock, p_stock), (mine, p_mine) = (measure(build, GPT_RULES, "h.*", t, save, ckpt, ids)
                                                for save in (True, False))
            full = s * b * h * (34 + 5 * a * s / h) / t
            cpu = s * b * h * (36 + 6 * a * s / h) / t  # torch's CPU dropout keeps its mask in the activation dtype
            formula, cpu = ({"full": 2 * s * b * h / t, "every 2": (f + 2 * s * b * h / t) / 2}.get(name, f)
                            for f in (full, cpu))
            label = name + (" (Megatron selective: 34sbh/t = %.2f)" % (34 * s * b * h / t / 2**20)
                            if name == "ops mm" else "")
            print(f"| {t} | {label} | {stock / 2**20:.2f} | {mine / 2**20:.2f} | {formula / 2**20:.2f} | "
                  f"{stock / formula:.2f} | {mine / formula:.2f} | {cpu / 2**20:.2f} | {mine / cpu:.2f} | "
                  f"{p_stock / 2**20:.1f} / {p_mine / 2**20:.1f} |")


def selective_table(args) -> None:
    from meshplan.solver.candidate import Candidate, Training
    from meshplan.solver.memory import block_activations
    from meshplan.solver.shape import ModelShape
    s, b, h, a = args.seq, args.batch, args.hidden, args.heads

    def build():
        return GPT(args.vocab, h, a, args.layers, seq=s).to(torch.bfloat16).train()
    ids = torch.randint(0, args.vocab, (b, s))
    shape = ModelShape(layers=args.layers, hidden=h, heads=a, kv_heads=a, ffn=4 * h, vocab=args.vocab, mlp="gelu",
                       norm="layernorm", bias=True)
    print(f"\nSelective recomputation, GPT layer as above; MiB per layer\n")
    print("| t | policy megatron, measured | Megatron selective 34sbh/t | measured / formula | meshplan estimate | "
          "estimate / measured | ops mm, measured | ops mm / formula |")
    print("|---|---|---|---|---|---|---|---|")
    for t in [t for t in args.tp if t > 1]:
        got, _ = measure(build, GPT_RULES, "h.*", t, False, CHECKPOINTING["megatron"], ids)
        mm, _ = measure(build, GPT_RULES, "h.*", t, False, CHECKPOINTING["ops mm"], ids)
        formula = 34 * s * b * h / t
        cand = Candidate(tp=t, micro_batch=b, ac="selective", ac_policy="megatron")
        est = block_activations(shape, cand, Training(seq=s, global_batch=b), False, False)
        print(f"| {t} | {got / 2**20:.3f} | {formula / 2**20:.3f} | {got / formula:.2f} | {est / 2**20:.3f} | "
              f"{est / got:.3f} | {mm / 2**20:.3f} | {mm / formula:.2f} |")


def llama_table(args) -> None:
    import llama
    cfg = llama.tiny_args(dim=args.hidden, n_heads=args.heads, n_kv_heads=args.heads, ffn_dim=2 * args.hidden,
                          max_seq_len=args.seq, n_layers=args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    one, _ = measure(lambda: llama.build(cfg), LLAMA_RULES, "layers.*", 1, True, None, ids)
    print(f"\nExample Llama (RMSNorm, SwiGLU, fused SDPA, fp32), same sizes; MiB per layer (t = 1: {one / 2**20:.2f})\n")
    print("| t | stock | meshplan | (t=1)/t | stock / ideal | meshplan / ideal |")
    print("|---|---|---|---|---|---|")
    for t in [t for t in args.tp if t > 1]:
        stock, _ = measure(lambda: llama.build(cfg), LLAMA_RULES, "layers.*", t, True, None, ids)
        mine, _ = measure(lambda: llama.build(cfg), LLAMA_RULES, "layers.*", t, False, None, ids)
        print(f"| {t} | {stock / 2**20:.2f} | {mine / 2**20:.2f} | {one / t / 2**20:.2f} | {stock / one * t:.2f} | "
              f"{mine / one * t:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--only", choices=["gpt", "selective", "llama"], help="print one table")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name, table in (("gpt", gpt_table), ("selective", selective_table), ("llama", llama_table)):
        if args.only in (None, name):
            table(args)


if __name__ == "__main__":
    main()
