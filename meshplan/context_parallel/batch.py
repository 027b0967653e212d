"""This rank's share of a batch along the sequence: what :func:`meshplan.train_step` feeds a context-parallel
model.

Every tensor of the inputs and targets whose sequence dim has the batch's length is cut into the plan's chunks and
this rank keeps its own (:func:`~meshplan.context_parallel.chunks.rank_positions`), so tokens, labels, masks and
caller-given position ids stay aligned. A model that shifts its labels itself (transformers' causal-LM loss) gets
them shifted over the WHOLE sequence first (``shift_labels``): a shard's last token's target lives on another
shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshplan.context_parallel.chunks import check_seq_len, rank_positions
from meshplan.context_parallel.documents import document_index, documents_of
from meshplan.errors import PlanError

__all__ = ["shard_batch", "shard_for_state", "sequence_length", "documents_of", "position_ids_of"]


def position_ids_of(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The position ids ``(1, sum(lengths))`` of documents of ``lengths`` tokens packed in one row (cumulative
    lengths → ids restarting per document: how packed documents reach a model and meshplan).

    Example::

        >>> position_ids_of([3, 2]).tolist()
        [[0, 1, 2, 0, 1]]
    """
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def sequence_length(inputs: Any, seq_dim: int) -> int | None:
    """The sequence length of the first tensor in ``inputs`` (dicts, tuples, lists searched in order)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[seq_dim] if inputs.dim() > seq_dim else None
    values = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else ()
    for v in values:
        n = sequence_length(v, seq_dim)
        if n is not None:
            return n
    return None


def _take(x: Any, index: torch.Tensor, seq_dim: int, seq_len: int) -> Any:
    """``x``'s positions ``index`` along ``seq_dim``: 1-D (every row), or ``(rows, n)`` per batch row (seq dim 1)."""
    if isinstance(x, torch.Tensor):
        if x.dim() <= seq_dim or x.shape[seq_dim] != seq_len:
            return x
        if index.dim() == 1 or index.shape[0] == 1:
            return x.index_select(seq_dim, index.reshape(-1).to(x.device))
        if x.shape[0] == 1:
            x = x.expand(index.shape[0], *x.shape[1:])
        if x.shape[0] != index.shape[0]:
            raise PlanError(f"context_parallel: a batch tensor of shape {tuple(x.shape)} has {x.shape[0]} rows; the "
                            f"position ids lay out {index.shape[0]} rows per document (expected {index.shape[0]} or 1)")
        idx = index.to(x.device).view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
        return x.gather(1, idx)
    if isinstance(x, dict):
        return {k: _take(v, index, seq_dim, seq_len) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_take(v, index, seq_dim, seq_len) for v in x)
    return x


def shard_batch(inputs: Any, targets: Any, *, cp: int, rank: int, load_balance: bool, seq_dim: int = 1,
                tp_sequence: int = 1, shift: bool = False, ignore_index: int = -100,
                documents: str | None = None) -> tuple[Any, Any, bool]:
    """``(inputs, targets, shift)`` of this cp rank: its chunks of every sequence-long tensor.

    Args:
        inputs, targets: this data rank's batch (whole sequences), as :func:`meshplan.train_step` takes it.
        cp, rank, load_balance, seq_dim: the plan's layout (:mod:`~meshplan.context_parallel.chunks`).
        tp_sequence: tp ranks that split each shard again (sequence parallelism), for the length check.
        shift: the model shifts its labels itself (``inputs`` is a dict with ``labels``); they are shifted over
            the whole sequence into ``shift_labels`` first and the returned ``shift`` is False.
        ignore_index: the label of the position after the last.
        documents: the key of the inputs' position ids when the model masks packed documents by them: rows packing
            documents are laid out per document, balanced by work (:mod:`~meshplan.context_parallel.documents`),
            where every document's length is a multiple of ``2·cp`` (and ``load_balance``, ``seq_dim`` 1); the
            model's runtime must then read the batch so (:func:`shard_for_state` tells it). None: the row layout.

    Returns:
        The sharded inputs and targets, and whether the targets still need shifting (no longer).

    Raises:
        PlanError: a length the layout cannot split (with valid lengths), or targets without the sequence dim.
    """
    return _sharded(inputs, targets, cp, rank, load_balance, seq_dim, tp_sequence, shift, ignore_index,
                    documents)[:3]


def _sharded(inputs: Any, targets: Any, cp: int, rank: int, load_balance: bool, seq_dim: int, tp_sequence: int,
             shift: bool, ignore_index: int, documents: str | None) -> tuple[Any, Any, bool, bool]:
    """:func:`shard_batch`, and whether the batch was laid out per document."""
    seq_len = sequence_length(inputs, seq_dim)
    if seq_len is None:
        raise PlanError(f"context_parallel: no input tensor has a sequence dim {seq_dim}")
    why = check_seq_len(seq_len, cp, load_balance, tp_sequence)
    if why:
        raise PlanError(f"context_parallel: {why}")
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
        raise PlanError("context_parallel: the batch's attention_mask pads some sequences; context parallelism "
                        "trains whole sequences (pack them without padding, or drop attention_mask)")
    if shift:
        shifted = F.pad(inputs["labels"], (0, 1), value=ignore_index)[..., 1:]
        inputs, targets = {**inputs, "shift_labels": shifted}, shifted
    if sequence_length(targets, seq_dim) != seq_len:
        raise PlanError(f"context_parallel: the targets have no sequence dim {seq_dim} of length {seq_len}; "
                        f"context parallelism trains per-token losses (a target per input token)")
    return _shard(inputs, targets, cp, rank, load_balance, seq_dim, seq_len, documents)


def _shard(inputs: Any, targets: Any, cp: int, rank: int, load_balance: bool, seq_dim: int, seq_len: int,
           documents: str | None) -> tuple[Any, Any, bool, bool]:
    """:func:`shard_batch`'s take, and whether the batch was laid out per document."""
    index = None
    ids = inputs.get(documents) if documents is not None and isinstance(inputs, dict) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] == seq_len and load_balance \
            and seq_dim == 1:
        index = document_index(ids, cp, rank)
    by_documents = index is not None
    if index is None:
        index = torch.tensor(rank_positions(seq_len, cp, rank, load_balance))
    return _take(inputs, index, seq_dim, seq_len), _take(targets, index, seq_dim, seq_len), False, by_documents


def shard_for_state(state: Any, inputs: Any, targets: Any, shift: bool = False,
                    ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """:func:`shard_batch` with the layout of a model's :class:`~meshplan.state.ParallelState` (its cp runtime;
    sequence parallelism's tp for the length check). Packed documents the runtime masks are laid out per document
    (balanced by work) when :meth:`CpRuntime.documents_layout_possible` says so and every length allows it; the
    runtime is told (``by_documents``), so its document ids follow the layout."""
    rt = state.context_parallel.runtime
    tp = state.topology.layout.tp if state.sequence_parallel is True else 1
    key = rt.positions_kwarg if isinstance(inputs, dict) and rt.documents_layout_possible(inputs) else None
    inputs, targets, shift, rt.by_documents = _sharded(inputs, targets, rt.cp, rt.rank, rt.load_balance, rt.seq_dim,
                                                       tp, shift, ignore_index, key)
    return inputs, targets, shift
