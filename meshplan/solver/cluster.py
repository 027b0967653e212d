"""The machine as the cost model sees it: compute rate, memory, and the links collectives run over. Torch-free.

A :class:`Cluster` is either a preset (:func:`meshplan.solver.presets.cluster_preset`: published peak numbers)
or a file written by ``meshplan profile`` (measured here: matmul rates by size, each collective's latency and
bandwidth per group size). Collective time follows the ring algorithm over the slowest link the group crosses:

* all-gather / reduce-scatter of a ``B``-byte buffer over ``n`` ranks: ``(n−1)·α + (n−1)/n · B / β``;
* all-reduce: twice that; all-to-all: ``(n−1)/n · B / β`` for the bytes a rank holds; send: ``α + B / β``;

with ``α, β`` the intra-node link's when the group lies inside a node and the inter-node link's (one NIC per
device) when it crosses nodes; beyond 16 ranks the latency term grows as ``2·log2(n)`` steps (NCCL's trees).
A profiled cluster replaces the formula by the measured fit ``α_n + B / β_n`` of that collective and group size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from meshplan.errors import PlanError

__all__ = ["Link", "Fit", "Cluster", "COLLECTIVES", "load_cluster_file"]

#: the fields holding measured curves (``(size, value)`` points; ``sync_loss``: ``(group, segment, seconds)``)
_CURVES = ("matmul_rates", "memory_rates", "optimizer_rates", "clip_rates", "sharded_attention", "sync_loss")
#: the collective kinds the model times (and ``meshplan profile`` measures)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


@dataclass(frozen=True)
class Link:
    """One kind of link: what a device drives over it in one direction, and the latency of one step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Fit:
    """A measured collective: ``latency + bytes / bandwidth`` seconds (bytes as :func:`Cluster.comm_time`), the
    least-squares line through the measured ``points`` ``(bytes, seconds)``.

    With two points or more :meth:`time` follows them instead, linearly between neighbours and along the last
    segment beyond the largest (the smallest one's time below it): one line through 8 KiB-4 MiB priced a 16 MiB
    all-reduce over 8 gloo ranks on 2 cores at 52 ms where it takes 94 (2026-11-27: caches).
    """

    latency: float
    bandwidth: float
    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(sorted((float(b), float(t)) for b, t in self.points)))

    def time(self, nbytes: float) -> float:
        pts = self.points
        if len(pts) < 2:
            return self.latency + nbytes / self.bandwidth
        if nbytes <= pts[0][0]:
            return pts[0][1]
        i = next((i for i in range(1, len(pts)) if nbytes <= pts[i][0]), len(pts) - 1)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        slope = (t1 - t0) / max(b1 - b0, 1e-30)
        if nbytes > b1:  # beyond the largest: the last segment, never flatter than the line
            return t1 + (nbytes - b1) * max(slope, 1.0 / self.bandwidth)
        return max(t0 + (nbytes - b0) * slope, pts[0][1])


def _interpolate(points: list[tuple[float, float]], x: float, below) -> float:
    """Piecewise log-linear in ``x`` over sorted ``(x, y)`` points; ``below(y0, x0)`` under the first, flat above."""
    if x <= points[0][0]:
        return below(points[0][1], points[0][0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return points[-1][1]


def _ring(kind: str, n: int) -> tuple[float, float]:
    """``(latency steps, volume factor)`` of a ring collective over ``n`` ranks."""
    steps = n - 1 if n <= 16 else 2 * math.log2(n)
    return {"all_gather": (steps, (n - 1) / n), "reduce_scatter": (steps, (n - 1) / n),
            "all_reduce": (2 * steps, 2 * (n - 1) / n), "all_to_all": (steps, (n - 1) / n),
            "all_to_all_v": (steps, (n - 1) / n),
            "send": (1, 1.0)}[kind]


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and compute, and the links between them.

    Attributes:
        name: preset name or where the profile ran. gpus_per_node: devices sharing the fast intra-node link.
        memory: bytes per device. flops: peak dense FLOP/s by compute dtype (``bfloat16``, ``float32``).
        hbm_bandwidth: device memory bandwidth (bytes/s): element-wise ops and the optimizer step.
        intra / inter: the intra-node link (NVLink) and the inter-node one (one NIC per device).
        matmul_efficiency: fraction of peak large matmuls reach. attention_efficiency: the same for attention.
        op_overhead: seconds per operator launch (per op, forward and backward counted apart).
        overlap: fraction of data-parallel and pipeline traffic hidden behind compute (1 on GPUs, whose
            collectives run on their own engines; 0 on a CPU, where the same cores compute and communicate).
        usable_memory: fraction of ``memory`` a layout may use (allocator, CUDA context, fragmentation).
        host_bandwidth: bytes/s one device moves to and from host memory (PCIe) and the host's memory bandwidth
            per device for an offloaded optimizer step (``data_parallel.cpu_offload``).
        oversubscription: ranks per compute unit on a node (a CPU host running more ranks than it has cores; 1 on
            GPUs; ``meshplan profile`` measures it). A rank idle in a pipeline bubble gives its share to the busy
            ones, so a bubble costs only what the busy ranks cannot use.
        dtensor_overheads: seconds a DTensor op takes beyond its local op, by kind (``mm``, ``view``,
            ``pointwise``: :mod:`meshplan.solver.overheads`). fsdp_unit_overhead: seconds of FSDP2's hooks per
            unit and microbatch; fsdp_byte_overhead: seconds more per byte of the unit's parameters (its copies
            into and out of the collectives' buffers). pipeline_action_overhead: seconds per pipeline schedule
            action beyond its compute.
        repeat_spread: the profile's median relative spread between repeated timing windows.
        calibration_error: mean relative error of this model against measured steps (``calibrate.py``, or the
            published runs for a preset); with ``repeat_spread`` the ± band of ``meshplan estimate``.
        calibration_source: where ``calibration_error`` comes from.
        matmul_rates: measured ``(size, FLOP/s)`` points, size the cube root of m·n·k (``meshplan profile``).
        memory_rates: measured ``(bytes per tensor, bytes/s)`` of element-wise work (caches make small tensors
            faster than ``hbm_bandwidth``).
        collectives: measured fits by kind and group size (``meshplan profile``).
        device: ``cuda`` or ``cpu``. source: where the numbers come from.
        optimizer_rates: measured ``(elements per tensor, seconds per float32 element)`` of torch's
            ``AdamW.step`` (``meshplan profile``; empty on a preset: priced by its bytes,
            :mod:`meshplan.solver.host_step`). clip_rates: the same for ``clip_grad_norm_`` (empty: not priced).
        expert_grad_rate: bytes/s of the dense gradients an eager expert loop's weight slices write and sum in
            backward (:mod:`meshplan.solver.moe_costs`; ``meshplan profile`` measures the pattern; 0: not
            measured, no MoE loop term). host_sync_overhead: seconds of one host sync (an MoE block reads its
            routing counts on the host once per microbatch).
        tp_hook_overhead: seconds per forward hook call of a tensor-parallel style (its ``from_local`` /
            ``to_local`` and their autograd nodes) beyond the DTensor ops it dispatches.
        collective_busy: seconds a tensor-parallel collective takes beyond its fit when the ranks compute between
            collectives (:mod:`meshplan.profile.tp_overheads`; not charged where ``sync_loss`` is measured).
        touch_rate: bytes/s of an eager block's element-wise reads and writes (:data:`~meshplan.solver.compute.TOUCHES`)
            as a reference block timed whole reaches them (:mod:`meshplan.profile.block`; 0: not measured, the
            bytes at ``memory_rates``). block_op_overhead: seconds per operator of that block beyond its
            element-wise bytes (0: ``op_overhead``). block_scale: that block's measured time, whole, over its price
            from the other rates (:func:`meshplan.profile.run.block_scale`): every block's price is multiplied by
            it (1: not measured).
        sharded_attention: measured ``(degree, factor)``: a rank's attention with the sequence sharded ``degree``
            ways, over its share of the unsharded attention (the sharding axis unit's ``Axis.profile``; empty: 1).
        sync_loss: measured ``(group size, segment seconds, seconds)``: what a collective that blocks the compute
            costs beyond its fit after a segment of compute (:mod:`meshplan.profile.sync`; empty: not priced).
    """

    name: str
    gpus_per_node: int
    memory: float
    flops: Mapping[str, float]
    hbm_bandwidth: float
    intra: Link
    inter: Link
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.35
    op_overhead: float = 0.0
    overlap: float = 1.0
    usable_memory: float = 0.9
    host_bandwidth: float = 25e9
    oversubscription: float = 1.0
    dtensor_overheads: Mapping[str, float] = field(default_factory=dict)
    fsdp_unit_overhead: float = 0.0
    fsdp_byte_overhead: float = 0.0
    pipeline_action_overhead: float = 0.0
    repeat_spread: float = 0.0
    calibration_error: float = 0.0
    calibration_source: str = ""
    matmul_rates: tuple[tuple[float, float], ...] = ()
    memory_rates: tuple[tuple[float, float], ...] = ()
    collectives: Mapping[str, Mapping[int, Fit]] = field(default_factory=dict)
    device: str = "cuda"
    source: str = ""
    optimizer_rates: tuple[tuple[float, float], ...] = ()
    clip_rates: tuple[tuple[float, float], ...] = ()
    expert_grad_rate: float = 0.0
    host_sync_overhead: float = 0.0
    tp_hook_overhead: float = 0.0
    collective_busy: float = 0.0
    touch_rate: float = 0.0
    block_op_overhead: float = 0.0
    block_scale: float = 1.0
    sharded_attention: tuple[tuple[float, float], ...] = ()
    sync_loss: tuple[tuple[float, float, float], ...] = ()

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s of ``dtype`` (float16 as bfloat16)."""
        key = "bfloat16" if dtype == "float16" else dtype
        if key not in self.flops:
            raise PlanError(f"cluster {self.name}: no peak FLOP/s for {dtype}; it has {', '.join(self.flops)}")
        return self.flops[key]

    def matmul_rate(self, size: float, dtype: str) -> float:
        """FLOP/s of a matmul of ``size`` = (m·n·k)^(1/3): the measured curve, else peak × efficiency."""
        if not self.matmul_rates:
            return self.peak(dtype) * self.matmul_efficiency
        # below the smallest measured size the rate falls with the size
        return _interpolate(sorted(self.matmul_rates), size, below=lambda r, s0: r * size / s0)

    def sharded_attention_factor(self, degree: int) -> float:
        """A rank's attention time, sequence sharded ``degree`` ways, over its share of the unsharded one (1 to the
        first point linearly, flat past the last; 1 unmeasured)."""
        if degree <= 1 or not self.sharded_attention:
            return 1.0
        return _interpolate(sorted(self.sharded_attention), degree,
                            below=lambda f, d0: 1 + (f - 1) * (degree - 1) / max(d0 - 1, 1e-9))

    def memory_rate(self, nbytes: float) -> float:
        """Bytes/s element-wise work reaches on tensors of ``nbytes``: the measured curve, else ``hbm_bandwidth``."""
        if not self.memory_rates:
            return self.hbm_bandwidth
        return _interpolate(sorted(self.memory_rates), nbytes, below=lambda r, s0: r)

    def comm_time(self, kind: str, n: int, nodes: int, nbytes: float) -> float:
        """Seconds one ``kind`` collective over ``n`` ranks on ``nodes`` nodes takes for ``nbytes`` (the full
        buffer: all-gather output, reduce-scatter input, all-reduce buffer; all-to-all: what one rank holds;
        send: the message)."""
        if n <= 1 and kind != "send":
            return 0.0
        measured = self.collectives.get(kind)
        if kind == "all_to_all" and self.collectives.get("all_to_all_v"):
            measured = self.collectives["all_to_all_v"]  # meshplan's all-to-alls (MoE dispatch) split unevenly
        if measured:
            return self._measured(measured, kind, n, nbytes)
        link = self.inter if nodes > 1 else self.intra
        steps, volume = _ring(kind, n)
        if kind == "all_to_all" and nodes > 1:  # the peers inside the node answer over the fast link
            inside = n // nodes
            return steps * link.latency + (n - inside) / n * nbytes / link.bandwidth
        return steps * link.latency + volume * nbytes / link.bandwidth

    def _measured(self, fits: Mapping[int, Fit], kind: str, n: int, nbytes: float) -> float:
        if n in fits:
            return fits[n].time(nbytes)
        near = min(fits, key=lambda g: abs(math.log(g / n)))  # scale the nearest size by the ring's factors
        s0, v0 = _ring(kind, near)
        s1, v1 = _ring(kind, n)
        return fits[near].latency * s1 / max(s0, 1e-9) + v1 / v0 * nbytes / fits[near].bandwidth

    def to_dict(self) -> dict:
        d = asdict(self)
        d["collectives"] = {k: {str(n): _fit_dict(f) for n, f in v.items()} for k, v in self.collectives.items()}
        for key in _CURVES:
            d[key] = [list(p) for p in getattr(self, key)]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "cluster") -> "Cluster":
        """The inverse of :meth:`to_dict` (a ``meshplan profile`` file).

        Raises:
            PlanError: a missing or malformed field, named.
        """
        try:
            data = dict(d)
            data["intra"], data["inter"] = Link(**d["intra"]), Link(**d["inter"])
            data["flops"] = {str(k): float(v) for k, v in d["flops"].items()}
            data["dtensor_overheads"] = {str(k): float(v) for k, v in d.get("dtensor_overheads", {}).items()}
            for key in _CURVES:
                data[key] = tuple(tuple(float(v) for v in p) for p in d.get(key, ()))
                if any(len(p) != (3 if key == "sync_loss" else 2) for p in data[key]):
                    raise ValueError(f"{key}: points of the wrong length")
            data["collectives"] = {k: {int(n): Fit(**f) for n, f in v.items()}
                                   for k, v in d.get("collectives", {}).items()}
            cluster = cls(**data)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"{where}: not a cluster description ({type(e).__name__}: {e}); write one with "
                            f"`meshplan profile -o cluster.json`") from None
        if cluster.gpus_per_node < 1 or min(cluster.memory, cluster.hbm_bandwidth, cluster.block_scale) <= 0:
            raise PlanError(f"{where}: gpus_per_node, memory, hbm_bandwidth and block_scale must be positive")
        numbers = {k: v for k, v in vars(cluster).items() if isinstance(v, (int, float))}
        numbers.update({f"flops.{k}": v for k, v in cluster.flops.items()})
        numbers.update({f"dtensor_overheads.{k}": v for k, v in cluster.dtensor_overheads.items()})
        bad = {k: v for k, v in numbers.items() if not math.isfinite(v) or v < 0}  # NaN compares false above
        if bad:
            raise PlanError(f"{where}: {', '.join(f'{k} = {v!r}' for k, v in list(bad.items())[:4])}: expected "
                            f"finite numbers >= 0")
        return cluster


def _fit_dict(f: Fit) -> dict:
    """A fit as JSON: its line, and its measured points when it has them."""
    d = {"latency": f.latency, "bandwidth": f.bandwidth}
    return {**d, "points": [list(p) for p in f.points]} if f.points else d


def load_cluster_file(path: str | Path) -> Cluster:
    """Read a cluster JSON file (``meshplan profile -o``).

    Raises:
        PlanError: unreadable, not JSON, or not a cluster description.
    """
    from meshplan.plan_file.reading import read_json
    p = Path(path)
    try:
        data = read_json(p, "cluster file")  # bounded: a regular file of at most 4 MiB
    except PlanError as e:
        raise PlanError(f"--cluster {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"--cluster {str(p)!r}: expected a JSON object")
    return Cluster.from_dict(data, f"--cluster {str(p)!r}")
