"""What each pipeline stage is fed: the token ids to the first stage, the keyword inputs to EVERY stage.

A stage view runs the model's whole ``forward`` (:mod:`meshplan.pipeline.ends`), so a later stage's own model code
rebuilds what its blocks need from the keyword inputs, exactly as the whole model does: rotary positions from
``position_ids``, the causal, padding (2-D ``attention_mask``), 4-D or packed-document mask (transformers reads
restarting position ids as documents), and context parallelism's document ids (its root hook on each stage view
gathers them from the position ids). torch's schedules split the keyword inputs into the microbatches along dim 0
and hand microbatch ``i``'s to each stage's forward of microbatch ``i`` (``PipelineStage.forward_one_chunk``), so
the side inputs cost no send: each rank slices its own copy. The token ids go positionally to the first stage;
the later stages get the previous stage's hidden state in their place.

What cannot be delivered is refused, naming it: positional inputs beyond the token ids (a stage's positional
input is the received hidden state), a tensor that is not per row (``cu_seqlens``: dim 0 is not the batch, so a
microbatch cannot be cut from it), labels (a pipelined model's loss is ``loss_fn`` on the last stage), and keyword
inputs to a traced split (its graph takes the token ids alone).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError

__all__ = ["stage_inputs"]

#: keys the schedule's ``step`` takes itself, and labels (the loss is the last stage's ``loss_fn``)
_RESERVED = ("target", "losses", "labels", "shift_labels")


def _first_parameter(model: nn.Module) -> str | None:
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def _per_row(key: str, value: Any, rows: int) -> Any:
    """``value`` cut by rows into microbatches: a tensor whose dim 0 is the batch (one row broadcast to all is
    expanded), anything else (``use_cache: False``) given whole to every microbatch."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() and value.shape[0] == rows:
        return value
    if value.dim() and value.shape[0] == 1:
        return value.expand(rows, *value.shape[1:])
    raise PlanError(f"train_step: a pipelined model's input {key!r} has shape {tuple(value.shape)}; each stage gets "
                    f"its microbatch's rows of every keyword input, so expected dim 0 = the batch's {rows} rows (or 1, "
                    f"broadcast); per-row position ids restarting per document carry packed documents (e.g. "
                    f"meshplan.context_parallel.batch.position_ids_of(lengths) per row, not cu_seqlens)")


def stage_inputs(model: nn.Module, inputs: Any, traced: bool = False) -> tuple[Any, dict]:
    """``(first, kwargs)``: the first stage's positional input (the token ids) and the keyword inputs every stage
    gets (cut into the schedule's microbatches by torch).

    Args:
        model: the pipelined model (its ``forward``'s first parameter names the token ids in a dict).
        inputs: this rank's step inputs: a tensor, a 1-tuple, or a dict of keyword arguments.
        traced: the split is ``trace`` (its graph takes the token ids only).

    Raises:
        PlanError: a tuple of more than one input, a dict without the forward's first parameter, labels, a tensor
            not per row, or keyword inputs to a traced split.
    """
    if isinstance(inputs, tuple) and len(inputs) > 1:
        raise PlanError(f"train_step: a pipelined model's inputs are a tuple of {len(inputs)}; a later stage's "
                        f"positional input is the previous stage's hidden state, so inputs 2..{len(inputs)} cannot "
                        f"reach it; expected the token ids alone, or a dict of keyword inputs (e.g. {{'input_ids': "
                        f"..., 'position_ids': ..., 'attention_mask': ...}}), which every stage gets")
    if not isinstance(inputs, dict):
        return (inputs[0] if isinstance(inputs, tuple) else inputs), {}
    name = _first_parameter(model)
    if name not in inputs:
        raise PlanError(f"train_step: a pipelined model's inputs are a dict (keys {list(inputs)}) without {name!r}, "
                        f"{type(model).__name__}.forward's first parameter: the first stage takes it positionally "
                        f"(the later stages the hidden state); expected a dict holding {name!r}")
    bad = [k for k in inputs if k in _RESERVED]
    if bad:
        raise PlanError(f"train_step: a pipelined model's inputs hold {bad}; its loss is loss_fn on the last stage's "
                        f"output against the batch's targets, so expected no {bad} in the inputs (pass them as the "
                        f"targets)")
    first = inputs[name]
    rest = {k: v for k, v in inputs.items() if k != name}
    if traced and any(v is not None for v in rest.values()):
        raise PlanError(f"train_step: pipeline.split: trace traced the model on the token ids alone; its stages "
                        f"cannot take the keyword inputs {list(rest)}; expected {name!r} alone, or split: blocks "
                        f"(every stage runs the model's forward with them)")
    rows = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    return first, {k: _per_row(k, v, rows) for k, v in rest.items() if v is not None}
