"""The learning-rate multiplier of each step: linear warmup, then cosine, linear or constant decay. Torch-free."""

from __future__ import annotations

import math

from meshplan.plan_file.training import Schedule

__all__ = ["lr_factor"]


def lr_factor(schedule: Schedule, step: int, steps: int) -> float:
    """The multiplier of the peak learning rate at ``step`` (1-based: the step about to run) of ``steps``.

    Warmup ramps ``step / warmup`` (the first step trains at ``1 / warmup``, never at 0); the decay then runs from
    1 at the first step after warmup to ``min_lr_ratio`` at the last step.

    Example::

        >>> s = Schedule(warmup=2, decay="linear", min_lr_ratio=0.0)
        >>> [lr_factor(s, k, 4) for k in (1, 2, 3, 4)]
        [0.5, 1.0, 1.0, 0.0]
    """
    if step <= schedule.warmup:
        return step / schedule.warmup
    if schedule.decay == "constant":
        return 1.0
    span = steps - schedule.warmup - 1
    frac = (step - schedule.warmup - 1) / span if span > 0 else 1.0
    lo = schedule.min_lr_ratio
    if schedule.decay == "linear":
        return 1.0 - (1.0 - lo) * frac
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))
