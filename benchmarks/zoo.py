"""The transformers zoo: every config class with a ``base_model_tp_plan``, tiny, on every parallelism axis.

For each model type (``CONFIG_MAPPING`` entries whose default config has a non-empty ``base_model_tp_plan``) and
each axis of ``zoo_plans.AXES`` (tp 2, pp 2, cp 2, ep 2 for MoE models, and a 3-D layout at world 8):

1. offline, in worker processes (``--jobs``, ``--timeout`` seconds per model): build the model tiny in float64
   (``zoo_plans.build``), write the axis' plan and ``meshplan.check`` it at the axis' world size
   (``zoo_plans.plan_model``);
2. on real processes: every checked plan runs in one torchrun/gloo launch per world size
   (``zoo_launch.run_items`` → ``zoo_dist.py``): one ``meshplan.train_step`` vs one device, loss and every
   gradient within 1e-9 relative. A launch that dies or stalls is relaunched on the rest.

Each (model, axis) is exactly one of ``equal``, ``refused`` (check or convert said no, with its reason),
``not buildable tiny`` (why), ``WRONG`` (check ok, numbers differ), ``crash`` (check ok, the run raised, hung or
died) or ``-`` (ep of a dense model). ``--hf`` adds transformers' own tp_plan on simulated ranks (``zoo_tp.py``).

    python benchmarks/zoo.py --jobs 2      # all: docs/transformers-zoo.md and /tmp/meshplan-zoo.json
    python benchmarks/zoo.py --only llama,mixtral --axes tp,ep --no-doc
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from zoo_plans import AXES, WORLD, short  # noqa: E402
from zoo_tp import _quiet, classify  # noqa: E402,F401  (classify: the simulated tp row, tests/test_zoo.py)


def zoo_types() -> dict[str, str]:
    """``{model type: config class name}`` for every config class whose default has a non-empty tp plan (a
    default that cannot be instantiated is read from the class attribute)."""
    _quiet()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    out = {}
    for model_type in CONFIG_MAPPING.keys():
        cls = CONFIG_MAPPING[model_type]
        try:
            plan = cls().base_model_tp_plan
        except Exception:  # noqa: BLE001 - fall back to the class attribute
            plan = getattr(cls, "base_model_tp_plan", None)
        if plan:
            out[model_type] = cls.__name__
    return out



def offline_row(model_type: str, axes=AXES, hf: bool = False) -> dict:
    """Phase 1 for one model: ``zoo_plans.plan_model`` (+ transformers' own tp_plan with ``hf``)."""
    _quiet()
    from zoo_plans import plan_model
    t0 = time.perf_counter()
    row = plan_model(model_type, axes)
    if hf and row.get("class") != "not buildable tiny":
        from meshplan.hf.tiny_models import tiny_model
        from zoo_tp import hf_side
        row["hf"] = hf_side(tiny_model(model_type, tp=2)[0])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _worker(conn, axes, hf: bool) -> None:
    _quiet()
    while True:
        model_type = conn.recv()
        if model_type is None:
            return
        try:
            row = offline_row(model_type, axes, hf)
        except BaseException as e:  # noqa: BLE001 - the sweep goes on
            row = {"type": model_type, "class": "crash", "reason": f"zoo worker: {short(e)}"}
        conn.send(row)


class _Slot:
    def __init__(self, axes, hf: bool):
        self.args, self.proc, self.conn, self.job, self.started = (axes, hf), None, None, None, 0.0

    def start(self, model_type: str) -> None:
        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
            self.proc.start()
        self.job, self.started = model_type, time.perf_counter()
        self.conn.send(model_type)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.proc = None


def _poll(s: _Slot, timeout: float) -> dict | None:
    try:
        if s.conn.poll():
            return s.conn.recv()
    except EOFError:
        s.kill()
        return {"type": s.job, "class": "crash", "reason": "offline worker died (convert/check/build)"}
    if time.perf_counter() - s.started > timeout:
        s.kill()
        return {"type": s.job, "class": "crash", "reason": f"offline phase timed out after {timeout:.0f} s"}
    return None


def offline(types: list[str], axes=AXES, jobs: int = 1, timeout: float = 180.0, hf: bool = False,
            log=print) -> list[dict]:
    """Phase 1 for every type in worker processes; a type past ``timeout`` seconds is a crash row."""
    todo, rows, slots = list(types), [], [_Slot(axes, hf) for _ in range(max(1, jobs))]
    while todo or any(s.job for s in slots):
        for s in slots:
            if s.job is None and todo:
                s.start(todo.pop(0))
        time.sleep(0.05)
        for s in slots:
            row = _poll(s, timeout) if s.job is not None else None
            if row is not None:
                rows.append(row)
                status = " ".join(f"{a}:{v['status']}" for a, v in row.get("axes", {}).items())
                log(f"{row['type']:34s} {status or row['class'] + ': ' + short(row['reason'], 90)}")
                s.job = None
    for s in slots:
        if s.proc is not None:
            s.conn.send(None)
            s.proc.join(5)
    return sorted(rows, key=lambda r: r["type"])


def verdicts(rows: list[dict], ran: dict) -> None:
    """Each row's ``axes[axis]`` becomes ``{class, reason, …}``: the check's refusal, or the run's result."""
    for r in rows:
        if r.get("class") == "crash":  # the offline phase itself failed: every axis is that crash
            r["axes"] = {a: {"class": "crash", "reason": r["reason"]} for a in AXES}
            r.pop("class")
        for a, v in r.get("axes", {}).items():
            status = v.pop("status", None)
            if status == "ok":
                v.update(ran.get((r["type"], a), {"class": "crash", "reason": "not run"}))
                v.pop("plan", None)
            elif status is not None:
                v["class"] = {"refused": "refused", "-": "-"}.get(status, "crash")


def run_all(rows: list[dict], timeout: float, log=print) -> tuple[dict, dict]:
    """Phase 2: every checked plan on real processes, one launch per world size; ``({(type, axis): result},
    {phase: seconds})``."""
    from zoo_launch import run_items
    ran, seconds = {}, {}
    for world in sorted(set(WORLD.values())):
        items = [{"i": i, "type": r["type"], "axis": a, "plan": v["plan"]}
                 for i, (r, a, v) in enumerate((r, a, v) for r in rows for a, v in r.get("axes", {}).items())
                 if v.get("status") == "ok" and WORLD[a] == world]
        t0 = time.perf_counter()
        log(f"world {world}: {len(items)} runs")
        results = run_items(items, world, timeout, log=log)
        seconds[f"world {world}"] = time.perf_counter() - t0
        ran.update({(t["type"], t["axis"]): {**results[t["i"]], "layout": t["plan"]["layout"]} for t in items})
    return ran, seconds


def combine(old: dict, new: dict, label: str = "") -> tuple[list[dict], dict]:
    """The rows of two sweeps' JSON: a model's axes in ``new`` replace its axes in ``old`` (a row that is not
    buildable in either replaces the other); seconds of ``new`` added under ``label``."""
    rows = {r["type"]: r for r in old["rows"]}
    for r in new["rows"]:
        mine = rows.get(r["type"])
        if mine is None or "axes" not in mine or "axes" not in r:
            rows[r["type"]] = r
        else:
            mine["axes"].update(r["axes"])
    seconds = {**old["seconds"], **{f"{label}{k}": v for k, v in new["seconds"].items()}}
    return sorted(rows.values(), key=lambda r: r["type"]), seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--axes", default=",".join(AXES), help="comma-separated axes of " + ",".join(AXES))
    ap.add_argument("--jobs", type=int, default=2, help="offline worker processes")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per run (gloo timeout)")
    ap.add_argument("--check-timeout", type=float, default=300.0, help="seconds per model, offline")
    ap.add_argument("--hf", action="store_true", help="also transformers' own tp_plan (simulated tp 2)")
    ap.add_argument("--json", default="/tmp/meshplan-zoo.json", help="raw results (out of git)")
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "transformers-zoo.md"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--merge", action="store_true", help="with --only: replace those rows in --json, rewrite --doc")
    ap.add_argument("--render", action="store_true", help="only rewrite --doc from the --json of an earlier sweep")
    ap.add_argument("--add", action="append", help="with --render: the JSON of a sweep of other axes, combined")
    ap.add_argument("--note", help="a paragraph for the doc's header (which rows were re-run, and when)")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.json) as f:
            data = json.load(f)
        rows, seconds, args.jobs = data["rows"], data["seconds"], data.get("jobs", args.jobs)
        for extra in args.add or []:  # sweeps of other axes, run beside this one
            with open(extra) as f:
                label = os.path.splitext(os.path.basename(extra))[0] + " "  # its phases' times kept apart
                rows, seconds = combine({"rows": rows, "seconds": seconds}, json.load(f), label)
    else:
        types = args.only.split(",") if args.only else list(zoo_types())
        axes = tuple(a for a in args.axes.split(",") if a)
        t0 = time.perf_counter()
        rows = offline(types, axes, jobs=args.jobs, timeout=args.check_timeout, hf=args.hf)
        seconds = {"offline": time.perf_counter() - t0}
        ran, run_seconds = run_all(rows, args.timeout)
        seconds.update(run_seconds)
        verdicts(rows, ran)
        if args.merge:  # the rows of --only replace theirs in the earlier sweep's --json
            with open(args.json) as f:
                data = json.load(f)
            rows, seconds = combine(data, {"rows": rows, "seconds": seconds}, "rerun ")
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "jobs": args.jobs, "rows": rows}, f, indent=1, default=str)
    from zoo_report import counts_line, markdown
    print(f"\n{len(rows)} models in {sum(seconds.values()) / 60:.1f} min; " + counts_line(rows))
    if not args.no_doc and (args.merge or not args.only):
        with open(args.doc, "w") as f:
            f.write(markdown(rows, seconds, {"jobs": args.jobs, "note": args.note}))
        print(f"wrote {args.doc}" + ("" if args.render else f", {args.json}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
