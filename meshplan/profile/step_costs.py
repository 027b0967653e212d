"""The per-step work every rank does over its own parameters, measured by the ``meshplan profile`` job (every rank
at once, as in training): torch's ``AdamW.step`` and ``clip_grad_norm_``.

Each is timed on parameter sets of one tensor size at a time, from small tensors (where the per-tensor ops
dominate) to 4 MiB ones (the tensor, its gradient and AdamW's two states past a core's cache), as seconds per
float32 element by tensor size: the solver prices them on a rank's local parameters at their mean tensor size
(:mod:`meshplan.solver.host_step`). On a CPU, AdamW runs tensor by tensor, 10 ops per tensor whose time is not
their bytes at the memory rate (calibrate.py's Llama: 7-8 ms measured, ~1 ms priced by bytes).
"""

from __future__ import annotations

from typing import Callable

import torch

from meshplan.solver.host_step import STEP_COST_FIELDS

__all__ = ["measure_step_costs", "SETS"]

#: ``(tensors, elements per tensor)`` of the measured parameter sets
SETS = ((64, 1 << 10), (16, 1 << 16), (4, 1 << 20))


def _params(tensors: int, numel: int, device: torch.device) -> list[torch.Tensor]:
    """Parameters with gradients."""
    out = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(numel, device=device))
        p.grad = torch.randn(numel, device=device)
        out.append(p)
    return out


def measure_step_costs(timed: Callable, mean: Callable, device: torch.device, sets=SETS) -> dict[str, list]:
    """``{"optimizer_rates": [[elements per tensor, seconds per element], ...], "clip_rates": [...]}`` (means over
    the ranks; ``timed`` and ``mean``: the worker's helpers; ``sets``: ``(tensors, elements per tensor)``)."""
    adamw, clip = [], []
    for tensors, numel in sets:
        params = _params(tensors, numel, device)
        opt = torch.optim.AdamW(params, lr=1e-6)
        opt.step()  # the states exist, as after a training step
        elements = tensors * numel
        adamw.append([numel, mean(timed(opt.step, reps=3, window=0.1)) / elements])
        clipped = timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), reps=3, window=0.1)
        clip.append([numel, mean(clipped) / elements])
    return dict(zip(STEP_COST_FIELDS, (adamw, clip)))
