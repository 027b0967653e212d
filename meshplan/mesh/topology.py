"""Build DeviceMeshes whose groups equal the rank engine's (Megatron's) groups.

Composite meshes (``dp``, ``dp_cp``, …) are flattened with
:func:`meshplan._torch.flatten_mesh` (torch's private ``DeviceMesh._flatten``).
Nothing here is global: a :class:`Topology` is a value, and two can coexist in
one process.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshplan._torch import flatten_mesh
from meshplan.errors import PlanError
from meshplan.plan_file.layout import Layout, ResolvedLayout

__all__ = ["Topology", "build_mesh", "current_topology", "MESH_KEYS"]

# Holds a weak reference: torch's backward stashes a copy of the context in the thread-local state that every
# collective captures, so a strong reference would let a gloo worker thread drop the last reference to the
# topology (and destroy its own process group, or need the GIL during interpreter exit) -- a native crash.
_ACTIVE: contextvars.ContextVar["weakref.ref[Topology] | None"] = contextvars.ContextVar("meshplan_topology",
                                                                                         default=None)

# flattened dense keys -> their dims (any order; sliced in mesh order)
_FLAT = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "tp_cp": ("cp", "tp"),
}
_EXPERT = {"ep": "ep", "etp": "etp", "edp": "edp"}
#: every key ``Topology[...]`` accepts
MESH_KEYS = ("tp", "cp", "pp", "dp_replicate", "dp_shard", *_FLAT, *_EXPERT)


def current_topology() -> "Topology | None":
    """The topology made active by ``with topology:`` (or ``with meshplan.init(...):``), else ``None``."""
    ref = _ACTIVE.get()
    return ref() if ref is not None else None


def _device_type(device_type: str | None) -> str:
    if device_type is not None:
        return device_type
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class Topology:
    """The meshes of one resolved layout.

    Attributes:
        layout: the :class:`~meshplan.plan_file.layout.ResolvedLayout`.
        dense: DeviceMesh with dims = the order reversed, dp split into
            ``dp_replicate, dp_shard`` (``pp, dp_replicate, dp_shard, cp, tp`` by default).
        expert: DeviceMesh of the folded expert grid (``pp, edp, ep, etp`` by default).
        rank: this process's global rank.
        plan_fingerprint: hash of the plan given to ``meshplan.init`` (every rank had the same), else None;
            ``meshplan.parallelize`` names ranks that pass another plan.
        job: the :class:`~meshplan.mesh.runtime.Job` ``meshplan.init`` started (its fault watch, the process
            group it made), ended with the topology; None for a topology made by :func:`build_mesh` alone. The
            topology itself is plain data and meshes: it knows nothing of faults.
        faults: the public alias of ``job.watch`` (the :class:`~meshplan.faults.watch.FaultWatch`), else None.

    ``topo["tp"]``, ``topo["dp_shard_cp"]``, … return the (flattened where
    needed) 1-D meshes; see :data:`MESH_KEYS`. ``with topo:`` makes it the
    active topology (a context variable) for code that finds it implicitly.
    """

    def __init__(self, layout: ResolvedLayout, dense: DeviceMesh, expert: DeviceMesh,
                 flat: Mapping[str, DeviceMesh], rank: int):
        self.layout = layout
        self.dense = dense
        self.expert = expert
        self._flat = dict(flat)
        self.rank = rank
        self.plan_fingerprint: str | None = None
        self.job: Any = None
        self._tokens: list[contextvars.Token] = []

    def __getitem__(self, key: str) -> DeviceMesh:
        if key in self._flat:
            return self._flat[key]
        if key in _EXPERT:
            return self.expert[_EXPERT[key]]
        if key in self.dense.mesh_dim_names:
            return self.dense[key]
        raise KeyError(f"unknown mesh {key!r}; keys: {', '.join(MESH_KEYS)}")

    def span(self, axes: tuple[str, ...]) -> DeviceMesh:
        """The 1-D mesh spanning the dense axes ``axes`` (size-1 axes do not count).

        The simplest key that covers the axes of size > 1 and adds only size-1 axes, tried in the order
        ``dp_shard, dp_replicate, tp, pp, dp_shard_cp, dp, dp_cp, tp_cp, cp`` (so cp-sharded data parallelism
        runs on ``dp_shard_cp``, as in torchtitan).

        Raises:
            KeyError: no key spans ``axes``.

        Example::

            >>> topo.span(("dp_replicate", "dp_shard", "cp"))   # topo["dp_cp"], or topo["dp"] when cp == 1
        """
        big = {a for a in axes if getattr(self.layout, a) > 1}
        for key in ("dp_shard", "dp_replicate", "tp", "pp", "dp_shard_cp", "dp", "dp_cp", "tp_cp", "cp"):
            dims = set(mesh_axes(key)[1])
            if big <= dims and all(a in big or getattr(self.layout, a) == 1 for a in dims):
                return self[key]
        raise KeyError(f"no mesh spans {axes}; keys: {', '.join(MESH_KEYS)}")

    # smp-style ranks and data-loading coordinates
    @property
    def tp_rank(self) -> int:
        return self.layout.smp_ranks(self.rank)["tp_rank"]

    @property
    def pp_rank(self) -> int:
        return self.layout.smp_ranks(self.rank)["pp_rank"]

    @property
    def rdp_rank(self) -> int:
        return self.layout.smp_ranks(self.rank)["rdp_rank"]

    @property
    def dp_rank(self) -> int:
        return self.layout.smp_ranks(self.rank)["dp_rank"]

    @property
    def mp_rank(self) -> int:
        return self.layout.smp_ranks(self.rank)["mp_rank"]

    @property
    def data_rank(self) -> int:
        """Which shard of the global batch this rank loads (its dp coordinate)."""
        return self.layout.dense_grid.coords(self.rank)["dp"]

    @property
    def data_world_size(self) -> int:
        """How many distinct batch shards there are (dp); tp, cp and pp ranks share one."""
        return self.layout.dp

    def __enter__(self) -> "Topology":
        self._tokens.append(_ACTIVE.set(weakref.ref(self)))  # the `with` statement keeps `self` alive
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Leave the topology; the outermost ``with`` of the one ``meshplan.init`` built also ends the job's
        distributed state: a failed collective escaping the block becomes a RankFailure (any other error is
        recorded for the peers' reports), the heartbeat stops, and the process group ``init`` created is shut down
        so that the process exits 0 (:func:`meshplan.faults.shutdown.shutdown`)."""
        _ACTIVE.reset(self._tokens.pop())
        if not self._tokens:
            self._end(exc)

    def close(self) -> None:
        """What the end of ``with meshplan.init(...)`` does, for a script that kept the topology without ``with``:
        call it once at the very end, on every rank, so that the process exits 0
        (:mod:`meshplan.faults.shutdown`)."""
        self._end(None)

    @property
    def faults(self) -> Any:
        """``job.watch``: the fault watch of the job ``meshplan.init`` started, else None (also once the job has
        ended). The public alias kept from before the job; meshplan reads the job's."""
        return self.job.watch if self.job is not None else None

    def _end(self, exc: BaseException | None) -> None:
        job, self.job = self.job, None  # ended once
        if job is not None:
            job.end(self, exc)

    def process_groups(self) -> list:
        """This rank's process groups of every mesh key, once each, the world's last."""
        groups = {}
        for key in MESH_KEYS:
            group = self[key].get_group()
            groups.setdefault(group.group_name, group)
        world = groups.pop(dist.group.WORLD.group_name, dist.group.WORLD)
        return [*groups.values(), world]

    def adopt_group(self, group: Any, axis: str) -> None:
        """A process group meshplan made beside the meshes (the pipeline's embedding group): the job's watch gives
        it the plan's timeout and its reports name it ``axis`` (:meth:`~meshplan.mesh.runtime.Job.adopt_group`)."""
        if self.job is not None:
            self.job.adopt_group(group, axis)

    def __str__(self) -> str:
        """One readable line, e.g. ``rank 0 of 16: pp 2 × dp 4 × tp 2 (order tp-cp-ep-dp-pp, innermost first);
        experts: pp 2 × edp 4 × ep 2`` (the dense and the expert mesh, degrees above 1, outermost first)."""
        def dims(mesh: Any) -> str:
            kept = [f"{n} {k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape) if k > 1]
            return " × ".join(kept) or "1 rank"
        s = self.layout
        expert = "" if s.ep == 1 else f"; experts: {dims(self.expert)}"
        return f"rank {self.rank} of {s.world_size}: {dims(self.dense)} (order {s.order_str}, innermost first){expert}"

    def __repr__(self) -> str:
        s = self.layout
        return (f"Topology(world_size={s.world_size}, order={s.order_str!r}, dense={dict(zip(self.dense.mesh_dim_names, self.dense.shape))}, "
                f"expert={dict(zip(self.expert.mesh_dim_names, self.expert.shape))}, rank={self.rank})")


def _as_layout(layout: Layout | Mapping[str, Any]) -> Layout:
    if isinstance(layout, Layout):
        return layout
    try:
        return Layout.model_validate(dict(layout))
    except Exception as e:  # pydantic.ValidationError
        from meshplan.plan_file.reading import pydantic_message
        raise PlanError(f"layout: {pydantic_message(e)}") from None


def _made_with_timeout(names: tuple[str, ...], sizes: tuple[int, ...], timeout_s: float | None,
                       p2p_timeout_s: float | None = None) -> dict | None:
    """DeviceMesh's ``backend_override`` making each sub-group with ``timeout_s`` (torch would give it 30 minutes;
    a whole-world dim reuses the default group) and the ``pp`` dim's groups, whatever their size, with
    ``p2p_timeout_s``: gloo keeps a group's creation timeout for point-to-point waits (the pipeline's sends and
    receives), whatever is set later."""
    if timeout_s is None:
        return None
    from meshplan._torch import group_options
    world = dist.get_world_size()
    made = {n: group_options(timeout_s) for n, size in zip(names, sizes) if size < world}
    if p2p_timeout_s is not None and "pp" in names and sizes[names.index("pp")] > 1:
        made["pp"] = group_options(p2p_timeout_s)
    return made or None


def build_mesh(layout: Layout | Mapping[str, Any] | ResolvedLayout, device_type: str | None = None,
               *, timeout_s: float | None = None, p2p_timeout_s: float | None = None) -> Topology:
    """Build the dense and expert DeviceMeshes of ``layout`` on the default process group.

    Args:
        layout: a :class:`Layout`, a resolved layout, or a dict such as ``{"tp": 4}``
            (unnamed degrees are 1, ``dp_shard`` inferred).
        device_type: ``"cpu"`` / ``"cuda"``; default from the process group's backend.
        timeout_s: make the meshes' sub-groups with this timeout (``meshplan.init`` passes the plan's
            ``faults.init_timeout_s``); default torch's (30 minutes).
        p2p_timeout_s: make the dense mesh's ``pp`` groups with this timeout (``faults.timeout_s``): on gloo, the
            one a pipeline send or receive waits, from the first step on.

    Returns:
        A :class:`Topology`.

    Raises:
        PlanError: no process group, or the layout does not fit its world size.

    Example::

        >>> topo = meshplan.build_mesh({"tp": 2})          # under torchrun --nproc-per-node 4
        >>> topo["tp"], topo["dp"]
    """
    if not dist.is_initialized():
        raise PlanError("build_mesh needs an initialized process group (torch.distributed.init_process_group "
                        "or meshplan.init)")
    world = dist.get_world_size()
    if isinstance(layout, ResolvedLayout):
        resolved = layout
        if resolved.world_size != world:
            raise PlanError(f"layout resolved for world_size({resolved.world_size}) but the process group has {world}")
    else:
        resolved = _as_layout(layout).resolve(world)
    dev = _device_type(device_type)
    grid = resolved.mesh_grid
    names = tuple(reversed(grid.order))
    sizes = tuple(grid.size(n) for n in names)
    dense = init_device_mesh(dev, sizes, mesh_dim_names=names,
                             backend_override=_made_with_timeout(names, sizes, timeout_s, p2p_timeout_s))
    flat = {}
    for key, dims in _FLAT.items():
        ordered = tuple(n for n in names if n in dims)
        flat[key] = flatten_mesh(dense[ordered], key)
    eg = resolved.expert_grid
    enames = tuple(n for n in reversed(eg.order) if n != "cp")
    esizes = tuple(eg.size(n) for n in enames)
    expert = init_device_mesh(dev, esizes, mesh_dim_names=enames,
                              backend_override=_made_with_timeout(enames, esizes, timeout_s))
    return Topology(resolved, dense, expert, flat, dist.get_rank())


def mesh_axes(key: str) -> tuple[str, tuple[str, ...]]:
    """Which grid (``"dense"`` on :attr:`ResolvedLayout.mesh_grid` or ``"expert"``) and axes a key spans."""
    if key in _EXPERT:
        return "expert", (key,)
    if key in _FLAT:
        return "dense", _FLAT[key]
    if key in MESH_KEYS:
        return "dense", (key,)
    raise KeyError(key)
