"""Packed documents laid out across cp ranks by work: the document-major order of a row.

With documents packed in a row (position ids restarting per document), the row's head-tail layout
(:func:`~meshplan.context_parallel.chunks.rank_positions`) balances tokens, not work: a rank holding the row's
head gets the short documents' few kept pairs. Cutting EVERY document into ``n = 2·cp`` chunks of ``c_d = L_d / n``
tokens and giving rank ``r`` chunks ``r`` and ``n−1−r`` of each gives every rank the same kept pairs per document
(:func:`~meshplan.context_parallel.chunks.document_positions`).

This module writes that layout as a permutation of the row, its *document-major order*: virtual chunk ``j`` is
chunk ``j`` of every document, in document order::

    order = [start_d + j·c_d + t  for j in range(n)  for d in documents  for t in range(c_d)]

The head-tail layout of the permuted row is then exactly the per-document layout, so the kernels run unchanged
on *virtual* positions (the index in ``order``) with document ids per virtual position: inside one document the
virtual order keeps the true order, so "causal on virtual positions and the same document" keeps exactly the
pairs "causal on true positions and the same document" keeps. A sliding window measures true distances, which the
virtual order stretches: windows keep the row's layout (:func:`document_index` is not asked for them). Each token's
true position id travels with it (the batch's ``position_ids`` are permuted like the tokens), so rotary embeddings
see true positions; labels move with their tokens, and the loss is a sum over tokens, so it is unchanged.
"""

from __future__ import annotations

import torch

from meshplan.context_parallel.chunks import rank_positions

__all__ = ["documents_of", "document_order", "document_index", "virtual_documents"]


def documents_of(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids ``(batch, seq)`` of packed sequences from their position ids, or None (one document per row).

    A document starts where the position id is not the previous one + 1 (transformers' padding-free convention,
    ``masking_utils.find_packed_sequence_indices``, which sdpa and eager attention follow without cp).

    Example::

        >>> documents_of(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
        [[0, 0, 0, 1, 1, 2]]
    """
    first = position_ids[..., :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((docs[..., -1] == 0).all()) else docs


def document_order(lengths: list[int], cp: int) -> list[int] | None:
    """The document-major order of a row of documents of ``lengths`` tokens (true positions in virtual order), or
    None when a length is not a multiple of ``2·cp``.

    Example::

        >>> document_order([4, 8], 2)
        [0, 4, 5, 1, 6, 7, 2, 8, 9, 3, 10, 11]
    """
    n = 2 * cp
    if any(length % n for length in lengths):
        return None
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    return [s + j * (length // n) + t for j in range(n) for s, length in zip(starts, lengths)
            for t in range(length // n)]


def _lengths(docs: torch.Tensor) -> list[int]:
    return torch.unique_consecutive(docs, return_counts=True)[1].tolist()


def document_index(position_ids: torch.Tensor, cp: int, rank: int) -> torch.Tensor | None:
    """The true positions ``(rows, seq / cp)`` rank ``rank`` holds of each row under the document-major layout,
    or None where the row's layout is kept: no row packs two documents, or some document's length is not a
    multiple of ``2·cp`` (then the whole batch keeps the row layout, so every row is laid out alike).

    Args:
        position_ids: ``(rows, seq)`` ids restarting per document (transformers' padding-free packing).

    Example::

        >>> document_index(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]), 2, 0).tolist()
        [[0, 4, 5, 3, 10, 11]]
    """
    docs = documents_of(position_ids)
    if docs is None:
        return None
    orders = [document_order(_lengths(row), cp) for row in docs]
    if any(o is None for o in orders):
        return None
    held = torch.tensor(rank_positions(position_ids.shape[-1], cp, rank, True))
    return torch.tensor(orders).index_select(-1, held)


def virtual_documents(ids: torch.Tensor, cp: int) -> torch.Tensor | None:
    """Document ids per virtual position ``(rows, seq)`` of rows in document-major order, from their position ids
    in virtual order (gathered from every rank): virtual chunk 0 holds chunk 0 of every document, whose ids
    restart at 0; every virtual chunk holds the same documents in the same order. None for one document per row.

    Raises:
        ValueError: ``ids`` is not the document-major order of any packing (a batch not laid out by
            :func:`document_index`, e.g. the model called directly after a step that was).
    """
    n = 2 * cp
    rows, seq = ids.shape
    first = ids[:, :seq // n]
    docs0 = documents_of(first)
    docs0 = docs0 if docs0 is not None else torch.zeros_like(first)
    chunk = torch.zeros_like(first)
    for r in range(rows):
        counts = torch.unique_consecutive(docs0[r], return_counts=True)[1]
        chunk[r] = torch.repeat_interleave(counts, counts)
    expect = torch.cat([first + j * chunk for j in range(n)], -1)
    if not torch.equal(expect, ids):
        raise ValueError("the position ids are not in document-major order (each virtual chunk j holding chunk j "
                         "of every document)")
    docs = docs0.repeat(1, n)
    return None if bool((docs == 0).all()) else docs
