"""The optimizer step and the gradient clipping of one rank, per step. Torch-free.

Both run once per step on every rank over its local parameters, whatever its batch: on a host running several
ranks per core they are part of the per-rank fixed cost (``docs/solver.md``, "The per-rank fixed cost").

* **Measured** (``meshplan profile``: :mod:`meshplan.profile.step_costs`): torch's ``AdamW.step`` and
  ``clip_grad_norm_`` timed per element at a few tensor sizes (a curve: per-tensor costs dominate small tensors,
  caches large ones), priced on the rank's local parameter elements at its mean tensor size (:attr:`Memory.numel`
  / :attr:`Memory.tensors`); below the smallest measured size a tensor costs what the smallest did. On a CPU,
  AdamW runs tensor by tensor (10 ops each: 392 for calibrate.py's 39 tensors, 7-8 ms where the byte count below
  gives ~1 ms) and clipping runs a norm per tensor, their total and a scale.
* **Otherwise** (a preset: no measurement): AdamW's bytes, ``(3 · states + 4)`` passes over the master
  parameters at the memory rate of one tensor, and no clipping time (a GPU's clip is a few fused kernels).

With ``cpu_offload`` the step runs on the host: parameters in and gradients out over PCIe, at the host bandwidth.
"""

from __future__ import annotations

from meshplan.solver.candidate import Training
from meshplan.solver.cluster import Cluster, _interpolate

__all__ = ["optimizer_time", "clip_time", "per_element", "STEP_COST_FIELDS"]

#: the :class:`Cluster` fields ``meshplan profile`` measures for this module: ``(elements per tensor, seconds per
#: element)`` points
STEP_COST_FIELDS = ("optimizer_rates", "clip_rates")


def per_element(rates, numel: float, tensors: int) -> float:
    """Seconds per element at the mean tensor size ``numel / tensors`` on a measured curve ``rates``."""
    size = numel / max(tensors, 1)
    return _interpolate(sorted(rates), size, below=lambda e0, s0: e0 * s0 / size)

#: the element size the profile's AdamW and clipping run at (float32 master parameters)
MEASURED_BYTES = 4


def optimizer_time(cl: Cluster, tr: Training, numel: float, tensors: int) -> float:
    """Seconds of one optimizer step over ``numel`` local parameter elements in ``tensors`` tensors."""
    if tr.cpu_offload:  # the step on the host; parameters in and gradients out over PCIe, once each per step
        return numel * tr.master_bytes * (3 * tr.optimizer_states + 6) / cl.host_bandwidth
    if cl.optimizer_rates and tr.optimizer_states == 2:
        return numel * tr.master_bytes / MEASURED_BYTES * per_element(cl.optimizer_rates, numel, tensors)
    per_tensor = numel * tr.master_bytes / max(tensors, 1)  # AdamW's foreach ops, tensor by tensor
    return numel * tr.master_bytes * (3 * tr.optimizer_states + 4) / cl.memory_rate(per_tensor)


def clip_time(cl: Cluster, tr: Training, numel: float, tensors: int) -> float:
    """Seconds of ``clip_grad_norm_`` over the local gradients (0 without clipping or without a measurement)."""
    if not tr.clip or not cl.clip_rates:
        return 0.0
    return numel * tr.master_bytes / MEASURED_BYTES * per_element(cl.clip_rates, numel, tensors)
