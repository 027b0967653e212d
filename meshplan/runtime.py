"""Start-up for torchrun SPMD scripts: process group, device, topology."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import PlanError
from .layout import Layout
from .topology import Topology, build_mesh

__all__ = ["init"]


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise PlanError(f"meshplan.init: environment variable {name} is not set; launch with torchrun "
                        f"(e.g. torchrun --nproc-per-node 4 train.py) or call torch.distributed.init_process_group first")
    return int(value)


def _layout_of(layout_or_plan: Any) -> Layout:
    from .plan_file import Plan, load_plan
    if isinstance(layout_or_plan, Layout):
        return layout_or_plan
    if isinstance(layout_or_plan, (str, Path)):
        layout_or_plan = load_plan(layout_or_plan)
    if isinstance(layout_or_plan, Plan):
        return layout_or_plan.layout or Layout()
    if isinstance(layout_or_plan, Mapping):
        data = dict(layout_or_plan)
        if "layout" in data or "tensor_parallel" in data or "version" in data:
            plan = Plan.from_data(data)
            return plan.layout or Layout()
        return Layout.model_validate(data)
    if layout_or_plan is None:
        return Layout()
    raise PlanError(f"meshplan.init takes a Layout, a Plan, a plan path or a dict, got {type(layout_or_plan).__name__}")


def _check_same_layout(fingerprint: str) -> None:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fingerprint)
    odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if odd:
        mine, first = fingerprint.split(";"), everyone[0].split(";")
        diff = [f"{a} vs {b}" for a, b in zip(first, everyone[odd[0]].split(";")) if a != b]
        raise PlanError(f"ranks disagree on the layout: rank 0 has {everyone[0]!r}, rank {odd[0]} differs "
                        f"({'; '.join(diff)}); this rank ({dist.get_rank()}) has {';'.join(mine)!r}. "
                        f"Every rank must load the same plan")


def init(layout_or_plan: Any = None, *, backend: str | None = None, timeout_s: float = 600.0,
         device_type: str | None = None) -> Topology:
    """Initialise torch.distributed from the torchrun environment and build the topology.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, initialises the process group
    (``nccl`` when CUDA is available, else ``gloo``) unless one exists, sets the
    device, checks that every rank resolved the same layout (one exchange; a
    mismatch fails on every rank with a diff instead of hanging) and builds the
    meshes.

    Args:
        layout_or_plan: a :class:`Layout`, a plan (path, dict or ``Plan``), a layout dict, or None (pure dp).
        backend: force a backend.
        timeout_s: process-group timeout.
        device_type: ``"cpu"`` or ``"cuda"``; default from the backend.

    Returns:
        The :class:`Topology`. Use it as a context manager to make it active; on
        exit the process group that ``init`` created is destroyed.

    Raises:
        PlanError: not under torchrun, a layout that does not fit, or ranks that disagree.

    Example::

        with meshplan.init("plans/llama.yaml") as topo:
            model = meshplan.parallelize(Transformer(args), "plans/llama.yaml", topo)
    """
    layout = _layout_of(layout_or_plan)
    owns = False
    if not dist.is_initialized():
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        layout.resolve(world)  # fail before any collective
        use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        owns = True
    resolved = layout.resolve(dist.get_world_size())
    _check_same_layout(resolved.fingerprint())
    return build_mesh(resolved, device_type, _owns_process_group=owns)
