"""Start-up for torchrun SPMD scripts: process group, device, topology, and the check that every rank has the same
plan.

A rank that loaded another plan (another ``sequence_parallel``, another rule) would otherwise hang in a collective
the others never issue, or die in gloo naming nothing. :func:`init` and :func:`check_same_plan` (which
``meshplan.parallelize`` calls) exchange a hash of the plan once; on a mismatch every rank raises the same
:class:`PlanError` with a one-line diff of the differing keys.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from meshplan.errors import PlanError
from meshplan.plan_file.layout import Layout
from meshplan.mesh.elastic import restart_store
from meshplan.mesh.topology import Topology, build_mesh

__all__ = ["init", "plan_fingerprint", "check_same_plan"]

#: at most this many differing keys are spelled out in a mismatch error
_MAX_DIFF_KEYS = 8


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise PlanError(f"meshplan.init: environment variable {name} is not set; launch with torchrun "
                        f"(e.g. torchrun --nproc-per-node 4 train.py) or call torch.distributed.init_process_group first")
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"meshplan.init: environment variable {name} must be an integer, got {value!r}") from None


def _plan_and_layout(layout_or_plan: Any) -> tuple[Any, Layout]:
    """``(Plan or None, Layout)`` of what :func:`init` was given."""
    from meshplan.plan_file.document import Plan, load_plan
    if isinstance(layout_or_plan, Layout):
        return None, layout_or_plan
    if isinstance(layout_or_plan, (str, Path)):
        layout_or_plan = load_plan(layout_or_plan)
    if isinstance(layout_or_plan, Mapping):
        data = dict(layout_or_plan)
        if not any(k in data for k in Plan.model_fields):
            return None, Layout.model_validate(data)
        layout_or_plan = Plan.from_data(data)
    if isinstance(layout_or_plan, Plan):
        if layout_or_plan.layout is None:
            raise PlanError(f"{layout_or_plan.source or '<plan>'}: meshplan.init: the plan has no layout section, so "
                            f"every degree would default to 1 and the whole world to data parallelism; found no "
                            f"layout, expected e.g. `layout: {{tp: 2}}` (pass a Layout, or None for pure data "
                            f"parallelism)")
        return layout_or_plan, layout_or_plan.layout
    if layout_or_plan is None:
        return None, Layout()
    raise PlanError(f"meshplan.init takes a Layout, a Plan, a plan path or a dict, got {type(layout_or_plan).__name__}")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"tensor_parallel.rules.'wq'.style": "colwise", …}``: a key with a dot in it is quoted."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        seg = k if k.isidentifier() else repr(k)
        out.update(_flat(v, f"{prefix}.{seg}" if prefix else seg))
    return out


def _canonical(plan: Any) -> str:
    return json.dumps(plan.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def plan_fingerprint(plan: Any) -> str:
    """SHA-256 of the validated plan's canonical JSON (sorted keys; ``source`` left out: the path may differ)."""
    return hashlib.sha256(_canonical(plan).encode()).hexdigest()


def _plan_diff(plans: list[Any], ranks: list[int]) -> str:
    """``key: rank 0 has X, rank R has Y; …`` for the first rank whose plan differs from the first rank's.

    ``plans[i]`` is global rank ``ranks[i]``'s plan (JSON data, or None when it gave a layout only).
    """
    odd = next(i for i, p in enumerate(plans) if p != plans[0])
    more = sum(p != plans[0] for p in plans) - 1
    r0, r1 = ranks[0], ranks[odd]
    if plans[0] is None or plans[odd] is None:
        kinds = ["no plan (a layout only)" if p is None else "a plan" for p in (plans[0], plans[odd])]
        return f"rank {r0} has {kinds[0]}, rank {r1} has {kinds[1]}"
    a, b = _flat(plans[0]), _flat(plans[odd])
    keys = [k for k in sorted(a.keys() | b.keys()) if a.get(k, ...) != b.get(k, ...)]

    def shown(d: dict[str, Any], k: str) -> str:
        return json.dumps(d[k]) if k in d else "no such key"

    parts = [f"{k}: rank {r0} has {shown(a, k)}, rank {r1} has {shown(b, k)}" for k in keys[:_MAX_DIFF_KEYS]]
    if len(keys) > _MAX_DIFF_KEYS:
        parts.append(f"and {len(keys) - _MAX_DIFF_KEYS} more keys")
    return "; ".join(parts) + (f" ({more} more rank(s) differ from rank {r0})" if more else "")


def _agree(layout_fp: str | None, plan: Any, group: Any = None, where: str = "meshplan.init",
           init_digest: str | None = None) -> None:
    """One ``all_gather_object`` of (layout fingerprint, plan hash); a second one, of the plans, only on a mismatch.

    Every rank sees every hash, so all of them take the same branch and raise the same error.
    ``init_digest``: the hash of the plan this rank gave :func:`init`, named in the error when it differs.
    """
    digest = plan_fingerprint(plan) if plan is not None else None
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (layout_fp, digest, init_digest), group=group)
    layouts = [e[0] for e in everyone]
    if layout_fp is not None and any(f != layouts[0] for f in layouts):
        _raise_layout_mismatch(layout_fp, layouts)
    if any(e[1] != everyone[0][1] for e in everyone):
        plans: list[Any] = [None] * len(everyone)
        dist.all_gather_object(plans, json.loads(_canonical(plan)) if plan is not None else None, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
        changed = [r for r, (_, d, i) in zip(ranks, everyone) if i is not None and d != i]
        since = f"; rank(s) {changed} pass another plan than they gave meshplan.init" if changed else ""
        raise PlanError(f"ranks disagree on the plan given to {where}: {_plan_diff(plans, ranks)}{since}; every rank "
                        f"must load the same plan")


def check_same_plan(plan: Any, mesh: Topology | Any) -> None:
    """Fail on every rank, with a diff, unless every rank of ``mesh`` has the same plan.

    Called by ``meshplan.parallelize`` on every rank before any collective of the model: one
    ``all_gather_object`` of the plan's hash over the whole world for a :class:`Topology`, over the
    group of a bare (1-D, tp) ``DeviceMesh`` otherwise. Skipped without a process group, with one rank,
    and on the ``fake`` backend (one process simulating many ranks has one plan).

    Raises:
        PlanError: ranks disagree, e.g. ``ranks disagree on the plan given to meshplan.parallelize:
            tensor_parallel.sequence_parallel: rank 0 has true, rank 1 has false; …``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = None if isinstance(mesh, Topology) else mesh.get_group()
    if dist.get_world_size(group) <= 1 or dist.get_backend(group) == "fake":
        return
    _agree(None, plan, group, "meshplan.parallelize", getattr(mesh, "plan_fingerprint", None))


def _check_same_layout(fingerprint: str) -> None:
    """Every rank resolved the layout with this fingerprint (one exchange), else PlanError on every rank."""
    _agree(fingerprint, None)


def _raise_layout_mismatch(fingerprint: str, everyone: list[str]) -> None:
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
    device, checks that every rank resolved the same layout and, when given a
    plan, has the same whole plan (one exchange of a hash; a mismatch fails on
    every rank with a one-line diff instead of hanging) and builds the meshes.
    The plan's hash is kept as ``topology.plan_fingerprint``.

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
    plan, layout = _plan_and_layout(layout_or_plan)
    owns = False
    if not dist.is_initialized():
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        layout.resolve(world)  # fail before any collective
        use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)  # torchrun restarts: fresh rendezvous keys per group (mesh/elastic.py)
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), rank=rank, world_size=world,
                                timeout=timeout, **({"store": store} if store is not None else {}))
        owns = True
    resolved = layout.resolve(dist.get_world_size())
    _agree(resolved.fingerprint(), plan)  # before any collective of the model: a mismatch fails, never hangs
    topo = build_mesh(resolved, device_type, _owns_process_group=owns)
    topo.plan_fingerprint = plan_fingerprint(plan) if plan is not None else None
    return topo
