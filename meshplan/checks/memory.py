"""``meshplan.memory``: the activation bytes one training step keeps, per block, and its peak.

A dispatch mode watches every tensor the step's ops create (a DTensor counts its local shard). The bytes still
alive when the forward has returned are what autograd keeps for the backward (the saved activations, plus the
output), and they are attributed to the block that created them; the peak is the most bytes alive at once from
the start of the forward to the end of the backward. Storages are counted once (views share them) and by their
size in bytes, so the numbers are exact on the meta device (no memory is touched) and on CPU or CUDA. Parameters,
buffers and their views (a transposed weight) are not counted, nor inputs made before the step; FSDP2's gathered
parameters are (they are made in the step). FSDP2 frees a resharded block's gathered parameters by resizing their
storage to 0, which a dispatch mode does not see: ``saved`` reads each storage's size when the forward has
returned (so only the gathered parameters still held then count), while ``peak`` counts a gathered storage from
its first all-gather on (an upper bound under FSDP2).

The meta device runs the ops the model asks for, but kernels chosen by device are not: ``scaled_dot_product_attention``
takes its math path there (it keeps the ``s × s`` attention probabilities) where CPU and CUDA run fused kernels
(they keep the output and a log-sum-exp), so measure fused attention on the device it runs on.

On CUDA ``torch.cuda.max_memory_allocated`` is reported too (the allocator's view, with its caching and
fragmentation). Nothing here changes how the model runs: the SP re-gather (``save_gathered_inputs: false``) and
activation checkpointing work as in training.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from meshplan._torch import TorchDispatchMode, local_tensor, tree_leaves
from meshplan.plan_file.patterns import match_pattern

__all__ = ["ActivationMemory", "memory"]


@dataclass
class ActivationMemory:
    """What :func:`memory` measured, in bytes (this rank).

    Attributes:
        saved: bytes kept from the forward for the backward (alive when the forward returned).
        per_block: ``{block path: saved bytes it created}`` (``""``: outside every block).
        peak: most bytes alive at once during forward and backward (tensors the step created).
        cuda_peak: ``torch.cuda.max_memory_allocated`` over the step, or None off CUDA.
    """

    saved: int = 0
    per_block: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    cuda_peak: int | None = None

    def per_layer(self) -> float:
        """The mean saved bytes of the blocks."""
        blocks = [v for k, v in self.per_block.items() if k]
        return sum(blocks) / len(blocks) if blocks else 0.0


class _Tracker(TorchDispatchMode):
    def __init__(self, before: set[int]) -> None:
        super().__init__()
        self.before = before  # storages that existed before the step (parameters, buffers): views of them are free
        self.live: dict[int, tuple[Any, int, str]] = {}  # id(storage) -> (weakref, bytes, block)
        self.block = ""
        self.now = self.peak = 0

    def _gone(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.now -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = local_tensor(t).untyped_storage()
                key = id(st)
                if key not in self.live and key not in self.before:
                    self.live[key] = (weakref.ref(st, lambda _r, k=key: self._gone(k)), st.nbytes(), self.block)
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
        return out


def memory(model: nn.Module, step: Callable[[], Any], blocks: str = "layers.*") -> ActivationMemory:
    """Measure one training step's activation memory: ``step()`` runs the forward and returns the loss, whose
    ``backward()`` is then called (gradients accumulate as in training).

    Args:
        model: the (parallelized) model. step: runs the forward, returns the loss.
        blocks: the pattern of the blocks bytes are attributed to (as in the plan's ``blocks`` section).

    Returns:
        :class:`ActivationMemory`.

    Example::

        >>> mem = meshplan.memory(model, lambda: meshplan.cross_entropy(model(x), y))
        >>> mem.per_layer(), mem.peak
    """
    held = [local_tensor(t).untyped_storage() for t in (*model.parameters(), *model.buffers())]
    tracker = _Tracker({id(st) for st in held})
    paths = [p for p in match_pattern(model, blocks, "meshplan.memory") if p]
    handles = []
    for path in paths:
        mod = model.get_submodule(path)
        handles.append(mod.register_forward_pre_hook(lambda m, a, p=path: setattr(tracker, "block", p)))
        handles.append(mod.register_forward_hook(lambda m, a, o: setattr(tracker, "block", ""), always_call=True))
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        with tracker:
            loss = step()
            result = ActivationMemory()
            for ref, _, block in list(tracker.live.values()):
                st = ref()
                if st is not None:  # its size now: FSDP2 frees a resharded parameter by resizing its storage to 0
                    result.saved += st.nbytes()
                    result.per_block[block] = result.per_block.get(block, 0) + st.nbytes()
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        del held
    result.peak = tracker.peak
    result.cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    return result
