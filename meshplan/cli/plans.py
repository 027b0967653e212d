"""``meshplan check``: added to the parser by :mod:`meshplan.cli.main`.

The model convention of ``check --model MODULE:FACTORY [--config JSON]``:

* ``MODULE`` is imported with the ``--path`` directories, the current directory and its
  ``examples/`` directory on ``sys.path`` (``examples.llama:build`` and ``llama:build`` both work
  from a repo root);
* ``FACTORY`` (a dotted attribute of the module) is called **under** ``torch.device("meta")``, so
  nothing is allocated, with the ``--config`` object (JSON text or a ``.json`` file) as:

  1. ``FACTORY(HFConfigClass(**config))`` when it is a transformers ``PreTrainedModel`` class
     (``--model transformers:LlamaForCausalLM``);
  2. ``FACTORY(**config)`` when its signature takes those keywords (``examples.hf_models:llama``);
  3. ``FACTORY(Args(**config))`` when it takes one argument annotated with a class
     (``examples.llama:build`` with ``args: ModelArgs``).

  It must return an ``nn.Module``. Any failure is one ``meshplan: error:`` line and exit 2, and so
  is a module or factory that calls ``sys.exit``. What they print is discarded (stdout carries the
  report). A ``--config`` key that a transformers config does not have (not an attribute of its
  default instance, e.g. ``num_hiden_layers``) is an error naming the key and its close matches,
  not a silently stored extra attribute.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

from meshplan.cli.args import add_layout_flags, layout_from_args, write_output
from meshplan.errors import PlanError
from meshplan.checks.model_factory import _failure, _hf_config_of, _quiet_transformers, _silenced
from meshplan.cli.models import build_user_model

__all__ = ["register"]


def _check(args: argparse.Namespace) -> int:
    import warnings

    from meshplan.plan_file.document import load_plan
    args.progress.stage("reading the plan")
    plan = load_plan(args.plan)  # a bad plan is refused before torch is imported (3.5-13.5 s on 2 busy cores)
    base = plan.layout.model_dump(exclude_unset=True) if plan.layout else None
    layout = layout_from_args(args, base)
    resolved = layout.resolve(args.world_size or layout.smallest_world())  # bad flags: one line, before the model
    if args.rank is not None and not 0 <= args.rank < resolved.world_size:
        raise PlanError(f"check --rank: rank {args.rank} is outside the world: expected 0 <= rank < "
                        f"{resolved.world_size}")  # checks.rank_view.check_rank's words, without importing torch
    if args.schedule and args.model is None:
        return _schedule(args, plan, resolved, None)
    if args.model is None:
        raise PlanError("check: the following arguments are required: --model (only --schedule runs without one)")
    if plan.layout is None and args.tp is None:
        raise PlanError(f"{args.plan}: the plan has no layout and no --tp was given, so nothing would be sharded; "
                        f"add `layout: {{tp: N}}` to the plan or pass --tp N")
    args.progress.stage("building the model on the meta device")
    model = build_user_model(args)
    from meshplan.checks.explain import render_table
    from meshplan.checks.offline import check
    args.progress.stage("checking the plan (a dry run on fake ranks)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check(model, plan, world_size=args.world_size, layout=layout, rank=args.rank or 0)
    if args.schedule:
        return _schedule(args, plan, resolved, report)
    if args.numerics and report.ok:
        args.progress.stage("numerics: the plan on a small real instance")
    numerics = _numerics(args, model, plan, layout.tp) if args.numerics and report.ok else None
    if args.format == "json":
        doc = {**report.to_dict(), **({"numerics": numerics.to_dict()} if numerics else {})}
        write_output(json.dumps(doc, separators=(",", ":")) + "\n", args.output)
    elif args.format in ("svg", "png"):
        from meshplan.checks.call_order import forward_order
        from meshplan.checks.explain import summary_lines
        from meshplan.viz.model_draw import model_picture
        notes = summary_lines(report, unsharded=False, rank_lines=args.rank is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            order = forward_order(model, layout.tp, notes) if report.modules else None
        write_output(_picture(model_picture(report, plan, notes, order), args.format), args.output)
    else:
        import shutil
        import sys
        width = shutil.get_terminal_size().columns if args.output is None and sys.stdout.isatty() else None
        write_output(render_table(report, rank_lines=args.rank is not None, width=width) + "\n" +
                     (f"numerics: {numerics.summary()}\n" if numerics else ""),
                     args.output)
    return 0 if report.ok and (numerics is None or numerics.ok) else 2


def _picture(drawing: Any, fmt: str) -> str | bytes:
    if fmt == "png":
        from meshplan.viz.png import to_png
        return to_png(drawing)
    return drawing.to_svg()


def _schedule(args: argparse.Namespace, plan: Any, resolved: Any, report: Any) -> int:
    """``check --schedule``: the executed pipeline schedule (svg/png timeline, a text table, or json): the axis'
    picture (:func:`meshplan.axes.timeline`), written here."""
    from meshplan.axes import timeline
    shown = timeline(plan, resolved, report, args.plan, args.format)
    write_output(_picture(shown, args.format) if args.format in ("svg", "png") else shown, args.output)
    return 0


def _numerics(args: argparse.Namespace, meta_model: Any, plan: Any, tp: int):
    """``check --numerics``: a small real instance (a transformers model: its config shrunk by
    :func:`meshplan.hf.tiny_config.tiny_config`, keeping the architecture; else the factory with ``--config``), then
    :func:`meshplan.checks.numerics.check_numerics` at the plan's tp."""
    import torch

    from meshplan.checks.numerics import check_numerics
    torch.manual_seed(0)
    hf_config = _hf_config_of(meta_model)
    if hf_config is not None:
        from meshplan.hf.tiny_config import tiny_config
        try:
            with _quiet_transformers(), _silenced():
                model = type(meta_model)(tiny_config(hf_config, tp=tp))
        except Exception as e:
            raise PlanError(f"check --numerics: cannot build a small {type(meta_model).__name__}: {_failure(e)}") from None
    else:
        model = build_user_model(args, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_numerics(model, plan, tp=tp)


def register(sub) -> None:
    """Add ``check`` to the ``meshplan`` subparsers."""
    c = sub.add_parser("check", help="validate a plan against a model on the meta device and explain it",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("plan", help="plan file (.yaml/.json/.toml)")
    c.add_argument("--model", default=None, help="MODULE:FACTORY building the model (see below), or a transformers "
                                                 "checkpoint folder (its config.json); required but with --schedule")
    c.add_argument("--config", default=None, help="JSON object (or .json file) passed to the factory")
    c.add_argument("--path", action="append", help="extra import directory for MODULE (repeatable)")
    add_layout_flags(c, world_required=False)
    c.add_argument("--format", choices=("table", "json", "svg", "png"), default="table",
                   help="svg/png: the model as its blocks with each layer's style, weight and activation shardings "
                        "and the collectives at each boundary (png needs meshplan[viz])")
    c.add_argument("--schedule", action="store_true",
                   help="show the pipeline schedule torch runs for the plan's pipeline section instead: a timeline "
                        "per pp rank (svg/png), the steps per rank (table) or json; --model adds the stages' blocks")
    c.add_argument("--rank", type=int, default=None,
                   help="show one rank's view: its coordinates, stages and modules, parameter/gradient/optimizer "
                        "bytes and the collectives it joins per step (no GPU: a fake process group; default: the "
                        "totals are rank 0's, without the view)")
    c.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    c.add_argument("--numerics", action="store_true",
                   help="also run the plan on a small real instance, tp ranks simulated in this process, and "
                        "compare the loss and every gradient with the unparallelized model (exit 2 if any differs)")
    c.set_defaults(func=_check)

