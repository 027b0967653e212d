"""The model's ONE gradient finaliser: every tp reduction of a step in ONE collective, in any training loop.

A neutral module (it imports no axis folder and not the state module): :func:`meshplan.parallelize` creates the
model's one :class:`GradFinalizer` (:func:`finalizer_for`) and hands it to the axes through the record so far
(:attr:`meshplan.state.ParallelState.gradients`), which track the parameters whose gradients need a sum over tp
(replicated parameters, the plain parameters of a token region) and re-install it on FSDP2's parameters;
:func:`meshplan.train_step` finishes it once per step.

Two kinds of gradients need a sum over tp after backward:

* ``Partial`` grads of ``Replicate`` DTensor parameters (norm weights under sequence parallelism, ``replicate``
  modules): each tp rank saw a different part of the sequence;
* in smp's batch mode (``sequence_parallel: batch``), grads of plain (non-DTensor) parameters: each tp rank saw
  different samples.

Left alone, DTensor (or FSDP2, which redistributes each ``Partial`` grad before its reduce-scatter) issues one
all-reduce per parameter. :class:`GradFinalizer` does it with one flat all-reduce per (process groups, dtype):

1. a hook on each such parameter (the tensor autograd writes to: the parameter itself, or FSDP2's unsharded
   parameter) relabels a ``Partial`` grad as ``Replicate`` (local values unchanged) and records it as pending;
   FSDP2 then reduce(-scatters) the tp-partial sums over dp like any gradient (sharded: cheaper than
   all-reducing the full norm grads over tp first);
2. at the start of each backward the tracked parameters' current (final) grads are set aside, so after backward
   their ``.grad`` holds only this backward's contribution;
3. an autograd-engine final callback, queued after FSDP2's own root post-backward callback (FSDP2 queues it in
   its root pre-backward hook, before any parameter hook fires; callbacks run in order), all-reduces the pending
   contributions over tp in one buffer and adds them to the set-aside grads.

Only new contributions are reduced, so every accumulation pattern is exact: several backwards per step, FSDP2's
no-sync microbatches (their contributions wait in FSDP2's unsharded grads and are reduced with the syncing
backward; until then they stay pending), ``zero_grad`` between backwards or not. Inside :meth:`~GradFinalizer.
deferred` (:func:`meshplan.train_step`) the callback is not queued: one :meth:`~GradFinalizer.finish` after the
last microbatch reduces them all.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshplan._torch import funcol, hook_registered, local_tensor, queue_backward_callback, tree_leaves

__all__ = ["GradFinalizer", "finalizer_for", "replicated_names"]


def _clean(name: str) -> str:
    """A parameter path without checkpoint-wrapper segments."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _partial_groups(g: DTensor) -> tuple:
    """The process groups of ``g``'s ``Partial(sum)`` mesh dims (empty: nothing to reduce)."""
    dims = [i for i, pl in enumerate(g.placements) if isinstance(pl, Partial)]
    if not dims or any(g.placements[i].reduce_op != "sum" for i in dims):
        return ()
    return tuple(g.device_mesh.get_group(i) for i in dims)


def _relabel(g: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as a DTensor like ``g`` with ``Partial`` placements relabelled ``Replicate`` (no communication)."""
    placements = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in g.placements)
    stride = g.stride() if local.stride() == local_tensor(g).stride() else None
    return DTensor.from_local(local, g.device_mesh, placements, run_check=False, shape=g.shape, stride=stride)


def _same_holder(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can ``b`` replace ``a`` as the holder of final grads (same kind and mesh; not FSDP2's unsharded one)?"""
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    return not isinstance(a, DTensor) or a.device_mesh == b.device_mesh


def _add_into(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old + new``, in ``old``'s storage where the layouts agree."""
    if type(old) is type(new) and getattr(old, "placements", None) == getattr(new, "placements", None):
        local_tensor(old).add_(local_tensor(new))
        return old
    return old + new


def replicated_names(model: nn.Module, size: int, sequence_parallel: bool | str = False,
                     summed: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """``(names, plain)``: the parameters of a tensor-parallel ``model`` (before FSDP) whose gradients need a sum
    over its ``size`` tp ranks: its ``Replicate`` DTensor parameters, and as plain tensors those named in
    ``summed`` (``head_norm`` modules: each rank's gradient covers its heads) and, in batch mode, every other plain
    parameter (each rank saw its own samples); the plain ones only when ``size > 1``."""
    names, plain = [], [n for n in summed if size > 1]
    batch = sequence_parallel == "batch" and size > 1
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if isinstance(p, DTensor):
            if all(isinstance(pl, Replicate) for pl in p.placements):
                names.append(n)
        elif batch and n not in plain:
            plain.append(n)
    return names, plain


def finalizer_for(model: nn.Module, mesh: Any, sequence_parallel: bool | str = False, summed: Iterable[str] = (),
                  into: "GradFinalizer | None" = None) -> "GradFinalizer | None":
    """Track ``model``'s :func:`replicated_names` over the 1-D ``mesh`` in ``into`` (the model's finaliser that
    :func:`meshplan.parallelize` handed over) or, called outside ``parallelize``, in a new one; returns it, or None
    when there was nothing to track and none was handed. Call :meth:`GradFinalizer.install` after."""
    names, plain = replicated_names(model, mesh.size(), sequence_parallel, summed)
    if not names and not plain and into is None:
        return None
    sync = into if into is not None else GradFinalizer()
    return sync.track(mesh.get_group(), names, plain) if names or plain else sync


class GradFinalizer:
    """Coalesced tp reduction of tp-replicated gradients after every backward (or step); created empty (by
    :func:`meshplan.parallelize`, once per model, or :func:`finalizer_for`), the axes it is handed to add what to
    sum with :meth:`track`.

    Attributes:
        tp_group: the tp process group plain parameters reduce over (None until the first :meth:`track`).
        names: paths of the tracked parameters (checkpoint-wrapper segments ignored); ``plain``: those reduced
            as plain tensors (batch mode, head norms, MoE token regions); ``active``: whether any is tracked.

    Example::

        >>> sync = finalizer_for(model, tp_mesh, sequence_parallel=True)
        >>> sync.install(model)            # after fully_shard too: hooks go on FSDP2's parameters
        >>> loss.backward()                # one all-reduce over tp for all norm grads
    """

    def __init__(self) -> None:
        self.tp_group: Any = None
        self.plain: set[str] = set()
        self.names: set[str] = set()
        self.active = False  # an attribute, not a property: state.grad_sync reads it without a call
        self.collectives = 0  # all-reduces issued so far (diagnostics)
        self._params: dict[str, torch.Tensor] = {}  # clean name -> the parameter that holds the final grad
        self._raw: dict[str, str] = {}  # clean name -> its path in the model
        self._pending: dict[str, tuple] = {}  # clean name -> process groups to sum its next grad over
        self._stash: dict[str, torch.Tensor] = {}
        self._open = self._queued = self._deferred = self._fsdp = False
        self._hooked: dict[int, Any] = {}  # id(tensor) -> hook handle (no weakrefs: they block swap_tensors)
        self._handles: list = []


    def track(self, tp_group: Any, names: Iterable[str] = (), plain: Iterable[str] = ()) -> "GradFinalizer":
        """Also sum the gradients of ``names`` (their ``Partial`` placements say over what) and of the plain
        parameters ``plain`` (over ``tp_group``, which the first call sets: each tp rank saw its own tokens) after
        backward; call :meth:`install` after."""
        self.tp_group = self.tp_group if self.tp_group is not None else tp_group
        added = {_clean(n) for n in plain}
        self.plain |= added
        self.names |= {_clean(n) for n in names} | added
        self.active = bool(self.names)
        return self

    # ------------------------------------------------------------------ installation
    def install(self, model: nn.Module) -> "GradFinalizer":
        """(Re)install the hooks on ``model``; call again after ``fully_shard``/``replicate``.

        Without FSDP2 only the root's outputs are hooked (backward starts there; the grads' own placements
        say what is partial). Under FSDP2 each FSDP module's outputs are hooked, and its gathered parameters
        (``Partial`` grads are relabelled there, before FSDP2 would redistribute each one); the root's too when
        it is no FSDP module (FSDP2 on the experts only, over edp: a plain parameter's grad, MuseSpark's
        ``post_expert_proj`` after the experts, arrives before the experts' output grad)."""
        from torch.distributed.fsdp import FSDPModule
        self.remove()
        self._raw = {_clean(n): n for n, _ in model.named_parameters() if _clean(n) in self.names}
        self._params = {c: model.get_parameter(r) for c, r in self._raw.items()}
        fsdp = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDPModule)]
        self._fsdp = bool(fsdp)
        self._handles.append(model.register_forward_pre_hook(self._refresh, prepend=True))
        for prefix, mod in fsdp:  # after FSDP2's own hooks: parameters gathered, its pre-backward hook set
            self._handles.append(mod.register_forward_pre_hook(functools.partial(self._hook_gathered, prefix)))
            self._handles.append(mod.register_forward_hook(self._hook_output))
        if not isinstance(model, FSDPModule):  # also beside FSDP2 on the experts only: backward starts at the root
            self._handles.append(model.register_forward_hook(self._hook_output))
        return self

    def remove(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        for h in self._hooked.values():
            h.remove()
        self._handles, self._hooked = [], {}

    def _refresh(self, model: nn.Module, args: Any) -> None:
        """Root pre-forward: follow parameters replaced since install (``to_empty``, loading)."""
        for c, raw in self._raw.items():
            try:
                p = model.get_parameter(raw)
            except AttributeError:
                continue
            old = self._params.get(c)
            if p is not old and (old is None or _same_holder(old, p)):
                self._params[c] = p

    def _hook_gathered(self, prefix: str, module: nn.Module, args: Any) -> None:
        for name, p in module.named_parameters(prefix=prefix):
            c = _clean(name)
            if c in self.names and p.requires_grad:
                self._hook(c, p)

    def _hook_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_output_grad)

    def _hook(self, name: str, p: torch.Tensor) -> None:
        handle = self._hooked.get(id(p))  # FSDP2's unsharded parameters persist (nothing swaps them)
        if handle is not None and hook_registered(p, handle):
            return  # hooked already (handle ids are unique, so a reused id(p) is told apart)
        self._hooked[id(p)] = p.register_hook(functools.partial(self._on_grad, name))

    # ------------------------------------------------------------------ backward
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._begin()

    def _on_grad(self, name: str, g: torch.Tensor) -> torch.Tensor | None:
        """FSDP2's gathered parameter: relabel a ``Partial`` grad ``Replicate``, remember its groups."""
        groups, out = None, None
        if isinstance(g, DTensor):
            groups = _partial_groups(g)
            if groups:
                out = _relabel(g, local_tensor(g))
        elif name in self.plain:
            groups = (self.tp_group,)
        if groups:
            self._begin()
            self._pending[name] = groups
        return out

    def _begin(self) -> None:
        """First event of a backward: set the final grads aside, queue :meth:`finish`."""
        if not self._open:
            self._open = True
            for c, p in self._params.items():
                if p.grad is not None:
                    self._stash[c] = p.grad
                    p.grad = None
        if not self._queued and not self._deferred:
            self._queued = True
            queue_backward_callback(self.finish)

    @contextlib.contextmanager
    def deferred(self):
        """Within: backwards accumulate without tp reductions; call :meth:`finish` after the last one."""
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False

    def finish(self) -> int:
        """All-reduce the pending contributions over tp, one flat buffer per (groups, dtype), and add them to
        the grads set aside. Returns the number of buffers reduced."""
        self._queued = False
        if not self._open:
            return 0
        self._open = False
        stash, self._stash = self._stash, {}
        buckets: dict[tuple, list] = defaultdict(list)
        for c, p in self._params.items():
            g, old = p.grad, stash.get(c)
            if g is None:  # no new grad (FSDP2 no-sync: the contribution is still unsharded and pending)
                if old is not None:
                    p.grad = old
                continue
            # FSDP2: what the hooks recorded; else the grad says (Partial dims; plain grads in batch mode)
            groups = self._pending.pop(c, None) or (_partial_groups(g) if isinstance(g, DTensor) else
                                                    (self.tp_group,) if c in self.plain else ())
            if groups:
                local = local_tensor(g)
                buckets[(groups, local.dtype, local.device)].append((p, g, local, old))
            elif old is not None:
                p.grad = _add_into(old, g)
        for (groups, _, _), items in buckets.items():
            flat = torch.cat([local.reshape(-1) for _, _, local, _ in items])
            for group in groups:
                flat = funcol.all_reduce(flat, "sum", group)
            if isinstance(flat, funcol.AsyncCollectiveTensor):
                flat = funcol.wait_tensor(flat)
            offset = 0
            for p, g, local, old in items:
                piece = flat[offset:offset + local.numel()].view(local.shape)
                offset += local.numel()
                if old is not None:
                    local_tensor(old).add_(piece)
                    p.grad = old
                else:  # the flat buffer's slice, labelled with the parameter's placements
                    p.grad = _relabel(g, piece) if isinstance(g, DTensor) else piece
        self.collectives += len(buckets)
        return len(buckets)
