"""The first-forward audit of context parallelism, run by ``meshplan check`` on a small copy.

:class:`~meshplan.context_parallel.runtime.CpRuntime` refuses, at the first forward, a
``scaled_dot_product_attention`` call outside the plan's attention modules, an attention module that calls none, and
a softmax over a (sequence × sequence) score matrix (attention written by hand).
``check`` runs the same audit on one forward of the small copy the cross-shard check runs
(:func:`meshplan.model_copies.small_copy`), so a plan ``check`` passes does not stop there: HRM's
``H_module`` and ``L_module`` both hold attention, and a plan naming one of them is refused here, with the pattern
to add.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshplan.plan_file.patterns import path_matches, wildcard

__all__ = ["attention_audit_errors"]


_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax)


class _Callers(TorchFunctionMode):
    """Records the module stack (paths, outermost first) of every ``scaled_dot_product_attention`` call, and the
    innermost module of every softmax over a ``seq × seq`` matrix (in ``hand``)."""

    def __init__(self, stack: list[str], calls: list[tuple[str, ...]], seq: int, hand: list[str]) -> None:
        super().__init__()
        self.stack, self.calls, self.seq, self.hand = stack, calls, seq, hand

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls.append(tuple(self.stack))
        elif func in _SOFTMAX and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 \
                and tuple(args[0].shape[-2:]) == (self.seq, self.seq):
            self.hand.append(self.stack[-1] if self.stack else "(root)")
        return func(*args, **(kwargs or {}))


_Found = tuple[list[tuple[str, ...]], list[str], list[str]]


def _sdpa_calls(model: nn.Module, cp: int, notes: list[str]) -> _Found | None:
    """``(call stacks, module paths, hand-written softmax callers)`` of one forward of the small copy, or None (with
    a note) when it cannot run."""
    from meshplan.model_copies import default_batch
    from meshplan.model_copies import small_copy
    try:
        small = small_copy(model, cp, notes)
        if small is None:
            return None
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl is not None and getattr(small, "config", None) is not None:
            small.config._attn_implementation = impl  # the routed attention is SDPA: the model's own choice
        batch = {k: v for k, v in default_batch(model, cp).items() if k != "labels"}
        stack: list[str] = []
        calls: list[tuple[str, ...]] = []
        hand: list[str] = []
        handles = []
        for path, m in small.named_modules():
            if path:
                handles.append(m.register_forward_pre_hook(lambda _m, _a, p=path: stack.append(p)))
                handles.append(m.register_forward_hook(lambda _m, _a, _o: stack.pop() and None, always_call=True))
        try:
            seq = next(iter(batch.values())).shape[-1]
            with torch.no_grad(), _Callers(stack, calls, seq, hand):
                small(**batch) if hasattr(small, "config") else small(*batch.values())
        finally:
            for h in handles:
                h.remove()
    except Exception as e:  # the runtime audits the first forward anyway
        notes.append(f"context_parallel: attention calls not audited offline: a small copy's forward failed "
                     f"({type(e).__name__}: {' '.join(str(e).split())[:120]}); parallelize audits the first forward")
        return None
    return calls, [p for p, _ in small.named_modules() if p], hand


def attention_audit_errors(model: nn.Module, patterns: tuple[str, ...] | list[str], cp: int, where: str,
                           notes: list[str]) -> list[str]:
    """What the runtime's first-forward audit would refuse, found on a small copy (see the module docstring).

    Args:
        model: the model checked (not changed); patterns: the section's ``attention`` patterns.
        cp: the degree (sizes of the small copy divisible by it); where: the error prefix.
        notes: gets one line when the small copy cannot run (nothing is refused then).
    """
    found = _sdpa_calls(model, cp, notes)
    if found is None:
        return []
    calls, paths, hand = found

    def listed(path: str) -> bool:
        return any(path_matches(p, path) or path_matches(p, wildcard(path)) for p in patterns)
    outside = list(dict.fromkeys(wildcard(s[-1]) if s else "(root)" for s in calls if not any(map(listed, s))))
    called = {p for s in calls for p in s}
    silent = list(dict.fromkeys(wildcard(p) for p in paths if listed(p) and p not in called))
    errors = [f"{where}.attention: {path} calls scaled_dot_product_attention outside the attention modules "
              f"{list(patterns)} (one forward of a small copy; parallelize refuses it at the first forward); found "
              f"it unlisted, expected its pattern in context_parallel.attention: add {path!r}" for path in outside]
    errors += [f"{where}: {path} computes a softmax over a sequence × sequence score matrix itself (attention "
               f"written by hand; one forward of a small copy); found it, expected scaled_dot_product_attention "
               f"(transformers: attn_implementation='sdpa'), the only attention context parallelism makes exact "
               f"across shards" for path in dict.fromkeys(map(wildcard, hand))]
    if silent:
        errors.append(f"{where}.attention: the attention modules {silent} called no scaled_dot_product_attention in "
                      f"one forward of a small copy (attention written by hand, or a module that is not attention); "
                      f"found them listed, expected only modules whose attention is scaled_dot_product_attention")
    return errors
