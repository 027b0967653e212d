"""One optimizer step of a pipelined model: the plan's schedule runs the microbatches.

The same contract as :func:`meshplan.train_step`: ``loss_fn`` returns a SUM over valid targets, every rank
counts the tokens of its batch and ONE all-reduce gives the global count, so each microbatch's loss is divided
by the global number of tokens (the schedule does not scale gradients). Tied parameters (first and last stage)
have their gradients summed over the embedding group; clipping weighs each stage's parameters by the ranks
that hold them; the loss (on the last stage) reaches every rank in the clipping all-reduce.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text
from meshplan.training.clip import clip_with, comm_device
from meshplan.training.result import StepResult

__all__ = ["pipeline_step"]


def _check_batch(inputs: Any, m: int) -> None:
    n = inputs.shape[0] if isinstance(inputs, torch.Tensor) else None
    if n is not None and n % m:
        raise PlanError(f"train_step: pipeline.microbatches({m}) does not divide this rank's batch size ({n}); "
                        f"valid microbatches: {divisors_text(n)}")


def _run(state: Any, first: Any, side: dict, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's step: the first stage feeds the token ids ``first``, every stage gets the keyword inputs
    ``side`` (torch cuts them into the microbatches), the last takes the targets.

    Returns:
        The sum of this rank's microbatch losses, each already divided by the global token count (0 off the
        last stage), as a float64 tensor of one element.
    """
    record = state.pipeline
    args = (first,) if record.has_first else ()
    losses: list = []
    kwargs = {**side, "target": targets, "losses": losses} if record.has_last else dict(side)
    sync = state.grad_sync
    with sync.deferred() if sync is not None else contextlib.nullcontext():
        record.schedule().step(*args, **kwargs)
        if sync is not None:
            sync.finish()
    total = sum((float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                 for loss in losses), 0.0)
    return torch.tensor([total], dtype=torch.float64)


def _last_copies(model: nn.Module, state: Any) -> list[nn.Parameter]:
    """The last stage's copies of tied parameters: clipped, but counted in the norm by the first stage."""
    record = state.pipeline
    return [model.get_parameter(n) for n in record.tied] if record.has_last and not record.has_first else []


def pipeline_step(model: nn.Module, state: Any, batch: tuple[Any, torch.Tensor], loss_fn: Callable | None,
                  optimizer: torch.optim.Optimizer, *, topology: Any = None, max_grad_norm: float | None = None,
                  ignore_index: int = -100, shard_batch: Callable, attach: Callable) -> Any:
    """:func:`meshplan.train_step` for a model with pipeline stages (see there): the unit's ``run_step``; returns
    its ``StepResult``. ``shard_batch``: every axis' share of a batch (:func:`meshplan.axes.shard_batch`);
    ``attach(pipeline=record)``: attaches a new record (``split: trace``'s stages, traced on the first step) and
    returns the model's state.

    Raises:
        PlanError: ``loss_fn=None`` (a pipelined model's last stage has no labels of its own),
            ``pipeline.microbatches`` not dividing the batch, or inputs no stage can be given
            (:func:`~meshplan.pipeline.inputs.stage_inputs`).
    """
    from meshplan.pipeline.apply import sync_tied
    if loss_fn is None:
        raise PlanError("train_step: a pipelined model needs a loss_fn (e.g. meshplan.cross_entropy): its last "
                        "stage computes the loss on the schedule's microbatches")
    topology = topology or state.topology
    from meshplan.pipeline.inputs import stage_inputs
    from meshplan.pipeline.traced import TracedPipeline, prepare_traced
    inputs, targets = batch
    record = state.pipeline
    stage_inputs(model, inputs, isinstance(record, TracedPipeline))  # refused before any collective (same on all)
    inputs, targets, _ = shard_batch(state, inputs, targets, ignore_index=ignore_index)  # each axis' share
    first, side = stage_inputs(model, inputs, isinstance(record, TracedPipeline))
    _check_batch(first, record.section.microbatches)
    traced = prepare_traced(model, record, first, optimizer, topology)  # split: trace: traced on the first step
    if traced is not record:  # a new record, attached by train_step (the owner of the state)
        state, record = attach(pipeline=traced), traced
    lay = topology.layout
    world = dist.get_world_size()
    data = math.prod(getattr(lay, a) for a in state.data_axes)
    model.zero_grad(set_to_none=True)
    count = (targets != ignore_index).sum().double().reshape(1).to(comm_device())
    dist.all_reduce(count)  # every rank counted its batch: tp·pp·… copies of each data shard's count
    num_tokens = int(round(float(count) / (world // data)))
    record.loss.fn, record.loss.num_tokens = loss_fn, num_tokens
    loss_sum = _run(state, first, side, targets)
    sync_tied(model, record)
    last_copies = world // (data * lay.pp)  # ranks of the last stage holding one data shard's loss (tp)
    grad_norm, extra = clip_with(model.parameters(), max_grad_norm if max_grad_norm is not None else math.inf,
                                 True, loss_sum / last_copies, pp=lay.pp, uncounted=_last_copies(model, state))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=float(extra[0]) if num_tokens else float("nan"),
                      grad_norm=grad_norm if max_grad_norm is not None else None, num_tokens=num_tokens)
