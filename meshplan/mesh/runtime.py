"""Start-up for torchrun SPMD scripts: process group, device, topology, and the check that every rank has the same
plan.

A rank that loaded another plan (another ``sequence_parallel``, another rule) would otherwise hang in a collective
the others never issue, or die in gloo naming nothing. :func:`init` and :func:`check_same_plan` (which
``meshplan.parallelize`` calls) exchange a hash of the plan once; on a mismatch every rank raises the same
:class:`PlanError` with a one-line diff of the differing keys.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from pydantic import ValidationError

from meshplan.errors import PlanError
from meshplan.faults.agree import _canonical, agree, model_signature, plan_fingerprint, software
from meshplan.faults.one_error import install as install_one_error
from meshplan.faults.watch import translating
from meshplan.plan_file.faults import STALE_BEATS, Faults
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.reading import pydantic_message
from meshplan.mesh.elastic import restart_store
from meshplan.mesh.topology import Topology, build_mesh

__all__ = ["init", "plan_fingerprint", "check_same_plan", "Job", "watch_of"]


class Job:
    """What :func:`init` started beside the meshes, and what ends with them: the fault watch and, when ``init``
    created it, the process group. The topology stays plain data and meshes: it holds its job
    (``topology.job``) only to end it at the end of ``with meshplan.init(...)`` (or ``topology.close()``); the
    job, not the topology, knows about faults. meshplan reads the watch as ``topology.job.watch``
    (:func:`watch_of`); ``topology.faults`` is kept as the public alias of it.

    Args:
        watch: the :class:`~meshplan.faults.watch.FaultWatch` (None for one rank or simulated ranks).
        owns_process_group: ``init`` created the process group, so the end shuts it down.
    """

    def __init__(self, watch: Any, owns_process_group: bool):
        self.watch = watch
        self.owns_process_group = owns_process_group
        self.adopted: list = []

    def adopt_group(self, group: Any, axis: str) -> None:
        """A process group meshplan made beside the meshes (an axis' own group): the watch gives it
        the plan's timeout and its reports name it ``axis``; the job's end destroys it with the meshes'."""
        self.adopted.append(group)
        if self.watch is not None:
            self.watch.adopt(group, axis)

    def own_groups(self, topology: Any) -> list:
        """This rank's groups that ``topology`` made, once each, in the same order on every rank: each dim of the
        dense and the expert mesh, the flattened meshes, the adopted groups; never the world group (a dim
        spanning the world reuses it). torch 2.13 makes fresh groups for every ``init_device_mesh`` and
        ``_flatten``, so no other topology holds these."""
        from meshplan.mesh.topology import MESH_KEYS
        made = [*(m.get_group(i) for m in (topology.dense, topology.expert) for i in range(m.ndim)),
                *(topology[key].get_group() for key in MESH_KEYS), *self.adopted]
        groups = {g.group_name: g for g in made}
        groups.pop(dist.group.WORLD.group_name, None)
        return list(groups.values())

    def end(self, topology: Any, exc: BaseException | None) -> None:
        """The end of ``with meshplan.init``: a failed collective escaping the block becomes a RankFailure (any
        other error is recorded for the peers' reports), the heartbeat stops, and the process group ``init``
        created is shut down so that the process exits 0 (:func:`meshplan.faults.shutdown.shutdown`); when
        ``init`` found the process group already made, only the groups ``topology`` made are destroyed
        (:func:`meshplan.faults.shutdown.release`), so that a loop of ``init`` blocks does not pile up gloo
        threads, and the world group stays.

        Args:
            topology: the ending :class:`Topology`.
            exc: the exception leaving the block, or None.
        """
        from meshplan._torch import forget_groups
        from meshplan.faults.shutdown import release, shutdown
        watch, owns = self.watch, self.owns_process_group
        self.watch, self.owns_process_group = None, False  # ended once
        failure = watch.ending(exc) if watch is not None else None
        try:
            if dist.is_initialized():
                with translating(watch if exc is None else None):
                    if owns:
                        shutdown(topology.process_groups(), clean=exc is None)
                    else:
                        groups, self.adopted = self.own_groups(topology), []
                        release(groups, clean=exc is None)
                        # the root meshes' registries hold the last references (a gloo group's threads end with
                        # them); DTensor's caches hold meshes equal to a later topology's, whose ops would get these
                        forget_groups([topology.dense, topology.expert], [g.group_name for g in groups])
        finally:
            if watch is not None:
                watch.close()
        if failure is not None:
            raise failure from exc


def watch_of(mesh: Any) -> Any:
    """The fault watch of the job that started ``mesh`` (a :class:`Topology` from :func:`init`), else None: a
    topology built alone, a bare ``DeviceMesh``, or a job that has ended."""
    job = getattr(mesh, "job", None)
    return job.watch if job is not None else None


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


def check_same_plan(plan: Any, mesh: Topology | Any, model: Any = None) -> None:
    """Fail on every rank, with a diff, unless every rank of ``mesh`` has the same plan, model and software.

    Called by ``meshplan.parallelize`` on every rank before any collective of the model: one
    ``all_gather_object`` of hashes (plan, the model's parameter and buffer names, shapes and dtypes, the
    torch/meshplan/Python versions) over the whole world for a :class:`Topology`, over the group of a bare (1-D,
    tp) ``DeviceMesh`` otherwise. Skipped without a process group, with one rank, and on the ``fake`` backend
    (one process simulating many ranks has one plan).

    Raises:
        PlanError: ranks disagree, e.g. ``ranks disagree on the plan given to meshplan.parallelize:
            tensor_parallel.sequence_parallel: rank 0 has true, rank 1 has false; …``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = None if isinstance(mesh, Topology) else mesh.get_group()
    if dist.get_world_size(group) <= 1 or dist.get_backend(group) == "fake":
        return
    claims = {"software": software(), "plan": json.loads(_canonical(plan)) if plan is not None else None}
    if model is not None:
        claims["model"] = model_signature(model)
    with translating(watch_of(mesh)):
        agree(claims, group, "meshplan.parallelize", getattr(mesh, "plan_fingerprint", None))


def _check_same_layout(fingerprint: str) -> None:
    """Every rank resolved the layout with this fingerprint (one exchange), else PlanError on every rank."""
    agree({"layout": fingerprint})


def _fault_settings(plan: Any, timeout_s: float | None) -> tuple[Faults, str]:
    """The plan's ``faults`` section (defaults without one) and where its timeouts come from, for reports;
    ``timeout_s`` given to :func:`init` sets both timeouts."""
    source = (plan.source if plan is not None else None) or "the plan"
    settings = plan.faults if plan is not None and plan.faults is not None else None
    if timeout_s is not None:
        base = settings or Faults()
        try:
            fields = {**base.model_dump(), "init_timeout_s": float(timeout_s), "timeout_s": float(timeout_s)}
            beat = min(base.heartbeat_s, float(timeout_s) / STALE_BEATS)
            return Faults.model_validate({**fields, "heartbeat_s": beat}), f"meshplan.init(timeout_s={timeout_s:g})"
        except ValidationError as e:
            raise PlanError(f"meshplan.init: timeout_s: {pydantic_message(e)}") from None
    if settings is None:
        return Faults(), f"the default; set it in a faults section of {source}"
    return settings, source


def _start_watch(settings: Faults, origin: str) -> Any:
    """The FaultWatch of this job (heartbeat started), or None for one rank or simulated ranks."""
    if dist.get_world_size() <= 1 or dist.get_backend() == "fake":
        return None
    from meshplan.faults.watch import FaultWatch
    watch = FaultWatch(settings, origin)
    watch.start()
    return watch


def init(layout_or_plan: Any = None, *, backend: str | None = None, timeout_s: float | None = None,
         device_type: str | None = None, keep_host_memory: bool = True) -> Topology:
    """Initialise torch.distributed from the torchrun environment and build the topology.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, initialises the process group (``nccl`` when CUDA is available,
    else ``gloo``; torch's flight recorder on) unless one exists, sets the device, checks that every rank runs
    the same software, resolved the same layout and, when given a plan, has the same whole plan (one exchange of
    hashes; a mismatch fails on every rank with a one-line diff instead of hanging) and builds the meshes. Every
    process group, DeviceMesh sub-groups included, waits at most the plan's ``faults.init_timeout_s`` until the
    first ``meshplan.train_step`` has finished, then ``faults.timeout_s``; a heartbeat thread lets a rank whose
    peer died or stopped name it (:class:`~meshplan.errors.RankFailure`, :mod:`meshplan.faults`).
    The plan's hash is kept as ``topology.plan_fingerprint``; the fault watch and the shutdown belong to the
    :class:`Job` the topology holds (``topology.job``; ``topology.job.watch``, alias ``topology.faults``).

    Args:
        layout_or_plan: a :class:`Layout`, a plan (path, dict or ``Plan``), a layout dict, or None (pure dp).
        backend: force a backend.
        timeout_s: both collective timeouts, in place of the plan's ``faults`` section (default 600 s until the
            first step, 300 s after).
        device_type: ``"cpu"`` or ``"cuda"``; default from the backend.
        keep_host_memory: on a CPU job, glibc keeps freed memory for reuse as torch's CUDA allocator does
            (:func:`meshplan.mesh.host_memory.keep_freed_memory`; the process's setting): a step's large tensors
            reuse pages instead of faulting in fresh ones (an eager MoE step at world 8 on 2 cores: 2.6-3.2 s
            → 1.8-2.0 s). False leaves the allocator as it is.

    Returns:
        The :class:`Topology` (as before the job existed: ``with meshplan.init(...) as topo`` yields it, and
        ``meshplan.parallelize``/``train_step`` take it), holding its :class:`Job` as ``topology.job``. Use it as
        a context manager to make it active; on exit the job ends: the watch stops and the process group that
        ``init`` created is destroyed (on a process group it found, the groups this topology made are).

    Raises:
        PlanError: not under torchrun, a layout that does not fit, or ranks that disagree.
        RankFailure: a rank died or stopped answering during the exchange.

    Example::

        with meshplan.init("plans/llama.yaml") as topo:
            model = meshplan.parallelize(Transformer(args), "plans/llama.yaml", topo)
    """
    install_one_error()  # under torchrun: an uncaught meshplan error is one line per job, not one per rank
    plan, layout = _plan_and_layout(layout_or_plan)
    settings, origin = _fault_settings(plan, timeout_s)
    owns = False
    if not dist.is_initialized():
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        layout.resolve(world)  # fail before any collective
        use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from meshplan.faults.flight import enable
        enable(settings.flight_recorder, settings.dump_dir)
        timeout = datetime.timedelta(seconds=settings.init_timeout_s)
        store = restart_store(timeout)  # torchrun restarts: fresh rendezvous keys per group (mesh/elastic.py)
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), rank=rank, world_size=world,
                                timeout=timeout, **({"store": store} if store is not None else {}))
        owns = True
    resolved = layout.resolve(dist.get_world_size())
    watch = _start_watch(settings, origin)
    claims = {"software": software(), "layout": resolved.fingerprint(),
              "plan": json.loads(_canonical(plan)) if plan is not None else None}
    try:
        with translating(watch):
            agree(claims)  # before any collective of the model: a mismatch fails, never hangs
        made = dict(timeout_s=settings.init_timeout_s, p2p_timeout_s=settings.timeout_s) if watch is not None else {}
        topo = build_mesh(resolved, device_type, **made)
        if keep_host_memory and topo.dense.device_type == "cpu":
            from meshplan.mesh.host_memory import keep_freed_memory
            keep_freed_memory()
    except BaseException:
        if watch is not None:
            watch.close()
        raise
    if watch is not None:
        watch.adopt_topology(topo)
    topo.job = Job(watch, owns)
    topo.plan_fingerprint = plan_fingerprint(plan) if plan is not None else None
    return topo
