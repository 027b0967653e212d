"""``meshplan profile`` and ``meshplan solve --profile``: launch the measuring job (:mod:`meshplan.profile.worker`)
under torchrun on this machine and turn its numbers into a :class:`~meshplan.solver.cluster.Cluster` file.

The cluster is one node of ``nproc`` devices: its intra-node link is what the collectives measured, its
inter-node link the same (nothing else is measurable from one machine); collective times come from the measured
fits (:meth:`Cluster.comm_time`), compute from the measured matmul curve, memory-bound work from the measured
bandwidth, what the counts leave out (DTensor dispatch, FSDP2 hooks, pipeline actions: :mod:`meshplan.solver.overheads`)
from :mod:`meshplan.profile.overheads`, the optimizer step and clipping from :mod:`meshplan.profile.step_costs`, and the ranks per core from the measured effective parallelism. On a CPU
host the data-parallel overlap is 0: the cores that compute also communicate.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.solver.candidate import DTYPE_BYTES, Candidate, Training
from meshplan.solver.cluster import Cluster, Fit, Link
from meshplan.solver.compute import OPS_PER_BLOCK, block_time, touches_per_token
from meshplan.solver.host_step import STEP_COST_FIELDS
from meshplan.solver.shape import ModelShape

__all__ = ["profile_cluster", "cluster_from_measurement", "block_costs", "block_scale", "reference_block_price"]

#: measured scalars the cluster takes as they are (0 in a profile from before they were measured)
_SCALARS = ("expert_grad_rate", "host_sync_overhead", "tp_hook_overhead", "collective_busy", "fsdp_byte_overhead")


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def _oversubscription(m: dict, world: int, cpu: bool) -> float:
    """Ranks per core that a bubble can hand over: the measured effective parallelism's inverse, at most the job's
    own ranks over the host's cores (``m["cores"]``, else this host's). A single-threaded rank idle in a bubble
    frees a core only for a busy rank that was sharing one with the job's other ranks; the share that other
    processes' load takes (a measured 0.63 cores per rank at world 2 on 2 loaded cores) is not handed back, so
    counting it waived the whole bubble (pp 2 rows measured 1.5x their estimate). 1 on a GPU host."""
    if not cpu:
        return 1.0
    own = world / (m.get("cores") or os.cpu_count() or world)
    measured = 1.0 / float(m["parallelism"]) if m.get("parallelism") else own
    return max(1.0, min(measured, own))


def _attention_efficiency(m: dict, rates: tuple, cpu: bool) -> float:
    """The measured attention rate over the matmul peak (a profile from before it was measured: 0.5 on a CPU,
    0.35 on a GPU, as assumed then)."""
    if not m.get("attention_rate"):
        return 0.5 if cpu else 0.35
    return float(m["attention_rate"]) / max(r for _, r in rates)


def block_costs(m: dict) -> dict:
    """``touch_rate`` and ``block_op_overhead`` from the reference block's times beyond its matmuls and attention
    (:mod:`meshplan.profile.block`: its element-wise work and launches): the two token counts split them into a
    per-token part (the block's :data:`~meshplan.solver.compute.TOUCHES` bytes at ``touch_rate``) and a per-call
    one (:data:`~meshplan.solver.compute.OPS_PER_BLOCK` launches). Empty (the memory rate and ``op_overhead``
    price them) in a profile from before it was measured, or when noise left no per-token part."""
    ref, rest = m.get("block_reference"), sorted(m.get("block_rest_times") or ())
    if not ref or len(rest) < 2:
        return {}
    shape = _reference_shape(ref)
    (b1, r1), (b2, r2) = rest[0], rest[-1]
    t1, t2 = b1 * ref["seq"], b2 * ref["seq"]
    per_token = (r2 - r1) / (t2 - t1)
    if per_token <= 0:
        return {}
    return {"touch_rate": touches_per_token(shape) * DTYPE_BYTES[m["dtype"]] / per_token,
            "block_op_overhead": max(r1 - per_token * t1, 0.0) / OPS_PER_BLOCK}


def block_scale(m: dict, cluster: Cluster) -> float:
    """The reference block's measured time over its price under ``cluster`` (every other rate already measured):
    summed over the measured batch sizes, so the price of a block fits the block timed whole. 1 in a profile from
    before the whole block was timed."""
    ref, whole = m.get("block_reference"), m.get("block_whole_times") or ()
    if not ref or not whole:
        return 1.0
    return sum(t for _, t in whole) / reference_block_price(cluster, ref, [int(b) for b, _ in whole], m["dtype"])


def reference_block_price(cluster: Cluster, ref: dict, batches, dtype: str = "float32") -> float:
    """Seconds of the reference block (``ref``: :data:`meshplan.profile.block.REFERENCE`'s shape) forward and
    backward, summed over ``batches`` sequences per call, priced under ``cluster``. For a profiled cluster and the
    profile's batches it is the whole block's time the profile measured (its ``block_scale`` makes the price fit
    it): beside which a later :func:`meshplan.profile.block.whole_block_time` reads the host's drift."""
    shape, priced = _reference_shape(ref), 0.0
    for batch in batches:
        train = Training(seq=ref["seq"], global_batch=int(batch), dtype=dtype)
        priced += block_time(shape, Candidate(micro_batch=int(batch)), train, cluster, False, False)[0]
    return priced


def _reference_shape(ref: dict) -> ModelShape:
    return ModelShape(layers=1, hidden=ref["hidden"], heads=ref["heads"], kv_heads=ref["kv_heads"], ffn=ref["ffn"],
                      vocab=1)


def cluster_from_measurement(m: dict) -> Cluster:
    """A :class:`Cluster` from the worker's JSON."""
    world = int(m["world"])
    measured = {**m["collectives"], "all_to_all_v": m.get("all_to_all_v", {})}
    fits = {k: {int(n): Fit(**f) for n, f in v.items()} for k, v in measured.items() if v}
    ag = fits.get("all_gather", {})
    big = ag[max(ag)] if ag else Fit(1e-5, 1e9)
    link = Link(bandwidth=big.bandwidth * (max(ag) - 1) / max(ag) if ag else 1e9,
                latency=big.latency / max(max(ag) - 1, 1) if ag else 1e-5)
    rates = tuple((float(n), float(r)) for n, r in m["matmul_rates"])
    memory_rates = tuple((float(n), float(r)) for n, r in m.get("memory_rates", ()))
    cpu = m["device"] == "cpu"
    memory = float(m["memory"] or _host_memory() / world)
    when = datetime.date.today().isoformat()
    cluster = Cluster(
        name=f"profiled-{platform.node() or 'host'}-{m['backend']}-{world}", gpus_per_node=world, memory=memory,
        flops={m["dtype"]: max(r for _, r in rates)}, hbm_bandwidth=float(m["hbm_bandwidth"]), intra=link,
        inter=link, matmul_efficiency=1.0, attention_efficiency=_attention_efficiency(m, rates, cpu),
        op_overhead=float(m["op_overhead"]), overlap=0.0 if cpu else 1.0, usable_memory=0.9,
        oversubscription=_oversubscription(m, world, cpu), matmul_rates=rates,
        dtensor_overheads={k: float(v) for k, v in m.get("dtensor_overheads", {}).items()},
        fsdp_unit_overhead=float(m.get("fsdp_unit_overhead", 0.0)),
        pipeline_action_overhead=float(m.get("pipeline_action_overhead", 0.0)),
        repeat_spread=float(m.get("repeat_spread", 0.0)),
        memory_rates=memory_rates,
        sharded_attention=tuple((float(n), float(f)) for n, f in m.get("sharded_attention", ())),
        sync_loss=tuple((float(g), float(t), float(x)) for g, t, x in m.get("sync_loss", ())),
        collectives=fits, device=m["device"],
        **{k: tuple((float(n), float(t)) for n, t in m.get(k, ())) for k in STEP_COST_FIELDS},
        **{k: float(m.get(k, 0.0)) for k in _SCALARS},
        source=(f"measured by `meshplan profile` on {platform.node()} ({m['backend']}, {world} processes, "
                f"{os.cpu_count()} CPU cores, {m['threads']} threads each, {when})"))
    cluster = replace(cluster, **block_costs(m))
    return replace(cluster, block_scale=block_scale(m, cluster))


def _error_line(stderr: str) -> str:
    """The worker's exception line (``RuntimeError: ...``) from a failed job's stderr, not torchrun's summary."""
    lines = [ln.removeprefix("[rank0]: ").strip() for ln in stderr.splitlines()]
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", ln) and "ChildFailedError" not in ln]
    rest = [ln for ln in lines if ln and not set(ln) <= set("=-")]
    return (raised or rest or ["no output"])[-1]


def profile_cluster(nproc: int, out: str | Path | None = None, backend: str | None = None,
                    timeout: float = 900) -> Cluster:
    """Measure this machine with ``nproc`` processes; write the cluster file to ``out`` (if given).

    Raises:
        PlanError: the job failed or timed out (its last error line in the message), or ``out`` cannot be written.
    """
    with tempfile.TemporaryDirectory(prefix="meshplan-profile-") as tmp:
        result = Path(tmp) / "measured.json"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if backend:
            env["MESHPLAN_PROFILE_BACKEND"] = backend
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "meshplan.profile.worker", "--out", str(result)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PlanError(f"profile: the measuring job did not finish in {timeout:.0f} s") from None
        if proc.returncode or not result.is_file():
            last = _error_line(proc.stderr or "")
            raise PlanError(f"profile: the measuring job failed (exit {proc.returncode}): {last[:300]}")
        cluster = cluster_from_measurement(json.loads(result.read_text(encoding="utf-8")))
    if out is not None:
        try:
            Path(out).write_text(json.dumps(cluster.to_dict(), indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise PlanError(f"profile: cannot write {str(out)!r}: {e.strerror or e}") from None
    return cluster
