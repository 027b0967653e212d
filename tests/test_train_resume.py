"""``examples/train.py --checkpoint-dir D --checkpoint-every N`` on real torchrun/gloo processes.

* Kill and restart: one worker of a ``torchrun --max-restarts 1`` run (tp 2) is sent SIGKILL once its step-4
  checkpoint exists; torchrun restarts the group, which resumes from the latest complete checkpoint, and the final
  checkpoint (parameters, AdamW state, RNG states, every entry) equals the uninterrupted run's bit for bit.
* Another layout: the uninterrupted run's step-4 checkpoint resumed by 4 processes with ``plans/llama_pp.yaml``
  (pp 2 × dp 2) prints the uninterrupted run's losses for steps 5 on (float64, ``RTOL`` = 1e-9 relative, the one
  fixed tolerance of ``tests/_float64.py``: only the reduction order differs; in float32 8 AdamW steps amplify it).
* Another global batch size is refused with both values, unless ``--allow-batch-change``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _float64 import RTOL
from _launch import ROOT

pytestmark = pytest.mark.dist

STEPS = 12
ARGS = ("--global-batch", "8", "--steps", str(STEPS), "--seq", "32", "--dim", "64", "--layers", "2",
        "--checkpoint-every", "2", "--json", "--dtype", "float64")  # float64: another layout's losses to RTOL


def _torchrun(nproc: int, *args: str, restarts: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # this checkout's meshplan, not an installed one
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "examples/train.py", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[list[dict], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def _checkpoint(path: Path) -> dict:
    """Every tensor of a checkpoint folder, read in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return state


@pytest.fixture(scope="module")
def uninterrupted():
    root = Path(tempfile.mkdtemp(prefix="meshplan-train-"))
    steps, _ = _finish(_torchrun(2, "--plan", "plans/llama.yaml", *ARGS, "--checkpoint-dir", str(root / "ref"),
                                 "--keep", "0"))
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    yield root, steps
    shutil.rmtree(root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(uninterrupted):
    root, _ = uninterrupted
    d = root / "killed"
    proc = _torchrun(2, "--plan", "plans/llama.yaml", *ARGS, "--checkpoint-dir", str(d), restarts=1)
    deadline = time.time() + 300
    while not (d / "step-00000004").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-4 checkpoint"
        time.sleep(0.02)
    os.kill(_children(proc.pid)[-1], signal.SIGKILL)  # one worker, mid-run
    _, err = _finish(proc)
    assert "resumed from" in err, err[-3000:]  # the restarted group resumed (a run that had ended would not)
    final, ref = _checkpoint(d / f"step-{STEPS:08d}"), _checkpoint(root / "ref" / f"step-{STEPS:08d}")
    assert sorted(final) == sorted(ref)
    import torch
    assert [k for k in ref if not torch.equal(final[k], ref[k])] == []


def test_resume_on_another_layout_prints_the_same_losses(uninterrupted):
    root, ref_steps = uninterrupted
    d = root / "other"
    d.mkdir()
    shutil.copytree(root / "ref" / "step-00000004", d / "step-00000004")
    steps, err = _finish(_torchrun(4, "--plan", "plans/llama_pp.yaml", *ARGS, "--checkpoint-dir", str(d)))
    assert "resumed from" in err and [s["step"] for s in steps] == list(range(5, STEPS + 1)), err[-2000:]
    for got, want in zip(steps, ref_steps[4:]):
        assert abs(got["loss"] - want["loss"]) <= RTOL * abs(want["loss"]), (got, want)


def test_other_global_batch_refused_with_both_values(uninterrupted):
    root, _ = uninterrupted
    d = root / "batch"
    d.mkdir()
    shutil.copytree(root / "ref" / "step-00000004", d / "step-00000004")
    args = [a if a != "8" else "16" for a in ARGS]  # --global-batch 16
    proc = _torchrun(1, "--plan", "plans/single.yaml", *args, "--checkpoint-dir", str(d))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "the global batch size was 8 when saved, 16 now" in err and "--allow-batch-change" in err, err[-2000:]
