"""The cost model against measured steps here: ``meshplan estimate`` with a ``meshplan profile`` cluster vs
``examples/train.py``'s step time, for many layouts at world 4 and 8 (CPU/gloo), and the solver's first choice
vs the fastest measured layout.

    python benchmarks/calibrate.py                  # ~15-25 minutes on the 2-core host: run it when it is idle
    python benchmarks/calibrate.py --worlds 4 --steps 6

For each world the machine is profiled with as many processes as the runs use (8 ranks on 2 cores are
oversubscribed 4×, and so are the profile's rates: the model sees the machine the run sees). Each layout is a
plan written from the repository's rule sections (plans/llama.yaml, llama_cp.yaml, moe.yaml) and run by
``torchrun examples/train.py --json``; its step time is the median of the steps after the first two. Printed:
measured and predicted seconds per step, the error of each, Spearman's rank correlation per world and model,
and the solver's first choice (searched over what train.py runs: no gradient accumulation) measured beside the
fastest measured layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def _pp(layout: dict, schedule: str = "1f1b", m: int = 4, **extra) -> dict:
    return {"layout": layout, "blocks": BLOCKS, "pipeline": {"schedule": schedule, "microbatches": m}, **extra}


#: world → {name: (model, plan)}
LAYOUTS = {
    4: {"fsdp4": ("llama", {"layout": {}}), "ddp4": ("llama", {"layout": {"dp_replicate": 4}}),
        "tp2_fsdp2": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP}),
        "tp4": ("llama", {"layout": {"tp": 4}, "tensor_parallel": TP}),
        "pp2_fsdp2": ("llama", _pp({"pp": 2})), "pp4_gpipe": ("llama", _pp({"pp": 4}, "gpipe", 4)),
        "cp2_fsdp2": ("llama", {"layout": {"cp": 2}, "context_parallel": CP}),
        "cp2_tp2": ("llama", {"layout": {"cp": 2, "tp": 2}, "context_parallel": CP, "tensor_parallel": TP}),
        "tp2_pp2": ("llama", _pp({"tp": 2, "pp": 2}, m=2, tensor_parallel=TP)),
        "fsdp4_full_ac": ("llama", {"layout": {}, "blocks": {**BLOCKS, "activation_checkpointing": {"mode": "full"}}}),
        "moe_ep4": ("moe", {"layout": {"ep": 4}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_ep2_fsdp": ("moe", {"layout": {"ep": 2}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_tp2_ep2": ("moe", {k: v for k, v in MOE.items() if k != "version"})},
    8: {"fsdp8": ("llama", {"layout": {}}), "ddp8": ("llama", {"layout": {"dp_replicate": 8}}),
        "tp2_fsdp4": ("llama", {"layout": {"tp": 2}, "tensor_parallel": TP}),
        "tp4_fsdp2": ("llama", {"layout": {"tp": 4}, "tensor_parallel": TP}),
        "pp2_fsdp4": ("llama", _pp({"pp": 2})),
        "pp2_tp2_fsdp2": ("llama", _pp({"pp": 2, "tp": 2}, m=2, tensor_parallel=TP)),
        "cp2_tp2_fsdp2": ("llama", {"layout": {"cp": 2, "tp": 2}, "context_parallel": CP, "tensor_parallel": TP}),
        "cp4_fsdp2": ("llama", {"layout": {"cp": 4}, "context_parallel": CP}),
        "moe_ep4_fsdp2": ("moe", {"layout": {"ep": 4}, "expert_parallel": MOE["expert_parallel"]}),
        "moe_tp2_ep4": ("moe", {"layout": {"tp": 2, "ep": 4, "etp": 1}, "tensor_parallel": MOE["tensor_parallel"],
                                "expert_parallel": MOE["expert_parallel"]})},
}


def model_config(kind: str) -> dict:
    """train.py's model (see its ``common`` and MoE arguments) in ModelArgs keys."""
    cfg = dict(dim=DIM, n_layers=LAYERS, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=4 * DIM)
    return {**cfg, "moe_hidden": 2 * DIM, "n_experts": 8, "top_k": 2} if kind == "moe" else cfg


def measure(plan: dict, kind: str, world: int, steps: int, tmp: Path) -> float:
    """Median seconds per step of ``examples/train.py`` with ``plan`` on ``world`` processes."""
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump({"version": 1, **plan}, sort_keys=False))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "examples/train.py"), "--plan", str(path), "--model", kind, "--global-batch", str(BATCH),
           "--seq", str(SEQ), "--dim", str(DIM), "--layers", str(LAYERS), "--steps", str(steps), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or len(rows) < steps:
        said = [ln for ln in out.stderr.splitlines() if ln.startswith("[rank") or "Error" in ln]
        raise RuntimeError(f"train.py failed ({out.returncode}): " + "\n".join(said[-30:] or [out.stderr[-1500:]]))
    return statistics.median(BATCH * SEQ / r["tokens_per_s"] for r in rows[2:])


def predict(plan: dict, kind: str, world: int, cluster) -> float:
    cand, train = candidate_from_plan(Plan.from_data(plan, "calibration"), world, SEQ, BATCH)
    return evaluate(shape_from_config(model_config(kind)), cand, train, cluster).step_time


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1)) if n > 2 else float("nan")


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


def run_world(world: int, steps: int, tmp: Path) -> None:
    from meshplan.profile.run import profile_cluster
    cluster = profile_cluster(nproc=world, out=tmp / f"cluster{world}.json")
    print(f"\n### world {world} on {os.cpu_count()} cores — {cluster.source}\n")
    print("| layout | model | measured s/step | predicted s/step | error | load before |")
    print("|---|---|---|---|---|---|")
    results: dict[str, list] = {"llama": [], "moe": []}
    for name, (kind, plan) in LAYOUTS[world].items():
        load = os.getloadavg()[0]
        got, want = measure(plan, kind, world, steps, tmp), predict(plan, kind, world, cluster)
        results[kind].append((name, got, want))
        print(f"| {name} | {kind} | {got:.3f} | {want:.3f} | {100 * (want / got - 1):+.0f}% | {load:.1f} |", flush=True)
    for kind, rows in results.items():
        if len(rows) > 2:
            rho = spearman([r[1] for r in rows], [r[2] for r in rows])
            print(f"\n{kind}: Spearman rank correlation {rho:.2f} over {len(rows)} layouts; mean |error| "
                  f"{100 * statistics.fmean(abs(r[2] / r[1] - 1) for r in rows):.0f}%")
        plan = first_choice(kind, world, cluster)
        got = measure(plan, kind, world, steps, tmp)
        fastest = min(rows, key=lambda r: r[1])
        print(f"{kind}: solver's first choice {plan['layout']} (blocks {plan.get('blocks', {})}) measured "
              f"{got:.3f} s/step vs the fastest measured {fastest[0]} {fastest[1]:.3f}: "
              f"{100 * (got / fastest[1] - 1):+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (numbers are only worth reporting below ~1.5)")
    with tempfile.TemporaryDirectory(prefix="meshplan-calibrate-") as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            run_world(world, args.steps, Path(tmp))
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
