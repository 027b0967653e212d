"""The cost model against measured steps here: ``meshplan estimate`` with a ``meshplan profile`` cluster vs
measured training steps, for at least 12 layouts at world 2, 4 and 8 (CPU/gloo), and the solver's first choice vs
the fastest measured layout.

    python benchmarks/calibrate.py --parts               # all three worlds, 3 repeats of 2 + 3 steps, a launch
                                                         # per layout and repeat: all three worlds took 55
                                                         # minutes on the 2-core host of 2026-11-28 (run 2)
    python benchmarks/calibrate.py --worlds 2 --repeats 1 --steps 1     # a quick look
    python benchmarks/calibrate.py --parts --keep runs/     # keep each world's profile, layouts and measurements
    python benchmarks/calibrate.py --parts --reprice runs/  # run nothing: price them again with the current model

For each world the machine is profiled with as many processes as the runs use (8 ranks on 2 cores share the
cores, and so do the profile's rates; the profile measures the cores each rank gets and what the counts leave
out: DTensor dispatch, FSDP2 hooks, pipeline actions, uneven all-to-alls, a cp rank's attention blocks, the
ranks' wait at blocking collectives). Then
every layout, and the solver's first choice for each model, runs in a torchrun launch of its own
(``benchmarks/_calibrate_worker.py``; ``--one-launch``: all in one, faster, but a layout measured right after
another in the same processes ran 10-30% slower), in ``--repeats`` interleaved passes (load from elsewhere lands
on all layouts alike), each ``--warmup`` unmeasured
steps then the median of ``--steps`` timed ones, recording the load average. Printed: per layout the median over
repeats, the repeats' spread, the prediction and its error and the load; per world the mean and worst |error|,
Spearman's rank correlation, and each model's first choice measured beside its fastest measured layout; then the
error split into a level (the median of measured / predicted) and a shape (the errors left once every prediction
is scaled by that level), beside the repeats' own spread (what no model can price better than). The world is
profiled again after its runs (``--no-profile-after``: not); each layout's prediction is then the geometric mean
of its step under the two profiles (the host's state over the runs: one profile's level moved 0.82-1.32× between
the worlds of one calibration on the host of 2026-11-27), and each profile's own error is printed too.
The worker also times the profile's reference block before each layout's steps: the host's drift, that block's
time then over the profiles' time for it, is printed per world (run 12, 2026-11-27: medians ×1.01 / 0.98 / 0.91
at worlds 2 / 4 / 8 while the steps ran ×1.08 / 1.21 / 1.26 their prediction: not the host drifting; scaling
each layout's prediction by its own drift made the errors worse, 12% mean against 9% at world 2: one block's
second is noisier than the drift). ``--save-clusters DIR`` keeps each profiled cluster with its calibration error
(``meshplan estimate``'s ± band).
Each layout is a plan written from the repository's rule sections (plans/llama.yaml, llama_cp.yaml, moe.yaml).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import yaml  # noqa: E402

from meshplan.plan_file.document import Plan  # noqa: E402
from meshplan.solver.candidate import Training  # noqa: E402
from meshplan.solver.plans import candidate_from_plan, plan_from_candidate  # noqa: E402
from meshplan.solver.search import Space, search  # noqa: E402
from meshplan.solver.shape import shape_from_config  # noqa: E402
from meshplan.solver.step import evaluate  # noqa: E402

DIM, LAYERS, SEQ, BATCH = 256, 4, 256, 16
TP = yaml.safe_load((ROOT / "plans/llama.yaml").read_text())["tensor_parallel"]
CP = yaml.safe_load((ROOT / "plans/llama_cp.yaml").read_text())["context_parallel"]
MOE = yaml.safe_load((ROOT / "plans/moe.yaml").read_text())
BLOCKS = {"pattern": "layers.*"}
FULL = {"activation_checkpointing": {"mode": "full"}}


def _pp(layout: dict, schedule: str = "1f1b", m: int = 4, **extra) -> dict:
    return {"layout": layout, "blocks": BLOCKS, "pipeline": {"schedule": schedule, "microbatches": m}, **extra}


#: world → {name: (model, plan)}: tp, pp under two or more schedules, cp, ep, fsdp, ddp, checkpointing, combinations
LAYOUTS = {
    2: {"fsdp2": ("llama", {"layout": {}}), "ddp2": ("llama", {"layout": {"dp_replicate": 2}}),
        "tp2": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP}),
        "tp2_full_ac": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP, "blocks": {**BLOCKS, **FULL}}),
        "pp2_gpipe": ("llama", _pp({"pp": 2}, "gpipe", 4)), "pp2_1f1b": ("llama", _pp({"pp": 2}, "1f1b", 4)),
        "pp2_interleaved": ("llama", _pp({"pp": 2, "vpp": 2}, "interleaved_1f1b", 4)),
        "cp2": ("llama", {"layout": {"cp": 2}, "context_parallel": CP}),
        "fsdp2_full_ac": ("llama", {"layout": {}, "blocks": {**BLOCKS, **FULL}}),
        "moe_ep2": ("moe", {"layout": {"ep": 2}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_fsdp2": ("moe", {"layout": {}}), "moe_ddp2": ("moe", {"layout": {"dp_replicate": 2}})},
    4: {"fsdp4": ("llama", {"layout": {}}), "ddp4": ("llama", {"layout": {"dp_replicate": 4}}),
        "tp2_fsdp2": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP}),
        "tp4": ("llama", {"layout": {"tp": 4}, "tensor_parallel": TP}),
        "pp2_fsdp2": ("llama", _pp({"pp": 2})), "pp4_gpipe": ("llama", _pp({"pp": 4}, "gpipe", 4)),
        "cp2_fsdp2": ("llama", {"layout": {"cp": 2}, "context_parallel": CP}),
        "cp2_tp2": ("llama", {"layout": {"cp": 2, "tp": 2}, "context_parallel": CP, "tensor_parallel": TP}),
        "tp2_pp2": ("llama", _pp({"tp": 2, "pp": 2}, m=2, tensor_parallel=TP)),
        "fsdp4_full_ac": ("llama", {"layout": {}, "blocks": {**BLOCKS, **FULL}}),
        "moe_ep4": ("moe", {"layout": {"ep": 4}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_ep2_fsdp": ("moe", {"layout": {"ep": 2}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_tp2_ep2": ("moe", {k: v for k, v in MOE.items() if k != "version"})},
    8: {"fsdp8": ("llama", {"layout": {}}), "ddp8": ("llama", {"layout": {"dp_replicate": 8}}),
        "tp2_fsdp4": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP}),
        "tp4_fsdp2": ("llama", {"layout": {"tp": 4}, "tensor_parallel": TP}),
        "pp2_fsdp4": ("llama", _pp({"pp": 2})), "pp4_gpipe_dp2": ("llama", _pp({"pp": 4, "dp_replicate": 2}, "gpipe")),
        "pp2_tp2_fsdp2": ("llama", _pp({"pp": 2, "tp": 2}, m=2, tensor_parallel=TP)),
        "cp2_tp2_fsdp2": ("llama", {"layout": {"cp": 2, "tp": 2}, "context_parallel": CP, "tensor_parallel": TP}),
        "cp4_fsdp2": ("llama", {"layout": {"cp": 4}, "context_parallel": CP}),
        "fsdp8_full_ac": ("llama", {"layout": {}, "blocks": {**BLOCKS, **FULL}}),
        "moe_ep4_fsdp2": ("moe", {"layout": {"ep": 4}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_ep8": ("moe", {"layout": {"ep": 8}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_tp2_ep4": ("moe", {"layout": {"tp": 2, "ep": 4, "etp": 1}, "tensor_parallel": MOE["tensor_parallel"],
                                "expert_parallel": MOE["expert_parallel"]})},
}


def model_config(kind: str) -> dict:
    """train.py's model (see its ``common`` and MoE arguments) in ModelArgs keys; the MoE's with its routers'
    measured ``expert_loads`` (:func:`expert_loads`)."""
    cfg = dict(dim=DIM, n_layers=LAYERS, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=4 * DIM)
    return {**cfg, "moe_hidden": 2 * DIM, "n_experts": 8, "top_k": 2, "expert_loads": expert_loads()} \
        if kind == "moe" else cfg


@functools.cache
def expert_loads(steps: int = 3) -> list[list[int]]:
    """Tokens each MoE layer's router sends to each expert on each of the first ``steps`` global batches (a row
    per layer and batch), for the model the runs build (the worker's, same seed) and their data (examples/train.py's
    ``batches``): what an expert-parallel layout's busiest rank computes each step
    (:func:`meshplan.solver.moe_costs.expert_imbalance`)."""
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("calibrate_worker", ROOT / "benchmarks" / "_calibrate_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    model, data = worker._model("moe", DIM, LAYERS, SEQ), worker._examples_train().batches(256, SEQ, BATCH)
    rows = []
    with torch.no_grad():
        for _ in range(steps):
            model(next(data)[0])
            rows += [m.tokens_per_expert.long().tolist() for m in model.modules() if hasattr(m, "tokens_per_expert")]
    return rows


def _launch(layouts: dict, world: int, args, tmp: Path, repeats: int) -> dict:
    """One torchrun launch of the worker over ``layouts`` (``repeats`` passes): ``{name: {"times": ...}}``."""
    spec, out = tmp / f"layouts{world}.json", tmp / f"measured{world}.json"
    spec.write_text(json.dumps([{"name": n, "kind": k, "plan": p} for n, (k, p) in layouts.items()]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "benchmarks/_calibrate_worker.py"), "--layouts", str(spec), "--out", str(out),
           "--repeats", str(repeats), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--dim", str(DIM), "--layers", str(LAYERS), "--seq", str(SEQ), "--batch", str(BATCH)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if proc.returncode or not out.is_file():
        said = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank") or "Error" in ln]
        raise RuntimeError(f"calibration worker failed ({proc.returncode}): "
                           + "\n".join(said[-30:] or [proc.stderr[-1500:]]))
    return json.loads(out.read_text())


def measure(layouts: dict, world: int, args, tmp: Path) -> dict:
    """``{name: {"times": [median s/step per repeat], "load": [...]}}``. Each layout runs in its own torchrun
    launch, as a job runs one layout, in ``--repeats`` interleaved passes over the layouts (``--one-launch``: every
    layout in one launch, as before 2026-11-27: a layout measured right after another in the same processes ran
    10-30% slower at world 8 than in a launch of its own, fsdp8 2.49 s/step against 2.20-2.27)."""
    if args.one_launch:
        return _launch(layouts, world, args, tmp, args.repeats)
    got: dict = {}
    for _ in range(args.repeats):
        for name, layout in layouts.items():
            for key, values in _launch({name: layout}, world, args, tmp, 1)[name].items():
                got.setdefault(name, {}).setdefault(key, []).extend(values)
    (tmp / f"layouts{world}.json").write_text(
        json.dumps([{"name": n, "kind": k, "plan": p} for n, (k, p) in layouts.items()]))
    return got


def estimate(plan: dict, kind: str, world: int, cluster):
    cand, train = candidate_from_plan(Plan.from_data(plan, "calibration"), world, SEQ, BATCH)
    return evaluate(shape_from_config(model_config(kind)), cand, train, cluster)


def _candidate(plan: dict, world: int):
    """The layout a plan asks for (degrees, schedule, microbatching, checkpointing), as the solver sees it."""
    return candidate_from_plan(Plan.from_data(plan, "calibration"), world, SEQ, BATCH)[0]


def predict(plan: dict, kind: str, world: int, cluster) -> float:
    return estimate(plan, kind, world, cluster).step_time


def drift(got: dict, cluster, after=None) -> list[float]:
    """Per layout, the reference block's time just before its steps (the worker's ``drift``, the median over its
    repeats) over the profiles' own time for the same block (:func:`~meshplan.profile.run.reference_block_price`;
    the geometric mean of the profile before the runs and the one after them): how far the host's speed moved
    between the profiles and the runs. Empty for measurements from before the worker timed it."""
    from meshplan.profile.block import BATCHES, REFERENCE
    from meshplan.profile.run import reference_block_price
    ref = REFERENCE[cluster.device]
    own = (reference_block_price(cluster, ref, BATCHES) * reference_block_price(after or cluster, ref, BATCHES)) ** 0.5
    return [statistics.median(v["drift"]) / own for v in got.values() if v.get("drift") and not v.get("same_as")]


def print_parts(layouts: dict, got: dict, world: int, cluster) -> None:
    """The error's structure: each layout's predicted parts (seconds per step, the nonzero ones) beside what was
    measured and left unexplained."""
    print(f"\n#### world {world}: predicted parts per layout (s/step)\n")
    for name, (kind, plan) in layouts.items():
        est = estimate(plan, kind, world, cluster)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in est.parts.items() if abs(v) >= 5e-4)
        gap = statistics.median(got[name]["times"]) - est.step_time
        print(f"- {name}: measured - predicted {gap:+.3f}; {parts}")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks, tied values sharing their mean rank (as
    ``scipy.stats.spearmanr``: two layouts the model prices exactly equal are not a claim that the first listed is
    the faster).

        >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3, 4], [4, 3, 2, 1])
        (1.0, -1.0)
        >>> round(spearman([1.0, 2.0, 3.0], [5.0, 5.0, 6.0]), 3)
        0.866
    """
    def ranks(v):
        first, last = {}, {}
        for i, x in enumerate(sorted(v)):
            first.setdefault(x, i)
            last[x] = i
        return [(first[x] + last[x]) / 2 for x in v]
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def level_and_shape(measured: list[float], predicted: list[float]) -> tuple[float, list[float]]:
    """``(level, shape errors)``: the median of measured / predicted over the layouts, and each layout's |error|
    once every prediction is scaled by it. Separates what one factor common to the world's layouts would fix (a
    profile's rates off for all of them: drift between the profile and the runs, contention it did not see) from
    what it would not (the model's pricing of one layout against another).

        >>> level, shape = level_and_shape([2.0, 3.0, 4.4], [1.0, 1.5, 2.0])
        >>> level, [round(e, 2) for e in shape]
        (2.0, [0.0, 0.0, 0.1])
    """
    level = statistics.median(m / p for m, p in zip(measured, predicted))
    return level, [abs(m / (level * p) - 1) for m, p in zip(measured, predicted)]


def first_choice(kind: str, world: int, cluster) -> dict:
    """The solver's best layout for train.py's run (one microbatch without a pipeline: train.py does not
    accumulate), as a plan."""
    base = {"tensor_parallel": TP, "context_parallel": CP}
    if kind == "moe":
        base = {"tensor_parallel": MOE["tensor_parallel"], "expert_parallel": MOE["expert_parallel"]}
    train = Training(seq=SEQ, global_batch=BATCH, dtype="float32", reduce_dtype="float32")
    space = Space(micro_batches=(1, 2, 4, 8, 16), schedules=("gpipe", "1f1b", "interleaved_1f1b"), vpps=(2,))
    res = search(shape_from_config(model_config(kind)), train, cluster, world, space)
    best = next(e for e in res.valid if e.candidate.pp > 1 or e.candidate.microbatches == 1)
    plan = plan_from_candidate(best.candidate, train, base)
    return {k: v for k, v in plan.items() if k != "version"}


def run_world(world: int, args, tmp: Path) -> dict:
    """Profile, measure every layout (and the solver's first choices) in one launch, print the table. With
    ``--reprice`` nothing runs: the kept profile and measurements of an earlier ``--keep`` run are priced again by
    the current model (the first choices stay the ones measured then)."""
    from meshplan.profile.run import profile_cluster
    from meshplan.solver.cluster import Cluster
    after = None
    if args.reprice:
        cluster = Cluster.from_dict(json.loads((tmp / f"cluster{world}.json").read_text()))
        if (tmp / f"cluster{world}_after.json").is_file():
            after = Cluster.from_dict(json.loads((tmp / f"cluster{world}_after.json").read_text()))
        spec = json.loads((tmp / f"layouts{world}.json").read_text())
        layouts = {d["name"]: (d["kind"], d["plan"]) for d in spec}
        got = json.loads((tmp / f"measured{world}.json").read_text())
        layouts.update({n: layouts[v["same_as"]] for n, v in got.items() if v.get("same_as") and n not in layouts})
    else:
        cluster = profile_cluster(nproc=world, out=tmp / f"cluster{world}.json")
        layouts = dict(LAYOUTS[world])
        same = {}  # a first choice that IS a listed layout is that layout's measurement (run apart: ±15% noise)
        candidates = {n: (k, _candidate(p, world)) for n, (k, p) in layouts.items()}
        for kind in ("llama", "moe"):
            plan = first_choice(kind, world, cluster)
            want = (kind, _candidate(plan, world))
            listed = [n for n, kc in candidates.items() if kc == want]
            layouts[f"solver_first_{kind}"] = (kind, plan)
            if listed:
                same[f"solver_first_{kind}"] = listed[0]
        got = measure({n: v for n, v in layouts.items() if n not in same}, world, args, tmp)
        got.update({first: {**got[listed], "same_as": listed} for first, listed in same.items()})
        (tmp / f"measured{world}.json").write_text(json.dumps(got))
        if args.profile_after:
            after = profile_cluster(nproc=world, out=tmp / f"cluster{world}_after.json")
    print(f"\n### world {world} on {os.cpu_count()} cores — {cluster.source}\n")
    if after is not None:
        print("Predicted: the geometric mean of the model's step under the profile taken before the runs and under "
              "the one taken after them (the host's state over the runs; each profile alone below).\n")
    print("| layout | model | measured s/step (median of repeats) | spread | predicted | error | load |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, (kind, plan) in layouts.items():
        times, loads = got[name]["times"], got[name]["load"]
        m, p = statistics.median(times), predict(plan, kind, world, cluster)
        p_after = predict(plan, kind, world, after) if after is not None else p
        rows.append((name, kind, m, (p * p_after) ** 0.5, (max(times) - min(times)) / m, p, p_after))
        p = rows[-1][3]
        print(f"| {name} | {kind} | {m:.3f} | {100 * rows[-1][4]:.0f}% | {p:.3f} | "
              f"{100 * (p / m - 1):+.0f}% | {statistics.median(loads):.1f} |", flush=True)
    if args.parts:
        print_parts(layouts, got, world, cluster)
    threads = [n for v in got.values() for n in v.get("threads", [])]
    print(f"\nrank 0's threads after each layout: {min(threads)}-{max(threads)} (flat: each layout's groups released)")
    same = {n: v["same_as"] for n, v in got.items() if v.get("same_as")}
    return summarize(world, rows, cluster, args, tmp, same, drift(got, cluster, after))


def summarize(world: int, rows: list, cluster, args, tmp: Path, same: dict, drifts: list) -> dict:
    """Spearman, mean and worst error over the listed layouts; the solver's first choice vs the fastest."""
    listed = [r for r in rows if not r[0].startswith("solver_first")]
    errors = [abs(r[3] / r[2] - 1) for r in listed]
    rho = spearman([r[2] for r in listed], [r[3] for r in listed])
    print(f"\nworld {world}: {len(listed)} layouts; mean |error| {100 * statistics.fmean(errors):.0f}%, worst "
          f"{100 * max(errors):.0f}%, Spearman {rho:.2f}")
    level, shape = level_and_shape([r[2] for r in listed], [r[3] for r in listed])
    spreads = [r[4] for r in listed]
    print(f"  level: measured / predicted, median over layouts, ×{level:.2f}; the shape (each prediction × that "
          f"level): mean |error| {100 * statistics.fmean(shape):.0f}%, worst {100 * max(shape):.0f}%; the repeats' "
          f"own spread: median {100 * statistics.median(spreads):.0f}%, worst {100 * max(spreads):.0f}%")
    if any(r[5] != r[6] for r in listed):
        for label, i in (("before the runs", 5), ("after them", 6)):
            errs = [abs(r[i] / r[2] - 1) for r in listed]
            lv, _ = level_and_shape([r[2] for r in listed], [r[i] for r in listed])
            print(f"  the profile {label} alone: mean |error| {100 * statistics.fmean(errs):.0f}%, worst "
                  f"{100 * max(errs):.0f}%, level ×{lv:.2f}")
    if drifts:
        print(f"  the host's drift: the reference block timed before each layout over the profiles' time for it, "
              f"median ×{statistics.median(drifts):.2f} ({min(drifts):.2f}-{max(drifts):.2f} over the layouts)")
        d = statistics.median(drifts)  # measured on a fixed block, not fitted to the steps; the ranking is unmoved
        errs = [abs(d * r[3] / r[2] - 1) for r in listed]
        print(f"  with that drift priced (every prediction × {d:.2f}): mean |error| {100 * statistics.fmean(errs):.0f}%, "
              f"worst {100 * max(errs):.0f}%")
    for kind in ("llama", "moe"):
        first = next(r for r in rows if r[0] == f"solver_first_{kind}")
        fastest = min((r for r in listed if r[1] == kind), key=lambda r: r[2])
        alias = same.get(first[0])
        print(f"{kind}: solver's first choice{f' (it is {alias})' if alias else ''} measured {first[2]:.3f} s/step vs "
              f"the fastest measured {fastest[0]} {fastest[2]:.3f}: {100 * (first[2] / fastest[2] - 1):+.1f}%")
    if args.save_clusters:
        from dataclasses import replace
        path = Path(args.save_clusters) / f"cluster{world}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        done = replace(cluster, calibration_error=statistics.fmean(errors),
                       calibration_source=f"benchmarks/calibrate.py at world {world}, {len(listed)} layouts")
        path.write_text(json.dumps(done.to_dict(), indent=1) + "\n")
    return {"world": world, "mean": statistics.fmean(errors), "worst": max(errors), "spearman": rho}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes over all layouts, interleaved (each layout's median over them: one slow launch in "
                         "three moves it little, in two it moves the mean)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per layout and repeat")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per layout and repeat (median)")
    ap.add_argument("--parts", action="store_true", help="print each layout's predicted parts (the error's structure)")
    ap.add_argument("--save-clusters", default=None,
                    help="write each world's profiled cluster here with its calibration error (estimate's ± band)")
    ap.add_argument("--profile-after", action=argparse.BooleanOptionalAction, default=True,
                    help="profile each world again after its runs and price with both (default; the host drifts)")
    ap.add_argument("--one-launch", action="store_true",
                    help="run every layout in one torchrun launch (faster; a layout after another runs slower)")
    ap.add_argument("--keep", default=None, help="keep each world's profile, layouts and measurements in this folder")
    ap.add_argument("--reprice", default=None,
                    help="run nothing: price a --keep folder's measurements again with the current model")
    args = ap.parse_args()
    if args.reprice:
        for world in (int(w) for w in args.worlds.split(",")):
            run_world(world, args, Path(args.reprice))
        return
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (the table is worth "
          f"reporting only on a quiet host)")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as tmp:
        keep = Path(args.keep or tmp)
        keep.mkdir(parents=True, exist_ok=True)
        for world in (int(w) for w in args.worlds.split(",")):
            run_world(world, args, keep)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}; {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
