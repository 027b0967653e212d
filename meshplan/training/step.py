"""One training step done right: global loss normalisation, mesh-aware clipping, accumulation.

The contract of ``loss_fn(output, targets)``: return the SUM of the per-token
losses over this rank's valid targets (``targets != ignore_index``), e.g.
``F.cross_entropy(out.flatten(0, 1), tgt.flatten(), reduction="sum")`` or
``meshplan.cross_entropy(..., reduction="sum")``. :func:`train_step` counts the
valid tokens of every microbatch, sums the count over every rank that holds
different data (dp_replicate, dp_shard, cp; + tp in smp's batch mode) with
ONE all-reduce, and divides: the gradient is that of the mean over ALL valid
tokens of the global batch, not a mean of per-rank or per-microbatch means.
Gradients are therefore SUMMED over the data axes (the ``data_parallel``
section's default ``gradient_reduction: sum``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshplan.errors import PlanError
from meshplan.tensor_parallel.grad_sync import grad_sync

__all__ = ["StepResult", "train_step", "clip_grad_norm_"]


@dataclass(frozen=True)
class StepResult:
    """``loss``: mean over all valid tokens of the global batch; ``grad_norm``: total L2 norm before
    clipping (None without ``max_grad_norm``); ``num_tokens``: the global number of valid tokens."""

    loss: float
    grad_norm: float | None
    num_tokens: int


def _grad_norm_parts(params: Iterable[nn.Parameter], ranks_per_stage: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """Σ local‖g‖² weighted by 1/(number of ranks holding the same values): a float64 scalar on ``device``."""
    norms, weights = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
            sharded = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements)
                                if isinstance(pl, (Shard, _StridedShard)))
            g = g._local_tensor
        else:
            sharded = 1
        norms.append(torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double().to(device or g.device))
        weights.append(sharded / ranks_per_stage)
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return (torch.stack(norms) ** 2 * torch.tensor(weights, dtype=torch.float64, device=norms[0].device)).sum()


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, *, distributed: bool = True) -> float:
    """Clip gradients by their total L2 norm over every rank, with ONE all-reduce.

    Each gradient's local ‖g‖² is weighted by ``(product of its Shard mesh sizes) / world``, i.e.
    divided by how many ranks hold the same values (Replicate dims and dims outside its mesh), and
    everything is summed with a single all-reduce over WORLD: no Replicate copy is double counted and
    any number of meshes (FSDP×TP, HSDP, plain) costs one collective.

    Args:
        params: the parameters (plain tensors or DTensors).
        max_norm: the maximum total norm.
        distributed: sum over WORLD (False: local only).

    Returns:
        The total norm before clipping (as ``torch.nn.utils.clip_grad_norm_``, but a float).

    Example::

        >>> norm = clip_grad_norm_(model.parameters(), 1.0)
    """
    return _clip(params, max_norm, distributed, None)[0]


def _clip(params: Iterable[nn.Parameter], max_norm: float, distributed: bool,
          extra: torch.Tensor | None) -> tuple[float, torch.Tensor | None]:
    """:func:`clip_grad_norm_`, all-reducing ``extra`` (float64, SUM) in the same collective."""
    params = [p for p in params if p.grad is not None]
    dist_on = distributed and dist.is_initialized()
    world = dist.get_world_size() if dist_on else 1
    device = _comm_device() if dist_on else torch.device("cpu")
    buf = _grad_norm_parts(params, world, device).reshape(1)
    if extra is not None:
        buf = torch.cat([buf, extra.reshape(-1).double().to(device)])
    if dist_on:
        dist.all_reduce(buf)
    buf = buf.cpu()  # the one host sync of clipping
    total = float(buf[0].sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0) if math.isfinite(total) else float("nan")
    grads = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad for p in params]
    if grads:
        torch._foreach_mul_(grads, coef)
    return total, (buf[1:] if extra is not None else None)


def _comm_device() -> torch.device:
    """The device the default process group communicates on."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _split(x: Any, n: int, what: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.shape[0] % n:
            valid = [d for d in range(1, x.shape[0] + 1) if x.shape[0] % d == 0]
            raise PlanError(f"train_step: microbatches({n}) does not divide the {what} batch size ({x.shape[0]}); "
                            f"valid: {', '.join(map(str, valid))}")
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


def _accumulation_knobs(model: nn.Module, state: Any, i: int, n: int) -> None:
    """FSDP2 knobs for microbatch ``i`` of ``n`` (i == n restores the defaults)."""
    sec, last, ddp = state.section, i >= n - 1, state.mode == "ddp"
    keep_fwd = sec.accumulate_unsharded and not ddp and (sec.reshard_after_forward is None
                                                          or isinstance(sec.reshard_after_forward, bool))
    if sec.accumulate_unsharded:
        model.set_requires_gradient_sync(last)
        if not ddp:
            model.set_reshard_after_backward(last)
    model.set_is_last_backward(last)
    if keep_fwd and i == 0:
        model.set_reshard_after_forward(False)  # no re-gather in backward nor in the next microbatch
    if keep_fwd and i == n:
        for path in state.blocks:
            model.get_submodule(path).set_reshard_after_forward(sec.reshard_after_forward is not False,
                                                                recurse=False)
        model.set_reshard_after_forward(False, recurse=False)  # torch's root default


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
        topology: default: the model's data-parallel topology, else the one :func:`meshplan.parallelize` used,
            else the active one; without any (and no DTensor
            parameters) the step is local.
        microbatches: gradient-accumulation steps; FSDP parameters stay gathered between them (see
            ``data_parallel.accumulate_unsharded``).
        max_grad_norm: clip the total L2 norm (over every mesh) to this; None: no clipping, no norm.
        ignore_index: targets equal to it are not counted.
        sequence_parallel: ``"batch"`` if tp ranks hold different data; default: what the model's plan
            said (its data-parallel state or :class:`~meshplan.tensor_parallel.generate.TpApplied`).

    Returns:
        :class:`StepResult` with the global mean loss, the norm before clipping and the global token count.

    Raises:
        PlanError: microbatches not dividing the batch, pp > 1, or DTensor parameters without a topology.

    Example::

        >>> loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")
        >>> res = train_step(model, (tokens, labels), loss_fn, opt, microbatches=2, max_grad_norm=1.0)
    """
    from meshplan.data_parallel.fsdp import data_parallel_state
    from meshplan.training.loss import cross_entropy
    from meshplan.mesh.topology import current_topology
    if loss_fn is cross_entropy:  # its default is "mean"; the contract here is a sum
        loss_fn = functools.partial(cross_entropy, reduction="sum", ignore_index=ignore_index)
    batch, loss_fn, shift = _own_loss(model, batch, loss_fn)
    state = data_parallel_state(model)
    topology = (topology or (state.topology if state else None) or getattr(model, "_meshplan_topology", None)
                or current_topology())
    has_dtensor = any(isinstance(p, DTensor) for p in model.parameters())
    distributed = dist.is_initialized() and (topology is not None or has_dtensor)
    replicas = 1
    if distributed:
        if topology is None:
            raise PlanError("train_step: the model has DTensor parameters but no topology; pass topology= or run "
                            "inside `with topo:`")
        lay = topology.layout
        if lay.pp > 1:
            raise PlanError(f"train_step: pp({lay.pp}) > 1; pipeline schedules are not handled by train_step")
        tp_applied = getattr(model, "_meshplan_tp", None)
        sync = grad_sync(model)
        batch_mode = "batch" in (sequence_parallel, getattr(tp_applied, "sequence_parallel", None),
                                 getattr(sync, "sequence_parallel", None))
        axes = state.data_axes if state else ("dp_replicate", "dp_shard", "cp") + (("tp",) if batch_mode else ())
        replicas = dist.get_world_size() // math.prod(getattr(lay, a) for a in axes)
    inputs, targets = batch
    n = int(microbatches)
    if n < 1:
        raise PlanError(f"train_step: microbatches must be >= 1, got {n}")
    xs, ys = _split(inputs, n, "inputs"), _split(targets, n, "targets")
    model.zero_grad(set_to_none=True)
    count = torch.stack([((y[..., 1:] if shift else y) != ignore_index).sum() for y in ys]).sum().double().reshape(1)
    count = count.to(_comm_device()) if distributed else count
    work = dist.all_reduce(count, async_op=True) if distributed else None  # overlaps the first forward
    root = model if state is not None and state.mode != "none" else None  # an FSDPModule (ddp: replicate)
    sync = grad_sync(model)  # the tp reductions of replicated grads: one collective per step, after all microbatches
    loss_sum = 0.0
    with sync.deferred() if sync is not None else contextlib.nullcontext():
        try:
            for i, (x, y) in enumerate(zip(xs, ys)):
                if root is not None and n > 1:
                    _accumulation_knobs(root, state, i, n)
                loss = loss_fn(_call(model, x), y)
                if i == 0:
                    if work is not None:
                        work.wait()
                    num_tokens = int(round(float(count) / replicas))
                (loss / max(num_tokens, 1)).backward()
                loss_sum = loss_sum + _scalar(loss)  # stays on the loss's device
        finally:
            if root is not None and n > 1:
                _accumulation_knobs(root, state, n, n)
        if sync is not None:
            sync.finish()
    extra = (torch.as_tensor(loss_sum, dtype=torch.float64) / replicas).reshape(1)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm, extra = _clip(model.parameters(), max_grad_norm, distributed, extra)
    elif distributed:
        extra = extra.to(_comm_device())
        dist.all_reduce(extra)
        extra = extra.cpu()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_value = float(extra[0]) / num_tokens if num_tokens else float("nan")
    return StepResult(loss=loss_value, grad_norm=grad_norm, num_tokens=num_tokens)
