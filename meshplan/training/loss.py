"""Cross-entropy on vocab-sharded (loss-parallel) logits.

:func:`cross_entropy` is ``F.cross_entropy`` with the class dim LAST; for a
DTensor whose vocab dim is sharded it runs Megatron's vocab-parallel algorithm
on the local shards, never gathering the ``[tokens, vocab]`` logits.

Design decision: our own ``autograd.Function``, not torch's ``loss_parallel()``.
torch 2.13's ``torch/distributed/tensor/parallel/loss.py`` patches DTensor's
dispatcher for ``_log_softmax``/``nll_loss*``, so (1) ``backward()`` must also
run inside the context, (2) the class dim must be dim 1 (``(b, s, V)`` needs a
transpose), (3) ``reduction="mean"`` raises on multi-dim meshes (per-rank
denominator) and (4) the context manager has no ``try/finally``.  Extending it
means wrapping private handlers; the algorithm is ~40 lines on local tensors
with functional collectives, which also run under ``LocalTensorMode``.

Forward collectives (backward has none):

1. all-reduce MAX over tp of the row max;
2. all-reduce SUM over tp of the row ``sum(exp(x - max))`` (stacked with the
   row ``sum(x)`` when ``label_smoothing > 0``: still one collective);
3. ``"none"``: all-reduce SUM over tp of the row loss, computed only on the rank
   owning the target class (the others add exact zeros); ``"mean"``/``"sum"``:
   ONE all-reduce SUM of ``[loss_sum, n_valid]`` over tp *and* the mesh dims
   sharding the batch (each valid token is counted once, by its owner), so the
   global count is free.  Group: ``mesh[dims]`` flattened (named meshes), WORLD
   (unnamed mesh spanning all ranks), else one all-reduce per mesh dim.

Mean semantics (a documented choice): ``"mean"`` divides by the number of
non-ignored targets in the GLOBAL batch the logits DTensor represents, so every
rank's loss equals ``F.cross_entropy`` on the full tensors and each rank's
gradient is already a share of the global-mean gradient: a data-parallel
wrapper that *averages* gradients over dp (FSDP/DDP default) divides by dp
once more -- sum there instead, or scale the loss by the dp size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

from meshplan._torch import LOG_SOFTMAX, dtensor_op_handlers, flatten_mesh, funcol

__all__ = ["cross_entropy", "loss_parallel"]


def _all_reduce(t: torch.Tensor, op: str, groups: list) -> torch.Tensor:
    for g in groups:
        t = funcol.all_reduce(t, op, g)
        if isinstance(t, funcol.AsyncCollectiveTensor):
            t = t.wait()
    return t


class _VocabParallelCE(torch.autograd.Function):
    """Megatron vocab-parallel CE on the local shard of the DTensor ``logits``; ``target`` is local."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, reduction, smoothing, tp_groups, all_groups):
        local = logits.to_local()
        x, vocab, out_shape = local.reshape(-1, local.shape[-1]), logits.shape[-1], target.shape
        target = target.reshape(-1)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least; float64 stays float64
        valid = target != ignore_index
        local_t = target - vocab_start
        own = valid & (local_t >= 0) & (local_t < xf.shape[-1])
        row_max = _all_reduce(xf.amax(-1), "max", tp_groups)                      # all-reduce 1
        shifted = xf - row_max.unsqueeze(-1)
        sums = shifted.exp().sum(-1)
        if smoothing > 0:
            sums = _all_reduce(torch.stack([sums, shifted.sum(-1)]), "sum", tp_groups)  # all-reduce 2
            lse, mean_x = sums[0].log(), sums[1] / vocab
        else:
            lse = _all_reduce(sums, "sum", tp_groups).log()                     # all-reduce 2
        picked = shifted.gather(-1, torch.where(own, local_t, 0).unsqueeze(-1)).squeeze(-1)
        row = lse - picked
        if smoothing > 0:
            row = (1.0 - smoothing) * row + smoothing * (lse - mean_x)
        row = torch.where(own, row, 0.0)
        if reduction == "none":
            loss = _all_reduce(row, "sum", tp_groups)                           # all-reduce 3
            denom = None
        else:
            stats = torch.stack([row.sum().double(), own.sum().double()])
            stats = _all_reduce(stats, "sum", all_groups)                       # all-reduce 3
            denom = stats[1].to(xf.dtype) if reduction == "mean" else None
            loss = (stats[0] / stats[1] if reduction == "mean" else stats[0]).to(xf.dtype)
        ctx.save_for_backward(x, row_max + lse, local_t, own, valid, denom)
        ctx.conf = (reduction, smoothing, vocab, logits.device_mesh, logits.placements, logits.shape, logits.stride())
        ctx.local_shape = local.shape
        return (loss.reshape(out_shape) if reduction == "none" else loss).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, lse, local_t, own, valid, denom = ctx.saved_tensors
        reduction, smoothing, vocab, mesh, placements, shape, stride = ctx.conf
        cd = lse.dtype  # the forward's compute dtype (fp32, or float64 for float64 logits)
        g = torch.exp(x.to(cd) - lse.unsqueeze(-1))                             # softmax, local shard
        if smoothing > 0:
            g = g - smoothing / vocab
        hit = torch.where(own, -(1.0 - smoothing), 0.0).to(cd).unsqueeze(-1)
        g = g.scatter_add(-1, torch.where(own, local_t, 0).unsqueeze(-1), hit)  # - one_hot
        scale = grad.to(cd).reshape(-1) / denom if reduction == "mean" else grad.to(cd).reshape(-1)
        g = (g * torch.where(valid, scale, 0.0).unsqueeze(-1)).to(x.dtype).reshape(ctx.local_shape)
        # explicit global shape/stride: inferring them from an uneven local shard breaks LocalTensorMode
        g = DTensor.from_local(g, mesh, placements, run_check=False, shape=shape, stride=stride)
        return g, None, None, None, None, None, None, None


def _groups(mesh, dims: list[int]) -> list:
    """Process groups whose nested all-reduces cover mesh ``dims`` (one group when possible)."""
    if len(dims) <= 1:
        return [mesh.get_group(d) for d in dims]
    if mesh.mesh_dim_names is None:
        if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
            return [dist.group.WORLD]
        return [mesh.get_group(d) for d in dims]
    sub = mesh if len(dims) == mesh.ndim else mesh[tuple(mesh.mesh_dim_names[d] for d in dims)]
    return [flatten_mesh(sub).get_group()]


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy over the LAST dim of ``logits``; vocab-parallel when that dim is sharded.

    Equals ``F.cross_entropy(logits.flatten(0, -2), target.flatten(), ...)``
    computed on the full tensors.  The backward needs no context manager and no
    collective; the logits' gradient is a DTensor with the logits' placements.

    Args:
        logits (Tensor or DTensor): ``(*, V)`` scores.  A DTensor may shard the
            last dim on at most one mesh dim (``Shard(-1)``), shard any other
            dim (batch/sequence, e.g. ``[Shard(0), Shard(2)]`` on a (dp, tp)
            mesh) and be ``Replicate`` elsewhere; ``Partial`` is rejected.
        target (Tensor or DTensor): ``(*)`` class indices.  A plain tensor
            holds this rank's rows (shape ``logits.to_local().shape[:-1]``); a
            DTensor is redistributed to the logits' placements minus the vocab
            shard (free if it already matches).
        ignore_index (int): target value that contributes no loss or gradient.
        reduction (str): ``"mean"`` (over non-ignored targets of the GLOBAL
            batch), ``"sum"`` or ``"none"``.
        label_smoothing (float): as in ``F.cross_entropy``, in ``[0, 1]``.

    Returns:
        Tensor: a plain (non-DTensor) 0-d tensor for ``"mean"``/``"sum"``, equal
        on every rank; for ``"none"`` a plain tensor with this rank's rows
        (the local target shape), ignored rows 0.

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``, the vocab dim sharded
            on more than one mesh dim (or strided), ``Partial`` placements, a
            target whose shape, mesh, dtype or type does not fit the logits.

    Example:
        >>> # xdoctest: +SKIP("distributed")
        >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        >>> logits = model(tokens)                 # DTensor [Shard(0), Shard(2)], (b, s, V)
        >>> loss = cross_entropy(logits, labels)   # labels: this rank's (b/2, s) rows
        >>> loss.backward()
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if not isinstance(logits, DTensor):
        if isinstance(target, DTensor):
            raise ValueError(f"target is a DTensor {target.placements} but logits are a plain tensor")
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"target shape {tuple(target.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
        return _local_cross_entropy(logits, target, kw)

    vocab_dims, batch_dims = _sharded_dims(logits)
    target, local = _local_target(logits, target, vocab_dims)
    if not vocab_dims and not batch_dims:  # fully replicated: nothing distributed to do
        return _local_cross_entropy(local, target, kw)
    mesh = logits.device_mesh
    return _VocabParallelCE.apply(
        logits, target, _vocab_start(logits, target, vocab_dims), ignore_index, reduction, float(label_smoothing),
        _groups(mesh, vocab_dims), _groups(mesh, sorted(vocab_dims + batch_dims)),
    )


def _local_cross_entropy(logits: torch.Tensor, target: torch.Tensor, kw: dict) -> torch.Tensor:
    """``F.cross_entropy`` over the last dim of plain ``logits``; ``"none"`` keeps ``target``'s shape."""
    out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), **kw)
    return out.reshape(target.shape) if kw["reduction"] == "none" else out


def _sharded_dims(logits: DTensor) -> tuple[list[int], list[int]]:
    """The mesh dims sharding the vocab (last) dim of ``logits`` and those sharding another dim.

    Raises:
        ValueError: ``Partial`` placements, a 0-d tensor, or the vocab dim not sharded by one plain ``Shard``.
    """
    mesh, placements, ndim = logits.device_mesh, tuple(logits.placements), logits.ndim
    if ndim < 1 or any(p.is_partial() for p in placements):
        raise ValueError(f"logits must be Shard/Replicate, ndim >= 1; got {placements}, shape {tuple(logits.shape)}")
    vocab_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim == ndim - 1]
    batch_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim != ndim - 1]
    if len(vocab_dims) > 1 or any(type(placements[d]) is not Shard for d in vocab_dims):
        raise ValueError(
            f"the vocab dim {ndim - 1} may be sharded (plain Shard) on at most one mesh dim; got "
            f"placements {placements} on mesh dims {mesh.mesh_dim_names or mesh.ndim}"
        )
    return vocab_dims, batch_dims


def _local_target(logits: DTensor, target: torch.Tensor, vocab_dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``target`` (a DTensor is redistributed to the logits' placements minus the vocab shard)
    and the local logits.

    Raises:
        ValueError: a DTensor target that does not fit the logits, float targets, or a plain target whose shape
            is not the local logits' rows.
    """
    mesh, placements = logits.device_mesh, tuple(logits.placements)
    tgt_placements = tuple(Replicate() if i in vocab_dims else p for i, p in enumerate(placements))
    if isinstance(target, DTensor):
        if target.device_mesh != mesh or tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"target DTensor shape {tuple(target.shape)} on {target.device_mesh} does not fit logits "
                f"shape {tuple(logits.shape)} on {mesh}; expected shape {tuple(logits.shape[:-1])}"
            )
        if tuple(target.placements) != tgt_placements:
            target = target.redistribute(mesh, tgt_placements)
        target = target.to_local()
    local = logits.to_local()
    if target.is_floating_point():
        raise ValueError(f"target must hold class indices, got dtype {target.dtype} (probabilities unsupported)")
    if tuple(target.shape) != tuple(local.shape[:-1]):
        raise ValueError(
            f"plain target must hold this rank's rows: expected shape {tuple(local.shape[:-1])} "
            f"(local logits {tuple(local.shape)}, placements {placements}), got {tuple(target.shape)}"
        )
    return target, local


def _vocab_start(logits: DTensor, target: torch.Tensor, vocab_dims: list[int]) -> torch.Tensor:
    """The first vocab id of this rank's shard (``torch.chunk`` layout, uneven allowed), as a 0-d tensor.

    A tensor, not a Python int: under LocalTensorMode the offset is a per-rank SymInt.
    """
    start = 0
    if vocab_dims:
        mesh, d = logits.device_mesh, vocab_dims[0]
        _, start = Shard.local_shard_size_and_offset(logits.shape[-1], mesh.size(d), mesh.get_local_rank(d))
    return torch.full((), start, dtype=target.dtype, device=target.device)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """torch's :func:`~torch.distributed.tensor.parallel.loss_parallel`, made exception- and nesting-safe.

    Inside, ``F.cross_entropy`` on a class-dim-sharded DTensor (class dim 1)
    runs vocab-parallel; ``backward()`` must run inside too.  torch's version
    has no ``try/finally`` (an exception leaves DTensor's dispatcher patched)
    and a nested use raises ``KeyError`` on the outer exit; this one undoes the
    patch exactly once, when the outermost context exits, however it exits.

    Returns:
        A context manager yielding ``None``.

    Raises:
        Whatever the body raises, after the patch is undone.

    Example:
        >>> # xdoctest: +SKIP("distributed")
        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits_shard1, target)
        ...     loss.backward()
    """
    # The patch lives in DTensor's process-wide dispatcher table, so that table (not a counter of ours) says
    # whether an outer loss_parallel -- meshplan's or torch's -- is active: then leave it to that one.
    if LOG_SOFTMAX in dtensor_op_handlers():
        yield
        return
    cm = _torch_loss_parallel()
    cm.__enter__()
    try:
        yield
    finally:
        cm.__exit__(None, None, None)  # resume torch's generator past its yield: runs the unpatch
