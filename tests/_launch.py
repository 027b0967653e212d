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

import functools
import gc
import importlib
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
    # PYTHONFAULTHANDLER: a rank that dies of a signal (one SIGSEGV in a world-8 launch, 2026-11-27) prints its
    # threads' Python stacks into the stderr kept below
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "MESHPLAN_CASE_OUT": str(out),
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
    only = os.environ.get("MESHPLAN_CASES")  # a comma-separated subset, for debugging one case
    if only:
        cases = {k: v for k, v in cases.items() if k in only.split(",")}
    ctx = setup() if setup else None
    _finish(_run(cases if not setup else {k: functools.partial(fn, ctx) for k, fn in cases.items()}))


def _run(cases: dict, release: bool = False) -> dict:
    """Run each case (a function of no arguments) on this rank: ``{name: {"value": …} or {"error": …}}``;
    ``release``: after each case, destroy the process groups it made (:func:`_release_groups`)."""
    import torch.distributed as dist
    out: dict = {}
    for name, fn in cases.items():
        t = time.time()
        before = _groups() if release else ()
        try:
            out[name] = {"value": fn()}
        except Exception as e:  # recorded, the next case still runs
            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
            # now, not only in the results: a rank that fails alone leaves the others waiting, and the launch's
            # stderr is all that says why
            print(f"[rank {os.environ.get('RANK')}] case {name} failed: {out[name]['error']}", file=sys.stderr,
                  flush=True)
        if dist.is_initialized():
            dist.barrier()
            if release:
                gc.collect()  # the case's models and meshes
                _release_groups(keep=before)
        # what a slow launch spent where, and whether threads (gloo groups) accumulate across cases
        out[name].update(seconds=round(time.time() - t, 2), threads=_threads())
    return out


def _threads() -> int:
    """This process's threads, native ones included (gloo's): ``/proc/self/task`` where there is one."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1


def _finish(out: dict) -> None:
    """Write this rank's results and leave (see the comment below for why without finalizing)."""
    import torch.distributed as dist
    Path(os.environ["MESHPLAN_CASE_OUT"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))
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


# ---------------------------------------------------------------- one launch per world size for many workers

#: The workers whose cases share one launch per world size (``tests/dist/suite_worker.py``): ``{worker: (the test
#: file that reads its cases, {world size: the cases to run there, "" for all})}``. Each worker defines
#: ``launch_cases() -> (cases, context)``: its cases (functions of no arguments) and the context they run in
#: (``keep_float64``, ``meshplan.init``); its ``__main__`` runs the same alone. A launch costs 5-18 s (torchrun,
#: one interpreter per rank importing torch and transformers; ~8 CPU-s per rank measured): worlds 2, 4 and 8 have
#: one launch each. After each case :func:`_release_groups` destroys the groups the case's meshes made (without
#: it world 2's launch ended with ~3,000 threads per rank, busy gloo threads taking most of its CPU, and a world-4
#: one stalled); a worker whose cases share groups (a cache of meshes, a topology opened by its context) says
#: ``KEEPS_GROUPS = True`` and is released after its last case. Not shared: workers that count or time their process's groups (topology, faults, one_error),
#: restarts, the trainer's CLI launches. A worker at a world not listed gets its own plain launch.
SHARED = {
    "cp_worker": ("test_dist_context.py", {2: "", 4: "", 8: ""}),
    "dp_worker": ("test_dist_dp.py", {2: "", 4: "", 8: ""}),
    "ep_worker": ("test_dist_expert.py", {2: "", 4: ""}),
    "ep_hf_worker": ("test_dist_expert_hf.py", {2: "", 4: ""}),
    "moe_worker": ("test_dist_moe.py", {2: "", 4: "", 8: ""}),
    "pp_worker": ("test_dist_pipeline.py", {2: "", 4: "", 8: ""}),
    "tp_worker": ("test_dist_tp.py", {2: "", 4: ""}),
    "trace_worker": ("test_pipeline_trace.py", {2: ""}),
    "zoo_worker": ("test_dist_zoo.py", {2: "", 4: "", 8: ""}),
    "ckpt_worker": ("test_checkpoint_dist.py", {4: ""}),
    "solver_worker": ("test_dist_solver.py", {4: ""}),
    # last: their context is meshplan.init (run_suite restores the world group's timeout after it)
    "arch_worker": ("test_dist_architectures.py", {2: ""}),
    "hf_worker": ("test_dist_hf.py", {2: "", 4: "llama_matrix"}),
}


def run_suite(entries: list[str]) -> None:
    """Worker side of a shared launch: ``entries`` are ``worker`` or ``worker:case,case``; each worker's cases run
    in its context, recorded as ``worker:case``; a worker that fails to import or to set up records
    ``worker:`` with the error and the next worker still runs."""
    only = os.environ.get("MESHPLAN_CASES")
    out: dict = {}
    for entry in entries:
        name, _, wanted = entry.partition(":")
        try:
            cases, context = importlib.import_module(name).launch_cases()
        except Exception as e:  # every rank fails alike (an import, a module-level build)
            out[f"{name}:"] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
            continue
        keep = [k for k in cases if (not wanted or k in wanted.split(",")) and (not only or k in only.split(","))]
        release = not getattr(importlib.import_module(name), "KEEPS_GROUPS", False)
        with context():
            out.update({f"{name}:{k}": v for k, v in _run({k: cases[k] for k in keep}, release).items()})
        _fresh_world()
    _finish(out)


def _fresh_world() -> None:
    """What a worker's context may leave on the world group, undone for the next worker: ``meshplan.init`` on an
    existing group keeps it but gives it the plan's fault timeouts (300 s after a train_step, not torch's 30 min)."""
    from torch.distributed.constants import default_pg_timeout

    from meshplan._torch import set_group_timeout
    set_group_timeout(None, default_pg_timeout.total_seconds())
    _release_groups()
    gc.collect()


def _groups() -> tuple:
    """The process groups alive now (torch's registry)."""
    from torch.distributed.distributed_c10d import _world  # tests may touch torch's privates; meshplan may not
    return tuple(_world.pg_map)


def _release_groups(keep: tuple = ()) -> None:
    """Destroy every process group but the world's and ``keep`` (the cases ended at a barrier, their meshes are
    done with), drop them from the meshes' registries and empty DTensor's caches (an ended mesh equals a later one):
    a gloo group's threads end only when its last reference goes, and idle ones still burn CPU (measured, world 2:
    1,800 threads per rank cost 0.45 of a core each while idle and made a matmul + all-reduce loop 2.2x slower).
    Without it the shared world-2 launch ended with ~3,000 threads per rank."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world  # tests may touch torch's privates; meshplan may not

    from meshplan._torch import forget_groups
    groups = [pg for pg in list(_world.pg_map) if pg is not dist.GroupMember.WORLD and pg not in keep]
    if not groups:
        return
    names = [_world.pg_names[pg] for pg in groups if pg in _world.pg_names]
    meshes = [o for o in gc.get_objects() if type(o).__name__ == "DeviceMesh"]
    for pg in groups:
        dist.destroy_process_group(pg)
    forget_groups(meshes, names)


class SharedLaunches:
    """Pytest side: ``launches(worker, n)`` is ``{case: {rank: result}}`` of ``worker``'s cases at world ``n``, as
    :func:`launch` of the worker alone gives, from ONE launch per world size of every :data:`SHARED` worker whose
    test file is in the session (``files``, by name). A worker asked for outside them gets a launch of its own.
    Hold one per pytest session (``tests/conftest.py``: the ``shared_launch`` fixture)."""

    def __init__(self, files: set[str]) -> None:
        self.files = files
        self.done: dict[tuple[int, tuple[str, ...]], dict] = {}

    def __call__(self, worker: str, nproc: int) -> dict:
        if nproc not in SHARED.get(worker, ("", {}))[1]:  # its own launch, as before
            if (nproc, (worker,)) not in self.done:
                self.done[nproc, (worker,)] = launch(f"tests/dist/{worker}.py", nproc)
            return self.done[nproc, (worker,)]
        entries = tuple(f"{w}:{worlds[nproc]}".rstrip(":") for w, (file, worlds) in SHARED.items()
                        if file in self.files and nproc in worlds)
        if not any(e.partition(":")[0] == worker for e in entries):
            entries = (f"{worker}:{SHARED[worker][1][nproc]}".rstrip(":"),)
        if (nproc, entries) not in self.done:
            self.done[nproc, entries] = launch("tests/dist/suite_worker.py", nproc, *entries, timeout=2400)
        results = self.done[nproc, entries]
        meta = dict(results["_meta"])
        broken = results.get(f"{worker}:", {})
        if broken:  # the worker did not import: its error stands for its cases' missing reports
            meta["stderr"] = f"{worker} failed before its cases: {next(iter(broken.values()))['error']}"
        view = {"_meta": meta}
        view.update({k.partition(":")[2]: v for k, v in results.items() if k.partition(":")[0] == worker and
                     k.partition(":")[2]})
        return view
