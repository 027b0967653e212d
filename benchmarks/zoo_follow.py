"""Follow the zoo's refusals: every refusal whose suggestion can be followed mechanically is followed, checked and
run on real gloo processes against one device, like the zoo's own rows.

"A refusal's suggestion, followed, works or is not offered": the sweep (``benchmarks/zoo.py``) records each
refusal's reason; this script reads that JSON, rebuilds each refused model's plan (``zoo_plans.axis_plan``),
applies what the suggestion says and runs the result (``zoo_launch.run_items`` → ``zoo_dist.py``, one launch per
world size). Suggestions followed:

==================================================  ===================================================================
suggestion in the refusal                           the plan that follows it
==================================================  ===================================================================
``use pipeline.split: trace with split_points P``   pp axis: ``pipeline.split: trace``, ``split_points: P``; the
                                                    ``tensor_parallel``, ``data_parallel`` and ``blocks`` sections
                                                    dropped (what the suggestion says the traced split runs without)
``leave cp out of the layout (… dp_shard …)``       cp axis: ``layout: {dp_shard: 2}``, no ``context_parallel``
``set layout.etp: N`` / ``set layout.ep: N``        that degree; ranks it frees go to ``dp_shard`` (same world size)
``module M computes across … or leave the module    the ``tensor_parallel`` rules of M (every layer: indices as
unsharded``                                         ``*``) and of its children dropped
``use pp 1 (no pipeline)``                          not run: pp 1 is the one-device model the zoo compares against
==================================================  ===================================================================

Every other refusal offers no mechanical step (a rule to write by hand, a model that cannot be split); it is listed
as ``not followed`` with its reason's first words. A 3-D refusal suggesting ``split: trace`` is the pp row's
(traced stages run on pp ranks only, without the 3-D layout's other sections).

    python benchmarks/zoo_follow.py --json /tmp/meshplan-zoo.json [--add pp3d.json] [--doc docs/transformers-zoo.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from zoo_plans import WORLD, axis_plan, build, short  # noqa: E402

HEADING = "## Refusals' suggestions, followed"
_TRACE = re.compile(r"use pipeline\.split: trace with split_points (\[[^\]]*\])")
_LAYOUT = re.compile(r"set layout\.(etp|ep): (\d+)")
_UNSHARDED = re.compile(r"module '([^']+)' computes across .* or leave the module unsharded")


def follow(axis: str, reason: str, plan: dict) -> tuple[str, dict | None]:
    """``(what was done, the plan that follows the suggestion)``; the plan is None where nothing can be run."""
    m = _TRACE.search(reason)
    if m and axis == "pp":
        points = json.loads(m.group(1).replace("'", '"'))
        rest = {k: v for k, v in plan.items() if k not in ("tensor_parallel", "data_parallel", "blocks")}
        return (f"split: trace at {points}",
                {**rest, "pipeline": {**plan["pipeline"], "split": "trace", "split_points": points}})
    if m:  # 3d: traced stages run on pp ranks only, without the layout's other degrees: the pp row
        return "as the pp row: split: trace runs on pp ranks only", None
    if axis == "cp" and "leave cp out of the layout" in reason:
        rest = {k: v for k, v in plan.items() if k != "context_parallel"}
        return "layout dp_shard 2 (cp left out)", {**rest, "layout": {"dp_shard": 2}}
    m = _LAYOUT.search(reason)
    if m:
        layout = {**plan["layout"], m.group(1): int(m.group(2))}
        used = 1
        for k in ("tp", "pp", "cp", "dp_replicate", "dp_shard"):
            used *= layout.get(k, 1)
        if used < WORLD[axis]:  # ep's ranks (data ranks folded) go to data parallelism
            layout["dp_shard"] = layout.get("dp_shard", 1) * WORLD[axis] // used
        return f"layout {layout}", {**plan, "layout": layout}
    m = _UNSHARDED.search(reason)
    if m and "tensor_parallel" in plan:
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", m.group(1))
        rules = {k: v for k, v in plan["tensor_parallel"]["rules"].items()
                 if k != pattern and not k.startswith(pattern + ".")}
        return (f"{pattern} left unsharded",
                {**plan, "tensor_parallel": {**plan["tensor_parallel"], "rules": rules}})
    if "use pp 1 (no pipeline)" in reason:
        return "pp 1: the one-device model itself (the reference)", None
    return "not followed: no mechanical step offered", None


def refusals(rows: list[dict], axes: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(type, axis, reason)`` of every refused (model, axis) on ``axes``."""
    return [(r["type"], a, str(v.get("reason", ""))) for r in rows for a, v in (r.get("axes") or {}).items()
            if a in axes and v.get("class") == "refused"]


def prepare(found: list[tuple[str, str, str]], log=print) -> tuple[list[dict], list[dict]]:
    """``(rows, items)``: one row per refusal (``followed``, ``check``), and the runnable plans as launch items."""
    import meshplan
    from zoo_plans import is_moe
    rows, items, models = [], [], {}
    for model_type, axis, reason in found:
        row = {"type": model_type, "axis": axis, "reason": short(reason, 160)}
        rows.append(row)
        try:
            if model_type not in models:
                model = build(model_type)[0]
                models[model_type] = (model, is_moe(model))
            model, moe = models[model_type]
            plain = axis in ("tp", "ep", "3d")  # the zoo's plain plan: its refusal is the one recorded
            row["followed"], plan = follow(axis, reason, axis_plan(model, axis, moe, sp=not plain))
        except Exception as e:  # noqa: BLE001 - a refusal at convert time: nothing to follow
            row["followed"], plan = f"not followed: {short(e, 100)}", None
        if plan is None:
            row["class"] = "-"
            continue
        report = meshplan.check(model, plan, world_size=WORLD[axis])
        if not report.ok:
            row.update({"class": "refused", "result": short("; ".join(str(e) for e in report.errors[:1]), 200)})
            continue
        items.append({"i": len(rows) - 1, "type": model_type, "axis": axis, "plan": plan})
        log(f"{model_type:32s} {axis}: {row['followed']}: check ok")
    return rows, items


def markdown(rows: list[dict]) -> str:
    """The doc section: counts, then one line per refusal."""
    ran = [r for r in rows if r["class"] != "-"]
    counts = {c: sum(r["class"] == c for r in ran) for c in ("equal", "refused", "WRONG", "crash")}
    lines = [HEADING, "",
             f"`python benchmarks/zoo_follow.py` reads the sweep's refusals and follows every suggestion a plan can "
             f"follow mechanically (see its docstring), checked and run on real gloo like the rows above. Of "
             f"{len(rows)} refusals, {len(ran)} offer such a step; followed: "
             + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".", "",
             "| model | axis | suggestion followed | result |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["class"] == "-", r["axis"], r["type"])):
        result = r["class"] if r["class"] == "-" else f"**{r['class']}** {r.get('result', '')}"
        lines.append(f"| `{r['type']}` | {r['axis']} | {r['followed']} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="a zoo sweep's JSON (benchmarks/zoo.py --json)")
    ap.add_argument("--add", action="append", default=[], help="the JSON of a sweep of other axes")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--doc", help="replace this section of the zoo doc (docs/transformers-zoo.md)")
    args = ap.parse_args(argv)
    from zoo import combine
    from zoo_launch import run_items
    from zoo_tp import _quiet
    _quiet()
    with open(args.json) as f:
        data = json.load(f)
    for extra in args.add:
        with open(extra) as f:
            data["rows"], data["seconds"] = combine(data, json.load(f))
    rows, items = prepare(refusals(data["rows"], ("tp", "pp", "cp", "ep", "3d")))
    for world in sorted({WORLD[t["axis"]] for t in items}):
        done = run_items([t for t in items if WORLD[t["axis"]] == world], world, args.timeout)
        for i, res in done.items():
            rows[i].update({"class": res["class"], "result": short(res["reason"], 120)})
    section = markdown(rows)
    print(section)
    if args.doc:
        with open(args.doc) as f:
            text = f.read().split(HEADING)[0].rstrip("\n")
        with open(args.doc, "w") as f:
            f.write(text + "\n\n" + section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
