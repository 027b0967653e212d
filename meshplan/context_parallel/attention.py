"""Attention exact across context-parallel shards: all-gather K and V over ``cp`` (Llama 3's method).

Each rank keeps its queries and gathers every rank's keys and values (ONE all-gather of K and V stacked, per
attention call); the backward of that all-gather is a reduce-scatter of dK and dV, so gradients are exact. Under
a causal mask the gathered keys are put in true order and each local query chunk attends to the keys before its
end only (:func:`~meshplan.context_parallel.chunks.causal_blocks`): with the head-tail layout every rank computes
the same number of query-key pairs. On CPU each chunk is two blocks merged by log-sum-exp
(:mod:`~meshplan.context_parallel.blocks`): the keys before it mask-free, its own keys the causal diagonal, both
torch's CPU flash kernel, so no float mask exists (before: one per block shape, ~1.25 GiB at 32k tokens, cp 2);
on CUDA torch's lower-right causal bias needs none either.

The model's own mask is accepted when it is the local causal mask or no mask (what a causal model builds for
its local length); anything else (padding, sliding windows, a bias) is refused, as the local mask cannot say
what the global one is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshplan._torch import funcol
from meshplan.context_parallel.blocks import attend_block, block_grads, merge
from meshplan.context_parallel.chunks import causal_blocks, n_chunks, rank_chunks, rank_positions
from meshplan.context_parallel.local_mask import causal_from_mask, check_local_mask, mask_is_causal  # noqa: F401
from meshplan.context_parallel.masks import AttentionMask
from meshplan.errors import PlanError

__all__ = ["allgather_kv_attention", "mask_is_causal", "causal_from_mask", "check_local_mask", "on_local_heads",
           "block_mask"]


def on_local_heads(attention: Callable) -> Callable:
    """Wrap a cross-shard ``attention(query, key, value, …)`` so DTensor q/k/v (heads sharded by tensor
    parallelism) run on their local heads and the output is a DTensor placed as ``query``."""
    @functools.wraps(attention)
    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(query, DTensor):
            return attention(query, key, value, *args, **kwargs)
        out = attention(query.to_local(), key.to_local(), value.to_local(), *args, **kwargs)
        return DTensor.from_local(out, query.device_mesh, query.placements, run_check=False)
    return run


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group: Any, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V along the sequence dim (-2), in rank order; one collective when the shapes agree.

    K and V are stacked with the sequence dim first, so the all-gather's output is the concatenation as is (no
    copy to re-interleave it)."""
    if key.shape == value.shape:
        kv = torch.stack([key, value]).movedim(-2, 0).contiguous()  # (L, 2, ..., d)
        kv = funcol.all_gather_single_autograd(kv, 0, group)
        return kv[:, 0].movedim(0, -2), kv[:, 1].movedim(0, -2)
    k = funcol.all_gather_single_autograd(key.movedim(-2, 0).contiguous(), 0, group).movedim(0, -2)
    v = funcol.all_gather_single_autograd(value.movedim(-2, 0).contiguous(), 0, group).movedim(0, -2)
    return k, v


@functools.lru_cache(maxsize=64)  # every attention call of a step asks the same
def _true_order(cp: int, load_balance: bool, seq_len: int, device: torch.device) -> torch.Tensor:
    """Index into the rank-ordered gathered keys that puts them in true sequence order."""
    gathered = [p for r in range(cp) for p in rank_positions(seq_len, cp, r, load_balance)]
    return torch.argsort(torch.tensor(gathered, device=device))


def block_mask(chunk: int, keys: int, offset: int, dtype: torch.dtype, device: torch.device,
               masks: dict | None = None) -> Any:
    """The mask of a causal block (query ``i`` sees keys ``<= offset + i``): torch's lower-right causal bias on
    CUDA (its kernels apply it without a tensor), else an additive float mask, built once per shape in ``masks``
    (SDPA keeps a float mask of the query's dtype by reference for backward: the layers share one tensor). On CPU
    only with dropout: without it the CPU path needs no mask (:class:`_PrefixDiagonal`)."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(chunk, keys)
    key = (chunk, keys, offset, dtype, device)
    if masks is not None and key in masks:
        return masks[key]
    keep = torch.ones(chunk, keys, dtype=torch.bool, device=device).tril(offset)
    mask = torch.zeros(chunk, keys, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    if masks is not None:
        masks[key] = mask
    return mask


class _PrefixDiagonal(torch.autograd.Function):
    """A causal query chunk against the gathered keys before its end, as two blocks merged by lse: the keys before
    the chunk mask-free, its own keys the causal diagonal (torch's CPU flash kernel, ``is_causal``); no mask tensor.
    Saves what SDPA would (the chunk's q, the keys and values, out, lse), not a (chunk × keys) float mask."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> Any:
        c, causal = q.shape[-2], AttentionMask(causal=True)
        rows = range(offset, offset + c)
        out, lse = attend_block(q, k[..., offset:, :], v[..., offset:, :], scale=scale, mask=causal, q_pos=rows,
                                k_pos=rows)
        if offset:
            out, lse = merge(*attend_block(q, k[..., :offset, :], v[..., :offset, :], scale=scale, mask=causal,
                                           q_pos=rows, k_pos=range(offset)), out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offset, ctx.scale = offset, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        o, c, causal = ctx.offset, q.shape[-2], AttentionMask(causal=True)
        dout, rows, delta = dout.contiguous(), range(o, o + c), None
        kw = {"scale": ctx.scale, "mask": causal, "q_pos": rows, "out": out}
        dq, dk, dv = block_grads(q, k[..., o:, :], v[..., o:, :], dout, lse, delta, k_pos=rows, **kw)
        if o:
            pq, pk, pv = block_grads(q, k[..., :o, :], v[..., :o, :], dout, lse, delta, k_pos=range(o), **kw)
            dq, dk, dv = dq + pq, torch.cat([pk, dk], -2), torch.cat([pv, dv], -2)
        return dq, dk, dv, None, None


@on_local_heads
def allgather_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                           scale: float | None = None, enable_gqa: bool = False, *, group: Any, cp: int, rank: int,
                           load_balance: bool, where: str = "attention", masks: dict | None = None,
                           mask: AttentionMask | None = None, documents: torch.Tensor | None = None,
                           keeps: dict | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries against the whole sequence's keys and values.

    Args:
        query, key, value: this rank's shards, ``(..., heads, local_len, head_dim)`` (plain tensors or DTensors
            sharded over heads by tensor parallelism), in the layout of :mod:`~meshplan.context_parallel.chunks`.
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as ``F.scaled_dot_product_attention``.
        group: the ``cp`` process group; cp, rank: its size and this rank's index in it.
        load_balance: the head-tail layout (else contiguous).
        where: the attention module's path, for errors.
        masks: a cache of the causal block masks (the model's runtime keeps one), or None.
        mask: the layer's :class:`~meshplan.context_parallel.masks.AttentionMask` (window, soft-cap), or None:
            causal or full as the call says. The model's own (local) mask must then be what the layer builds for
            its local length: none, causal, or causal within the same window.
        documents: ``(batch, seq)`` document ids per global position (packed sequences), or None (one each).
        keeps: a cache of the keep-matrices (the runtime keeps one per forward, shared by the layers), or None.

    Returns:
        The attention output for this rank's queries (a DTensor when ``query`` is one).

    Raises:
        PlanError: a mask other than causal or none, or one that disagrees with ``mask``.
    """
    length = query.shape[-2]
    if mask is None:
        mask = AttentionMask(causal=causal_from_mask(attn_mask, is_causal, length, where))
    else:
        check_local_mask(attn_mask, is_causal, mask, length, where)
    k, v = _gather_kv(key, value, group, cp)
    kw = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": enable_gqa}
    if mask.plain and documents is None:
        return F.scaled_dot_product_attention(query, k, v, **kw)
    seq_len = length * cp
    order = _true_order(cp, load_balance, seq_len, query.device)
    k, v = k.index_select(-2, order), v.index_select(-2, order)
    if mask.window is None and mask.softcap is None and documents is None and mask.causal:
        return _causal(query, k, v, kw, cp, rank, load_balance, masks)
    return _masked(query, k, v, kw, mask, documents, (cp, rank, load_balance), keeps)


def _causal(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict, cp: int, rank: int,
            load_balance: bool, masks: dict | None) -> torch.Tensor:
    """Plain causal attention: each local query chunk against the keys before its end (keys in true order)."""
    chunk = query.shape[-2] // len(causal_blocks(cp, rank, load_balance, 1))
    outs = []
    for start, keys, offset in causal_blocks(cp, rank, load_balance, chunk):
        q = query[..., start:start + chunk, :]
        # no float mask per block shape (issue 30); MLA's V head size differs and the flash kernel takes one size
        if query.device.type == "cpu" and not kw["dropout_p"] and v.shape[-1] == query.shape[-1]:
            s = kw["scale"] if kw["scale"] is not None else query.shape[-1] ** -0.5
            outs.append(_PrefixDiagonal.apply(q, k[..., :keys, :], v[..., :keys, :], offset, s))
            continue
        mask = block_mask(chunk, keys, offset, query.dtype, query.device, masks)
        outs.append(F.scaled_dot_product_attention(q, k[..., :keys, :], v[..., :keys, :], attn_mask=mask, **kw))
    return torch.cat(outs, dim=-2)


def _masked(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict, mask: AttentionMask,
            documents: torch.Tensor | None, where: tuple[int, int, bool], keeps: dict | None) -> torch.Tensor:
    """Any :class:`AttentionMask` (window, soft-cap) and documents: each local query chunk against the key chunks
    its mask reaches (:meth:`AttentionMask.reaches`), through the boolean keep-matrix of
    :meth:`AttentionMask.keep` (documents ``(batch, seq)`` give one per row); ``where``: (cp, rank, load_balance)."""
    cp, rank, load_balance = where
    held = rank_chunks(cp, rank, load_balance)
    chunk = query.shape[-2] // len(held)
    every = range(n_chunks(cp, load_balance))
    outs = []
    for i, j in enumerate(held):
        q_lo, q_hi = j * chunk, (j + 1) * chunk
        reached = [c for c in every if mask.reaches(q_lo, q_hi, c * chunk, (c + 1) * chunk)]
        k_lo, k_hi = reached[0] * chunk, (reached[-1] + 1) * chunk
        keep = keep_matrix(mask, (q_lo, q_hi, k_lo, k_hi), documents, query, keeps)
        q = query[..., i * chunk:(i + 1) * chunk, :]
        outs.append(_attend(q, k[..., k_lo:k_hi, :], v[..., k_lo:k_hi, :], keep, mask.softcap, kw))
    return torch.cat(outs, dim=-2)


def keep_matrix(mask: AttentionMask, span: tuple[int, int, int, int], documents: torch.Tensor | None,
                query: torch.Tensor, keeps: dict | None = None) -> torch.Tensor | None:
    """The keep-matrix of queries ``span[0]:span[1]`` against keys ``span[2]:span[3]`` (global positions), built
    once per (mask, span, documents, dtype) in ``keeps``: boolean ``(queries, keys)`` or ``(batch, 1, queries,
    keys)`` with documents; off CUDA without a soft-cap the additive float mask SDPA would make of it (its math
    kernel keeps a float copy per call for backward: cached, the layers share one). The documents tensor is held
    in the entry, so a key with its ``id`` never names another batch's."""
    key = (mask, span, id(documents), query.dtype, query.device)
    if keeps is not None and key in keeps:
        return keeps[key][1]
    q_lo, q_hi, k_lo, k_hi = span
    q_pos, k_pos = (torch.arange(lo, hi, device=query.device) for lo, hi in ((q_lo, q_hi), (k_lo, k_hi)))
    q_doc = k_doc = None
    if documents is not None:
        docs = documents.to(query.device)
        q_doc, k_doc = docs[:, q_lo:q_hi], docs[:, k_lo:k_hi]
    keep = mask.keep(q_pos, k_pos, q_doc, k_doc)
    if keep is not None and keep.dim() == 3:
        keep = keep[:, None]  # (batch, 1, queries, keys): one per row, every head
    if keep is not None and mask.softcap is None and query.device.type != "cuda":
        keep = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill_(~keep, float("-inf"))
    if keeps is not None:
        keeps[key] = (documents, keep)
    return keep


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, softcap: float | None,
            kw: dict) -> torch.Tensor:
    """SDPA with a boolean keep-matrix; with a soft-cap, the same in explicit math (SDPA cannot cap logits)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, **kw)
    if kw["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = kw["scale"] if kw["scale"] is not None else q.shape[-1] ** -0.5
    scores = softcap * torch.tanh((q @ k.transpose(-2, -1)) * scale / softcap)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = (scores - scores.logsumexp(-1, keepdim=True)).exp()  # a softmax the first forward's audit ignores
    if kw["dropout_p"]:
        probs = F.dropout(probs, kw["dropout_p"])
    return probs @ v
