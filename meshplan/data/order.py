"""Which window of the corpus is sample ``i``: a keyed bijection, a function of ``(seed, i)`` only. Torch-free.

A run reads its packed windows in an order that is random but reproducible without state: sample ``i`` of epoch
``e = i // n`` is window ``perm(seed, e)(i mod n)``, where ``perm`` is a bijection of ``[0, n)`` built from a
4-round Feistel network over the smallest power-of-four domain that holds ``n``, walked until it lands inside
(cycle walking). Any rank, layout or resumed run computes the same window for the same ``i`` without an RNG,
a shuffle buffer or a saved permutation.
"""

from __future__ import annotations

__all__ = ["splitmix64", "permute", "held_out", "step_seed"]

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A 64-bit mixing function (Steele et al.'s SplitMix64 finaliser): adjacent inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _feistel(x: int, half: int, key: int) -> int:
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for r in range(4):
        left, right = right, left ^ (splitmix64(key ^ (r << 56) ^ right) & mask)
    return (left << half) | right


def permute(i: int, n: int, key: int) -> int:
    """Position ``i`` of a keyed random permutation of ``range(n)``.

    Args:
        i: the index, ``0 <= i < n``.
        n: the size of the permuted range (>= 1).
        key: the permutation's key (different keys, unrelated permutations).

    Returns:
        ``perm(i)``; ``[permute(i, n, k) for i in range(n)]`` is a permutation of ``range(n)``.

    Raises:
        ValueError: ``i`` outside ``[0, n)``.

    Example::

        >>> sorted(permute(i, 10, key=7) for i in range(10)) == list(range(10))
        True
    """
    if not 0 <= i < n:
        raise ValueError(f"index {i} is outside 0..{n - 1}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    x = _feistel(i, half, key)
    while x >= n:  # cycle walking: the Feistel domain is at most 4n, so ~4 steps at worst on average
        x = _feistel(x, half, key)
    return x


def held_out(window: int, seed: int, fraction: float) -> bool:
    """Whether window ``window`` belongs to the held-out (evaluation) split: a hash of ``(seed, window)`` below
    ``fraction`` of the 64-bit range, so the split never depends on how many windows the corpus has."""
    return splitmix64(splitmix64(seed ^ 0x5EED5EED) ^ window) < int(fraction * (1 << 64))


def step_seed(seed: int, step: int) -> int:
    """The torch seed of step ``step`` (dropout): a function of ``(seed, step)``, so a resumed run redraws what the
    uninterrupted one drew, on any layout (the data never touches it)."""
    return splitmix64((((seed & 0xFFFFFFFF) << 32) | (step & 0xFFFFFFFF)) ^ 0xD1B54A32D192ED03) >> 1
