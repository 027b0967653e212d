"""What a query may see, in global positions: causal, sliding window, documents, and the logit soft-cap. Torch-free.

One value, :class:`AttentionMask`, says which (query, key) pairs attention keeps; both context-parallel methods
(all-gather and ring) and the plan's checks read it, so a mask means the same thing everywhere. Positions are the
tokens' true (global) positions in the packed sequence; documents are given per position at run time (the batch
carries them), so they are not part of the value.

The pair (query ``q``, key ``k``) is kept when all of these hold:

- ``causal``: ``k <= q``;
- ``window`` ``w`` (transformers' ``sliding_window``): ``k > q - w``, i.e. a query sees itself and the ``w - 1``
  keys before it;
- documents: ``doc[q] == doc[k]``.

``softcap`` is not a mask: it caps the logits, ``s -> softcap * tanh(s / softcap)`` (Gemma 2, Grok), before the
masked softmax. It travels with the mask because every attention kernel that honours one must honour the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AttentionMask"]


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs an attention keeps, by global position (documents aside).

    Args:
        causal: keys after the query are hidden.
        window: the sliding window (a query sees itself and the ``window - 1`` keys before it), or None.
        softcap: the logit soft-cap, or None.

    Raises:
        ValueError: a window below 1 or a soft-cap that is not positive.

    Example::

        >>> m = AttentionMask(causal=True, window=4)
        >>> m.reaches(8, 12, 0, 4), m.reaches(8, 12, 4, 8), m.covers(8, 12, 0, 4)
        (False, True, False)
    """

    causal: bool = True
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1; got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be > 0; got {self.softcap}")

    @property
    def plain(self) -> bool:
        """True: a full (non-causal, no window) attention with no soft-cap: nothing to mask or cap."""
        return not self.causal and self.window is None and self.softcap is None

    def _lo_hi(self, q: int) -> tuple[float, float]:
        """The kept key positions of query ``q``: ``lo <= k <= hi`` (floats: unbounded sides are infinite)."""
        hi = float(q) if self.causal else float("inf")
        lo = float(q - self.window + 1) if self.window is not None else float("-inf")
        return lo, hi

    def reaches(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether some query in ``[q_lo, q_hi)`` keeps some key in ``[k_lo, k_hi)`` (documents ignored).

        A block that this says False for can be skipped: no K/V of it is needed by those queries.
        """
        if q_lo >= q_hi or k_lo >= k_hi:
            return False
        if self.causal and k_lo > q_hi - 1:  # every key after every query
            return False
        if self.window is not None and k_hi - 1 <= q_lo - self.window:  # every key before every window
            return False
        return True

    def covers(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
        """Whether every query in ``[q_lo, q_hi)`` keeps every key in ``[k_lo, k_hi)`` (documents ignored).

        A block this says True for needs no mask (only the soft-cap and documents, if any).
        """
        if q_lo >= q_hi or k_lo >= k_hi:
            return True
        if self.causal and k_hi - 1 > q_lo:  # the first query must see the last key
            return False
        if self.window is not None and k_lo <= (q_hi - 1) - self.window:  # the last query must see the first key
            return False
        return True

    def pairs(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
        """How many (query, key) pairs of the block are kept (documents ignored): the block's attention work."""
        total = 0
        for q in range(q_lo, q_hi):
            lo, hi = self._lo_hi(q)
            a, b = max(k_lo, lo), min(k_hi - 1, hi)
            total += int(max(0, b - a + 1))
        return total

    def keep(self, q_pos: Any, k_pos: Any, q_doc: Any = None, k_doc: Any = None) -> Any:
        """The boolean keep-matrix ``(len(q_pos), len(k_pos))`` of a block, or None when every pair is kept.

        Args:
            q_pos, k_pos: 1-D integer tensors of the global positions of the block's queries and keys.
            q_doc, k_doc: integer tensors of their document ids, ``(..., len(q_pos))`` and ``(..., len(k_pos))``
                (a leading batch dim gives one matrix per row), or None (one document).

        Returns:
            A bool tensor (True = kept) on ``q_pos``'s device, ``(..., len(q_pos), len(k_pos))``, or None.
        """
        q, k = q_pos[:, None], k_pos[None, :]
        keep = None
        if self.causal:
            keep = k <= q
        if self.window is not None:
            inside = k > q - self.window
            keep = inside if keep is None else keep & inside
        if q_doc is not None and k_doc is not None:
            same = q_doc[..., :, None] == k_doc[..., None, :]
            keep = same if keep is None else keep & same
        return keep
