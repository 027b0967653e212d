"""What an eager MoE expert loop costs beyond its FLOPs and ops, measured by the ``meshplan profile`` job (every rank
at once): the rate of its weight slices' dense gradients and one host sync (:mod:`meshplan.solver.moe_costs`
prices them).

* **expert gradient rate**: three stacked weights ``[8, 256, 512]`` (4 MiB each in float32: calibrate.py's MoE
  block's ``w1``, ``w2``, ``w3``; the working set matters: one such weight alone measured 42 GB/s, three 31) whose
  slices ``w[e]`` are each used once per expert, forward and backward: each slice's backward writes a zero-filled
  gradient of its whole weight and autograd sums them in place; the rate is
  :func:`~meshplan.solver.moe_costs.expert_grad_bytes` over the seconds (the slices' reads and the ~100 small ops
  are under 3% of the time, not subtracted; with the experts' matmuls on one row each the rate measured 29 GB/s);
* **host sync**: ``tolist()`` of a small tensor just computed, beyond the computation (on a GPU: a stream sync).
"""

from __future__ import annotations

from typing import Callable

import torch

from meshplan.solver.moe_costs import expert_grad_bytes

__all__ = ["measure_moe"]

#: one measured stacked weight: experts, rows, columns (calibrate.py's MoE: 8 experts, width 512, hidden 256)
STACKED = (8, 256, 512)
#: stacked weights of one block (SwiGLU: w1, w2, w3)
WEIGHTS = 3


def _expert_grad_rate(timed: Callable, mean: Callable, device: torch.device, dtype: torch.dtype) -> float:
    """Bytes/s of the weight slices' gradients (see the module's docstring)."""
    experts = STACKED[0]
    ws = [torch.zeros(STACKED, device=device, dtype=dtype, requires_grad=True) for _ in range(WEIGHTS)]

    def step() -> None:
        total = ws[0][0].sum()
        for e in range(experts):
            for w in ws[1 if e == 0 else 0:]:
                total = total + w[e].sum()
        total.backward()
        for w in ws:
            w.grad = None
    sec = timed(step, reps=3, window=0.1)
    return mean(expert_grad_bytes(experts, sum(w.numel() * w.element_size() for w in ws)) / sec)


def _host_sync(timed: Callable, mean: Callable, device: torch.device) -> float:
    """Seconds of one ``tolist()`` of a just-computed small tensor beyond the computation."""
    x = torch.ones(8, device=device)
    synced = timed(lambda: (x + 1).tolist(), reps=3, window=0.1)
    bare = timed(lambda: x + 1, reps=3, window=0.1)
    return mean(max(synced - bare, 0.0))


def measure_moe(timed: Callable, mean: Callable, device: torch.device, dtype: torch.dtype) -> dict:
    """The measurements above as the worker's JSON keys (``timed``, ``mean``: the worker's helpers)."""
    return {"expert_grad_rate": _expert_grad_rate(timed, mean, device, dtype),
            "host_sync_overhead": _host_sync(timed, mean, device)}
