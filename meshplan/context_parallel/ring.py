"""meshplan's ring (pass-K/V) attention, the plan's ``method: ring``: exact attention across ``cp`` shards on any
device and backend (gloo included), keeping O(S/cp) per rank.

Forward: each rank holds its queries and its K/V block; for ``cp`` steps it attends its queries to the block it
holds (:func:`~meshplan.context_parallel.blocks.attend_block`, per pair of held chunks, skipping the pairs the
:class:`~meshplan.context_parallel.masks.AttentionMask` does not reach) while the block moves on to the next rank
(point-to-point ``isend``/``irecv``, posted before the block's math so they overlap it), and merges the partial
results by log-sum-exp. Saved for backward: the local ``q, k, v, out, lse`` only.

Backward: K/V go round again; each rank recomputes a block's probabilities from the saved ``lse``
(:func:`~meshplan.context_parallel.blocks.block_grads`), adds to its own dQ, and adds its share to the block's dK/dV,
which travel with the block (one hop behind it, overlapping the next block's math) and arrive home after ``cp``
hops. Per attention call: ``cp − 1`` K/V hops forward; ``cp − 1`` K/V hops and ``cp`` dK/dV hops backward; each
hop ``1/cp`` of the sequence's K/V.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshplan.context_parallel.attention import causal_from_mask, check_local_mask, on_local_heads
from meshplan.context_parallel.blocks import attend_block, block_grads, merge, work_dtype
from meshplan.context_parallel.chunks import rank_chunks
from meshplan.context_parallel.doc_blocks import attend_documents, document_grads, document_segments
from meshplan.context_parallel.masks import AttentionMask
from meshplan.errors import PlanError

__all__ = ["ring_attention", "RingLinks", "QueueLinks", "ring_forward", "ring_backward"]

_K, _V, _DK, _DV = 0, 1, 2, 3  # point-to-point tags: at most one message of each kind in flight per direction


class RingLinks:
    """The ``cp`` group's point-to-point links: send to the next rank, receive from the previous one."""

    def __init__(self, group: Any, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def post(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], tags: list[int]) -> list[Any]:
        """Start sending ``sends`` to the next rank and receiving ``recvs`` from the previous; the works."""
        ops = [op for s, r, t in zip(sends, recvs, tags)
               for op in (dist.P2POp(dist.isend, s, self.next, self.group, t),
                          dist.P2POp(dist.irecv, r, self.prev, self.group, t))]
        return dist.batch_isend_irecv(ops)


class QueueLinks:
    """In-process links for ``cp`` ranks run as threads (tests): ``queues[(src, dst, tag)]`` carry copies."""

    def __init__(self, queues: dict, cp: int, rank: int) -> None:
        self.queues, self.cp, self.rank = queues, cp, rank

    def post(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], tags: list[int]) -> list[Any]:
        nxt, prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        for s, t in zip(sends, tags):
            self.queues.setdefault((self.rank, nxt, t), queue.Queue()).put(s.clone())
        return [_QueueWork(self.queues.setdefault((prev, self.rank, t), queue.Queue()), r)
                for r, t in zip(recvs, tags)]


@dataclass
class _QueueWork:
    q: Any
    into: torch.Tensor

    def wait(self) -> None:
        self.into.copy_(self.q.get(timeout=60))


@dataclass(frozen=True)
class Ring:
    """One ring attention call's constants: the links, the layout, the mask and the documents.

    ``documents``: ``(batch, seq)`` document ids per global position (packed sequences; ids non-decreasing along
    a row), or None. ``blocks`` caches, per (query chunk, key chunk), what :meth:`documents_of` found, so the
    backward reuses the forward's answers."""

    links: Any
    load_balance: bool
    mask: AttentionMask
    scale: float
    documents: Any = None
    blocks: dict = field(default_factory=dict, compare=False, repr=False)

    def pieces(self, source: int, chunk: int) -> list[tuple[int, range]]:
        """``(local offset, global positions)`` of each chunk rank ``source`` holds."""
        return [(i * chunk, range(j * chunk, (j + 1) * chunk))
                for i, j in enumerate(rank_chunks(self.links.cp, source, self.load_balance))]

    def pairs(self, source: int, chunk: int) -> list[tuple[int, range, int, range]]:
        """The (query chunk, key chunk) pairs of this rank against ``source``'s block the mask reaches."""
        return [(qo, qr, ko, kr) for qo, qr in self.pieces(self.links.rank, chunk)
                for ko, kr in self.pieces(source, chunk)
                if self.mask.reaches(qr.start, qr.stop, kr.start, kr.stop) and self.documents_of(qr, kr)[0]]

    def documents_of(self, qr: range, kr: range) -> tuple[bool, Any, Any]:
        """``(kept, q_doc, k_doc)`` of a block: ``kept`` False when no row has a document on both sides (the
        block is skipped: no math, and nothing to add to dK/dV); ``q_doc``/``k_doc`` ``(batch, len)`` or None when
        there are no documents or in every row one document holds all the block's queries and keys (then the
        block takes the mask-free path: the causal diagonal or a covered block in torch's fused kernel).

        Documents are contiguous runs of non-decreasing ids, so a row shares a document between the chunks iff
        their id ranges overlap; under a causal mask a key chunk before the queries then holds a kept pair."""
        if self.documents is None:
            return True, None, None
        key = (qr.start, kr.start)
        if key not in self.blocks:
            qd, kd = self.documents[:, qr.start:qr.stop], self.documents[:, kr.start:kr.stop]
            shared = (qd[:, :1] <= kd[:, -1:]) & (kd[:, :1] <= qd[:, -1:])
            one = (qd[:, :1] == qd[:, -1:]) & (kd[:, :1] == kd[:, -1:]) & (qd[:, :1] == kd[:, :1])
            self.blocks[key] = (False, None, None) if not bool(shared.any()) else \
                (True, None, None) if bool(one.all()) else (True, qd, kd)
        return self.blocks[key]

    def segments(self, qr: range, kr: range, q: torch.Tensor) -> list | None:
        """The block's documents one by one (:func:`~meshplan.context_parallel.doc_blocks.document_segments`), or
        None: the block takes one call (no documents, one per row, or ``q`` not ``(rows, heads, L, d)``)."""
        _, qd, kd = self.documents_of(qr, kr)
        if qd is None or q.dim() != 4 or q.shape[0] != qd.shape[0]:
            return None
        key = ("segments", qr.start, kr.start)
        if key not in self.blocks:
            self.blocks[key] = document_segments(qd, kd)
        return self.blocks[key]


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse)`` over the whole sequence, K/V passed around the ring (see the module doc)."""
    cp, rank = ring.links.cp, ring.links.rank
    chunk = q.shape[-2] // len(rank_chunks(cp, rank, ring.load_balance))
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    kv = (k.contiguous(), v.contiguous())
    for step in range(cp):
        source, works = (rank - step) % cp, []
        if step < cp - 1:
            nxt = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            works = ring.links.post(list(kv), list(nxt), [_K, _V])
        for qo, qr, ko, kr in ring.pairs(source, chunk):
            _, q_doc, k_doc = ring.documents_of(qr, kr)
            block = q[..., qo:qo + chunk, :], kv[0][..., ko:ko + chunk, :], kv[1][..., ko:ko + chunk, :]
            segments = ring.segments(qr, kr, q)
            part = attend_block(*block, scale=ring.scale, mask=ring.mask, q_pos=qr, k_pos=kr, q_doc=q_doc,
                                k_doc=k_doc) if segments is None else \
                attend_documents(*block, segments, scale=ring.scale, mask=ring.mask, q_pos=qr, k_pos=kr)
            acc[qo] = part if qo not in acc else merge(*acc[qo], *part)
        _wait(works)
        if step < cp - 1:
            kv = nxt
    outs, lses = [], []
    for qo, _ in ring.pieces(rank, chunk):
        if qo not in acc:  # no key of the sequence reaches these queries
            shape = (*q.shape[:-1], v.shape[-1])
            acc[qo] = (q.new_zeros(shape), torch.full(q.shape[:-1], float("-inf"), device=q.device,
                                                      dtype=work_dtype(q.dtype)))
        outs.append(acc[qo][0])
        lses.append(acc[qo][1])
    out = torch.cat(outs, -2)
    if out.dim() >= 3:  # SDPA's layout (heads inside the sequence): the model's transpose + reshape is then a view,
        out = out.transpose(-3, -2).contiguous().transpose(-3, -2)  # not a second copy saved for o_proj
    return out, torch.cat(lses, -1)


def ring_backward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's shards: K/V round the ring again, dK/dV travelling with their block."""
    cp, rank = ring.links.cp, ring.links.rank
    chunk = q.shape[-2] // len(rank_chunks(cp, rank, ring.load_balance))
    work = lse.dtype
    delta = (dout.to(work) * out.to(work)).sum(-1)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    kv, incoming = (k.contiguous(), v.contiguous()), None
    for step in range(cp):
        source, works = (rank - step) % cp, []
        if step < cp - 1:
            nxt = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            works = ring.links.post(list(kv), list(nxt), [_K, _V])
        dk = torch.zeros(kv[0].shape, dtype=work, device=q.device)
        dv = torch.zeros(kv[1].shape, dtype=work, device=q.device)
        for qo, qr, ko, kr in ring.pairs(source, chunk):
            _, q_doc, k_doc = ring.documents_of(qr, kr)
            block = q[..., qo:qo + chunk, :], kv[0][..., ko:ko + chunk, :], kv[1][..., ko:ko + chunk, :]
            rows = dout[..., qo:qo + chunk, :], lse[..., qo:qo + chunk], delta[..., qo:qo + chunk]
            segments = ring.segments(qr, kr, q)
            g = block_grads(*block, *rows, scale=ring.scale, mask=ring.mask, q_pos=qr, k_pos=kr, q_doc=q_doc,
                            k_doc=k_doc, out=out[..., qo:qo + chunk, :]) if segments is None else \
                document_grads(*block, *rows, out[..., qo:qo + chunk, :], segments, scale=ring.scale, mask=ring.mask,
                               q_pos=qr, k_pos=kr)
            if g is not None:
                dq[..., qo:qo + chunk, :] += g[0]
                dk[..., ko:ko + chunk, :] += g[1]
                dv[..., ko:ko + chunk, :] += g[2]
        if incoming is not None:  # the block's dK/dV from the ranks it visited before
            _wait(incoming[0])
            dk, dv = dk + incoming[1][0], dv + incoming[1][1]
        recv = (torch.empty_like(dk), torch.empty_like(dv))
        incoming = (ring.links.post([dk, dv], list(recv), [_DK, _DV]), recv)
        _wait(works)
        if step < cp - 1:
            kv = nxt
    _wait(incoming[0])
    dk, dv = incoming[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd's view of the ring: saves the local ``q, k, v, out, lse`` (O(S/cp)), nothing gathered."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        out, lse = ring_forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        return (*ring_backward(ctx.ring, q, k, v, out, lse, dout.contiguous()), None)


def ring_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """The ring's attention output of this rank's shards, differentiable (:class:`_RingAttention`)."""
    return _RingAttention.apply(q, k, v, ring)


@on_local_heads
def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, *, group: Any, cp: int, rank: int,
                   load_balance: bool, where: str = "attention", mask: AttentionMask | None = None,
                   documents: torch.Tensor | None = None, keeps: dict | None = None,
                   links: Any = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's shards, exact over the sequence, by meshplan's ring.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, group, cp, rank, load_balance,
            where: as :func:`~meshplan.context_parallel.attention.allgather_kv_attention` (GQA is read from the
            head counts whatever ``enable_gqa`` says).
        mask: the layer's :class:`~meshplan.context_parallel.masks.AttentionMask` (window, soft-cap), or None:
            causal or full as the call says. Given, the model's own (local) mask must be what the layer builds
            for its local length (none, causal, or causal within the same window).
        documents: ``(batch, seq)`` document ids per global position (packed sequences), or None.
        keeps: the runtime's keep-matrix cache, which the ring does not need (each block's keep is built per
            query tile when its math runs, forward and backward, and never kept); accepted so both methods take
            the runtime's arguments.
        links: the point-to-point links (None: :class:`RingLinks` over ``group``; tests pass :class:`QueueLinks`).

    Returns:
        The output for this rank's queries (a DTensor when ``query`` is one).

    Raises:
        PlanError: a mask other than causal or none (or one that disagrees with ``mask``), or dropout.
    """
    del keeps
    if dropout_p:
        raise PlanError(f"context_parallel: {where} asks scaled_dot_product_attention for dropout_p={dropout_p}; "
                        f"method: ring computes attention without dropout (set the model's attention dropout to 0)")
    if mask is None:
        mask = AttentionMask(causal=causal_from_mask(attn_mask, is_causal, query.shape[-2], where))
    else:
        check_local_mask(attn_mask, is_causal, mask, query.shape[-2], where)
    ring = Ring(links=links if links is not None else RingLinks(group, cp, rank), load_balance=load_balance,
                mask=mask, scale=scale if scale is not None else query.shape[-1] ** -0.5, documents=documents)
    return ring_attend(query, key, value, ring)
