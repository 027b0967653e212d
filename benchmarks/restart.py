"""Does ``torchrun --max-restarts 1`` bring a gloo job back after a worker is killed? Success rate per recipe.

Run: ``python benchmarks/restart.py [--trials 10] [--nproc 2]`` from the repo root (≈5 min). Each trial launches
this script's worker under torchrun: every rank joins the process group and all-reduces; in the first attempt
(``TORCHELASTIC_RESTART_COUNT=0``) rank 1 then kills itself with SIGKILL, the others' collective fails, and torchrun
restarts the group; the restarted group all-reduces 10 times and finishes. A trial succeeds when torchrun exits 0
with every rank of attempt 1 finished, within ``--timeout`` seconds (a hang counts as a failure). Recipes:

* **standalone**: ``torchrun --standalone`` and ``init_process_group("gloo")`` (env://): torch's defaults.
* **c10d endpoint**: ``--rdzv-backend c10d --rdzv-endpoint localhost:PORT`` instead of ``--standalone``.
* **no shared store**: ``--standalone`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store per restart).
* **meshplan.init**: ``--standalone``, the process group from ``meshplan.init`` (rendezvous keys prefixed with the
  restart count, ``meshplan/mesh/elastic.py``).

Why the first two fail: torchrun's agent shares ONE TCP store with every worker group, and the gloo addresses of
the dead group stay under the keys the restarted group reads; a restarted rank that reads its peer's stale address
before the peer's successor overwrites it gets ``connectFullMesh … Connection refused``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("standalone", "c10d endpoint", "no shared store", "meshplan.init")


def worker(use_meshplan: bool) -> None:
    import torch
    import torch.distributed as dist
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if use_meshplan:
        import meshplan
        meshplan.init(None)
    else:
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if attempt == 0 and dist.get_rank() == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(10):
        dist.all_reduce(t)
        time.sleep(0.05)
    print(f"attempt {attempt} rank {dist.get_rank()} done", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def trial(recipe: str, nproc: int, timeout: float) -> tuple[bool, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rdzv = ["--standalone"]
    if recipe == "c10d endpoint":
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_free_port()}", "--nnodes", "1"]
    if recipe == "no shared store":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={nproc}", "--max-restarts=1",
           __file__, "--worker", *(["--meshplan"] if recipe == "meshplan.init" else [])]
    t = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.time() - t, "hang"
    done = proc.stdout.count("attempt 1 rank")
    why = "connectFullMesh" if "connectFullMesh" in proc.stderr else f"rc {proc.returncode}"
    return proc.returncode == 0 and done == nproc, time.time() - t, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--meshplan", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.meshplan)
    print(f"{args.nproc} gloo ranks, rank 1 SIGKILLed once, --max-restarts 1; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| recipe | restarted | failures (why) | s per trial |\n|---|---|---|---|")
    for recipe in args.recipes:
        results = [trial(recipe, args.nproc, args.timeout) for _ in range(args.trials)]
        ok = sum(r[0] for r in results)
        why = sorted({r[2] for r in results if not r[0]})
        mean = sum(r[1] for r in results) / len(results)
        print(f"| {recipe} | {ok}/{args.trials} | {args.trials - ok} ({', '.join(why) or '-'}) | {mean:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
