"""Activation checkpointing under context parallelism: a checkpointed block's recompute sees its own forward's state.

A checkpointed block runs again in backward, after the model's forward returned (and, where microbatches
interleave, after later microbatches' forwards). The context-parallel runtime's per-forward state then belongs to
another forward or to none: the rows of a position-indexed buffer (a RoPE table) are swapped in only while the model's
forward runs, and the document ids of packed sequences and their keep-matrices are the last forward's. A block that
reads the buffer itself, or attends over packed documents, would recompute with the wrong positions or masks
(measured: the example Llama whose blocks read ``freqs_cis``, cp 2, full checkpointing: gradients 0.77% off).

:func:`checkpoint_contexts` is the ``context_fn`` meshplan gives torch's checkpoint when it checkpoints the plan's
blocks under context parallelism: its forward context records the state, its recompute context puts it back for
the recompute and takes it away after. Attention recomputed under a checkpoint meshplan did not apply, while that
state is in use (a buffer, or packed documents), is refused (:func:`refuse_outside`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from meshplan._torch import module_buffers
from meshplan.errors import PlanError

__all__ = ["Snapshot", "checkpoint_contexts", "refuse_outside", "replaying", "snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """One forward's context-parallel state, as a checkpointed block saw it.

    Attributes:
        local_len: this rank's tokens per sequence.
        documents, keeps: the packed sequences' document ids and keep-matrices (None and empty without packing).
        slot: ``(owner module, buffer name, the rows swapped in)`` of a position-indexed buffer, or None.
    """

    local_len: int | None
    documents: Any
    keeps: dict
    slot: tuple | None


def snapshot(rt: Any) -> Snapshot:
    """The state of ``rt`` (a :class:`~meshplan.context_parallel.runtime.CpRuntime`) inside its forward now."""
    slot = None
    if rt._swapped:
        owner, name, _full = rt._swapped[-1]
        slot = (owner, name, module_buffers(owner)[name])
    return Snapshot(rt.local_len, rt.documents, rt.keeps, slot)


@contextlib.contextmanager
def replaying(rt: Any, snap: Snapshot):
    """Inside: ``rt`` holds ``snap``'s state (and the buffer its rows); after: what it held before."""
    before = (rt.local_len, rt.documents, rt.keeps)
    rt.local_len, rt.documents, rt.keeps = snap.local_len, snap.documents, snap.keeps
    held = None
    if snap.slot is not None:
        owner, name, rows = snap.slot
        held = module_buffers(owner)[name]
        module_buffers(owner)[name] = rows
    rt.replaying += 1
    try:
        yield
    finally:
        rt.replaying -= 1
        if snap.slot is not None:
            module_buffers(snap.slot[0])[snap.slot[1]] = held
        rt.local_len, rt.documents, rt.keeps = before


def refuse_outside(rt: Any, path: str) -> None:
    """Refuse attention at ``path`` running outside the model's forward and outside a meshplan recompute (a
    checkpoint applied by hand recomputing it in backward) while per-forward state is in use.

    Raises:
        PlanError: ``rt`` has a position-indexed buffer or packed documents, and no forward or replay is running.
    """
    if rt.forwarding or rt.replaying or (rt.buffer is None and rt.documents is None):
        return
    what = f"the rows of {rt.buffer}" if rt.buffer is not None else "the packed documents' masks"
    raise PlanError(f"context_parallel: {path} ran outside the model's forward (a checkpoint meshplan did not apply "
                    f"recomputing it in backward?): {what} would be another forward's or none; checkpoint the "
                    f"blocks with the plan's blocks.activation_checkpointing, which carries them to the recompute")


class _Record:
    """The forward context: records the state at the block's forward into ``cell``."""

    def __init__(self, rt: Any, cell: dict) -> None:
        self.rt, self.cell = rt, cell

    def __enter__(self) -> None:
        self.cell["snap"] = snapshot(self.rt)

    def __exit__(self, *exc: Any) -> None:
        return None


class _Replay:
    """The recompute context: the recorded state while the block runs again."""

    def __init__(self, rt: Any, cell: dict) -> None:
        self.rt, self.cell, self.stack = rt, cell, contextlib.ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(replaying(self.rt, self.cell["snap"]))

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


class _Both:
    """Two context managers entered in order, left in reverse (torch's checkpoint takes one per phase)."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


def checkpoint_contexts(rt: Any, inner: Callable | None = None) -> Callable:
    """A checkpoint ``context_fn``: ``(forward context, recompute context)`` that carry ``rt``'s state from a block's
    forward to its recompute, around ``inner``'s pair (a selective policy's), if given.

    Example::

        >>> checkpoint_wrapper(block, context_fn=checkpoint_contexts(runtime))
    """
    def contexts() -> tuple:
        cell: dict = {}
        fwd, rec = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        return _Both(_Record(rt, cell), fwd), _Both(_Replay(rt, cell), rec)
    return contexts
