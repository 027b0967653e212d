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
from meshplan.errors import PlanError

__all__ = ["shard_batch", "shard_for_state", "sequence_length", "documents_of", "position_ids_of"]


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
    if isinstance(x, torch.Tensor):
        if x.dim() > seq_dim and x.shape[seq_dim] == seq_len:
            return x.index_select(seq_dim, index.to(x.device))
        return x
    if isinstance(x, dict):
        return {k: _take(v, index, seq_dim, seq_len) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_take(v, index, seq_dim, seq_len) for v in x)
    return x


def shard_batch(inputs: Any, targets: Any, *, cp: int, rank: int, load_balance: bool, seq_dim: int = 1,
                tp_sequence: int = 1, shift: bool = False, ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """``(inputs, targets, shift)`` of this cp rank: its chunks of every sequence-long tensor.

    Args:
        inputs, targets: this data rank's batch (whole sequences), as :func:`meshplan.train_step` takes it.
        cp, rank, load_balance, seq_dim: the plan's layout (:mod:`~meshplan.context_parallel.chunks`).
        tp_sequence: tp ranks that split each shard again (sequence parallelism), for the length check.
        shift: the model shifts its labels itself (``inputs`` is a dict with ``labels``); they are shifted over
            the whole sequence into ``shift_labels`` first and the returned ``shift`` is False.
        ignore_index: the label of the position after the last.

    Returns:
        The sharded inputs and targets, and whether the targets still need shifting (no longer).

    Raises:
        PlanError: a length the layout cannot split (with valid lengths), or targets without the sequence dim.
    """
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
    index = torch.tensor(rank_positions(seq_len, cp, rank, load_balance))
    return _take(inputs, index, seq_dim, seq_len), _take(targets, index, seq_dim, seq_len), False


def shard_for_state(state: Any, inputs: Any, targets: Any, shift: bool = False,
                    ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """:func:`shard_batch` with the layout of a model's :class:`~meshplan.state.ParallelState` (its cp runtime;
    sequence parallelism's tp for the length check)."""
    rt = state.context_parallel.runtime
    tp = state.topology.layout.tp if state.sequence_parallel is True else 1
    return shard_batch(inputs, targets, cp=rt.cp, rank=rt.rank, load_balance=rt.load_balance, seq_dim=rt.seq_dim,
                       tp_sequence=tp, shift=shift, ignore_index=ignore_index)
