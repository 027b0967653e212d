"""Faults, measured on real torchrun/gloo launches; prints tables.

    python benchmarks/faults.py detect [--repeat 3]   # SIGSTOP / SIGKILL of one rank at world 2 and 4: time until
                                                      # every other rank has named it (plan timeout 4 s)
    python benchmarks/faults.py exit [--runs 40]      # exit statuses of finished runs: the gloo exit race provoked
                                                      # (torch alone vs inside `with meshplan.init`), examples/train.py
    python benchmarks/faults.py lines [--repeat 10]   # world 4, a rank killed / stopped: launches in which every
                                                      # survivor printed exactly one line naming it
    python benchmarks/faults.py overhead              # tokens/s of examples/train.py, flight recorder on vs off

``detect`` and the provoked race run ``tests/dist/faults_worker.py``; ``exit --train-src DIR`` runs
``examples/train.py`` of another checkout (e.g. ``git worktree add /tmp/base main``) for a before/after count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from _launch import launch  # noqa: E402

TIMEOUT_S = 4.0  # the faults section of tests/dist/faults_worker.py


def detect(repeat: int) -> None:
    print("| world | plan | signal (where) | victim | ranks that named it | time to the error, s (min / median / max) "
          "| timeout |")
    print("|---|---|---|---|---|---|---|")
    for world in (2, 4):
        victim = world - 1
        for sig, kind, where in (("sigstop", "tp", "step"), ("sigstop", "pp", "forward"), ("sigkill", "tp", "step")):
            times, named, total = [], 0, 0
            for _ in range(repeat):
                res = launch("tests/dist/faults_worker.py", world, sig, str(victim), kind, where, timeout=300)
                sent = res.get("victim", {}).get(victim, {}).get("value", {}).get("t")
                verb = "stopped answering" if sig == "sigstop" else "died"
                for rank in (r for r in range(world) if r != victim):
                    total += 1
                    report = res.get("fault", {}).get(rank, {}).get("value")
                    if report and sent and report["message"].startswith(f"meshplan: rank {victim} {verb}"):
                        named += 1
                        times.append(report["t"] - sent)
            shown = f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}" if times else "-"
            plan = ("tp 2" if kind == "tp" else "pp 2 (1F1B)") + (" × dp_shard 2 (FSDP)" if world == 4 else "")
            print(f"| {world} | {plan} | {sig.upper()} ({'mid-forward' if where == 'forward' else 'step start'}) | "
                  f"{victim} | {named}/{total} | {shown} | {TIMEOUT_S:g} s |", flush=True)


def lines(repeat: int) -> None:
    """World 4, rank 2 killed or stopped at step 3 (tp 2 × dp_shard 2): launches in which EVERY survivor wrote
    exactly one stderr line, naming rank 2 (the worker ends as examples/train.py does)."""
    world, victim = 4, 2
    print("| signal | launches where every survivor printed one line naming rank 2 | survivors | s per launch |")
    print("|---|---|---|---|")
    for sig, verb in (("sigkill", "died"), ("sigstop", "stopped answering")):
        good = ok = total = 0
        t = time.time()
        for _ in range(repeat):
            try:
                res = launch("tests/dist/faults_worker.py", world, sig, str(victim), "tp", "step", timeout=300,
                             rank_stderr=True)
            except subprocess.TimeoutExpired:  # counted as a failed launch (a machine loaded past its means)
                print(f"  {sig}: launch timed out after 300 s", file=sys.stderr, flush=True)
                total += world - 1
                continue
            logs = res["_meta"].get("rank_stderr", {})
            fine = 0
            for rank in (r for r in range(world) if r != victim):
                got = [x for x in logs.get(rank, "").splitlines() if x.strip()]
                fine += len(got) == 1 and got[0].startswith(f"meshplan: rank {victim} {verb} (")
            total += world - 1
            ok += fine
            good += fine == world - 1
            print(f"  {sig}: {fine}/{world - 1} survivors printed one line naming rank {victim} "
                  f"({res['_meta']['seconds']:.0f} s)", file=sys.stderr, flush=True)
        print(f"| {sig.upper()} | {good}/{repeat} | {ok}/{total} | {(time.time() - t) / repeat:.1f} |", flush=True)


def _torchrun(src: Path, nproc: int, script: str, *args: str) -> dict:
    """``launch`` for a script of another checkout: its own meshplan first on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(src), str(src / "examples")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(src / script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=src)
    return {"returncode": proc.returncode, "stderr": proc.stderr}


def _exit_counts(runs: int, src: Path | None, nproc: int, script: str, *args: str) -> tuple[int, int, float]:
    ok = aborted = 0
    t = time.time()
    for _ in range(runs):
        meta = launch(script, nproc, *args, timeout=600)["_meta"] if src is None else _torchrun(src, nproc, script,
                                                                                                 *args)
        ok += meta["returncode"] == 0
        aborted += "terminate called" in meta["stderr"] or "SIGABRT" in meta["stderr"]
    return ok, aborted, (time.time() - t) / runs


def exit_statuses(runs: int, train_src: Path) -> None:
    train = ("examples/train.py", "--steps", "5", "--plan", "plans/llama.yaml")
    rows = [("gloo exit race provoked, torch alone", None, 2, ("tests/dist/faults_worker.py", "exit_race_plain")),
            ("gloo exit race provoked, inside `with meshplan.init`", None, 2,
             ("tests/dist/faults_worker.py", "exit_race")),
            ("gloo exit race provoked, `topo = meshplan.init(…)` … `topo.close()`", None, 2,
             ("tests/dist/faults_worker.py", "exit_race_close")),
            (f"examples/train.py --steps 5, plans/llama.yaml, from {train_src}", train_src, 2, train),
            (f"examples/train.py --steps 5, plans/llama.yaml, from {train_src}", train_src, 4, train)]
    print("| run | ranks | exit 0 | aborted at exit | s per launch |")
    print("|---|---|---|---|---|")
    for name, src, nproc, args in rows:
        n = runs if nproc == 2 else max(1, runs // 2)
        ok, aborted, per = _exit_counts(n, src, nproc, *args)
        print(f"| {name} | {nproc} | {ok}/{n} | {aborted} | {per:.1f} |", flush=True)


def overhead(pairs: int) -> None:
    """Alternating launches (recorder off, on), median tokens/s of steps 6-25 each."""
    speeds: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(pairs):
        for mode in ("off", "on"):
            os.environ["TORCH_FR_BUFFER_SIZE"] = "0" if mode == "off" else "2000"
            meta = launch("examples/train.py", 2, "--steps", "25", "--json", timeout=600)["_meta"]
            steps = [json.loads(line) for line in meta["stdout"].splitlines() if line.startswith('{"step"')]
            speeds[mode].append(statistics.median(s["tokens_per_s"] for s in steps if s["step"] > 5))
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    off, on = statistics.median(speeds["off"]), statistics.median(speeds["on"])
    print("| flight recorder | tokens/s (median of launches) | ratio to off |")
    print("|---|---|---|")
    print(f"| off | {off:,.0f} | 1.00 |")
    print(f"| on (2000 entries, meshplan's default) | {on:,.0f} | {on / off:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("detect", "lines", "exit", "overhead"))
    ap.add_argument("--repeat", type=int, default=3, help="detect: launches per configuration")
    ap.add_argument("--runs", type=int, default=40, help="exit: launches per 2-rank row (4-rank rows: half)")
    ap.add_argument("--train-src", type=Path, default=ROOT, help="exit: the checkout whose examples/train.py runs")
    ap.add_argument("--pairs", type=int, default=3, help="overhead: launches per setting")
    args = ap.parse_args()
    os.chdir(ROOT)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.what == "detect":
        detect(args.repeat)
    elif args.what == "lines":
        lines(args.repeat)
    elif args.what == "exit":
        exit_statuses(args.runs, args.train_src.resolve())
    else:
        overhead(args.pairs)


if __name__ == "__main__":
    main()
