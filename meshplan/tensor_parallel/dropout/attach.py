"""Attach dropout randomness to a tensor-parallel model, as the section's ``dropout_rng`` says: per-shard streams
(:mod:`meshplan.tensor_parallel.dropout.per_shard`) or the single-device masks
(:mod:`meshplan.tensor_parallel.dropout.single_device`)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan._torch import DropoutNd
from meshplan.plan_file.tensor_parallel import TensorParallel
from meshplan.tensor_parallel.dropout.per_shard import TpRng
from meshplan.tensor_parallel.dropout.single_device import INHERIT, OUTSIDE, REGION, SHARED, SingleDeviceDropout

__all__ = ["attach_rng"]


def attach_rng(model: nn.Module, modules: dict[str, nn.Module], meta: dict, section: TensorParallel,
               tp_mesh: DeviceMesh, where: str) -> TpRng | SingleDeviceDropout:
    """Dropout randomness per ``section.dropout_rng``: per-shard streams, or the single-device masks.

    Args:
        model: the parallelized model.
        modules: its modules by path.
        meta: :func:`~meshplan.tensor_parallel.generate.generate_tp_plan`'s ``meta`` (``fanout``: the TP
            regions; ``norm_dropouts``: dropouts on the residual stream).
        section: the plan's ``tensor_parallel`` section.
        tp_mesh: the 1-D tensor-parallel mesh.
        where: ``"<plan>: tensor_parallel.rules"``, for error messages.

    Returns:
        The live :class:`TpRng` or :class:`SingleDeviceDropout` (its hooks are on the model).
    """
    if section.dropout_rng == "single_device":  # draws nothing extra: TpRng's fork would consume the shared stream
        sdd = SingleDeviceDropout(tp_mesh, section.sequence_parallel,
                                  where.replace("tensor_parallel.rules", "tensor_parallel.dropout_rng"))
        sdd.attach(model, "", OUTSIDE)
        for parent in meta["fanout"]:
            sdd.attach(modules[parent] if parent else model, parent, REGION)
        shared = set(meta["norm_dropouts"])
        for path, mod in modules.items():
            if isinstance(mod, DropoutNd):
                sdd.attach(mod, path, SHARED if path in shared else INHERIT)
        return sdd
    rng = TpRng(tp_mesh.get_local_rank(), tp_mesh.device_type)
    for parent in meta["fanout"]:
        rng.fork(modules[parent] if parent else model)
    for path in meta["norm_dropouts"]:
        (rng.fork if section.sequence_parallel is not False else rng.shared)(modules[path])
    return rng
