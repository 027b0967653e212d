"""A block of packed documents computed document by document: the ring's work at document granularity.

A (query chunk, key chunk) block of packed rows keeps only the pairs inside one document. Instead of the whole
block under a keep-matrix, each batch row's documents present on both sides give one sub-block (the document's
queries of the chunk against its keys of the other chunk), which needs no document ids: inside one document the
sub-block is covered (a mask-free block) or the causal diagonal, both torch's fused kernel on CPU, or the
window's keep on its positions. The work is then the kept pairs' blocks, not ``chunk²``: what makes the
per-document layout (:mod:`~meshplan.context_parallel.documents`), where every chunk holds a piece of every
document, pay.
"""

from __future__ import annotations

from typing import Any

import torch

from meshplan.context_parallel.blocks import attend_block, block_grads, work_dtype

__all__ = ["document_segments", "attend_documents", "document_grads"]


def _runs(docs: torch.Tensor) -> dict[int, tuple[int, int]]:
    ids, counts = torch.unique_consecutive(docs, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {int(d): (e - c, e) for d, c, e in zip(ids.tolist(), counts.tolist(), ends)}


def document_segments(q_doc: torch.Tensor, k_doc: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """``(row, q_lo, q_hi, k_lo, k_hi)`` of each document present in both chunks of each row (local offsets).

    Args:
        q_doc, k_doc: ``(rows, chunk)`` document ids of the block's queries and keys; a document is one run in
            each (true for the row layout and for the document-major order alike).

    Example::

        >>> document_segments(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 1, 1, 1]]))
        [(0, 0, 2, 0, 1), (0, 2, 4, 1, 4)]
    """
    out = []
    for row in range(q_doc.shape[0]):
        qs, ks = _runs(q_doc[row]), _runs(k_doc[row])
        out += [(row, *qs[d], *ks[d]) for d in qs if d in ks]
    return out


def _sub(t: torch.Tensor, row: int, lo: int, hi: int) -> torch.Tensor:
    return t[row:row + 1, ..., lo:hi, :]


def attend_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list, *, scale: float, mask: Any,
                     q_pos: range, k_pos: range) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block ``q`` ``(rows, heads, chunk, d)`` against ``k``, ``v``, one
    :func:`~meshplan.context_parallel.blocks.attend_block` per segment (positions: the chunks' ranges); a query in
    no segment gets ``out = 0``, ``lse = -inf``."""
    work = work_dtype(q.dtype)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
    for row, qa, qb, ka, kb in segments:
        o, s = attend_block(_sub(q, row, qa, qb), _sub(k, row, ka, kb), _sub(v, row, ka, kb), scale=scale, mask=mask,
                            q_pos=range(q_pos.start + qa, q_pos.start + qb),
                            k_pos=range(k_pos.start + ka, k_pos.start + kb))
        out[row:row + 1, ..., qa:qb, :] = o
        lse[row:row + 1, ..., qa:qb] = s
    return out, lse


def document_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, out: torch.Tensor, segments: list, *, scale: float, mask: Any,
                   q_pos: range, k_pos: range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The block's ``(dq, dk, dv)`` (work dtype), one :func:`~meshplan.context_parallel.blocks.block_grads` per
    segment; None when no segment has a kept pair."""
    work = work_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    dk = torch.zeros(k.shape, dtype=work, device=q.device)
    dv = torch.zeros(v.shape, dtype=work, device=q.device)
    reached = False
    for row, qa, qb, ka, kb in segments:
        g = block_grads(_sub(q, row, qa, qb), _sub(k, row, ka, kb), _sub(v, row, ka, kb), _sub(dout, row, qa, qb),
                        lse[row:row + 1, ..., qa:qb], delta[row:row + 1, ..., qa:qb], scale=scale, mask=mask,
                        q_pos=range(q_pos.start + qa, q_pos.start + qb),
                        k_pos=range(k_pos.start + ka, k_pos.start + kb), out=_sub(out, row, qa, qb))
        if g is not None:
            reached = True
            dq[row:row + 1, ..., qa:qb, :] += g[0]
            dk[row:row + 1, ..., ka:kb, :] += g[1]
            dv[row:row + 1, ..., ka:kb, :] += g[2]
    return (dq, dk, dv) if reached else None
