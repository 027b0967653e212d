"""``meshplan convert IN --from F --to T``: plans between meshplan, transformers, torch, DeepSpeed and accelerate
(:mod:`meshplan.convert`). The converted text goes to stdout (or ``-o``); every item the target cannot hold, and
every guess, is one ``meshplan convert: dropped …`` / ``assumed …`` line on stderr."""

from __future__ import annotations

import argparse
import sys

from meshplan.cli.args import int_arg, write_output
from meshplan.errors import PlanError

__all__ = ["register"]


def _modules(args: argparse.Namespace):
    if args.model is None:
        return None
    from meshplan.checks.model_factory import _config_arg, build_model
    from meshplan.convert.formats import model_modules
    return model_modules(build_model(args.model, _config_arg(args.config), args.path or []))


def _setting(text: str) -> tuple[str, object]:
    """An argparse ``type`` for ``--set NAME=VALUE``: true/false, None, an integer, else the text."""
    name, eq, value = text.partition("=")
    if not eq or not name.replace(".", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. loss_parallel=true), got {text[:60]!r}")
    low = value.strip().lower()
    if low in ("true", "false", "none"):
        return name, {"true": True, "false": False, "none": None}[low]
    return name, int(low) if low.lstrip("-").isdigit() else value


def _convert(args: argparse.Namespace) -> int:
    from meshplan.checks.model_factory import _failure, _quiet_transformers, _silenced
    from meshplan.convert.formats import Options, convert
    opts = Options(modules=_modules(args), world_size=args.world_size, tp=args.tp, name=args.name,
                   sequence_parallel=not args.no_sequence_parallel, loss_parallel=not args.no_loss_parallel,
                   ep=args.ep, settings=tuple(args.set or ()))
    try:
        with _quiet_transformers(), _silenced():
            text, notes = convert(args.source, args.from_, args.to, opts)
    except PlanError:
        raise
    except (Exception, SystemExit) as e:  # transformers rejecting a malformed config.json
        raise PlanError(f"convert {args.source!r}: transformers cannot use this config: {_failure(e)}") from None
    if notes.lost and not args.allow_drop:  # one error line (the CLI's contract); --allow-drop lists them all
        raise PlanError(f"convert {args.source!r}: {len(notes.lost)} rule(s) for modules with parameters dropped "
                        f"({'; '.join(notes.lost[:3])}{'; …' if len(notes.lost) > 3 else ''}): the written plan would "
                        f"leave them unsharded; nothing written; pass --allow-drop to write it anyway (each dropped "
                        f"item then one line)")
    for line in notes.lines():
        print(line, file=sys.stderr)
    write_output(text, args.output)  # says "meshplan: wrote FILE (N bytes)" after -o
    return 0


def register(sub) -> None:
    """Add ``convert`` to the ``meshplan`` subparsers."""
    from meshplan.convert.formats import FORMATS
    v = sub.add_parser("convert", help="convert plans between meshplan, transformers, torch, DeepSpeed, accelerate",
                       description=__doc__)
    v.add_argument("source", help="--from meshplan: a plan file; hf: a transformers plan document (JSON: tp_plan, "
                                  "pp_plan, ep_plan, sizes), a model type (llama, …), a config.json or its "
                                  "directory; torch: a Python file with a parallelize_module plan; deepspeed: a "
                                  "DeepSpeed JSON config (AutoTP layer_specs); accelerate: an accelerate config "
                                  "(YAML/JSON) or a Python file calling ParallelismConfig")
    v.add_argument("--from", dest="from_", choices=FORMATS, default="hf")
    v.add_argument("--to", choices=FORMATS, default="meshplan")
    v.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    v.add_argument("--model", default=None, help="MODULE:FACTORY (as in meshplan check): module types and "
                                                 "parameter names resolve DeepSpeed regexes and embedding/head rules")
    v.add_argument("--config", default=None, help="JSON object (or .json file) passed to the --model factory")
    v.add_argument("--path", action="append", help="extra import directory for --model (repeatable)")
    v.add_argument("--world-size", type=int_arg(1, 1 << 20, " (2**20)"), default=None,
                   help="--to accelerate: resolves a dp_shard the plan infers")
    v.add_argument("--tp", type=int_arg(1, 1 << 20, " (2**20)"), default=None,
                   help="write layout.tp (a torch plan holds no degrees)")
    v.add_argument("--set", action="append", type=_setting, metavar="NAME=VALUE",
                   help="--from torch: the value of an option the file's conditions read (repeatable), e.g. "
                        "--set loss_parallel=true; a parameter default is assumed (one line)")
    v.add_argument("--allow-drop", action="store_true", help="write the result even when a rule for a module with "
                                                             "parameters was dropped (exit 0; the lines still say "
                                                             "what)")
    v.add_argument("--name", default=None, help="--from torch: the dict to read when the file holds several")
    v.add_argument("--ep", type=int_arg(1, 1 << 20, " (2**20)"), default=None,
                   help="--from hf, mixture-of-experts models: the expert-parallel degree (an expert_parallel section "
                        "from the config's base_model_ep_plan)")
    v.add_argument("--no-sequence-parallel", action="store_true", help="--from hf model type: sequence_parallel false")
    v.add_argument("--no-loss-parallel", action="store_true", help="--from hf model type: loss_parallel false")
    v.set_defaults(func=_convert)
