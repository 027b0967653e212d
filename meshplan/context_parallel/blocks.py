"""Attention of a query block against one key/value block, with its log-sum-exp, and the merge of two such blocks.

The kernel both context-parallel methods share: explicit math (``scores · scale → softcap · tanh(· / softcap) →
masked softmax``; SDPA cannot cap), any device, any dtype (half precision computed in float32), GQA (``k``/``v``
with fewer heads than ``q``: query head ``h`` reads kv head ``h // (heads / kv_heads)``, as
``repeat_interleave``). The mask is one :class:`~meshplan.context_parallel.masks.AttentionMask` value on global
positions: a block it does not reach is skipped, a block it covers gets no mask tensor, and the rest get a boolean
keep-matrix per query tile. Queries are tiled so a score tile holds at most :data:`TILE_SCORES` elements.

A query that keeps no key of the block gets ``out = 0`` and ``lse = -inf`` (no NaN), and contributes nothing to a
:func:`merge`. :func:`attend_block` is differentiable by autograd (the all-gather method uses it so);
:func:`block_grads` is the same block's backward from a saved ``lse`` (the ring's backward recomputes the
probabilities from it instead of saving them).
"""

from __future__ import annotations

from typing import Any

import torch

from meshplan._torch import CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD
from meshplan.context_parallel.masks import AttentionMask

__all__ = ["attend_block", "merge", "block_grads", "work_dtype", "fused_causal", "TILE_SCORES"]

#: most score elements one query tile holds (per tile: batch · heads · rows · keys)
TILE_SCORES = 1 << 22


def _bounds(pos: Any) -> tuple[int, int]:
    """``[lo, hi)`` enclosing the positions (a ``range``: free; a tensor: its min and max)."""
    if isinstance(pos, range):
        return (pos.start, pos.stop) if len(pos) else (0, 0)
    if pos.numel() == 0:
        return 0, 0
    return int(pos.min()), int(pos.max()) + 1


def _tensor(pos: Any, device: torch.device) -> torch.Tensor:
    if isinstance(pos, range):
        return torch.arange(pos.start, pos.stop, device=device)
    return pos.to(device)


def _keep(mask: AttentionMask, q_pos: Any, k_pos: Any, q_doc: Any, k_doc: Any,
          device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """``(reached, keep)``: whether any pair is kept, and the keep-matrix (None: every pair kept)."""
    q_lo, q_hi = _bounds(q_pos)
    k_lo, k_hi = _bounds(k_pos)
    if not mask.reaches(q_lo, q_hi, k_lo, k_hi):
        return False, None
    if mask.covers(q_lo, q_hi, k_lo, k_hi) and q_doc is None:
        return True, None
    keep = mask.keep(_tensor(q_pos, device), _tensor(k_pos, device), q_doc, k_doc)
    if keep is not None and keep.dim() == 3:  # documents per batch row: (n, 1, 1, rows, keys), every head
        keep = keep[:, None, None]
    return True, keep


def fused_causal(q: torch.Tensor, mask: AttentionMask | None, q_pos: Any, k_pos: Any,
                 q_doc: Any = None, v: Any = None) -> bool | None:
    """Whether torch's CPU flash kernel computes this block exactly: None when it cannot (not CPU, a soft-cap,
    documents, a mask tensor needed), else its ``is_causal`` (True: the causal diagonal, queries and keys the
    same positions; False: a block the mask covers). The kernel returns the lse, and its backward takes the whole
    row's output and lse, so the fused block is the explicit math's equal, without a score tile in Python."""
    if q.device.type != "cpu" or q_doc is not None or not isinstance(q_pos, range) or not isinstance(k_pos, range):
        return None
    if v is not None and v.shape[-1] != q.shape[-1]:  # MLA: the flash kernel takes one head size for q, k and v
        return None
    mask = mask if mask is not None else AttentionMask(causal=False)
    if mask.softcap is not None:
        return None
    if mask.covers(q_pos.start, q_pos.stop, k_pos.start, k_pos.stop):
        return False
    if mask.causal and (mask.window is None or mask.window >= len(q_pos)) and q_pos == k_pos:
        return True  # a window at least the block's length hides nothing of its causal diagonal
    return None


def _repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = q.shape[-3] // k.shape[-3]
    return (k, v) if g == 1 else (k.repeat_interleave(g, -3), v.repeat_interleave(g, -3))


def _fused_forward(q, k, v, scale, causal):
    k, v = _repeat(q, k, v)
    out, lse = CPU_FLASH_ATTENTION(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(work_dtype(q.dtype))


def _fused_backward(q, k, v, dout, out, lse, scale, causal):
    kr, vr = _repeat(q, k, v)
    dq, dk, dv = CPU_FLASH_ATTENTION_BACKWARD(dout, q, kr, vr, out, lse.to(work_dtype(q.dtype)), 0.0, causal,
                                              scale=scale)
    g = q.shape[-3] // k.shape[-3]
    if g > 1:
        dk, dv = (t.unflatten(-3, (k.shape[-3], g)).sum(-3) for t in (dk, dv))
    return dq, dk, dv


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(n, heads, L, d)`` → ``(n, kv_heads, heads / kv_heads, L, d)``."""
    n, h, length, d = q.shape
    if h % kv_heads:
        raise ValueError(f"attention: {h} query heads are not a multiple of {kv_heads} kv heads")
    return q.view(n, kv_heads, h // kv_heads, length, d)


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, mask: AttentionMask,
            keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capped, masked scores ``(n, kv, g, rows, keys)`` and the tanh of the cap (None without one)."""
    s = torch.einsum("nhgqd,nhkd->nhgqk", q5, k) * scale
    cap = None
    if mask.softcap is not None:
        cap = torch.tanh(s / mask.softcap)
        s = cap * mask.softcap
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s, cap


def _tiles(n: int, heads: int, rows: int, keys: int) -> int:
    return max(1, min(rows, TILE_SCORES // max(1, n * heads * keys)))


def _rows(pos: Any, a: int, b: int) -> Any:
    return pos[a:b]


def _flat(q: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """``(..., heads, L, d)`` → ``(n, heads, L, d)`` and the leading shape."""
    lead = q.shape[:-3]
    return q.reshape(-1, *q.shape[-3:]), lead


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: AttentionMask | None,
                 q_pos: Any, k_pos: Any, q_doc: torch.Tensor | None = None,
                 k_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries ``q`` against the block ``k``, ``v``, with each query row's log-sum-exp.

    Args:
        q: ``(..., heads, Lq, d)``; k, v: ``(..., kv_heads, Lk, d)`` (``heads`` a multiple of ``kv_heads``).
        scale: the score scale (SDPA's default is ``d ** -0.5``).
        mask: the :class:`~meshplan.context_parallel.masks.AttentionMask` (None: every pair kept, no cap).
        q_pos, k_pos: the rows' and keys' global positions (a ``range`` or a 1-D integer tensor).
        q_doc, k_doc: their document ids, 1-D (every batch row) or ``(n, Lq)`` / ``(n, Lk)`` (one per row of the
            flattened leading dims, e.g. per batch row for SDPA's ``(batch, heads, L, d)``), or None (one document).

    Returns:
        ``(out, lse)``: ``out`` ``(..., heads, Lq, d)`` in ``q``'s dtype and ``lse`` ``(..., heads, Lq)`` (float32
        for half-precision inputs); ``lse = -inf`` and ``out = 0`` for a row that keeps no key (a query tile the
        mask does not reach is not computed: a caller that skips whole blocks asks ``mask.reaches`` first).

    Example::

        >>> out, lse = attend_block(q, k, v, scale=0.125, mask=AttentionMask(causal=True),
        ...                         q_pos=range(64, 128), k_pos=range(0, 64))     # covered: no mask tensor
    """
    causal = fused_causal(q, mask, q_pos, k_pos, q_doc, v)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if causal is not None and not grad:
        return _fused_forward(q, k, v, scale, causal)  # no gradient through its lse is asked for
    mask = mask if mask is not None else AttentionMask(causal=False)
    qf, lead = _flat(q)
    kf, vf = _flat(k)[0], _flat(v)[0]
    n, h, rows, _ = qf.shape
    work = work_dtype(q.dtype)
    kf, vf = kf.to(work), vf.to(work)
    tile = _tiles(n, h, rows, kf.shape[-2])
    outs, lses = [], []
    for a in range(0, rows, tile):
        b = min(rows, a + tile)
        qd = None if q_doc is None else q_doc[..., a:b]
        reached, keep = _keep(mask, _rows(q_pos, a, b), k_pos, qd, k_doc, q.device)
        if not reached:
            outs.append(qf.new_zeros(n, h, b - a, vf.shape[-1], dtype=work))
            lses.append(qf.new_full((n, h, b - a), float("-inf"), dtype=work))
            continue
        q5 = _grouped(qf[:, :, a:b].to(work), kf.shape[1])
        s, _ = _scores(q5, kf, scale, mask, keep)
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        safe = torch.where(total > 0, total, torch.ones_like(total))
        out = torch.einsum("nhgqk,nhkd->nhgqd", p, vf) / safe
        lse = torch.where(total > 0, m + torch.log(safe), torch.full_like(m, float("-inf")))
        outs.append(out.reshape(n, h, b - a, -1))
        lses.append(lse.reshape(n, h, b - a))
    out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
    return out.to(q.dtype).reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two key blocks from each one's ``(out, lse)`` (the online softmax).

    ``lse = log(exp(lse_a) + exp(lse_b))``; ``out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)``. A row
    with ``lse = -inf`` on both sides stays ``(0, -inf)``; on one side, the other side is returned for it.

    Example::

        >>> out, lse = merge(*attend_block(q, k1, v1, **kw), *attend_block(q, k2, v2, **kw))
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa, wb = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    out = (out_a.to(wa.dtype) * wa + out_b.to(wb.dtype) * wb).to(out_a.dtype)
    return out, lse


def block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, *, scale: float, mask: AttentionMask | None, q_pos: Any, k_pos: Any,
                q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One block's share of ``(dq, dk, dv)``, its probabilities recomputed from the whole row's ``lse``.

    Args:
        q, k, v, scale, mask, q_pos, k_pos, q_doc, k_doc: as :func:`attend_block`.
        dout: the gradient of the whole attention output of ``q``'s rows ``(..., heads, Lq, d)``.
        lse: the rows' log-sum-exp over ALL key blocks ``(..., heads, Lq)``.
        delta: ``(dout · out).sum(-1)`` of the whole output ``(..., heads, Lq)``.
        out: the whole output of the rows, or None; given, a block :func:`fused_causal` accepts runs torch's
            CPU flash backward.

    Returns:
        ``(dq, dk, dv)`` of this block in the work dtype (float32 for half inputs; dk, dv summed over the query
        heads that share a kv head), or None when the mask reaches no pair of the block.
    """
    causal = fused_causal(q, mask, q_pos, k_pos, q_doc, v)
    if causal is not None and out is not None:
        return _fused_backward(q, k, v, dout, out, lse, scale, causal)
    mask = mask if mask is not None else AttentionMask(causal=False)
    work = work_dtype(q.dtype)
    qf, _ = _flat(q)
    kf, vf = _flat(k)[0].to(work), _flat(v)[0].to(work)
    dof, lsef, deltaf = _flat(dout)[0], lse.reshape(qf.shape[:-1]), delta.reshape(qf.shape[:-1])
    n, h, rows, _ = qf.shape
    kvh = kf.shape[1]
    dq = torch.zeros(qf.shape, dtype=work, device=q.device)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    tile, any_reached = _tiles(n, h, rows, kf.shape[-2]), False
    for a in range(0, rows, tile):
        b = min(rows, a + tile)
        qd = None if q_doc is None else q_doc[..., a:b]
        reached, keep = _keep(mask, _rows(q_pos, a, b), k_pos, qd, k_doc, q.device)
        if not reached:
            continue
        any_reached = True
        q5, do5 = _grouped(qf[:, :, a:b].to(work), kvh), _grouped(dof[:, :, a:b].to(work), kvh)
        s, cap = _scores(q5, kf, scale, mask, keep)
        row = lsef[:, :, a:b].to(work).view(n, kvh, h // kvh, b - a, 1)
        p = torch.exp(s - torch.where(torch.isfinite(row), row, torch.zeros_like(row)))
        dv += torch.einsum("nhgqk,nhgqd->nhkd", p, do5)
        ds = p * (torch.einsum("nhgqd,nhkd->nhgqk", do5, vf)
                  - deltaf[:, :, a:b].to(work).view(n, kvh, h // kvh, b - a, 1))
        if cap is not None:
            ds = ds * (1 - cap * cap)
        dq[:, :, a:b] = torch.einsum("nhgqk,nhkd->nhgqd", ds, kf).reshape(n, h, b - a, -1) * scale
        dk += torch.einsum("nhgqk,nhgqd->nhkd", ds, q5) * scale
    if not any_reached:
        return None
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
