"""Layouts as plans write them (``replicate``, ``shard(N)``, ``partial``), as text: the residual stream and the
collectives of a conversion. Torch-free (the spec layer: ``docs/house.md``).

The style semantics (:mod:`meshplan.plan_file.style_semantics`) state each style's layouts in this text form, so
``meshplan check``'s explain table (collectives), validation (the residual stream), the converters and the solver
read the same layouts; :mod:`meshplan.tensor_parallel.layouts` turns them into torch's placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.plan_file.tensor_parallel import layout_kind

__all__ = ["residual_stream", "Stream", "redistribute_collectives", "backward_collectives", "conversions_collectives"]


def residual_stream(sequence_parallel: bool | str) -> str:
    """The layout of the residual stream between tensor-parallel regions.

    Args:
        sequence_parallel: the section's ``sequence_parallel`` (``True``, ``False`` or ``"batch"``).

    Returns:
        ``"shard(1)"`` (sequence-sharded), ``"shard(0)"`` (smp's batch mode) or ``"replicate"``.

    Example::

        >>> residual_stream("batch")
        'shard(0)'
    """
    return "shard(1)" if sequence_parallel is True else "shard(0)" if sequence_parallel == "batch" else "replicate"


@dataclass(frozen=True)
class Stream:
    """What a style's default layouts depend on: the section's ``sequence_parallel`` and ``loss_parallel``.

    Attributes:
        sequence_parallel: ``True``, ``False`` or ``"batch"``.
        loss_parallel: keep the logits vocab-sharded.
    """

    sequence_parallel: bool | str = False
    loss_parallel: bool = False

    @classmethod
    def of(cls, section: Any) -> "Stream":
        """The stream of a ``tensor_parallel`` section (``None``: no section, a replicated stream)."""
        return cls() if section is None else cls(section.sequence_parallel, bool(section.loss_parallel))

    @property
    def layout(self) -> str:
        """The residual stream's layout (:func:`residual_stream`)."""
        return residual_stream(self.sequence_parallel)

    @property
    def batch(self) -> str:
        """The layout of per-sample tensors that are not sequence-sharded (token ids in, gathered logits out):
        ``"shard(0)"`` in batch mode, else ``"replicate"``."""
        return "shard(0)" if self.sequence_parallel == "batch" else "replicate"

    @property
    def local(self) -> bool:
        """Is the residual stream a plain (local) tensor? Only without sequence parallelism."""
        return self.sequence_parallel is False

    @property
    def logits(self) -> str:
        """The logits' layout: vocab-sharded ``"shard(-1)"`` with loss parallelism, else :attr:`batch`."""
        return "shard(-1)" if self.loss_parallel else self.batch

    @property
    def local_logits(self) -> bool:
        """Are the logits a plain tensor? Unless loss parallelism keeps them a vocab-sharded DTensor."""
        return not self.loss_parallel


def redistribute_collectives(a: str | None, b: str | None) -> list[str]:
    """Collectives of converting layout ``a`` to ``b`` (``None``: replicate).

    ``S→R`` all_gather, ``P→R`` all_reduce, ``P→S`` reduce_scatter, ``S(i)→S(j)`` all_to_all, ``R→S`` nothing.

    Example::

        >>> redistribute_collectives("partial", "shard(1)")
        ['reduce_scatter']
    """
    a, b = a or "replicate", b or "replicate"
    ka, kb = layout_kind(a), layout_kind(b)
    if a == b or ka == "R":
        return []
    if ka == "S" and kb == "S":
        return ["all_to_all"]
    if ka == "S":
        return ["all_gather"]
    return ["all_reduce"] if kb == "R" else ["reduce_scatter"]


def backward_collectives(a: str | None, b: str | None) -> list[str]:
    """Backward of a forward conversion ``a → b`` whose consumer is not a colwise (the reverse conversion)."""
    ka, kb = layout_kind(a), layout_kind(b)
    if ka == "P":
        return [] if kb == "R" else ["all_gather"]
    if ka == "R" and kb == "S":
        return ["all_gather"]
    return redistribute_collectives(b, a) if ka == kb == "S" and a != b else []


def conversions_collectives(source: Any, desired: Any) -> tuple[list[str], list[str]]:
    """``(forward, backward)`` collectives of converting each layout of ``source`` (one, or a list) to the one of
    ``desired`` at the same position; a missing layout on either side converts nothing."""
    fwd: list[str] = []
    bwd: list[str] = []
    pairs = zip(source if isinstance(source, list) else [source], desired if isinstance(desired, list) else [desired])
    for a, b in pairs:
        if a and b:
            fwd += redistribute_collectives(a, b)
            bwd += backward_collectives(a, b)
    return fwd, bwd
