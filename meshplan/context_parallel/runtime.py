"""What runs during a context-parallel forward: positions for the local tokens, attention routed across shards,
and an audit of the first forward.

:class:`CpRuntime` belongs to one model (two models coexist). Its hooks:

* on the root module: learn the local length from the input, give the model each token's true position (a
  keyword argument, or the rows of a position-indexed buffer), and on the first forward watch the whole model:
  ``scaled_dot_product_attention`` outside the plan's attention modules, or a softmax over a (local length ×
  local length) score matrix (attention written by hand), is refused before any gradient exists;
* on each attention module: route its ``scaled_dot_product_attention`` calls to the cross-shard attention of the
  plan's method.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshplan._torch import module_buffers
from meshplan.context_parallel.chunks import rank_positions
from meshplan.context_parallel.replay import refuse_outside
from meshplan.errors import PlanError

__all__ = ["CpRuntime"]

_SDPA = F.scaled_dot_product_attention
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax)


class _Route(TorchFunctionMode):
    """Inside an attention module: its ``scaled_dot_product_attention`` calls go to ``attend``."""

    def __init__(self, runtime: "CpRuntime", path: str) -> None:
        super().__init__()
        self.runtime, self.path = runtime, path

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            self.runtime.called.add(self.path)
            return self.runtime.attend(*args, **(kwargs or {}), where=self.path, **self.runtime.masking(self.path))
        return func(*args, **(kwargs or {}))


class _Audit(TorchFunctionMode):
    """The first forward, the whole model: attention the plan's modules do not hold is an error."""

    def __init__(self, runtime: "CpRuntime") -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rt = self.runtime
        if func is _SDPA and rt.depth == 0:
            raise PlanError(f"context_parallel: {rt.module_path()} calls scaled_dot_product_attention outside the "
                            f"attention modules {list(rt.patterns)}; add its path to context_parallel.attention")
        if func in _SOFTMAX and args and isinstance(args[0], torch.Tensor) and rt.local_len is not None \
                and args[0].dim() >= 2 and tuple(args[0].shape[-2:]) == (rt.local_len, rt.local_len):
            raise PlanError(f"context_parallel: {rt.module_path()} computes a softmax over a {rt.local_len}×"
                            f"{rt.local_len} score matrix itself (attention written by hand); context parallelism "
                            f"makes scaled_dot_product_attention exact across shards only (transformers: "
                            f"attn_implementation='sdpa')")
        return func(*args, **(kwargs or {}))


@dataclass
class CpRuntime:
    """One model's context-parallel runtime: the cp group, the layout, and the per-forward state.

    Attributes:
        group, cp, rank: the ``cp`` process group, its size and this rank's index.
        load_balance, seq_dim: the plan's layout of the sequence.
        attend: ``attend(q, k, v, ..., where=path)``, the cross-shard attention of the plan's method.
        positions_kwarg, buffer, buffer_dim: how the model learns positions (the plan's ``positions``).
        patterns, attention_paths: the plan's attention patterns and the modules they matched.
        layer_masks: the :class:`~meshplan.context_parallel.masks.AttentionMask` of each attention module whose
            model says it (transformers' per-layer sliding windows); the others follow their call.
        masked: ``attend`` takes ``mask`` and ``documents`` (all-gather, ring); else a window or documents are refused.
        forwarding, replaying: root forwards and recomputes (:mod:`~meshplan.context_parallel.replay`) running.
        documents: this forward's ``(batch, seq)`` document ids per global position (packed sequences), or None.
        keeps: this forward's keep-matrices, built by the first layer that needs one and shared by the others
            (emptied at each forward's start; keyed by the documents they were built from).
        by_documents: the batch was laid out per document (document-major order,
            :mod:`~meshplan.context_parallel.documents`): set by each
            :func:`~meshplan.context_parallel.batch.shard_for_state`; the document ids then follow that order.
        use_cache: the model config's ``use_cache`` (a forward without ``use_cache`` reads it).
        packing: the model masks packed documents by position ids (:func:`~meshplan.context_parallel.hf_check.
            reads_packing`); False: documents are not masked, as on one device (Afmoe).
    """

    group: Any
    cp: int
    rank: int
    load_balance: bool
    seq_dim: int
    attend: Callable
    positions_kwarg: str | None
    buffer: str | None
    buffer_dim: int
    patterns: tuple[str, ...]
    attention_paths: tuple[str, ...]
    inject_mask: bool = False
    packing: bool = True
    layer_masks: dict = field(default_factory=dict)
    masked: bool = True
    documents: Any = None
    keeps: dict = field(default_factory=dict)
    by_documents: bool = False
    use_cache: bool = False
    depth: int = 0
    forwarding: int = 0
    replaying: int = 0
    local_len: int | None = None
    audited: set = field(default_factory=set)
    called: set = field(default_factory=set)
    _stack: list = field(default_factory=list)
    _modes: list = field(default_factory=list)
    _swapped: list = field(default_factory=list)
    _audit: Any = None

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The true positions of this rank's ``local_len`` tokens (a sequence of ``local_len · cp``).

        Raises:
            PlanError: ``local_len`` is not a whole number of this rank's chunks.
        """
        held = 2 if self.load_balance else 1
        if local_len % held:
            raise PlanError(f"context_parallel: the model got {local_len} tokens per sequence, not this rank's "
                            f"{held} equal chunks; feed it through meshplan.train_step or shard_batch")
        return torch.tensor(rank_positions(local_len * self.cp, self.cp, self.rank, self.load_balance),
                            device=device)

    def masking(self, path: str) -> dict:
        """The keyword arguments ``attend`` gets for the module at ``path``: its layer's mask and the documents.

        Raises:
            PlanError: a window, soft-cap or documents with a method that does not take them (torch_ring).
        """
        mask = self.layer_masks.get(path)
        if mask is None and self.documents is None:
            return {}
        if not self.masked:
            raise PlanError(f"context_parallel: {path} needs {mask or 'document masks (packed sequences)'}; "
                            f"method: torch_ring does not take them; use method: ring or allgather_kv")
        return {"mask": mask, "documents": self.documents, "keeps": self.keeps}

    def reads_documents(self, kwargs: dict) -> bool:
        """Whether the model masks packed documents by the position ids in ``kwargs``, as transformers reads them
        (``masking_utils._preprocess_mask_arguments``): position ids given, no ``attention_mask`` and no cache
        (``use_cache`` off: with the config's default ``use_cache=True`` a transformers model builds a cache and
        ignores the packing, on one device too)."""
        ids = kwargs.get(self.positions_kwarg) if self.positions_kwarg is not None else None
        use_cache = kwargs.get("use_cache")
        use_cache = self.use_cache if use_cache is None else use_cache
        return self.inject_mask and self.packing and ids is not None and kwargs.get("attention_mask") is None and not use_cache \
            and kwargs.get("past_key_values") is None

    def documents_layout_possible(self, kwargs: dict) -> bool:
        """Whether a batch of these keyword inputs may be laid out per document: the documents are masked
        (:meth:`reads_documents`, a method that takes them), the positions are the batch's (no buffer indexed by
        position), and no layer has a sliding window (it measures true distances; the layout stretches them)."""
        return self.masked and self.buffer is None and self.reads_documents(kwargs) \
            and all(m is None or m.window is None for m in self.layer_masks.values())

    def _documents(self, kwargs: dict, rows: int) -> torch.Tensor | None:
        """Document ids per global (virtual) position from the caller's position ids, all-gathered over cp: the
        local ids cannot say where a document starts. None for one document per row, or when the model does not
        read packing (:meth:`reads_documents`). A batch laid out per document (``by_documents``) has its ids in
        document-major order (:func:`~meshplan.context_parallel.documents.virtual_documents`).

        Raises:
            PlanError: ``by_documents`` and the position ids are not in document-major order, or given but not
                read as packing (``attention_mask`` or a cache: the forward would attend across documents).
        """
        if not self.reads_documents(kwargs):
            if self.by_documents and kwargs.get(self.positions_kwarg) is not None:
                raise PlanError("context_parallel: the batch was laid out per document (shard_for_state) but the "
                                "forward does not mask documents (attention_mask, use_cache or no position ids); "
                                "call the model with the inputs shard_for_state returned")
            return None
        from meshplan.context_parallel.batch import documents_of
        local = kwargs[self.positions_kwarg].expand(rows, -1).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.cp)]
        torch.distributed.all_gather(parts, local, group=self.group)
        order = torch.argsort(torch.tensor([p for r in range(self.cp) for p in
                                            rank_positions(local.shape[-1] * self.cp, self.cp, r, self.load_balance)]))
        ids = torch.cat(parts, -1).index_select(-1, order.to(local.device))
        if not self.by_documents:
            return documents_of(ids)
        from meshplan.context_parallel.documents import virtual_documents
        try:
            return virtual_documents(ids, self.cp)
        except ValueError as e:
            raise PlanError(f"context_parallel: the batch was laid out per document by shard_for_state, but {e}; "
                            f"feed each batch through meshplan.train_step or shard_for_state") from None

    def module_path(self) -> str:
        return self._stack[-1] if self._stack else "the model"

    def install(self, model: nn.Module) -> None:
        """Register the hooks on ``model`` (the root) and on its attention modules."""
        self.use_cache = bool(getattr(getattr(model, "config", None), "use_cache", False))
        model.register_forward_pre_hook(self._root_pre, with_kwargs=True)
        model.register_forward_hook(self._root_post, always_call=True)
        for path in self.attention_paths:
            module = model.get_submodule(path)
            module.register_forward_pre_hook(self._enter(path))
            module.register_forward_hook(self._leave(path), always_call=True)

    def _enter(self, path: str) -> Callable:
        def hook(_m: nn.Module, _args: tuple) -> None:
            refuse_outside(self, path)
            mode = _Route(self, path)
            mode.__enter__()
            self._modes.append(mode)
            self.depth += 1
        return hook

    def _leave(self, path: str) -> Callable:
        def hook(_m: nn.Module, _args: tuple, _out: Any) -> None:
            self.depth -= 1
            self._modes.pop().__exit__(None, None, None)
        return hook

    def _root_pre(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if first is None or first.dim() <= self.seq_dim:
            raise PlanError(f"context_parallel: {type(model).__name__}'s forward got no tensor with a sequence dim "
                            f"{self.seq_dim} to learn the local length from")
        self.local_len = first.shape[self.seq_dim]
        self.forwarding += 1
        pos = self.positions(self.local_len, first.device)
        self.documents = self._documents(kwargs, first.shape[0])
        self.keeps = {}  # per forward; keyed by the documents tensor (held), so a later recompute never takes another batch's
        if self.positions_kwarg is not None and kwargs.get(self.positions_kwarg) is None:
            kwargs = {**kwargs, self.positions_kwarg: pos.unsqueeze(0).expand(first.shape[0], -1)}
        if self.inject_mask and kwargs.get("attention_mask") is None:  # else a jump in positions reads as packing
            kwargs = {**kwargs, "attention_mask": torch.ones(first.shape[0], self.local_len, dtype=torch.long,
                                                             device=first.device)}
        if self.buffer is not None:
            owner, name = _owner(model, self.buffer)
            full = module_buffers(owner)[name]
            self._swapped.append((owner, name, full))
            module_buffers(owner)[name] = full.index_select(self.buffer_dim, pos.to(full.device))
        if id(model) not in self.audited:  # each root once: the model, or each pipeline stage view
            self._start_audit(model)
        return args, kwargs

    def _root_post(self, model: nn.Module, _args: tuple, out: Any) -> None:
        self.forwarding = max(0, self.forwarding - 1)
        if self.buffer is not None:
            owner, name, full = self._swapped.pop()
            module_buffers(owner)[name] = full
        if id(model) not in self.audited:
            self._finish_audit(model, out is not None)

    def _start_audit(self, model: nn.Module) -> None:
        self.called.clear()
        audit = _Audit(self)
        stack = contextlib.ExitStack()
        for path, module in model.named_modules():
            if path:
                stack.callback(module.register_forward_pre_hook(self._push(path)).remove)
                stack.callback(module.register_forward_hook(self._pop, always_call=True).remove)
        audit.__enter__()
        stack.callback(audit.__exit__, None, None, None)
        self._audit = stack

    def _push(self, path: str) -> Callable:
        def hook(_m: nn.Module, _args: tuple) -> None:
            self._stack.append(path)
        return hook

    def _pop(self, _m: nn.Module, _args: tuple, _out: Any) -> None:
        self._stack.pop()

    def _finish_audit(self, model: nn.Module, completed: bool) -> None:
        self._audit.close()
        self._stack.clear()
        if not completed:
            return
        self.audited.add(id(model))
        present = {path for path, _ in model.named_modules()}
        silent = [p for p in self.attention_paths if p in present and p not in self.called]
        if silent:
            raise PlanError(f"context_parallel: the attention modules {silent} called no "
                            f"scaled_dot_product_attention in the first forward (attention written by hand, or a "
                            f"module that is not attention); context_parallel.attention names modules whose "
                            f"attention is scaled_dot_product_attention")


def _owner(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name
