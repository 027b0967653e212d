"""Changing the plan does not change the math, as the user sees it: ``examples/train.py --json`` prints the same
per-step losses and gradient norms for every plan in ``plans/`` that targets ``examples/llama.py`` (at a matching
``--nproc-per-node``) as one process with ``plans/single.yaml`` (no parallelism), in float64 (``--dtype float64``;
gloo reduces float64), within ``RTOL`` relative (1e-9, the one fixed tolerance of ``tests/_float64.py``).

Why they can be equal: every step draws its global batch by global sample index (sample ``i`` of the run is a
function of ``(seed, i)`` only), each data-parallel rank takes its slice, the model is built from one seed on every
rank before it is sharded, dropout is 0, and ``meshplan.train_step`` divides by the global token count.

To cover a new plan, add one row to :data:`LAYOUTS`. :func:`test_every_llama_plan_is_covered` fails when a plan in
``plans/`` whose module paths all exist in ``examples/llama.py``'s model has no row.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _float64 import RTOL
from _launch import ROOT

#: (plan, nproc): each launch must print REFERENCE's losses and grad norms. Pick the smallest world that
#: exercises the plan's layout.
LAYOUTS = [
    ("plans/llama.yaml", 2),  # tp 2 (sequence parallel, loss_parallel)
    ("plans/llama.yaml", 4),  # tp 2 × dp_shard 2 (FSDP2): the data-parallel slice of the global batch
    ("plans/llama_pp.yaml", 2),  # pp 2 (1F1B, 2 microbatches)
    ("plans/llama_3d.yaml", 8),  # pp 2 × dp_shard 2 × tp 2
    ("plans/llama_cp.yaml", 4),  # cp 2 × tp 2: whole sequences in, each rank trains its head-tail chunks
]
REFERENCE = ("plans/single.yaml", 1)
#: plans for examples/moe.py (``train.py --model moe``), against the same model in one process
MOE_LAYOUTS = [
    ("plans/moe.yaml", 4),  # tp 2 × ep 2 (etp 1: the ep group spans the tp ranks), experts' FSDP over edp 2
]
#: small enough for 2 CPU cores; the global batch is divisible by every dp size in LAYOUTS
STEPS = 3
ARGS = ("--global-batch", "8", "--steps", str(STEPS), "--seq", "32", "--dim", "64", "--layers", "2", "--lr", "3e-3",
        "--dtype", "float64")


def run_train(plan: str, nproc: int, *extra: str) -> list[dict]:
    """``torchrun examples/train.py --json``: the per-step objects rank 0 printed (checked: one per step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # this checkout's meshplan, not an installed one
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "examples/train.py", "--plan", plan, *ARGS, *extra, "--json"]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{plan} at {nproc}: rc {proc.returncode}\n{proc.stderr[-4000:]}"
    steps = [json.loads(line) for line in proc.stdout.splitlines()]  # --json: stdout holds only the objects
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), proc.stdout
    print(f"{plan} at {nproc} processes: {time.time() - t:.1f} s")
    return steps


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run_train(*REFERENCE)


@pytest.fixture(scope="module")
def moe_reference() -> list[dict]:
    return run_train(*REFERENCE, "--model", "moe")


@pytest.mark.dist
@pytest.mark.parametrize("plan,nproc", LAYOUTS, ids=[f"{Path(p).stem}-{n}" for p, n in LAYOUTS])
def test_same_losses_as_one_process(reference, plan, nproc):
    same_losses(reference, run_train(plan, nproc), plan, nproc)


@pytest.mark.dist
@pytest.mark.parametrize("plan,nproc", MOE_LAYOUTS, ids=[f"{Path(p).stem}-{n}" for p, n in MOE_LAYOUTS])
def test_moe_same_losses_as_one_process(moe_reference, plan, nproc):
    same_losses(moe_reference, run_train(plan, nproc, "--model", "moe"), plan, nproc)


def same_losses(reference: list[dict], got: list[dict], plan: str, nproc: int) -> None:
    for ref, step in zip(reference, got):
        assert all(math.isfinite(step[k]) for k in ("loss", "grad_norm", "tokens_per_s")), step
        assert step["tokens_per_s"] > 0
        assert rel(step["loss"], ref["loss"]) <= RTOL, (plan, nproc, step, ref)
        assert rel(step["grad_norm"], ref["grad_norm"]) <= RTOL, (plan, nproc, step, ref)
    worst = {k: max(rel(s[k], r[k]) for s, r in zip(got, reference)) for k in ("loss", "grad_norm")}
    print(f"{plan} at {nproc}: max relative difference, loss {worst['loss']:.2e}, grad_norm {worst['grad_norm']:.2e}")
    assert reference[-1]["loss"] < reference[0]["loss"]  # it trains: the steps are not all alike


# Which plans target examples/llama.py, without torch.distributed


def module_patterns(plan) -> list[str]:
    """Every module path or pattern a plan names: rule keys, ``pattern`` values (blocks), the pipeline's module
    lists. A new plan key that names modules belongs here."""
    found: list[str] = []

    def walk(node, key=None):
        if isinstance(node, dict):
            if key == "rules":
                found.extend(node)
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, (list, tuple)):
            if key in ("split_points", "first_stage_modules", "last_stage_modules"):
                found.extend(node)
            for v in node:
                walk(v)
        elif key == "pattern" and isinstance(node, str):
            found.append(node)

    walk(plan.model_dump())
    return found


def targets_llama(path: Path, example: str = "llama") -> bool:
    """True when every module path the plan names exists in examples/llama.py's Transformer (8 layers), or in
    examples/moe.py's with ``example="moe"``."""
    import importlib

    from meshplan import load_plan
    from meshplan.errors import PlanError
    from meshplan.plan_file.patterns import match_pattern
    module = importlib.import_module(example)
    if load_plan(path).training is not None:  # a trainer plan names its own model (plans/train.yaml)
        return False
    with torch.device("meta"):
        model = module.Transformer(module.tiny_args(n_layers=8))
    try:
        for pattern in module_patterns(load_plan(path)):
            match_pattern(model, pattern, str(path))
    except PlanError:
        return False
    return True


def plan_files() -> list[Path]:
    return sorted(p for p in (ROOT / "plans").iterdir()
                  if p.suffix in (".yaml", ".yml", ".toml", ".json") and p.name != "plan.schema.json")


@pytest.mark.fast
def test_every_llama_plan_is_covered():
    llama_plans = {str(p.relative_to(ROOT)) for p in plan_files() if targets_llama(p)}
    assert REFERENCE[0] in llama_plans and "plans/llama.yaml" in llama_plans
    assert "plans/hf_llama.yaml" not in llama_plans and "plans/torch_transformer.yaml" not in llama_plans
    missing = llama_plans - {REFERENCE[0]} - {p for p, _ in LAYOUTS}
    assert not missing, f"plans for examples/llama.py without a row in LAYOUTS: {sorted(missing)}"
    moe_plans = {str(p.relative_to(ROOT)) for p in plan_files() if targets_llama(p, "moe")} - llama_plans
    assert "plans/moe.yaml" in moe_plans
    missing = moe_plans - {p for p, _ in MOE_LAYOUTS}
    assert not missing, f"plans for examples/moe.py without a row in MOE_LAYOUTS: {sorted(missing)}"


# The data: sample i of the run depends on (seed, i) only


@pytest.mark.fast
def test_data_slices_tile_the_global_batch():
    from examples import train  # not benchmarks/train.py, which a benchmark test may have put on the path first
    one = train.batches(256, 16, 8)
    sliced = [train.batches(256, 16, 8, r, 4) for r in range(4)]
    halves = train.batches(256, 16, 4)  # a smaller global batch walks the same sample sequence
    for _ in range(2):
        x, y = next(one)
        parts = [next(s) for s in sliced]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        assert torch.equal(x, torch.cat([next(halves)[0], next(halves)[0]]))
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(next(train.batches(256, 16, 8, seed=1))[0], next(train.batches(256, 16, 8))[0])
    with pytest.raises(ValueError, match="not divisible"):
        next(train.batches(256, 16, 6, 0, 4))
