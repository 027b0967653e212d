"""Collective counting for the benchmarks: every collective one rank issues, its group and its bytes.

:class:`CommLog` is a ``TorchDispatchMode`` that, like ``CommDebugMode``, declines ops on DTensors
(``NotImplemented``) so that the collectives DTensor issues while dispatching an op (a ``Partial`` gradient met
in the optimizer, ``loss_parallel``'s handlers) reach it as well. Bytes are what ONE rank sends in a ring:
(d-1)/d of the full buffer for all-gather and reduce-scatter, 2(d-1)/d for all-reduce.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommLog"]

#: collective op name → (kind, index of the tensor argument, the factor from it to the full buffer's size)
_OPS = {"all_reduce": ("all_reduce", 0, 1), "all_reduce_": ("all_reduce", 0, 1), "allreduce_": ("all_reduce", 0, 1),
        "all_reduce_coalesced": ("all_reduce", 0, 1), "all_gather_into_tensor": ("all_gather", 0, "d"),
        "_allgather_base_": ("all_gather", 0, 1), "reduce_scatter_tensor": ("reduce_scatter", 0, 1),
        "_reduce_scatter_base_": ("reduce_scatter", 1, 1), "all_to_all_single": ("all_to_all", 1, 1),
        "alltoall_base_": ("all_to_all", 1, 1), "send": ("send", 0, 1), "recv_": ("recv", 0, 1)}


def _group_size(args) -> int:
    names = [a for a in args if isinstance(a, str)]
    if names:  # functional collectives: the group name is the last string argument
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(names[-1]).size()
    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops: the process group
            return dist.ProcessGroup.unbox(a).size()
    raise AssertionError(f"no process group among {[type(a).__name__ for a in args]}")


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


@dataclass
class CommLog(TorchDispatchMode):
    """Records every collective as ``(kind, group size, full buffer bytes)``.

    Like ``CommDebugMode`` it declines ops on DTensors (``NotImplemented``) so that the collectives DTensor
    issues while dispatching an op (a ``Partial`` gradient met in the optimizer, ``loss_parallel``'s
    handlers) reach it too; a mode that runs the DTensor op itself never sees them.
    """

    records: list = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        op = getattr(func, "_schema", None)
        spec = _OPS.get(op.name.split("::")[-1]) if op is not None and func.namespace in (
            "c10d", "_c10d_functional", "c10d_functional") else None
        if spec is not None:
            kind, i, factor = spec
            d = _group_size(args)
            d = 2 if kind in ("send", "recv") else d  # a point-to-point op joins two ranks
            self.records.append((kind, d, _nbytes(args[i]) * (d if factor == "d" else 1)))
        return out

    def calls(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _, _ in self.records:
            out[kind] = out.get(kind, 0) + 1
        return out

    def ring_bytes(self) -> float:
        return sum(n * (d - 1) / d * (2 if kind == "all_reduce" else 1) for kind, d, n in self.records)

    def by_group(self) -> Counter:
        """``Counter`` of ``"<kind>@<group size>"``."""
        return Counter(f"{kind}@{d}" for kind, d, _ in self.records)

    def ring_bytes_by_kind(self) -> Counter:
        """``Counter`` of the ring bytes one rank sends, per kind."""
        out: Counter = Counter()
        for kind, d, n in self.records:
            out[kind] += n * (d - 1) / d * (2 if kind == "all_reduce" else 1)
        return out
