"""Save this rank's shard of an all-gathered block input, not the gathered tensor; gather it again in backward.

Under sequence parallelism a block's input arrives sequence-sharded and is all-gathered once for its colwise
children (:class:`~meshplan.tensor_parallel.styles.PrepareHiddenInput`). Their matmuls save the gathered input for
their weight gradients: ``tp`` times this rank's shard, kept from forward to backward. Megatron-SP saves the shard
and all-gathers it again in backward; so does :class:`Regather` (``tensor_parallel.save_gathered_inputs: false``):

* while the module's forward runs, saved-tensor hooks replace every saved tensor that lives in the gathered
  tensor's storage (the tensor itself, or a view such as the 2-D reshape a matmul saves) by a small record:
  the shard, the view's geometry;
* the first unpack in backward all-gathers the shard (once per block input, whatever the number of colwise
  children), the others reuse it; the gathered copy is dropped after the last unpack. The gather starts
  asynchronously as soon as the module's backward begins (a hook on its output's gradient), so it overlaps the
  backward of the layers after the colwise ones (attention, the row-parallel output).

The values are the forward's, bit for bit: training is unchanged. Under activation checkpointing the block is
recomputed anyway: when another saved-tensor hook is active (checkpointing's), :class:`Regather` stands aside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshplan._torch import funcol, local_tensor, queue_backward_callback, saved_tensors_hooks_active, tree_leaves

__all__ = ["Regather"]


@dataclass
class _Saved:
    """One saved view of the gathered tensor: what unpack needs to rebuild it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    spec: Any = None  # (mesh, placements, shape, stride) of a DTensor view; None for a plain tensor


class _Gather:
    """The gathered input of one forward call: its shard, and the re-gathered copy while backward needs it."""

    def __init__(self, shard: torch.Tensor, dim: int, group: Any, storage: int):
        self.shard, self.dim, self.group, self.storage = shard, dim, group, storage
        self.packs = self.unpacks = 0
        self.full: Any = None

    def start(self) -> None:
        if self.full is None and self.packs > self.unpacks:
            self.full = funcol.all_gather_single(self.shard.contiguous(), self.dim, self.group)
            queue_backward_callback(self.finish)

    def finish(self) -> None:
        """End of backward: a gather no saved tensor asked for (its node did not run) is waited and dropped."""
        if self.full is not None and hasattr(self.full, "wait"):
            funcol.wait_tensor(self.full)
        self.full = None

    def take(self) -> torch.Tensor:
        self.start()
        full = self.full = funcol.wait_tensor(self.full) if hasattr(self.full, "wait") else self.full
        self.unpacks += 1
        if self.unpacks == self.packs:
            self.full = None  # the last user holds it now
        return full


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None where there is none to compare (meta, simulated ranks' tensors)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # LocalTensorMode's per-rank tensors have no storage of their own: stand aside
        return None


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its autograd history, sharing its data. A saved output kept as itself would hold its own
    ``grad_fn``: a cycle through the C++ graph that gc cannot see, so a forward never backwarded kept its graph and
    the parameters it saved alive (docs/scale.md). A DTensor is rebuilt from its stored shard: no op dispatched
    through DTensor (the solver's per-block DTensor op counts stay exact)."""
    if isinstance(t, DTensor):
        return DTensor.from_local(local_tensor(t).detach(), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach()


class Regather:
    """Saved-tensor hooks for one module whose input is all-gathered over ``group`` on ``dim``.

    Args:
        group: the tp process group. dim: the dim the input is sharded on (the stream's).

    Example::

        >>> hooks = Regather(tp_mesh.get_group(), dim=1)
        >>> hooks.enter(module, shard, gathered)   # in the module's forward pre-hook, after gathering
        >>> hooks.exit()                           # in its forward hook
    """

    def __init__(self, group: Any, dim: int):
        import torch.distributed as dist
        self.group, self.dim, self.size = group, dim, dist.get_world_size(group)
        self._open: list = []

    def enter(self, shard: torch.Tensor | None, gathered: torch.Tensor | None) -> None:
        """Begin saving ``gathered``'s views as ``shard`` records (no-op when ``shard`` is None, under no_grad, or
        when another saved-tensor hook is active); every call is paired with :meth:`exit`."""
        local = gathered.to_local() if isinstance(gathered, DTensor) else gathered
        storage = _storage(local) if shard is not None else None
        if storage is None or not torch.is_grad_enabled() or saved_tensors_hooks_active() or \
                local.storage_offset() != 0 or not local.is_contiguous() or \
                shard.shape[self.dim] * self.size != local.shape[self.dim]:  # even shards only
            self._open.append(None)
            return
        g = _Gather(shard.detach(), self.dim, self.group, storage)
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(g, t), lambda s: self._unpack(g, s))
        ctx.__enter__()
        self._open.append((ctx, g))

    def exit(self, output: Any = None) -> None:
        """End the module's forward; its backward starts the re-gather (on ``output``'s gradient)."""
        entry = self._open.pop()
        if entry is None:
            return
        ctx, g = entry
        ctx.__exit__(None, None, None)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and g.packs:
                t.register_hook(lambda grad, g=g: g.start())
                break

    @staticmethod
    def _pack(g: _Gather, t: torch.Tensor) -> Any:
        local = t.to_local() if isinstance(t, DTensor) else t
        if _storage(local) != g.storage:
            return _detached(t)
        g.packs += 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _Saved(tuple(local.shape), tuple(local.stride()), local.storage_offset(), spec)

    @staticmethod
    def _unpack(g: _Gather, s: Any) -> torch.Tensor:
        if not isinstance(s, _Saved):
            return s
        view = g.take().as_strided(s.size, s.stride, s.offset)
        if s.spec is None:
            return view
        mesh, placements, shape, stride = s.spec
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)
