"""One training step done right: global loss normalisation, mesh-aware clipping, accumulation.

The contract of ``loss_fn(output, targets)``: return the SUM of the per-token
losses over this rank's valid targets (``targets != ignore_index``), e.g.
``F.cross_entropy(out.flatten(0, 1), tgt.flatten(), reduction="sum")`` or
``meshplan.cross_entropy(..., reduction="sum")``. :func:`train_step` counts the
valid tokens of every microbatch, sums the count over every rank that holds
different data (the axes' data dims, :func:`meshplan.axes.data_dims`; + tp in smp's batch mode) with
ONE all-reduce, and divides: the gradient is that of the mean over ALL valid
tokens of the global batch, not a mean of per-rank or per-microbatch means.
Gradients are therefore SUMMED over the data axes (the ``data_parallel``
section's default ``gradient_reduction: sum``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from meshplan.faults.watch import translating
from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text
from meshplan.state import ParallelState, attach_state, parallel_state
from meshplan.training.clip import clip_grad_norm_, clip_with, comm_device
from meshplan.training.result import StepResult

__all__ = ["StepResult", "train_step", "clip_grad_norm_"]


def _split(x: Any, n: int, what: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.shape[0] % n:
            raise PlanError(f"train_step: microbatches({n}) does not divide the {what} batch size ({x.shape[0]}); "
                            f"valid: {divisors_text(x.shape[0])}")
        return list(x.chunk(n)) if n > 1 else [x]
    if isinstance(x, dict):
        parts = {k: _split(v, n, f"{what}[{k!r}]") for k, v in x.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    if isinstance(x, (tuple, list)):
        parts = [_split(v, n, f"{what}[{i}]") for i, v in enumerate(x)]
        return [type(x)(p[i] for p in parts) for i in range(n)]
    return [x] * n  # a non-tensor argument goes to every microbatch


def _call(model: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.double().reshape(())


def _own_loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> tuple[tuple, Callable, bool]:
    """``(batch, loss_fn, shift)``: with ``loss_fn=None`` the model's own summed loss and its label shift."""
    if loss_fn is not None:
        return batch, loss_fn, False
    from meshplan.hf.styles import labels_shifted
    inputs = batch[0] if isinstance(batch, tuple) else batch
    if not isinstance(inputs, dict) or "labels" not in inputs:
        raise PlanError("train_step: loss_fn=None uses the model's own loss, so the inputs must be a dict of keyword "
                        f"arguments holding 'labels'; got {type(inputs).__name__}")

    def own(out: Any, _targets: Any) -> torch.Tensor:
        loss = getattr(out, "loss", None)
        if loss is None:
            raise PlanError(f"train_step: loss_fn=None but {type(model).__name__} returned no loss")
        return loss
    return ({**inputs, "num_items_in_batch": 1}, inputs["labels"]), own, labels_shifted(model)


def train_step(model: nn.Module, batch: tuple[Any, torch.Tensor] | dict, loss_fn: Callable | None,
               optimizer: torch.optim.Optimizer,
               *, topology: Any = None, microbatches: int = 1, max_grad_norm: float | None = None,
               ignore_index: int = -100, sequence_parallel: bool | str | None = None) -> StepResult:
    """One optimizer step on ``batch`` with globally normalised loss, clipping and accumulation.

    Args:
        model: a plain model, or one from :func:`meshplan.parallelize` or
            :func:`~meshplan.data_parallel.fsdp.apply_data_parallel`.
        batch: ``(inputs, targets)``; inputs a tensor, a tuple (positional) or a dict (keyword arguments); both
            split along dim 0 into ``microbatches``. This rank's part of the global batch. With ``loss_fn=None``
            a dict of keyword arguments holding ``labels`` (transformers style).
        loss_fn: ``loss_fn(output, targets)`` returning the SUM of per-token losses over valid targets.
            :func:`meshplan.cross_entropy` itself is recognised and called with ``reduction="sum"``. ``None``:
            the model's own loss (transformers: ``model(**inputs, num_items_in_batch=...)``), with tokens
            counted as it counts them (a causal LM shifts its labels: the first label of each row is not a target).
        optimizer: stepped once; gradients are zeroed (set to None) before and after.
        topology: default: the model's (:attr:`meshplan.state.ParallelState.topology`: what
            :func:`meshplan.parallelize` or :func:`~meshplan.data_parallel.fsdp.apply_data_parallel` used), else
            the active one; without any (and no DTensor parameters) the step is local.
        microbatches: gradient-accumulation steps (a pipelined model uses its plan's ``pipeline.microbatches``
            and its schedule instead); FSDP parameters stay gathered between them (see
            ``data_parallel.accumulate_unsharded``).
        max_grad_norm: clip the total L2 norm (over every mesh) to this; None: no clipping, no norm.
        ignore_index: targets equal to it are not counted.
        sequence_parallel: ``"batch"`` if tp ranks hold different data; default: what the model's plan
            said (:attr:`meshplan.state.ParallelState.sequence_parallel`).

    Returns:
        :class:`StepResult` with the global mean loss, the norm before clipping and the global token count.

    Raises:
        PlanError: microbatches not dividing the batch, pp > 1 without pipeline stages, or DTensor parameters without a topology.
        RankFailure: a collective failed because a rank died or stopped answering (``faults`` in the plan).

    Example::

        >>> loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")
        >>> res = train_step(model, (tokens, labels), loss_fn, opt, microbatches=2, max_grad_norm=1.0)
    """
    watch = _fault_watch(model, topology)
    with translating(watch):
        result = _step(model, batch, loss_fn, optimizer, topology, microbatches, max_grad_norm, ignore_index,
                       sequence_parallel)
    if watch is not None:
        watch.steady()  # the first step is done: faults.timeout_s from now on
    return result


def _fault_watch(model: nn.Module, topology: Any) -> Any:
    """The FaultWatch of the step's topology (``meshplan.init`` made it), else None."""
    from meshplan.mesh.topology import current_topology
    state = parallel_state(model)
    topo = topology or (state.topology if state is not None else None) or current_topology()
    return getattr(getattr(topo, "job", None), "watch", None)  # the job owns the watch (mesh.runtime.Job)


def _step(model: nn.Module, batch: Any, loss_fn: Callable | None, optimizer: torch.optim.Optimizer, topology: Any,
          microbatches: int, max_grad_norm: float | None, ignore_index: int,
          sequence_parallel: bool | str | None) -> StepResult:
    """:func:`train_step`'s work."""
    from meshplan.training.loss import cross_entropy
    if loss_fn is cross_entropy:  # its default is "mean"; the contract here is a sum
        loss_fn = functools.partial(cross_entropy, reduction="sum", ignore_index=ignore_index)
    state = parallel_state(model)
    from meshplan.axes import shard_batch, step_runner
    runner = step_runner(state)  # an axis that takes the step over (Axis.run_step)
    if runner is not None:
        return runner(model, state, batch, loss_fn, optimizer, topology=topology, max_grad_norm=max_grad_norm,
                      ignore_index=ignore_index, shard_batch=shard_batch,
                      attach=lambda **record: attach_state(model, **record))
    batch, loss_fn, shift = _own_loss(model, batch, loss_fn)
    distributed, replicas = _data_ranks(model, state, topology, sequence_parallel)
    inputs, targets = batch
    inputs, targets, shift = shard_batch(state, inputs, targets, shift, ignore_index)  # each axis' share
    n = int(microbatches)
    if n < 1:
        raise PlanError(f"train_step: microbatches must be >= 1, got {n}")
    xs, ys = _split(inputs, n, "inputs"), _split(targets, n, "targets")
    model.zero_grad(set_to_none=True)
    count = torch.stack([((y[..., 1:] if shift else y) != ignore_index).sum() for y in ys]).sum().double().reshape(1)
    count = count.to(comm_device()) if distributed else count
    work = dist.all_reduce(count, async_op=True) if distributed else None  # overlaps the first forward
    loss_sum, num_tokens = _accumulate(model, state, loss_fn, xs, ys, count, work, replicas)
    extra = (torch.as_tensor(loss_sum, dtype=torch.float64) / replicas).reshape(1)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm, extra = clip_with(model.parameters(), max_grad_norm, distributed, extra)
    elif distributed:
        extra = extra.to(comm_device())
        dist.all_reduce(extra)
        extra = extra.cpu()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_value = float(extra[0]) / num_tokens if num_tokens else float("nan")
    return StepResult(loss=loss_value, grad_norm=grad_norm, num_tokens=num_tokens)


def _data_ranks(model: nn.Module, state: ParallelState | None, topology: Any,
                sequence_parallel: bool | str | None) -> tuple[bool, int]:
    """``(distributed, replicas)``: whether the step communicates, and how many ranks hold the same data.

    The topology is ``topology``, else the model's (:func:`~meshplan.parallel_state`), else the active one.
    """
    from meshplan.mesh.topology import current_topology
    topology = topology or (state.topology if state is not None else None) or current_topology()
    has_dtensor = any(isinstance(p, DTensor) for p in model.parameters())
    if not (dist.is_initialized() and (topology is not None or has_dtensor)):
        return False, 1
    if topology is None:
        raise PlanError("train_step: the model has DTensor parameters but no topology; pass topology= or run "
                        "inside `with topo:`")
    lay = topology.layout
    if lay.pp > 1:
        raise PlanError(f"train_step: pp({lay.pp}) > 1 but the model has no pipeline stages; parallelize it with "
                        f"a plan that has a pipeline section")
    batch = "batch" in (sequence_parallel, state.sequence_parallel if state is not None else False)
    from meshplan.axes import data_dims
    axes = data_dims() + (("tp",) if batch else ())
    return True, dist.get_world_size() // math.prod(getattr(lay, a) for a in axes)


def _accumulate(model: nn.Module, state: ParallelState | None, loss_fn: Callable, xs: list, ys: list,
                count: torch.Tensor, work: Any, replicas: int) -> tuple[Any, int]:
    """Forward and backward of every microbatch, each loss divided by the global token count.

    ``count`` is the token count being all-reduced by ``work`` (None: local), waited for after the first forward
    (which the all-reduce overlaps); ``replicas`` ranks counted the same tokens. The model's grad sync (if any)
    defers its tp reduction to one collective after the last microbatch.

    Returns:
        ``(sum of the microbatch losses (a tensor on the loss's device, or 0.0), global token count)``.
    """
    from meshplan.axes import accumulate  # each axis' knobs per microbatch (FSDP2's: keep the gathered parameters)
    n = len(xs)
    sync = state.grad_sync if state is not None else None  # one tp collective per step, after all microbatches
    loss_sum, num_tokens = 0.0, 0
    with sync.deferred() if sync is not None else contextlib.nullcontext():
        try:
            for i, (x, y) in enumerate(zip(xs, ys)):
                accumulate(model, state, i, n)
                loss = loss_fn(_call(model, x), y)
                if i == 0:
                    if work is not None:
                        work.wait()
                    num_tokens = int(round(float(count) / replicas))
                (loss / max(num_tokens, 1)).backward()
                loss_sum = loss_sum + _scalar(loss)  # stays on the loss's device
        finally:
            accumulate(model, state, n, n)
        if sync is not None:
            sync.finish()
    return loss_sum, num_tokens
