"""A pipeline stage that reduce-scatters its FSDP2 gradients every microbatch (``data_parallel.accumulate_unsharded:
false``).

torch's ``PipelineStage`` keeps an FSDP2 stage's parameters and gradients unsharded from its first backward to the
step's ``REDUCE_GRAD`` (one reduce-scatter per step, torchtitan's default): the stage's whole unsharded
parameters and gradients are alive at once, O(stage) rather than O(shard). Measured on ``benchmarks/scale.py
--size dev`` pp 2 × FSDP2 2 (the stage's 422 MiB sharded to 211 MiB a rank): peak 1.96 × (params + grads + AdamW
+ baseline). This stage lets FSDP2's own backward hooks reduce-scatter and reshard after each microbatch's
backward; the schedule's ``REDUCE_GRAD`` then finds nothing left to reduce (FSDP2's ``post_backward`` is a no-op
without unsharded gradients).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch.distributed.pipelining import PipelineStage

__all__ = ["ReducingStage"]

_KNOBS = ("set_is_last_backward", "set_reshard_after_backward", "set_requires_gradient_sync")


@contextlib.contextmanager
def _knobs_fixed(module: Any) -> Iterator[None]:
    """The stage's FSDP2 knob setters made no-ops on ``module`` (instance attributes shadowing the methods) while
    the stage's backward runs; the methods back afterwards."""
    for name in _KNOBS:
        object.__setattr__(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in _KNOBS:
            object.__delattr__(module, name)


class ReducingStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP2 module reduce-scatters its gradients and reshards its parameters after
    every microbatch's full backward (least memory: one unit's unsharded parameters and gradient at a time; one
    reduce-scatter per unit and microbatch instead of one per step).

    Split backwards (``input`` / ``weight``: zero-bubble schedules) keep torch's deferred reduction: the weight
    gradients of a microbatch exist only after its ``weight`` step.
    """

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        from torch.distributed.fsdp import FSDPModule
        module = self.submod
        if backward_type != "full" or not isinstance(module, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        module.set_is_last_backward(last_backward)
        with _knobs_fixed(module):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
