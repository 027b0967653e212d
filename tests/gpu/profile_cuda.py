"""``meshplan profile`` on CUDA/NCCL, and ``estimate`` with the cluster it writes vs a measured ``meshplan train``.
One GPU, no network, about 3 minutes. Not collected by pytest.

Run (from the repository root, on a machine with one GPU)::

    python tests/gpu/profile_cuda.py            # writes /tmp/meshplan-gpu/{cluster.json,train.log}

Needs what ``import meshplan`` needs (see tests/gpu/ring_cuda.py for the lent image's missing pydantic) and
transformers (the tiny Llama of examples/tiny_model.py).

Checks (PASS/FAIL lines, exit 1 on any FAIL):
1. ``meshplan profile --nproc 1 --backend nccl`` finishes (it failed on CUDA until 2026-11-26: a CPU tensor
   all-reduced over NCCL) and writes a cluster of device ``cuda`` whose bf16 matmul curve is measured past 1024
   (the sizes a GPU needs: on an H100 the rate climbs from 26 TFLOP/s at 1024 to ~700 at 8192);
2. ``meshplan train`` of a 92 M-parameter Llama (hidden 1024, 8 layers, bf16, 16 × 1024 tokens) runs on the GPU;
3. for the record (no verdict): the step time ``estimate`` prices with the profiled cluster and with the
   ``h100-80g`` preset beside the measured one (docs/solver.md, "On one H100").
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("MESHPLAN_GPU_OUT", "/tmp/meshplan-gpu"))
CLI = [sys.executable, "-m", "meshplan"]


def _run(args: list, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    failed = 0

    def verdict(ok: bool, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(("PASS " if ok else "FAIL ") + what, flush=True)

    cluster = OUT / "cluster.json"
    p = _run(CLI + ["profile", "--nproc", "1", "--backend", "nccl", "-o", str(cluster)], 300)
    rates = json.loads(cluster.read_text()).get("matmul_rates", []) if cluster.is_file() else []
    sizes = {int(n): r for n, r in rates}
    verdict(p.returncode == 0 and max(sizes, default=0) >= 8192 and sizes.get(8192, 0) > sizes.get(1024, 0),
            f"profile on CUDA: rc {p.returncode}, bf16 TFLOP/s by size "
            f"{ {n: round(r / 1e12, 1) for n, r in sizes.items()} } {p.stderr.strip().splitlines()[-1:] if p.returncode else ''}")
    model, plan = OUT / "llama-92m", OUT / "plan.yaml"
    plan.write_text("version: 1\n")
    _run([sys.executable, "examples/tiny_model.py", str(model), "--arch", "llama", "--hidden", "1024", "--layers", "8",
          "--vocab", "8192"], 300)
    p = _run(CLI + ["train", str(plan), "--nproc", "1", "--model.path", str(model), "--model.dtype", "bfloat16",
                    "--data.path", "docs", "--steps", "25", "--global-batch", "16", "--seq-len", "1024",
                    "--log.every", "5", "--export", "null"], 600)
    (OUT / "train.log").write_text(p.stdout + p.stderr)
    rates = [float(m.replace(",", "")) for m in re.findall(r"tokens/s ([\d,]+)", p.stdout)][1:]  # past warm-up
    verdict(p.returncode == 0 and bool(rates), f"train on CUDA: rc {p.returncode}, tokens/s {rates}")
    if rates:
        print(f"measured: {16 * 1024 / max(rates):.4f} s/step (best of {len(rates)} logged steps)")
    for name in (str(cluster), "h100-80g"):
        p = _run(CLI + ["estimate", str(plan), "--config", str(model / "config.json"), "--world-size", "1", "--seq",
                        "1024", "--global-batch", "16", "--dtype", "bfloat16", "--cluster", name], 120)
        print(next((ln for ln in p.stdout.splitlines() if ln.startswith("step time")), p.stderr.strip()[-300:]))
    print(f"{'FAILED' if failed else 'PASS all'} ({failed} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
