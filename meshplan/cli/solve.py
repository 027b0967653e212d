"""``meshplan estimate``, ``meshplan solve`` and ``meshplan profile``: added to the parser by :mod:`meshplan.cli.main`.

The model comes from one of: ``--preset NAME`` (:mod:`meshplan.solver.presets`), ``--config CONFIG`` (its
sizes: JSON text or a .json/.yaml/.toml file, in meshplan's keys, an example's ``ModelArgs`` keys or a
transformers ``config.json``), or ``--model MODULE:FACTORY [--config JSON]`` (built on the meta device as
``meshplan check`` builds it, its sizes read from its config). Only ``--model`` and ``--profile`` import torch.
The cluster is ``--cluster NAME`` (a preset), ``--cluster FILE`` (``meshplan profile -o FILE``) or ``--profile``
(measured now).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from meshplan.cli.args import int_arg
from meshplan.cli.solve_flags import DTYPES as _DTYPES, cluster_flags as _cluster_flags, model_flags as _model_flags, \
    run_flags as _run_flags, solve_flags as _solve_flags
from meshplan.errors import PlanError

__all__ = ["register"]

def _shape(args: argparse.Namespace):
    """``(shape, warning)`` from --preset, --model or --config."""
    from meshplan.solver.presets import model_preset
    from meshplan.solver.shape import shape_from_config
    given = [f for f in ("preset", "model") if getattr(args, f)]
    if len(given) > 1 or not (given or args.config):
        raise PlanError(f"{args.command}: give the model as one of --preset NAME, --model MODULE:FACTORY or "
                        f"--config CONFIG; got {', '.join('--' + g for g in given) or 'none'}")
    if args.preset:
        if args.config:
            raise PlanError(f"{args.command}: --config goes with --model or alone, not with --preset")
        return model_preset(args.preset), None
    if args.model:
        from meshplan.checks.model_shape import shape_of_model
        from meshplan.cli.models import build_user_model
        return shape_of_model(build_user_model(args))
    return shape_from_config(_read_config(args.config)), None


def _read_config(text: str) -> dict:
    from meshplan.plan_file.reading import read_plan_data
    if text.lstrip().startswith("{"):
        from meshplan.checks.model_factory import _config_arg
        return _config_arg(text)
    try:
        return read_plan_data(text)
    except PlanError as e:
        raise PlanError(f"--config: {e}") from None


def _cluster(args: argparse.Namespace):
    from dataclasses import replace

    from meshplan.solver.cluster import load_cluster_file
    from meshplan.solver.presets import cluster_preset
    if getattr(args, "profile", False):
        from meshplan.profile.run import profile_cluster
        cl = profile_cluster(nproc=args.nproc or min(args.gpus, 8), out=args.profile_out)
    elif Path(args.cluster).suffix == ".json" or Path(args.cluster).is_file():
        cl = load_cluster_file(args.cluster)
    else:
        cl = cluster_preset(args.cluster)
    if args.gpus_per_node:
        cl = replace(cl, gpus_per_node=args.gpus_per_node)
    if args.memory_gib is not None:
        cl = replace(cl, memory=args.memory_gib * float(1 << 30))
    return cl


def _emit(args: argparse.Namespace, text: str, doc: dict) -> None:
    if args.format == "json":
        sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(text + "\n")


def _estimate(args: argparse.Namespace) -> int:
    from meshplan.plan_file.document import load_plan
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.solver.report import estimate_json, estimate_text, uncertainty
    from meshplan.solver.rules import model_problem, run_problem
    from meshplan.solver.step import evaluate
    plan = load_plan(args.plan)
    cand, train = candidate_from_plan(plan, args.world_size, args.seq, args.global_batch,
                                      microbatches=args.microbatches, dtype=args.dtype)
    shape, warning = _shape(args)
    cluster = _cluster(args)
    why = model_problem(shape, cand) or run_problem(shape, cand, train, cluster.device)
    if why:
        raise PlanError(f"{args.plan}: {why[1]}")
    est = evaluate(shape, cand, train, cluster)
    if warning:
        print(f"meshplan: warning: {warning}", file=sys.stderr)
    text, doc = estimate_text(est, shape, cluster, args.plan), estimate_json(est)
    doc["uncertainty"] = uncertainty(cluster)
    from meshplan.solver.units import UNITS
    notes = [n for u in UNITS if u.costs.estimate_line for n in [u.costs.estimate_line(evaluate, shape, cand, train,
                                                                                       cluster)] if n]
    if notes:
        text, doc["notes"] = "\n".join([text, *notes]), notes
    if args.rank is not None:
        line, doc["rank"] = _one_rank(args, shape, cand, train, cluster)
        text += "\n" + line
    _emit(args, text, doc)
    return 0


def _one_rank(args: argparse.Namespace, shape, cand, train, cluster) -> tuple[str, dict]:
    """``--rank R``: that rank's coordinates and exact parameter/gradient/optimizer bytes (its FSDP2 chunks)."""
    from meshplan.solver.memory import rank_memory
    from meshplan.solver.placement import Placement
    if args.rank >= args.world_size:
        raise PlanError(f"--rank {args.rank}: outside world size {args.world_size}; expected 0..{args.world_size - 1}")
    place = Placement(cand, shape.layers, cluster.gpus_per_node)
    info = place.layout.rank_info(args.rank)
    mem = rank_memory(shape, cand, train, place, info["pp"], rank=args.rank)
    doc = {"rank": args.rank, **{k: info[k] for k in ("pp", "dp", "tp", "cp", "ep", "edp")},
           "params": int(mem.params), "grads": int(mem.grads), "optimizer": int(mem.optimizer)}
    coords = ", ".join(f"{k} {info[k]}" for k in ("pp", "dp", "tp", "cp", "ep", "edp"))
    return (f"rank {args.rank} ({coords}): params {doc['params']:,} B, grads {doc['grads']:,} B, optimizer "
            f"{doc['optimizer']:,} B (exact: its own FSDP2 chunks; the table shows the most loaded rank)"), doc


def _space(args: argparse.Namespace):
    from meshplan.solver.search import Space
    fixed = {k: getattr(args, k) for k in ("tp", "cp", "ep", "pp", "vpp", "dp_replicate") if getattr(args, k)}
    kw = {}
    for name in ("orders", "schedules", "ac"):
        if getattr(args, name) is not None:
            kw[name] = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
    for name in ("micro_batches", "vpps"):
        if getattr(args, name) is not None:
            try:
                kw[name] = tuple(int(x) for x in getattr(args, name).split(",") if x.strip())
            except ValueError:
                raise PlanError(f"--{name.replace('_', '-')}: expected integers separated by commas, got "
                                f"{getattr(args, name)!r}") from None
    return Space(fixed=fixed, **kw)


def _solve(args: argparse.Namespace) -> int:
    from meshplan.solver.candidate import Training
    from meshplan.solver.report import search_json, search_text
    from meshplan.solver.search import search
    if args.plan:  # checked before the search: a typo'd section is refused, not dropped from the written plan
        from meshplan.plan_file.document import load_plan
        load_plan(args.plan)
    shape, warning = _shape(args)
    train = Training(seq=args.seq, global_batch=args.global_batch, dtype=args.dtype, master_dtype=args.master_dtype,
                     reduce_dtype=args.master_dtype, sequence_parallel=not args.no_sequence_parallel,
                     save_gathered_inputs=args.save_gathered_inputs)
    cluster = _cluster(args)
    args.progress.stage(f"searching the layouts of {args.gpus:,} devices")
    res = search(shape, train, cluster, args.gpus, _space(args))
    if warning:
        print(f"meshplan: warning: {warning}", file=sys.stderr)
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None  # wrapped to fit a terminal
    _emit(args, search_text(res, shape, cluster, args.gpus, args.top, args.show_rejected, width),
          search_json(res, args.top))
    if args.write:
        if not res.valid:
            raise PlanError(f"--write {args.write!r}: no valid layout to write")
        _write(args, res.valid[0], train)
    return 0


def _write(args: argparse.Namespace, best, train) -> None:
    from meshplan.solver.plans import plan_from_candidate, plan_text
    base = None
    if args.plan:
        from meshplan.plan_file.reading import read_plan_data
        base = read_plan_data(args.plan)
    elif args.model or args.config:
        base = _known_rules(args)
    data = plan_from_candidate(best.candidate, train, base, (base or {}).get("blocks", {}).get("pattern", "layers.*"))
    header = (f"Written by `meshplan solve` for {args.gpus} devices: {best.candidate.label()}\n"
              f"estimated {best.step_time:.4g} s per step, {best.tokens_per_s_device:,.1f} tokens/s per device, "
              f"MFU {100 * best.mfu:.1f}%" + _rules_note(args.plan, data))
    try:
        Path(args.write).write_text(plan_text(data, header), encoding="utf-8")
    except (OSError, ValueError) as e:
        raise PlanError(f"--write {args.write!r}: cannot write: {getattr(e, 'strerror', None) or e}") from None
    print(f"meshplan: wrote {args.write}", file=sys.stderr)


def _rules_note(plan: str | None, data: dict) -> str:
    """The header's account of the rule sections kept from ``--plan`` (only the ones the written plan holds)."""
    kept = [k for k in ("tensor_parallel", "context_parallel", "expert_parallel") if k in data]
    if not plan:
        return ""
    return f"; {', '.join(kept)} from {plan}" if kept else f"; no rule section of {plan} needed by this layout"


def _known_rules(args: argparse.Namespace) -> dict | None:
    """The rules transformers ships for the model type (``meshplan convert``), when the model is one."""
    source = None
    if args.config and not args.config.lstrip().startswith("{") and Path(args.config).suffix == ".json":
        data = _read_config(args.config)
        source = args.config if data.get("model_type") else None
    if source is None:
        return None
    from meshplan.hf.convert import from_hf
    plan = from_hf(source, tp=None)
    plan.pop("_origin", None)
    plan["blocks"] = {"pattern": "model.layers.*"}
    return plan


def _profile(args: argparse.Namespace) -> int:
    from meshplan.profile.run import profile_cluster
    cl = profile_cluster(nproc=args.nproc, out=args.output, backend=args.backend)
    print(f"meshplan: profiled {cl.name}: {cl.source}; wrote {args.output}", file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add ``estimate``, ``solve`` and ``profile`` to the ``meshplan`` subparsers."""
    e = sub.add_parser("estimate", help="memory per rank, collectives per step and step time of a plan (no GPU)",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("plan", help="plan file (.yaml/.json/.toml)")
    _model_flags(e)
    e.add_argument("--world-size", type=int_arg(1, 1 << 20, " (2**20)"), required=True, help="ranks")
    _run_flags(e)
    e.add_argument("--microbatches", type=int_arg(1, 1 << 16), default=1,
                   help="gradient accumulation steps without a pipeline section (default 1)")
    e.add_argument("--dtype", choices=_DTYPES, default="float32", help="the model's dtype (default float32); "
                                                                       "data_parallel.param_dtype sets the compute one")
    e.add_argument("--rank", type=int_arg(0, 1 << 20), help="also one rank's coordinates and exact parameter, "
                   "gradient and optimizer bytes (benchmarks/rehearsal.py measures them)")
    _cluster_flags(e, profile=False)
    e.set_defaults(func=_estimate)
    s = sub.add_parser("solve", help="search every layout for a model on a cluster and rank the valid ones",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_flags(s)
    s.add_argument("--gpus", type=int_arg(1, 1 << 20, " (2**20)"), required=True, help="devices")
    _run_flags(s)
    _cluster_flags(s, profile=True)
    _solve_flags(s)
    s.set_defaults(func=_solve)
    p = sub.add_parser("profile", help="measure this machine's compute and collectives (a torchrun job) into a "
                                       "cluster file for solve/estimate")
    p.add_argument("-o", "--output", default="meshplan-cluster.json", help="the cluster file to write")
    p.add_argument("--nproc", type=int_arg(1, 1024), default=2, help="processes (devices) to measure (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.set_defaults(func=_profile)
