"""Packed documents under context parallelism: the row's head-tail layout (balanced by TOKENS) vs the per-document
layout (balanced by WORK, ``meshplan/context_parallel/documents.py``), both methods, up to 32k tokens on CPU.
Run: ``python benchmarks/cp.py --documents [--seq 8192 32768] [--cp 2 4] [--steps 2]``.

One batch row packs documents of mixed lengths (every length a multiple of ``2·cp``):

* ``long first``: ``S/2, S/4, S/16 × 4``; ``short first``: the same reversed; ``many``: ``S/32 × 8, S/4, S/8 × 2``.

For every rank, one process, one thread, ranks run one after the other (each rank's work alone, the machine's
other load aside): the rank's shards of q, k, v (``(1, 4 heads, S/cp, 32)``, 2 kv heads, float32) go through the
method's attention as the runtime calls it (document ids per position; the all-gather served by the whole
sequence's K/V in rank order, the ring's point-to-point hops by the source rank's block, dK/dV hops by zeros:
the same math, no transport), forward + backward, the fastest of ``--steps`` after one warm-up (other load on
the machine only adds time).

Columns per (row, cp, layout, method):

* **kept pairs/rank**: the (query, key) pairs the document-causal mask keeps for each rank's queries
  (:func:`~meshplan.context_parallel.chunks.document_pairs`), busiest ÷ idlest;
* **ring computed**: score entries per head the ring computes on the busiest rank (blocks whose chunks share no
  document skipped, the others document by document: ``doc_blocks.py``; diagonals counted whole);
* **attn ms/rank**: forward + backward per rank; **step ms**: the slowest rank's (the step waits for it).
"""

from __future__ import annotations

import argparse
import time

import torch

from meshplan.context_parallel import attention as cp_attention
from meshplan.context_parallel.attention import allgather_kv_attention
from meshplan.context_parallel.batch import documents_of, position_ids_of
from meshplan.context_parallel.chunks import document_pairs, rank_chunks, rank_positions
from meshplan.context_parallel.documents import document_order, virtual_documents
from meshplan.context_parallel.masks import AttentionMask
from meshplan.context_parallel.ring import Ring, ring_attend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def rows(seq: int) -> dict[str, list[int]]:
    long_first = [seq // 2, seq // 4] + [seq // 16] * 4
    return {"long first": long_first, "short first": long_first[::-1],
            "many": [seq // 32] * 8 + [seq // 4] + [seq // 8] * 2}


class _Links:
    """The ring's hops without transport: K/V from the source rank's shards, dK/dV as zeros."""

    def __init__(self, shards: list, cp: int, rank: int) -> None:
        self.shards, self.cp, self.rank, self.hops = shards, cp, rank, {0: 0, 1: 0}

    def post(self, sends, recvs, tags):
        for r, t in zip(recvs, tags):
            if t in (0, 1):
                self.hops[t] += 1
                r.copy_(self.shards[(self.rank - self.hops[t]) % self.cp][t])
            else:
                r.zero_()
        return []


def layout(lengths: list[int], cp: int, by_documents: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' order (true positions in virtual order: the identity for the row layout) and the document ids
    in that order, as the runtime reads them."""
    ids, seq = position_ids_of(lengths), sum(lengths)
    if not by_documents:
        return torch.arange(seq), documents_of(ids)
    order = torch.tensor(document_order(lengths, cp))
    return order, virtual_documents(ids[:, order], cp)


def _computed(ring: Ring, cp: int, chunk: int, q: torch.Tensor) -> int:
    """Score entries the ring computes on this rank per head (documents one by one where a block has several)."""
    total = 0
    for source in range(cp):
        for _, qr, _, kr in ring.pairs(source, chunk):
            segments = ring.segments(qr, kr, q)
            total += chunk * chunk if segments is None else sum((b - a) * (d - c) for _, a, b, c, d in segments)
    return total


def _time(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # the machine's other load only ever adds time


def measure(lengths: list[int], cp: int, by_documents: bool, method: str, steps: int) -> dict:
    seq = sum(lengths)
    order, docs = layout(lengths, cp, by_documents)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g)[:, :, order]  # in the kernels' order
    k, v = (torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g)[:, :, order] for _ in range(2))
    slot = [torch.tensor(rank_positions(seq, cp, r, True)) for r in range(cp)]  # kernel (virtual) positions
    held = [order[s] for s in slot]  # true positions
    shards = [(k[:, :, s].contiguous(), v[:, :, s].contiguous()) for s in slot]
    gathered = (torch.cat([a for a, _ in shards], -2), torch.cat([b for _, b in shards], -2))
    chunk, times, blocks = seq // (2 * cp), [], []
    assert len(rank_chunks(cp, 0, True)) * chunk * cp == seq
    for r in range(cp):
        ql = q[:, :, slot[r]].clone().requires_grad_()
        kl, vl = (t.clone().requires_grad_() for t in shards[r])
        if method == "ring":
            ring = Ring(_Links(shards, cp, r), True, AttentionMask(), HEAD_DIM ** -0.5, docs)
            blocks.append(_computed(ring, cp, chunk, ql))

            def step(ring=ring, ql=ql, kl=kl, vl=vl, r=r):
                ring.links.hops = {0: 0, 1: 0}
                ring_attend(ql, kl, vl, ring).sum().backward()
        else:
            def step(ql=ql, kl=kl, vl=vl, r=r):
                allgather_kv_attention(ql, kl, vl, is_causal=True, enable_gqa=True, group=None, cp=cp, rank=r,
                                       load_balance=True, mask=AttentionMask(), documents=docs,
                                       keeps={}).sum().backward()
        real = cp_attention._gather_kv
        cp_attention._gather_kv = lambda *_: gathered  # the all-gather's result, no transport
        try:
            times.append(_time(step, steps))
        finally:
            cp_attention._gather_kv = real
    kept = [document_pairs(h.tolist(), lengths) for h in held]
    return {"kept": kept, "blocks": max(blocks) if blocks else None, "ms": times}


def table(results: list[tuple]) -> str:
    head = ("| row | S | cp | layout | method | kept pairs/rank (M) | busiest ÷ idlest | ring computed "
            "(M, busiest) | attn ms/rank | step ms (slowest) |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for name, seq, cp, lay, method, m in results:
        kept, blocks = m["kept"], "" if m["blocks"] is None else f"{m['blocks'] / 1e6:.1f}"
        lines.append(f"| {name} | {seq} | {cp} | {lay} | {method} | {' / '.join(f'{x / 1e6:.1f}' for x in kept)} | "
                     f"{max(kept) / max(min(kept), 1):.2f} | "
                     f"{blocks} | "
                     f"{' / '.join(f'{x:.0f}' for x in m['ms'])} | {max(m['ms']):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["allgather_kv", "ring"])
    ap.add_argument("--rows", nargs="+", default=None, help="row names (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for seq in args.seq:
        for name, lengths in rows(seq).items():
            if args.rows and name not in args.rows:
                continue
            for cp in args.cp:
                for lay, by_docs in (("tokens", False), ("work", True)):
                    for method in args.methods:
                        results.append((name, seq, cp, lay, method, measure(lengths, cp, by_docs, method, args.steps)))
                        print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    print(text)
    return text


if __name__ == "__main__":
    main()
