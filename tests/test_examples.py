"""The examples run as the README says: the main job (``meshplan train plans/train.yaml --nproc 4``, as
``scripts/demo.sh`` runs it), the old demo (``examples/train.py`` on 4 CPU processes with ``plans/llama.yaml``) and
the class-decorator example, each under real ``torchrun``/gloo."""

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


def test_demo_trains_the_tiny_model_with_plans_train_yaml(tmp_path):
    """scripts/demo.sh's two commands on a smaller model (same arch and vocabulary), 6 steps, outputs in tmp; the
    corpus is a copy of docs/ so its token cache (``<corpus>/.meshplan``) goes to tmp too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for f in sorted((ROOT / "docs").glob("*.md")):
        (corpus / f.name).write_text(f.read_text())
    model = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, "examples/tiny_model.py", str(model), "--arch", "llama", "--vocab", "4096",
                    "--hidden", "32", "--layers", "2"], cwd=ROOT, env=env, check=True, capture_output=True)
    cmd = [sys.executable, "-m", "meshplan", "train", "plans/train.yaml", "--nproc", "4", "--steps", "6",
           "--schedule.warmup", "2", "--model.path", str(model), "--data.path", str(corpus), "--eval.every", "3", "--checkpoint.folder",
           str(tmp_path / "ckpt"), "--export", str(tmp_path / "out"), "--log.jsonl", str(tmp_path / "m.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(r"step +6 +loss [\d.]+ +grad_norm [\d.]+ +lr [\d.e+-]+ +tokens/s [\d,]+", proc.stdout), proc.stdout
    assert re.search(r"eval +6 +loss", proc.stdout) and "summary: steps 6  world 4" in proc.stdout, proc.stdout
    assert (tmp_path / "out" / "config.json").is_file() and len((tmp_path / "m.jsonl").read_text().splitlines()) == 8


def test_main_job_trains_and_reports_throughput():
    out = torchrun(4, "examples/train.py", "--plan", "plans/llama.yaml", "--steps", "8")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
    assert re.search(r"tokens/s", out), out


def test_decorated_example_parallelizes_on_construction():
    out = torchrun(2, "examples/decorated.py")
    assert re.search(r"loss \d+\.\d+; adapter.up.weight \(Shard\(dim=0\),\)", out), out
