"""Single-device-equivalent dropout for tensor-parallel models (``dropout_rng: single_device``).

Every rank draws the mask of the **global** tensor from the shared default
generator (all ranks seeded alike, as the single-device run) and keeps its own
slice, so masks, losses and gradients equal the one-device run's, provided the
model draws the same random numbers in the same order (it does: same shapes,
same dtypes, same module order). No communication; each rank does the RNG work
of the whole tensor (tp× redundant). This is the CPU/testing-grade path: on CUDA
torch's ``OffsetBasedRNGTracker`` gives DTensor random ops the same property
with philox offsets, at no redundant cost.

How. Forward-pre hooks push a ``TorchFunctionMode`` (forward hooks pop it) on the
model, its TP regions (modules whose children are colwise projections), its
``norm`` dropouts and every other dropout module. Hooks, not one root-level
mode: activation-checkpoint recomputation re-runs a block's forward during
backward and checkpoint restores the RNG state, so the same masks are drawn.
Inside the mode:

* ``F.dropout`` / ``torch.dropout`` (``nn.Dropout`` calls ``F.dropout``) on a
  DTensor: the global mask (``empty.bernoulli_(1 - p).div_(1 - p)``, as
  ``at::native::dropout`` on CPU), sliced by the placements.
* ``F.scaled_dot_product_attention(..., dropout_p > 0)`` on plain q/k/v inside a
  TP region: heads are sharded over tp (dim -3), so the ``(b, heads·tp, Lq, Lk)``
  mask is drawn and this rank's heads are kept; attention runs SDPA's math path
  (what CPU SDPA runs with dropout) with that mask, bit for bit.
* Plain tensors outside TP regions, or in ``norm`` dropouts without sequence
  parallelism, are replicated: drawn as usual (the same on every rank).
* Anything else (a plain tensor inside a TP region, whose sharding is unknown;
  DTensor q/k/v; feature/alpha dropout on sharded data) raises :class:`PlanError`.

Under ``data_parallel`` every replica draws the masks of its own micro-batch from
the same seed, as with ``per_shard``: single-device equivalence is per tp group.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from meshplan._torch import compute_local_shape_and_global_offset, safe_softmax
from meshplan.errors import PlanError

__all__ = ["SingleDeviceDropout", "sdpa_math", "REGION", "SHARED", "OUTSIDE", "INHERIT"]

#: hook kinds: a TP region (plain tensors sharded), a replicated ``norm`` dropout, the model, any other dropout
REGION, SHARED, OUTSIDE, INHERIT = "region", "shared", "outside", "inherit"
_DROPOUT = {F.dropout: (("input", "p", "training", "inplace"), (None, 0.5, True, False)),  # nn.Dropout calls it
            torch.dropout: (("input", "p", "train"), (None, None, None)),
            torch.dropout_: (("input", "p", "train"), (None, None, None))}
_UNMAPPED = (F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.alpha_dropout,
             torch.alpha_dropout_, torch.feature_dropout, torch.feature_dropout_, torch.feature_alpha_dropout,
             torch.feature_alpha_dropout_)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def sdpa_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              noise: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA's math backend (``aten._scaled_dot_product_attention_math``) with an explicit dropout ``noise``.

    The same ops in the same order as torch 2.13's C++ math path, so with the
    noise that ``at::dropout`` would draw (``bernoulli_(1 - p).div_(1 - p)`` of
    the attention probabilities' shape) the output and its gradients are
    bit-identical to ``F.scaled_dot_product_attention(..., dropout_p=p)`` on CPU.

    Args:
        query, key, value, attn_mask, is_causal, scale, enable_gqa: as
            :func:`torch.nn.functional.scaled_dot_product_attention`.
        noise: scaled keep-mask multiplied into the attention probabilities
            (shape ``(..., heads, Lq, Lk)``); ``None``: no dropout.

    Returns:
        The attention output, in ``query``'s dtype.

    Example::

        noise = torch.empty(b, h, lq, lk).bernoulli_(1 - p).div_(1 - p)
        out = sdpa_math(q, k, v, is_causal=True, noise=noise)
    """
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):  # the math path computes in fp32
        query, key, value = query.float(), key.float(), value.float()
    s = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    sq = math.sqrt(abs(s))
    query = query * (-sq if s < 0 else sq)
    if is_causal:
        if attn_mask is not None:
            raise ValueError("_scaled_dot_product_attention: explicit attn_mask should not be set when is_causal=True")
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))
    if enable_gqa and key.size(-3) != query.size(-3):
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * sq)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = safe_softmax(attn, -1)
    if noise is not None:
        attn = attn * noise
    return torch.matmul(attn, value).to(dtype)


def _noise(shape, stride, dtype, device, p: float) -> torch.Tensor:
    """What ``at::native::dropout`` draws for a tensor of this shape: ``empty_like(x).bernoulli_(1-p).div_(1-p)``."""
    noise = (torch.empty(shape, dtype=dtype, device=device) if stride is None
             else torch.empty_strided(shape, stride, dtype=dtype, device=device))
    return noise.bernoulli_(1 - p).div_(1 - p)


def _local_slice(noise: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's slice of the global ``noise`` for ``placements`` (per simulated rank under LocalTensorMode)."""
    local_shape, offset = compute_local_shape_and_global_offset(noise.shape, mesh, placements)
    for d in sorted({pl.dim % noise.dim() for pl in placements if isinstance(pl, Shard)}):
        noise = noise.narrow(d, offset[d], local_shape[d])
    return noise


def _bind(names, defaults, args, kwargs) -> list:
    return [args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in enumerate(zip(names, defaults))]


class _Mode(TorchFunctionMode):
    # Weak: every collective issued under the mode captures the mode stack in its thread-local state; a gloo
    # worker thread must never drop the last reference to the owner's mesh (and so to a process group).
    def __init__(self, owner: "SingleDeviceDropout"):
        super().__init__()
        self.owner = weakref.ref(owner)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner()
        assert owner is not None  # the mode is entered only while its owner's model runs
        if func in _DROPOUT:
            return owner._dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return owner._sdpa(func, args, kwargs)
        if func in _UNMAPPED:
            owner._unmapped(func, args, kwargs)
        return func(*args, **kwargs)


class SingleDeviceDropout:
    """Dropout masks of a tensor-parallel model equal to the single-device run's (see the module docstring).

    Args:
        tp_mesh: the 1-D tp mesh.
        sequence_parallel: the plan's ``sequence_parallel`` (``"batch"``: plain
            tensors outside TP regions hold a rank's own part of the batch).
        where: the plan key, for error messages (``"<file>: tensor_parallel.dropout_rng"``).

    Example::

        sdd = SingleDeviceDropout(tp_mesh, True)
        sdd.attach(model, "", OUTSIDE)
        sdd.attach(model.layers[0].attention, "layers.0.attention", REGION)
    """

    def __init__(self, tp_mesh: DeviceMesh, sequence_parallel: bool | str = True,
                 where: str = "tensor_parallel.dropout_rng"):
        self.mesh = tp_mesh
        self.tp = tp_mesh.size()
        self.batch = sequence_parallel == "batch"
        self.where = where
        self._stack: list[tuple[str, str]] = []  # (kind, module path) of the modules running now
        self._mode: _Mode | None = None

    def attach(self, module: nn.Module, path: str, kind: str) -> None:
        """Run ``module``'s forward under the mode; ``kind`` says how plain tensors in it are laid out.

        Args:
            module: the module to hook.
            path: its path in the model (for error messages).
            kind: ``REGION`` (plain tensors tp-sharded), ``SHARED`` (replicated), ``OUTSIDE``
                (the model: replicated, unless sequence_parallel is "batch") or ``INHERIT``.
        """
        module.register_forward_pre_hook(lambda *_: self._enter(kind, path))
        module.register_forward_hook(lambda *_: self._exit(), always_call=True)

    def _enter(self, kind: str, path: str) -> None:
        if not self._stack:
            self._mode = _Mode(self)
            self._mode.__enter__()
        self._stack.append((kind, path))

    def _exit(self) -> None:
        self._stack.pop()
        if not self._stack and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _context(self) -> tuple[str, str]:
        """The layout kind of plain tensors here (innermost non-INHERIT hook) and the innermost module path."""
        path = self._stack[-1][1] if self._stack else ""
        kind = next((k for k, _ in reversed(self._stack) if k != INHERIT), OUTSIDE)
        return kind, path

    def _replicated(self, kind: str) -> bool:
        return kind == SHARED or (kind == OUTSIDE and not self.batch)

    def _fail(self, what: str, found: str, path: str) -> PlanError:
        return PlanError(
            f"{self.where} 'single_device': module {path or '(root)'!r}: {what}; found {found}; expected "
            f"a DTensor, plain q/k/v of F.scaled_dot_product_attention(dropout_p=...) inside a TP region, or a "
            f"replicated plain tensor (list a dropout on the residual stream as 'norm'). Its mask cannot be sliced "
            f"from the single-device one; use dropout_rng: per_shard for Megatron-style per-rank masks")

    def _dropout(self, func, args, kwargs):
        x, p, training, *rest = _bind(*_DROPOUT[func], args, kwargs)
        inplace = rest[0] if rest else func is torch.dropout_
        if not training or p == 0:
            return func(*args, **kwargs)
        if isinstance(x, DTensor):
            if p == 1:  # at::native::dropout multiplies by zero and draws nothing
                return x.mul_(0.0) if inplace else x.mul(0.0)
            if any(type(pl) not in (Shard, Replicate, Partial)  # _StridedShard: not one contiguous slice
                   or (isinstance(pl, Partial) and pl.reduce_op not in ("sum", "avg")) for pl in x.placements):
                raise self._fail("dropout of a DTensor with placements it cannot slice", str(x.placements),
                                 self._context()[1])
            noise = _noise(x.shape, x.stride(), x.dtype, x.device, p)
            local = _local_slice(noise, x.device_mesh, x.placements)
            noise_d = DTensor.from_local(local, x.device_mesh,
                                         [Replicate() if isinstance(pl, Partial) else pl for pl in x.placements],
                                         shape=x.shape, stride=x.stride(), run_check=False)
            return x.mul_(noise_d) if inplace else x * noise_d
        kind, path = self._context()
        if self._replicated(kind):
            return func(*args, **kwargs)
        raise self._fail(f"dropout of a plain tensor of shape {tuple(x.shape)} "
                         + ("inside a TP region" if kind == REGION else "holding this rank's part of the batch"),
                         "a plain (local) tensor whose sharding is unknown", path)

    def _unmapped(self, func, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("input")
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
        kind, path = self._context()
        if train and p and (isinstance(x, DTensor) or not self._replicated(kind)):
            raise self._fail(f"{getattr(func, '__name__', func)} is not mapped", f"a {type(x).__name__} input", path)

    def _sdpa(self, func, args, kwargs):
        q, k, v, mask, p, causal, scale, gqa = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
        if not p:
            return func(*args, **kwargs)
        kind, path = self._context()
        if any(isinstance(t, DTensor) for t in (q, k, v, mask)):
            raise self._fail("F.scaled_dot_product_attention(dropout_p > 0) on DTensors",
                             "DTensor q/k/v/attn_mask (keep them local: colwise use_local_output true)", path)
        if kind != REGION:
            if self._replicated(kind):
                return func(*args, **kwargs)
            raise self._fail("attention dropout outside a TP region on this rank's part of the batch",
                             "plain q/k/v", path)
        if q.dim() != 4:
            raise self._fail("attention dropout inside a TP region needs (batch, heads, seq, head_dim) q/k/v",
                             f"q of shape {tuple(q.shape)}", path)
        b, h, lq, _ = q.shape
        shape = (b, h * self.tp, lq, k.size(-2))  # the attention probabilities of all heads
        dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        noise = _noise(shape, None, dtype, q.device, p)
        local = noise.narrow(1, self.mesh.get_local_rank() * h, h)  # colwise q: this rank's heads, in order
        return sdpa_math(q, k, v, mask, causal, scale, gqa, noise=local)
