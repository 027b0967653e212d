"""What ``benchmarks/pp.py`` measures on each rank, and the replay of the executed actions.

:class:`Trace` wraps one rank's ``PipelineStage`` objects: every ``forward_one_chunk`` (F),
``backward_one_chunk`` (B, or I when the schedule splits the backward) and ``backward_weight_one_chunk`` (W)
the schedule calls is recorded with its start and end time, and, while armed, sleeps a fixed cost so that
wall-clock time is the schedule's and not the CPU's (F = I = W = 1 unit, B = I + W = 2 units). Tensors that
the stage modules save for backward are tracked with ``torch.autograd.graph.saved_tensors_hooks``: the bytes
of distinct tensors alive at once (parameters excluded), freed when autograd drops them.

:func:`replay` re-times the executed per-rank action order with the same unit costs, zero communication cost
and the pipeline's data dependencies (F of stage s after F of stage s−1; B/I of stage s after B/I of stage
s+1; W after I): the idle fraction of the schedule itself, free of scheduler noise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = ["COST", "Trace", "Tracker", "replay", "peak_in_flight"]

#: unit cost of each compute action (one unit = one forward of one microbatch through one stage)
COST = MappingProxyType({"F": 1, "I": 1, "W": 1, "B": 2})


class _Saved:
    """A saved tensor's holder: tells the tracker when autograd drops it.

    It keeps ``tensor.detach()``: a node that saves its own output (ReLU) would otherwise hold, through the
    holder, a tensor whose ``grad_fn`` is that node, a cycle autograd never frees when the node is not
    re-run (the split I/W backward leaves it so); autograd itself saves outputs without their ``grad_fn``.
    """

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: tuple, tracker: Tracker) -> None:
        self.tensor, self.key, self.tracker = tensor.detach(), key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


@dataclass
class Tracker:
    """Bytes of distinct tensors saved for backward and alive at once; ``skip``: storages never counted.

    A tensor saved twice (a ReLU's output is also the next Linear's input) counts once: the key is its data
    pointer and size, so a view counts its own bytes, not its base's.
    """

    skip: set = field(default_factory=set)
    refs: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    live: int = 0
    peak: int = 0

    def acquire(self, key: tuple, nbytes: int) -> None:
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1

    def release(self, key: tuple) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def pack(self, t: torch.Tensor):
        if t.numel() == 0 or t.untyped_storage().data_ptr() in self.skip:
            return t
        nbytes = t.numel() * t.element_size()  # a view (a microbatch of the batch) counts its own bytes
        key = (t.data_ptr(), nbytes)
        self.acquire(key, nbytes)
        return _Saved(t, key, self)

    @staticmethod
    def unpack(h):
        return h.tensor if isinstance(h, _Saved) else h

    def hooks(self):
        """The ``saved_tensors_hooks`` context that counts into this tracker."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@dataclass
class Trace:
    """One rank's record: ``events`` = ``(kind, stage, microbatch, start, end)``; ``tracker``: saved bytes."""

    unit_s: float
    tracker: Tracker
    events: list = field(default_factory=list)
    armed: bool = False

    def wrap(self, stage) -> None:
        """Record (and cost) every compute call the schedule makes on ``stage``."""
        fwd, bwd, bww = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(mb, *args, **kwargs):
            with self.tracker.hooks():
                return self._timed("F", stage.stage_index, mb, fwd, mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, full_backward: bool = True, **kwargs):
            kind = "B" if full_backward else "I"
            return self._timed(kind, stage.stage_index, mb, bwd, mb, *args, full_backward=full_backward, **kwargs)

        def backward_weight_one_chunk(mb, *args, **kwargs):
            return self._timed("W", stage.stage_index, mb, bww, mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _timed(self, kind: str, stage: int, mb: int, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.armed:
            time.sleep(max(0.0, COST[kind] * self.unit_s - (time.perf_counter() - start)))
            self.events.append((kind, stage, mb, start, time.perf_counter()))
        return out


def _deps(kind: str, stage: int, mb: int, num_stages: int) -> list[tuple]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < num_stages - 1 else [])
    return [("G", stage, mb)]  # W after this stage's input gradient


def replay(orders: list[list[tuple]], num_stages: int) -> dict:
    """Unit-cost timeline of each rank's executed ``(kind, stage, mb)`` order; idle fraction and makespan.

    ``G`` (the input gradient of a stage/microbatch) is produced by B or I. Raises on an order that cannot run
    (a dependency never produced), which would be a deadlock.
    """
    done: dict[tuple, int] = {}
    free, pos = [0] * len(orders), [0] * len(orders)
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, stage, mb = order[pos[r]]
                deps = _deps(kind, stage, mb, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + COST[kind]
                done[(kind, stage, mb)] = free[r]
                if kind in ("B", "I"):
                    done[("G", stage, mb)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the executed orders cannot be replayed: stuck at {pos}")
    span = max(free)
    busy = [sum(COST[k] for k, _, _ in o) for o in orders]
    return {"span": span, "idle": sum(span - b for b in busy) / (len(orders) * span),
            "idle_units": [span - b for b in busy]}


def peak_in_flight(order: list[tuple]) -> int:
    """Most (stage, microbatch) pairs forwarded on a rank whose backward (B, or W after I) has not finished."""
    live, peak = 0, 0
    for kind, _, _ in order:
        live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak
