"""Run the zoo's checked plans on real gloo processes: one torchrun launch of ``benchmarks/zoo_dist.py`` per world
size running many items in sequence; a launch that dies or stalls is killed and relaunched on the items it left.

:func:`run_items` returns ``{i: result}`` for every item: the worker's per-rank lines merged
(:func:`merge`), or a crash row saying how the launch ended (``timed out after N s``, ``launch died (exit N)``
with the tail of its output) for the item it was running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "zoo_dist.py")
MAX_RSS_GIB = 8.0


def _read(out: str, nproc: int) -> tuple[dict, dict]:
    """``({i: {rank: line}}, {i: start time})`` from the rank files so far."""
    done: dict = {}
    started: dict = {}
    for r in range(nproc):
        path = os.path.join(out, f"rank{r}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line being written
                    continue
                if "start" in row:
                    started[row["i"]] = row["start"]
                else:
                    done.setdefault(row["i"], {})[r] = row
    return done, started


def merge(per_rank: dict) -> dict:
    """One item's class from its ranks' lines: ``crash`` (the first rank's error), ``WRONG`` (the worst rank's
    failures) or ``equal``."""
    errors = {r: v["error"] for r, v in sorted(per_rank.items()) if "error" in v}
    seconds = max(v.get("seconds", 0.0) for v in per_rank.values())
    if errors:
        r, e = next(iter(errors.items()))
        return {"class": "crash", "reason": f"rank {r}: {e}", "ranks_failed": sorted(errors), "seconds": seconds}
    worst = max(per_rank.values(), key=lambda v: (not v["ok"], v["worst"], v["loss_err"]))
    text = (f"loss rel err {worst['loss_err']:.1e}, worst grad rel err {worst['worst']:.1e} over "
            f"{worst['params']} parameters (tol 1e-09)")
    if not all(v["ok"] for v in per_rank.values()):
        return {"class": "WRONG", "reason": f"{text}; differ: {', '.join(worst['failed'])}", "seconds": seconds,
                "loss": worst["loss"]}
    layout = {"by_documents": worst["by_documents"]} if "by_documents" in worst else {}  # cpdoc: the layout used
    return {"class": "equal", "reason": text, "seconds": seconds, **layout}


def _launch(items: list, nproc: int, timeout: float, out: str) -> subprocess.Popen:
    path = os.path.join(out, f"items-{time.time_ns()}.json")
    with open(path, "w") as f:
        json.dump(items, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZOO_ITEMS": path, "ZOO_OUT": out, "ZOO_TIMEOUT": str(timeout),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", WORKER]
    log = open(os.path.join(out, "launch.log"), "a")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _rss_gib(pgid: int) -> float:
    """Resident memory of every process in the launch's process group, GiB (a runaway model must not take the
    shared machine's memory)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: the process group
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss in pages
        except (OSError, IndexError, ValueError):
            continue
    return total / 2**30


def _tail(out: str, n: int = 300) -> str:
    with open(os.path.join(out, "launch.log"), errors="replace") as f:
        text = f.read()[-20000:]
    lines = [ln for ln in text.splitlines() if re.match(r"\[rank\d+\]: \w+(Error|Exception)", ln)] or \
        [ln for ln in text.splitlines() if "Error" in ln or "error" in ln] or text.splitlines()
    return " ".join(" ".join(lines[-3:]).split())[-n:]


def run_items(items: list, nproc: int, item_timeout: float = 180.0, log=print) -> dict:
    """Run ``items`` (``{"i", "type", "axis", "plan"}``) at world ``nproc``; ``{i: merged result}``."""
    base = tempfile.mkdtemp(prefix=f"meshplan-zoo-{nproc}-")
    results: dict = {}
    todo = list(items)
    while todo:
        out = tempfile.mkdtemp(dir=base)  # a launch of its own: no stale lines of a killed one
        proc, t_launch = _launch(todo, nproc, item_timeout, out), time.time()
        while True:
            time.sleep(1.0)
            done, started = _read(out, nproc)
            for i, per_rank in done.items():
                if len(per_rank) == nproc and i not in results:
                    results[i] = merge(per_rank)
                    item = next(t for t in items if t["i"] == i)
                    log(f"  {nproc}: {item['type']:32s} {item['axis']:3s} {results[i]['class']:6s} "
                        f"{results[i]['reason'][:120]}")
            current = next((t for t in todo if t["i"] not in results), None)
            if current is None:
                break
            since = started.get(current["i"], t_launch)
            exited, rss = proc.poll() is not None, _rss_gib(proc.pid)
            if exited or time.time() - since > item_timeout + 30 or rss > MAX_RSS_GIB:
                why = (f"launch died (exit {proc.returncode}): {_tail(out)}" if exited else
                       f"used {rss:.1f} GiB (> {MAX_RSS_GIB}): the launch was killed" if rss > MAX_RSS_GIB else
                       f"timed out after {item_timeout + 30:.0f} s (the launch was killed)")
                if not exited:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                results[current["i"]] = {"class": "crash", "reason": why, "seconds": round(time.time() - since, 1)}
                log(f"  {nproc}: {current['type']:32s} {current['axis']:3s} crash  {why[:120]}")
                break
        if proc.poll() is None:
            proc.wait(timeout=60)
        todo = [t for t in todo if t["i"] not in results]
    return results
