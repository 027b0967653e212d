"""Which tokens of a sequence each context-parallel rank holds, and the attention work that follows. Torch-free.

Load-balanced (causal) layout: the sequence of length ``S`` is cut into ``2·cp`` chunks of ``c = S / (2·cp)``
tokens; rank ``r`` holds chunks ``r`` and ``2·cp−1−r`` (head and tail), in that order. Unbalanced: ``cp`` chunks,
rank ``r`` holds chunk ``r``. Under causal attention the query chunk ``j`` attends to the keys ``[0, (j+1)·c)``,
the last ``c`` of them through a lower-triangular mask: a rank holding chunks ``j`` and ``2·cp−1−j`` computes
``(2·cp+1)·c`` key columns per query row pair whatever ``j`` is, which is why the layout balances the work.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

from meshplan.context_parallel.masks import AttentionMask

__all__ = ["n_chunks", "rank_chunks", "rank_positions", "causal_blocks", "attention_pairs", "check_seq_len",
           "document_pairs", "document_positions", "method_pairs"]


def n_chunks(cp: int, load_balance: bool) -> int:
    """How many chunks a sequence is cut into: ``2·cp`` load-balanced, else ``cp``."""
    return 2 * cp if load_balance else cp


def rank_chunks(cp: int, rank: int, load_balance: bool) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` of ``cp`` holds, in the order it holds them.

    Example::

        >>> rank_chunks(4, 1, True), rank_chunks(4, 1, False)
        ((1, 6), (1,))
    """
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def rank_positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> list[int]:
    """The true positions (0-based) of the tokens rank ``rank`` holds, in its local order.

    Example::

        >>> rank_positions(8, 2, 0, True)
        [0, 1, 6, 7]
    """
    return list(_positions(seq_len, cp, rank, load_balance))


@functools.lru_cache(maxsize=64)  # asked per forward and per attention call: the same few lengths
def _positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> tuple[int, ...]:
    c = seq_len // n_chunks(cp, load_balance)
    return tuple(p for j in rank_chunks(cp, rank, load_balance) for p in range(j * c, (j + 1) * c))


def causal_blocks(cp: int, rank: int, load_balance: bool, chunk: int) -> list[tuple[int, int, int]]:
    """The attention blocks rank ``rank`` computes under a causal mask, keys in true order.

    Returns:
        One ``(local query offset, key length, mask offset)`` per local chunk: its ``chunk`` queries attend to
        keys ``[0, key length)``; query ``i`` of the block sees keys up to ``mask offset + i``.
    """
    return [(k * chunk, (j + 1) * chunk, j * chunk) for k, j in enumerate(rank_chunks(cp, rank, load_balance))]


def attention_pairs(seq_len: int, cp: int, rank: int, load_balance: bool) -> tuple[int, int]:
    """``(computed, unmasked)`` query-key pairs of rank ``rank`` under causal attention (per batch row and head).

    ``computed`` counts the score matrix entries the blocks of :func:`causal_blocks` evaluate, ``unmasked`` the
    ones the causal mask keeps.
    """
    c = seq_len // n_chunks(cp, load_balance)
    computed = unmasked = 0
    for _, keys, offset in causal_blocks(cp, rank, load_balance, c):
        computed += c * keys
        unmasked += c * offset + c * (c + 1) // 2
    return computed, unmasked


def document_pairs(positions: Sequence[int], lengths: Sequence[int], mask: AttentionMask = AttentionMask()) -> int:
    """The kept (query, key) pairs of the queries at ``positions`` of one row packing documents of ``lengths``
    tokens: a rank's attention work under document masks (:meth:`AttentionMask.pairs` per document).

    Example::

        >>> [document_pairs(rank_positions(8, 2, r, True), [6, 2]) for r in (0, 1)]  # head-tail of the row
        [6, 18]
        >>> [document_pairs(document_positions([4, 4], 2, r), [4, 4]) for r in (0, 1)]  # head-tail per document
        [10, 10]
    """
    starts = list(itertools.accumulate(lengths, initial=0))
    doc_of = [d for d, n in enumerate(lengths) for _ in range(n)]
    return sum(mask.pairs(q, q + 1, starts[doc_of[q]], starts[doc_of[q] + 1]) for q in positions)


def document_positions(lengths: Sequence[int], cp: int, rank: int) -> list[int] | None:
    """A layout balanced by work for documents of ``lengths`` packed in one row: every document cut into ``2·cp``
    chunks, rank ``r`` holding chunks ``r`` and ``2·cp−1−r`` of each (head-tail per document: the head-tail layout
    for one document), in document order. A pure function of the lengths, the same on every rank; None when a
    length is not a multiple of ``2·cp`` (then the row's head-tail layout, :func:`rank_positions`, is used).

    Example::

        >>> document_positions([4, 8], 2, 0)
        [0, 3, 4, 5, 10, 11]
        >>> document_positions([4, 6], 2, 0) is None
        True
    """
    if any(n % (2 * cp) for n in lengths):
        return None
    out: list[int] = []
    for start, n in zip(itertools.accumulate(lengths, initial=0), lengths):
        out += [start + p for p in rank_positions(n, cp, rank, True)]
    return out


def _kept(lo: int, hi: int, k_lo: int, k_hi: int, window: int | None) -> int:
    """Kept causal pairs of queries ``[lo, hi)`` against keys ``[k_lo, k_hi)`` under ``window`` (closed form per
    query run: a query ``q`` keeps keys ``max(k_lo, q − w + 1) .. min(k_hi − 1, q)``)."""
    w = window if window is not None else hi + 1
    return sum(max(0, min(k_hi - 1, q) - max(k_lo, q - w + 1) + 1) for q in range(lo, hi)) if hi - lo < 4096 \
        else sum(_kept(a, min(hi, a + 4095), k_lo, k_hi, window) for a in range(lo, hi, 4095))


def method_pairs(seq_len: int, cp: int, load_balance: bool, method: str, window: int | None = None) -> tuple[int, int]:
    """``(computed, kept)`` query-key pairs of the busiest cp rank per batch row and head under causal attention
    with ``window`` (None: none): what each method's attention costs at this length.

    ``ring`` computes only the (query chunk, key chunk) blocks the mask reaches, a block whole (its keep applied
    inside), the causal diagonal of a block as a triangle (the fused kernel; also under a window at least the
    chunk); ``allgather_kv`` computes each local query chunk against the whole span of gathered keys its window
    reaches (one masked SDPA call per chunk), or, without a window, exactly the ring's blocks (a mask-free prefix
    and the causal diagonal). A window therefore shrinks the ring's work to the reached blocks but leaves
    all-gather's rectangle per chunk, and leaves both methods' transfers as they are.

    Example::

        >>> method_pairs(64, 2, True, "ring"), method_pairs(64, 2, True, "allgather_kv")
        ((1040, 1040), (1040, 1040))
        >>> method_pairs(64, 2, True, "ring", window=20), method_pairs(64, 2, True, "allgather_kv", window=20)
        ((1040, 634), (1280, 634))
    """
    if method not in ("ring", "allgather_kv", "torch_ring"):
        raise ValueError(f"cp method {method!r}; valid: allgather_kv, ring, torch_ring")
    c = seq_len // n_chunks(cp, load_balance)
    mask = AttentionMask(causal=True, window=window)
    busiest = (0, 0)
    for rank in range(cp):
        computed = kept = 0
        for j in rank_chunks(cp, rank, load_balance):
            lo, hi = j * c, (j + 1) * c
            reached = [i for i in range(j + 1) if mask.reaches(lo, hi, i * c, (i + 1) * c)]
            kept += _kept(lo, hi, reached[0] * c, hi, window)
            diagonal = c * (c + 1) // 2 if window is None or window >= c else c * c
            if method != "allgather_kv" or window is None:
                computed += (len(reached) - 1) * c * c + diagonal
            else:
                computed += c * len(reached) * c
        busiest = max(busiest, (computed, kept))
    return busiest


def check_seq_len(seq_len: int, cp: int, load_balance: bool, tp_sequence: int = 1) -> str | None:
    """Why ``seq_len`` cannot be split over ``cp`` ranks (then over ``tp_sequence`` sequence-parallel ranks), or None.

    Example::

        >>> check_seq_len(100, 4, True)
        'sequence length 100 is not divisible by 2·cp = 8 (causal load balance); valid: multiples of 8, e.g. 96, 104'
    """
    chunks = n_chunks(cp, load_balance)
    step = math.lcm(chunks, cp * tp_sequence)
    if seq_len % step == 0:
        return None
    why = f"2·cp = {chunks} (causal load balance)" if load_balance else f"cp = {chunks}"
    if step != chunks:
        why = f"{step} ({why}, and each rank's {seq_len // cp if seq_len % cp == 0 else 'share'} tokens split " \
              f"over tp = {tp_sequence} by sequence parallelism)"
    return f"sequence length {seq_len} is not divisible by {why}; valid: multiples of {step}, e.g. " \
           f"{_near(seq_len, step)}"


def _near(n: int, unit: int) -> str:
    lo, hi = n // unit * unit, (n // unit + 1) * unit
    return f"{lo}, {hi}" if lo else f"{hi}"
