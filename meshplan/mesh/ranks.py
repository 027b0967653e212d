"""Megatron-exact rank arithmetic over an order string: pure Python, no torch.

A parallel layout is a grid of axes whose sizes multiply to the world size. The
order string lists the axes **innermost first** (Megatron's convention): in
``tp-cp-ep-dp-pp`` consecutive ranks differ in their ``tp`` coordinate. So the
stride of an axis is the product of the sizes of the axes before it, and

    rank = sum(coord[axis] * stride[axis])

A *group* over a set of axes is the set of ranks that agree on every other axis.
``RankGrid.groups`` lists them the way Megatron-LM's
``RankGenerator.get_ranks`` does: members ascending, groups ordered by their
first rank.

Example (Megatron's worked 16-GPU example, TP4-PP2-DP2, order ``tp-cp-ep-dp-pp``)::

    >>> g = RankGrid(("tp", "cp", "ep", "dp", "pp"), (4, 1, 1, 2, 2))
    >>> g.groups("dp")
    [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    >>> g.groups("tp")[:2]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> g.coords(13)
    {'tp': 1, 'cp': 0, 'ep': 0, 'dp': 1, 'pp': 1}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable, Iterable

__all__ = ["AXES", "RankGrid", "parse_axes", "pipeline_end_groups", "divisors", "divisors_text", "not_dividing", "ranks_text"]

#: Megatron's axis tokens, in their default (innermost-first) order.
AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")


def parse_axes(axes: str | Iterable[str]) -> tuple[str, ...]:
    """Split ``"dp-cp"`` (or an iterable of names) into a tuple of axis names."""
    if isinstance(axes, str):
        return tuple(a for a in axes.split("-") if a)
    return tuple(axes)


@dataclass(frozen=True)
class RankGrid:
    """A row-major grid of named axes, listed innermost first.

    Args:
        order: axis names, innermost first (e.g. ``("tp", "cp", "ep", "dp", "pp")``).
        sizes: the size of each axis, in the same order.

    Raises:
        ValueError: repeated names, a size below 1, or lengths that differ.
    """

    order: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.order) != len(self.sizes):
            raise ValueError(f"order {self.order} and sizes {self.sizes} differ in length")
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"order {'-'.join(self.order)} repeats an axis")
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"axis sizes must be >= 1, got {dict(zip(self.order, self.sizes))}")
        strides, acc = [], 1
        for s in self.sizes:
            strides.append(acc)
            acc *= s
        object.__setattr__(self, "strides", tuple(strides))

    @property
    def world_size(self) -> int:
        return prod(self.sizes)

    def size(self, axis: str) -> int:
        """Size of ``axis`` (1 for an axis the grid does not have)."""
        return self.sizes[self.order.index(axis)] if axis in self.order else 1

    def _index(self, axes: str | Iterable[str]) -> list[int]:
        names = parse_axes(axes)
        unknown = [a for a in names if a not in self.order]
        if unknown or len(set(names)) != len(names) or not names:
            raise ValueError(
                f"axes {'-'.join(names) or '(none)'} are not distinct axes of order "
                f"{'-'.join(self.order)}"
            )
        return [self.order.index(a) for a in names]

    def coords(self, rank: int) -> dict[str, int]:
        """Per-axis coordinates of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank({rank}) is outside world_size({self.world_size})")
        return {a: (rank // st) % s for a, s, st in zip(self.order, self.sizes, self.strides)}

    def rank(self, **coords: int) -> int:
        """Global rank at ``coords`` (missing axes are 0)."""
        unknown = set(coords) - set(self.order)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; grid has {'-'.join(self.order)}")
        out = 0
        for a, s, st in zip(self.order, self.sizes, self.strides):
            c = coords.get(a, 0)
            if not 0 <= c < s:
                raise ValueError(f"{a} coordinate {c} is outside 0..{s - 1}")
            out += c * st
        return out

    @staticmethod
    def _offsets(sizes: list[int], strides: list[int]) -> list[int]:
        # innermost axis varies fastest, so the offsets come out ascending
        offs = [0]
        for s, st in zip(sizes, strides):
            offs = [o + i * st for i in range(s) for o in offs]
        return offs

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """All groups over ``axes`` (``"dp-cp"``, ``("tp", "pp")``, …).

        Equal to Megatron's ``RankGenerator.get_ranks(token)``: each group holds
        the ranks that share every coordinate outside ``axes``; members ascending,
        groups ordered by their first rank.
        """
        idx = set(self._index(axes))
        inner = self._offsets([self.sizes[i] for i in sorted(idx)], [self.strides[i] for i in sorted(idx)])
        rest = [i for i in range(len(self.order)) if i not in idx]
        bases = self._offsets([self.sizes[i] for i in rest], [self.strides[i] for i in rest])
        return [[b + o for o in inner] for b in bases]

    def group_of(self, rank: int, axes: str | Iterable[str]) -> list[int]:
        """The group over ``axes`` that contains ``rank``."""
        idx = sorted(set(self._index(axes)))
        c = self.coords(rank)
        base = rank - sum(c[self.order[i]] * self.strides[i] for i in idx)
        return [base + o for o in self._offsets([self.sizes[i] for i in idx], [self.strides[i] for i in idx])]

    def rank_in_group(self, rank: int, axes: str | Iterable[str]) -> int:
        """Index of ``rank`` inside its group over ``axes`` (row-major, innermost first)."""
        idx = sorted(set(self._index(axes)))
        c = self.coords(rank)
        out, acc = 0, 1
        for i in idx:
            out += c[self.order[i]] * acc
            acc *= self.sizes[i]
        return out


def pipeline_end_groups(pp_groups: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron's embedding and position-embedding groups from the pipeline groups.

    The embedding group ties the first and the last pipeline stage (the input
    embedding and the output projection share weights); the position-embedding
    group is the first stage alone. With one stage both are the stage itself.

    Returns:
        ``(embedding_groups, position_embedding_groups)``.
    """
    embd = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in pp_groups]
    pos = [[g[0]] for g in pp_groups]
    return embd, pos


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order (the one helper behind every "valid tp: …" message).

    Example::

        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def divisors_text(n: int, where: Callable[[int], bool] | None = None) -> str:
    """``"1, 2, 4, 8"``: the divisors of ``n`` (those ``where`` accepts), or ``"none"``."""
    return ", ".join(str(d) for d in divisors(n) if where is None or where(d)) or "none"


def not_dividing(axis: str, degree: int, what: str, n: int) -> str | None:
    """The one wording of a degree that does not divide a size, or None when it divides.

    ``meshplan.parallelize`` (tensor_parallel, expert_parallel) and the layout solver both say it this way, so a
    layout ``meshplan solve`` rejects fails ``parallelize`` with the same words. ``what`` names the size; the
    number follows it in parentheses unless ``what`` places it itself (``"the {n} experts of …"``).

    Example::

        >>> not_dividing("tp", 3, "num_key_value_heads", 8)
        'tp(3) does not divide num_key_value_heads(8); valid tp: 1, 2, 4, 8'
        >>> not_dividing("ep", 4, "the {n} experts", 6)
        'ep(4) does not divide the 6 experts; valid ep: 1, 2, 3, 6'
    """
    if n % degree == 0:
        return None
    size = what.format(n=n) if "{n}" in what else f"{what}({n})"
    return f"{axis}({degree}) does not divide {size}; valid {axis}: {divisors_text(n)}"


def ranks_text(ranks: list[int]) -> str:
    """A group's ranks, short: every rank up to 8, else an arithmetic run as ``0, 8, …, 1016 (128 ranks, stride
    8)`` (``meshplan check --rank R`` and the model picture)."""
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    tail = f"stride {steps.pop()}" if len(steps) == 1 else "not evenly spaced"
    return f"{ranks[0]}, {ranks[1]}, …, {ranks[-1]} ({len(ranks)} ranks, {tail})"
