"""The examples run as the README says: the main job (``examples/train.py`` on 4 CPU processes with
``plans/llama.yaml``) and the class-decorator example, each under real ``torchrun``/gloo."""

import os
import re
import subprocess
import sys

import pytest

from _launch import ROOT

pytestmark = pytest.mark.dist


def torchrun(nproc: int, *argv: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_main_job_trains_and_reports_throughput():
    out = torchrun(4, "examples/train.py", "--plan", "plans/llama.yaml", "--steps", "8")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert re.search(r"tokens/s", out), out


def test_decorated_example_parallelizes_on_construction():
    out = torchrun(2, "examples/decorated.py")
    assert re.search(r"loss \d+\.\d+; adapter.up.weight \(Shard\(dim=0\),\)", out), out
