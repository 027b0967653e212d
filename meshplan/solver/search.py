"""The layout search: every candidate layout for a model on a cluster, each valid one timed, each rejected one
with the rule that rejects it. Torch-free.

Candidates are enumerated axis by axis (tp, cp, pp over the divisors of the GPU count; ep and etp for MoE
models; the data-parallel split; the order; the schedule and its vpp; the micro-batch size; activation
checkpointing). A rule that fails on a prefix (tp not dividing the KV heads) rejects the prefix once, with its
message, instead of each of its completions. Orders that put every group on the same nodes as an order already
tried are the same layout and are skipped.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors
from meshplan.plan_file.pipeline import SCHEDULES, V_SCHEDULES
from meshplan.plan_file.stages import other_degrees, schedule_problem
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.placement import Placement
from meshplan.solver.rules import layout_problem, model_problem, sequence_problem
from meshplan.solver.shape import ModelShape
from meshplan.solver.step import Estimate, evaluate, peak_memory

__all__ = ["Space", "Rejection", "SearchResult", "search"]


@dataclass(frozen=True)
class Space:
    """What the search varies.

    Attributes:
        orders: Megatron order strings tried. schedules: pipeline schedules tried. vpps: stages per rank tried
            by the loop schedules with several (the V-shaped ones take 2). micro_batches: sequences per microbatch.
        ac: activation checkpointing tried (``selective``: every ``ac_every``-th block, or op level with
            ``ac_ops``: matmul outputs kept, the rest recomputed; ``ac_policy`` ``megatron``: op level,
            :mod:`meshplan.recompute`).
        fixed: degrees pinned by the user (``{"tp": 8}``).
    """

    orders: tuple[str, ...] = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp")
    schedules: tuple[str, ...] = SCHEDULES
    vpps: tuple[int, ...] = (2, 4)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    ac: tuple[str, ...] = ("none", "selective", "full")
    ac_every: int = 2
    ac_ops: bool = False
    ac_policy: str | None = None
    fixed: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from meshplan.plan_file.layout import _parse_order
        empty = [k for k in ("orders", "schedules", "vpps", "micro_batches", "ac") if not getattr(self, k)]
        if empty:
            raise PlanError(f"{', '.join(empty)}: nothing to try (an empty list); give at least one value")
        bad = [x for x in self.schedules if x not in SCHEDULES]
        if bad:
            raise PlanError(f"schedules: {bad} are not schedules; valid: {', '.join(SCHEDULES)}")
        bad = [x for x in self.ac if x not in ("none", "selective", "full")]
        if bad:
            raise PlanError(f"ac: {bad} are not checkpointing modes; valid: none, selective, full")
        if self.ac_policy not in (None, "megatron"):
            raise PlanError(f"ac_policy: {self.ac_policy!r} is not a checkpointing policy; valid: megatron")
        if any(v < 1 for v in self.vpps + self.micro_batches) or self.ac_every < 1:
            raise PlanError(f"vpps {self.vpps}, micro_batches {self.micro_batches} and ac_every must be >= 1")
        for order in self.orders:
            try:
                _parse_order(order)
            except ValueError as e:
                raise PlanError(f"orders: {e}") from None


@dataclass(frozen=True)
class Rejection:
    """A candidate (or every completion of a prefix) and the rule that rejects it."""

    label: str
    reason: str
    message: str


@dataclass
class SearchResult:
    """What :func:`search` found: ``valid`` estimates fastest first, ``rejected`` with their rules,
    ``enumerated`` candidates and prefixes looked at, ``seconds`` spent."""

    valid: list[Estimate]
    rejected: list[Rejection]
    enumerated: int
    seconds: float

    def reasons(self) -> Counter:
        return Counter(r.reason for r in self.rejected)


class _Search:
    def __init__(self, s: ModelShape, tr: Training, cl: Cluster, gpus: int, space: Space):
        self.s, self.tr, self.cl, self.gpus, self.space = s, tr, cl, gpus, space
        self.valid: list[Estimate] = []
        self.times: dict = {}  # collective times, shared by every candidate
        self.rejected: list[Rejection] = []
        self.enumerated = 0

    def reject(self, label: str, problem: tuple[str, str]) -> None:
        self.rejected.append(Rejection(label, *problem))

    def degrees(self, axis: str, n: int) -> list[int]:
        fixed = self.space.fixed.get(axis)
        return [d for d in divisors(n) if fixed is None or d == fixed]

    def run(self) -> None:
        for tp in self.degrees("tp", self.gpus):
            self.enumerated += 1
            why = model_problem(self.s, Candidate(tp=tp, etp=tp))
            if why:
                self.reject(f"tp{tp}", why)
                continue
            for cp in self.degrees("cp", self.gpus // tp):
                self.enumerated += 1
                why = sequence_problem(Candidate(tp=tp, etp=tp, cp=cp), self.tr)
                if why:
                    self.reject(f"tp{tp} cp{cp}", why)
                    continue
                for pp in self.degrees("pp", self.gpus // (tp * cp)):
                    self.pipeline(tp, cp, pp)

    def pipeline(self, tp: int, cp: int, pp: int) -> None:
        self.enumerated += 1
        label, dp = f"tp{tp} cp{cp} pp{pp}", self.gpus // (tp * cp * pp)
        if self.s.layers < pp:
            self.reject(label, ("blocks", f"pipeline: {self.s.layers} blocks cannot fill {pp} stages (pp·vpp); "
                                          f"expected at least {pp} blocks"))
            return
        if self.tr.global_batch % dp:
            self.reject(label, ("batch", f"the global batch ({self.tr.global_batch}) must be a positive multiple of "
                                         f"the data-parallel size ({dp})"))
            return
        for ep, etp in self.experts(tp, pp):
            for rep, shard in self.dp_splits(dp, tp, cp):
                seen: set = set()
                for order in self.space.orders:
                    base = Candidate(tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, dp_replicate=rep, dp_shard=shard, order=order)
                    self.enumerated += 1
                    why = layout_problem(base)
                    if why:
                        self.reject(base.label(), why)
                        continue
                    self.schedules(base, seen)

    def experts(self, tp: int, pp: int) -> Iterator[tuple[int, int]]:
        if not self.s.experts:
            yield 1, tp
            return
        for etp in sorted({1, tp}):
            for ep in self.degrees("ep", self.gpus // (etp * pp)):
                self.enumerated += 1
                why = model_problem(self.s, Candidate(tp=tp, ep=ep, etp=etp))
                if why:
                    self.reject(f"tp{tp} ep{ep} etp{etp}", why)
                    continue
                yield ep, etp

    def dp_splits(self, dp: int, tp: int, cp: int) -> list[tuple[int, int]]:
        """``(dp_replicate, dp_shard)``: FSDP over every data rank, DDP, and HSDP sharding over one node's data
        ranks or eight nodes'."""
        pinned = self.space.fixed.get("dp_replicate")
        node = max(1, self.cl.gpus_per_node // (tp * cp))
        shards = {dp, 1} | {k for k in (node, 8 * node) if 1 < k < dp and dp % k == 0}
        out = [(dp // k, k) for k in sorted(shards, reverse=True)]
        return [o for o in out if pinned is None or o[0] == pinned]

    def schedules(self, base: Candidate, seen: set) -> None:
        layout_place = Placement(base, self.s.layers, self.cl.gpus_per_node)
        opts = [(None, 1)] if base.pp == 1 else [
            (sch, v) for sch in self.space.schedules
            for v in ((2,) if sch in V_SCHEDULES else (1,) if sch in ("gpipe", "1f1b") else self.space.vpps)]
        for sch, v in opts:
            if self.space.fixed.get("vpp") not in (None, v):
                continue
            cand = base.with_(schedule=sch, vpp=v)
            if self.s.layers < base.pp * v:
                self.enumerated += 1
                self.reject(cand.label(), ("blocks", f"pipeline: {self.s.layers} blocks cannot fill {base.pp * v} "
                                                     f"stages (pp·vpp); expected at least {base.pp * v} blocks"))
                continue
            place = layout_place.with_stages(cand)
            key = (sch, v, tuple(sorted(place.groups.items())))
            if key in seen:  # this order puts every group where an earlier one did
                continue
            seen.add(key)
            self.microbatching(cand, place)

    def microbatching(self, cand: Candidate, place: Placement) -> None:
        local = self.tr.global_batch // cand.dp
        for mb in self.space.micro_batches:
            if local % mb:
                continue
            c = cand.with_(micro_batch=mb, microbatches=local // mb)
            if c.pp > 1:
                why = schedule_problem(c.schedule, c.microbatches, c.pp, c.vpp, others=other_degrees(place.layout))
                if why:
                    self.enumerated += 1
                    self.reject(c.label(), ("schedule", why))
                    continue
            sharded = c.mode in ("fsdp", "hsdp") and c.microbatches > 1  # pipelines too (ReducingStage)
            for ac in self.space.ac:
                for keep in ((True, False) if sharded else (True,)):
                    self.enumerated += 1
                    selective = ac == "selective"
                    self.evaluate(c.with_(ac=ac, ac_every=self.space.ac_every if selective else 1,
                                          ac_ops=selective and self.space.ac_ops,
                                          ac_policy=self.space.ac_policy if selective else None,
                                          accumulate_unsharded=keep), place)

    def evaluate(self, c: Candidate, place: Placement) -> None:
        memo: dict = {}
        mem, rank = peak_memory(self.s, c, self.tr, place, memo)
        usable = self.cl.memory * self.cl.usable_memory
        if mem.total > usable:
            gib = 1 << 30
            self.reject(c.label(), ("memory", f"memory: {mem.total / gib:.1f} GiB on pipeline rank {rank} > "
                                              f"{usable / gib:.1f} GiB usable ({mem.describe()} GiB)"))
        else:
            self.valid.append(evaluate(self.s, c, self.tr, self.cl, place, self.times, memo))


def search(s: ModelShape, tr: Training, cl: Cluster, gpus: int, space: Space | None = None) -> SearchResult:
    """Every layout of ``s`` on ``gpus`` devices of ``cl`` for the run ``tr``: valid ones timed and ranked,
    rejected ones with their rule.

    Raises:
        PlanError: ``gpus`` below 1.

    Example::

        >>> res = search(model_preset("llama3-70b"), Training(seq=8192, global_batch=512), cluster_preset("h100-80g"), 256)
        >>> res.valid[0].candidate.label()
    """
    if gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    space = space or Space()
    for axis, d in space.fixed.items():
        if gpus % d:
            raise PlanError(f"--{axis.replace('_', '-')} {d}: does not divide --gpus {gpus}; a layout's degrees "
                            f"divide the device count (divisors of {gpus}: {', '.join(map(str, divisors(gpus)))})")
    t0 = time.perf_counter()
    run = _Search(s, tr, cl, gpus, space)
    run.run()
    if not run.valid and not run.rejected:
        pinned = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in space.fixed.items())
        raise PlanError(f"no layout to consider on --gpus {gpus}: the pinned degrees ({pinned or 'none'}) leave none "
                        f"(their product must divide {gpus}); pin fewer degrees")
    run.valid.sort(key=lambda e: (e.step_time, e.memory.total))  # a tie goes to the layout needing less memory
    return SearchResult(run.valid, run.rejected, run.enumerated, time.perf_counter() - t0)
