"""Pipeline schedules side by side: the idle (bubble) fraction and the peak activations each one really has.

Run: ``python benchmarks/pp.py [--quick] [--unit-ms 20]`` from the repo root (≈40 s on 2 cores, ≈2 min on a
loaded machine; ``--quick``: m = 8 only and a 10 ms unit, ≈25 s). Every schedule of
``torch.distributed.pipelining`` that meshplan names runs for real: one ``torch.multiprocessing`` spawn of 4
gloo CPU processes, p = 2 on a 2-rank group and p = 4 on all 4. The model is a stack of identical chunks
(Linear-ReLU-Linear-ReLU, hidden 64) cut by hand into p·v stages, one ``PipelineStage`` per stage (stage s on
rank s mod p; for ``zbv_zero_bubble`` and ``dualpipev`` the V shape, rank r holding stages r and 2p−1−r), the
schedule built by its torch class with an MSE loss, one warm-up ``step`` (shape inference), then the measured
``step``. Each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when the schedule splits the
backward) and ``backward_weight_one_chunk`` (W) is wrapped to record what the schedule really executes.

Columns, per (schedule, p, v, m):

* **idle: replay** — each rank's executed action order, re-timed with unit costs F = I = W = 1, B = I + W = 2
  (one unit = one forward of one microbatch through one stage: the zero-bubble papers' T_F = T_B = T_W),
  no communication cost, and the pipeline's dependencies (F after the previous stage's F; B/I after the next
  stage's B/I; W after its I). idle = Σ_ranks (makespan − busy) / (p · makespan). The schedule itself, free
  of machine noise.
* **idle: formula** — the schedule's published bubble in the same units; *formula: source* says which.
* **idle: wall** — the measured step on the wall clock: every recorded call sleeps its unit cost (the tiny
  chunk's own compute is far below a unit), idle = Σ_ranks (window − time inside calls) / (p · window). It adds
  what the replay leaves out: gloo send/recv, Python, a loaded machine.
* **peak saved activations** — per rank, the most bytes alive at once among the tensors the stage modules
  saved for backward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded; a tensor saved twice
  counted once; released when autograd drops it), over the bytes one microbatch saves through the rank's v
  chunks: "microbatches of the rank's layers". **in flight (actions)**: the same from the executed order
  (forwards not yet finished by their B, or W). **rank 0 expected**: the schedule's known peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _pp_trace import Trace, Tracker, peak_in_flight, replay  # noqa: E402

__all__ = ["Schedule", "SCHEDULES", "plan_jobs", "run", "rows", "table", "main"]

HIDDEN, MB_ROWS = 64, 4


@dataclass(frozen=True)
class Schedule:
    """A meshplan schedule name, its torch class, stages per rank and placement, and its published numbers.

    ``idle``: the bubble formula as an idle fraction in replay units; ``memory``: rank 0's peak, in
    microbatches of the rank's layers; ``min_m``: the fewest microbatches run here for a given p.
    """

    name: str
    torch_class: str
    v: int
    style: str  # "single" | "loop" (stage s on rank s mod p) | "v" (rank r holds r and 2p−1−r)
    formula: str
    source: str
    idle: Callable[[int, int, int], float]
    memory_text: str
    memory: Callable[[int, int, int], float]
    min_m: Callable[[int], int]


def _flush(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _zero_bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / (3 * v * m + p - 1)


def _dualpipe(p: int, v: int, m: int) -> float:
    return 2 * (p - 1) / (3 * v * m + 2 * (p - 1))


SCHEDULES = (
    Schedule("gpipe", "ScheduleGPipe", 1, "single", "(p−1)/(m+p−1)", "GPipe (Huang et al. 2019)", _flush,
             "m", lambda p, v, m: m, lambda p: 1),
    Schedule("1f1b", "Schedule1F1B", 1, "single", "(p−1)/(m+p−1)",
             "PipeDream-flush (Narayanan et al. 2021, PipeDream-2BW paper); Megatron-LM (Narayanan et al. SC'21)",
             _flush, "min(m, p)", lambda p, v, m: min(m, p), lambda p: p),
    Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", 2, "loop", "(p−1)/(v·m+p−1)",
             "Megatron-LM interleaved (Narayanan et al. SC'21): bubble (1/v)·(p−1)/m of the ideal time", _flush,
             "min(m, p+(p−1)/v)", lambda p, v, m: min(m, p + (p - 1) / v), lambda p: 1),
    Schedule("looped_bfs", "ScheduleLoopedBFS", 2, "loop", "(p−1)/(v·m+p−1)",
             "Breadth-First PP (Lamy-Poirier 2022), m ≥ p", _flush, "m", lambda p, v, m: m, lambda p: p),
    Schedule("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", 2, "loop", "(p−1)/(3v·m+p−1)",
             "ZB1P/ZB-H1 (Qi et al. ICLR'24): bubble rate (p−1)/3m at T_F=T_B=T_W, here per chunk (÷v)",
             _zero_bubble, "min(m, p)", lambda p, v, m: min(m, p), lambda p: 1),
    Schedule("zbv_zero_bubble", "ScheduleZBVZeroBubble", 2, "v", "(p−1)/(3v·m+p−1)",
             "ZB-V (Qi et al., arXiv 2401.10241 §6): 0 at T_F=T_B=T_W only with optimizer post-validation "
             "(steps overlap); a synchronous step keeps its (p−1)-unit warm-up", _zero_bubble, "min(m, p)",
             lambda p, v, m: min(m, p), lambda p: 1),
    Schedule("dualpipev", "ScheduleDualPipeV", 2, "v", "2(p−1)/(6m+2(p−1))",
             "DualPipeV (DeepSeek-V3; DualPipe README): (PP/2−1)(F&B+B−3W), PP = 2p stages, F&B = F+B "
             "(torch runs the pair back to back)", _dualpipe, "p+½ (PP+1 stages)", lambda p, v, m: p + 0.5,
             lambda p: 2 * p),  # torch: DualPipeV needs m ≥ 2p
)


def _stage_ids(spec: Schedule, p: int, rank: int) -> list[int]:
    """The stages ``rank`` holds: ``rank + k·p`` (loop), or ``rank, 2p−1−rank`` (V)."""
    if spec.style == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(spec.v)]


def _chunk(seed: int) -> nn.Module:
    """One stage: the same shape everywhere, weights seeded by the stage index."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())


def _unit_bytes(chunk: nn.Module) -> int:
    """Bytes one microbatch saves for backward through one chunk."""
    tracker = Tracker(skip={q.untyped_storage().data_ptr() for q in chunk.parameters()})
    with tracker.hooks():
        out = chunk(torch.randn(MB_ROWS, HIDDEN))
    del out
    return tracker.peak


def _build(spec: Schedule, p: int, m: int, group, unit_s: float):
    """This rank's stages (wrapped by a :class:`Trace`), the schedule, and the bytes of one rank-microbatch."""
    from torch.distributed.pipelining import PipelineStage, schedules
    ids = _stage_ids(spec, p, dist.get_rank(group))
    chunks = [_chunk(s) for s in ids]
    tracker = Tracker(skip={q.untyped_storage().data_ptr() for c in chunks for q in c.parameters()})
    trace = Trace(unit_s, tracker)
    stages = [PipelineStage(c, s, p * spec.v, torch.device("cpu"), group=group) for c, s in zip(chunks, ids)]
    for stage in stages:
        trace.wrap(stage)
    cls = getattr(schedules, spec.torch_class)
    sched = cls(stages[0] if spec.style == "single" else stages, n_microbatches=m, loss_fn=F.mse_loss)
    return sched, trace, _unit_bytes(chunks[0]) * len(chunks)


def _one(spec: Schedule, p: int, m: int, group, unit_s: float) -> dict:
    """Build, warm up and run one measured step of ``spec`` on this rank of ``group`` (p ranks)."""
    sched, trace, rank_unit = _build(spec, p, m, group, unit_s)
    torch.manual_seed(1234)
    x, y = torch.randn(m * MB_ROWS, HIDDEN), torch.randn(m * MB_ROWS, HIDDEN)
    sched.step(x, target=y)  # warm-up: shape inference, p2p set-up
    trace.tracker.peak = trace.tracker.live
    dist.barrier(group=group)
    trace.armed = True
    sched.step(x, target=y)
    trace.armed = False
    return {"events": trace.events, "peak": trace.tracker.peak, "unit": rank_unit}


def _worker(rank: int, world: int, plan: list, unit_s: float, init: str, out: str) -> None:
    """One spawned process: for each (p, jobs) in ``plan``, ranks below p run the jobs on a p-rank group."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    specs = {s.name: s for s in SCHEDULES}
    mine = []
    for p, jobs in plan:
        group = dist.new_group(list(range(p)))  # every rank takes part in creating it
        mine.append([_one(specs[name], p, m, group, unit_s) for name, m in jobs] if rank < p else [])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


def run(plan: list[tuple[int, list[tuple[str, int]]]], unit_s: float) -> list[list[list[dict]]]:
    """Run ``plan`` = [(p, [(schedule name, m), …]), …] in one spawn of max(p) gloo processes.

    Returns, per (p, jobs) entry and per job, the p ranks' records.
    """
    import torch.multiprocessing as mp
    world = max(p for p, _ in plan)
    with tempfile.TemporaryDirectory(prefix="meshplan-pp-") as tmp:
        init, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, plan, unit_s, init, out), nprocs=world, join=True)
        with open(out) as f:
            per_rank = json.load(f)
    return [[[per_rank[r][i][j] for r in range(p)] for j in range(len(jobs))] for i, (p, jobs) in enumerate(plan)]


def _wall_idle(records: list[dict]) -> float:
    """Idle fraction of the measured step on the wall clock, over the window of all ranks' recorded calls."""
    start = min(e[3] for r in records for e in r["events"])
    end = max(e[4] for r in records for e in r["events"])
    busy = [sum(e[4] - e[3] for e in r["events"]) for r in records]
    return sum(end - start - b for b in busy) / (len(records) * (end - start))


def rows(p: int, jobs: list[tuple[str, int]], records: list[list[dict]]) -> list[dict]:
    """One table row per job from every rank's record."""
    specs = {s.name: s for s in SCHEDULES}
    out = []
    for (name, m), recs in zip(jobs, records):
        spec = specs[name]
        orders = [[tuple(e[:3]) for e in r["events"]] for r in recs]
        out.append({"schedule": name, "p": p, "v": spec.v, "m": m, "replay": replay(orders, p * spec.v)["idle"],
                    "formula": spec.idle(p, spec.v, m), "wall": _wall_idle(recs),
                    "saved": [r["peak"] / r["unit"] for r in recs],
                    "in_flight": [peak_in_flight(o) / spec.v for o in orders],
                    "expected": f"{spec.memory_text} = {spec.memory(p, spec.v, m):g}"})
    return out


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}".rstrip("0").rstrip(".") for v in values)


def table(all_rows: list[dict]) -> str:
    """The Markdown table, then each schedule's formula and its source."""
    lines = ["| schedule | p | v | m | idle: replay | idle: formula | idle: wall | peak saved activations, "
             "rank 0 / … / p−1 | in flight (actions) | rank 0 expected |", "|" + "---|" * 10]
    for r in all_rows:
        lines.append(f"| `{r['schedule']}` | {r['p']} | {r['v']} | {r['m']} | {r['replay']:.3f} | "
                     f"{r['formula']:.3f} | {r['wall']:.3f} | {_per_rank(r['saved'])} | "
                     f"{_per_rank(r['in_flight'])} | {r['expected']} |")
    lines.append("")
    lines += [f"* `{s.name}` ({s.torch_class}): idle {s.formula}. {s.source}." for s in SCHEDULES]
    return "\n".join(lines)


def plan_jobs(quick: bool) -> list[tuple[int, list[tuple[str, int]]]]:
    """[(p, [(schedule, m), …]), …], leaving out the m a schedule does not run at that p (``min_m``)."""
    ms = (8,) if quick else (4, 8)
    return [(p, [(s.name, m) for s in SCHEDULES for m in ms if m >= s.min_m(p)]) for p in (2, 4)]


def _header(unit_ms: float) -> str:
    return (f"Pipeline schedules, torch {torch.__version__}, gloo on CPU: one stage = Linear-ReLU-Linear-ReLU "
            f"(hidden {HIDDEN}), microbatch {MB_ROWS} rows. idle = Σ_ranks idle / (p · makespan); unit = one F "
            f"of one microbatch through one stage, F = I = W = 1, B = 2 ({unit_ms:g} ms on the wall clock). "
            "Activations in microbatches of the rank's layers (v stages).")


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="m = 8 only (< 1 min)")
    ap.add_argument("--unit-ms", type=float, help="wall-clock cost of one unit, one F (default 20; --quick 10)")
    args = ap.parse_args(argv)
    args.unit_ms = args.unit_ms or (10.0 if args.quick else 20.0)
    started = time.perf_counter()
    plan = plan_jobs(args.quick)
    all_rows = [row for (p, jobs), recs in zip(plan, run(plan, args.unit_ms / 1000)) for row in rows(p, jobs, recs)]
    text = table(all_rows)
    print(_header(args.unit_ms))
    print(text)
    print(f"({time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          "cores: the wall column grows with the load, the replay does not)")
    return text


if __name__ == "__main__":
    main()
