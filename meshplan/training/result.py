"""What one training step returns; below :mod:`meshplan.training.step` and the axes' own steps
(:attr:`meshplan.axis.Axis.run_step`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """``loss``: mean over all valid tokens of the global batch; ``grad_norm``: total L2 norm before
    clipping (None without ``max_grad_norm``); ``num_tokens``: the global number of valid tokens."""

    loss: float
    grad_norm: float | None
    num_tokens: int
