"""Run a worker script under real `torchrun` (gloo, CPU) and collect per-case results.

A launch costs 5-18 s on 2 cores, so one launch runs many cases. A worker
script under ``tests/dist/`` defines ``CASES = {name: fn}``; each ``fn()`` runs
on every rank and returns a JSON-able dict (or raises). :func:`run_cases`
(in the worker) runs them all and writes ``rank<R>.json``; :func:`launch`
(in pytest) starts torchrun and returns ``{case: {rank: result}}``.

Example::

    RESULTS = launch_once("tests/dist/topology_worker.py", nproc=4)
    def test_case(): check(RESULTS, "groups")
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(script: str, nproc: int, *args: str, timeout: float = 900, torchrun_args: tuple[str, ...] = (),
           env: dict | None = None, rank_stderr: bool = False) -> dict:
    """Run ``torchrun --nproc-per-node nproc [torchrun_args] script`` and return ``{case: {rank: result}}``.

    ``rank_stderr``: torchrun writes each rank's stderr to its own file; ``results["_meta"]["rank_stderr"]`` is
    ``{local rank: text}`` (of the last attempt).
    """
    out = Path(tempfile.mkdtemp(prefix="meshplan-dist-"))
    if rank_stderr:
        torchrun_args = (*torchrun_args, "--log-dir", str(out / "logs"), "--redirects", "2")
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "MESHPLAN_CASE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples"), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *torchrun_args, str(ROOT / script), *args]
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results: dict = {"_meta": {"returncode": proc.returncode, "seconds": time.time() - t, "out": str(out),
                               "stderr": proc.stderr[-6000:], "stdout": proc.stdout[-3000:]}}
    if rank_stderr:
        files = sorted(out.glob("logs/*/attempt_*/*/stderr.log"), key=lambda f: int(f.parent.parent.name[8:]))
        results["_meta"]["rank_stderr"] = {int(f.parent.name): f.read_text(errors="replace") for f in files}
    for f in sorted(out.glob("rank*.json")):
        rank = int(f.stem[4:])
        for case, res in json.loads(f.read_text()).items():
            results.setdefault(case, {})[rank] = res
    return results


def case_result(results: dict, case: str, nproc: int) -> dict:
    """Assert ``case`` passed on every rank; return ``{rank: value}``."""
    meta = results["_meta"]
    if case not in results or len(results[case]) != nproc:
        raise AssertionError(f"case {case!r} did not report from all {nproc} ranks "
                             f"(torchrun rc={meta['returncode']}):\n{meta['stderr']}")
    errors = {r: v["error"] for r, v in results[case].items() if "error" in v}
    if errors:
        raise AssertionError(f"case {case!r} failed: " + "\n".join(f"rank {r}: {e}" for r, e in errors.items()))
    return {r: v["value"] for r, v in results[case].items()}


def run_cases(cases: dict, *, setup=None) -> None:
    """Worker side: run every case on this rank, recording its value or its error."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    only = os.environ.get("MESHPLAN_CASES")  # a comma-separated subset, for debugging one case
    if only:
        cases = {k: v for k, v in cases.items() if k in only.split(",")}
    ctx = setup() if setup else None
    out: dict = {}
    for name, fn in cases.items():
        try:
            value = fn(ctx) if setup else fn()
            out[name] = {"value": value}
        except Exception as e:  # recorded, the next case still runs
            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        if dist.is_initialized():
            dist.barrier()
    Path(os.environ["MESHPLAN_CASE_OUT"], f"rank{rank}.json").write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()
    # torch 2.13 + gloo race at interpreter exit: a gloo worker thread that releases a finished collective
    # drops Python objects from its captured thread-local state (backward stashes a context copy there); if
    # the main thread is already finalizing, taking the GIL ends that C++ thread -> "terminate called without
    # an active exception" / "free(): invalid pointer" (about 1 launch in 40 here). The results are written;
    # leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
