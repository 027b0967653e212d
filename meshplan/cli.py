"""The ``meshplan`` command: inspect layouts and plans without a GPU.

Bad input prints one line (``meshplan: error: …``) and exits 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from .errors import PlanError

__all__ = ["main"]

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise PlanError(f"{self.prog}: {message}")


def _add_layout_flags(p: argparse.ArgumentParser, world_required: bool) -> None:
    p.add_argument("--world-size", type=int, required=world_required, help="number of ranks")
    for name, help_ in [("tp", "tensor parallel"), ("pp", "pipeline parallel"), ("cp", "context parallel"),
                        ("ep", "expert parallel"), ("etp", "expert tensor parallel (default: tp)"),
                        ("vpp", "virtual stages per pp rank"), ("dp-replicate", "dp replicas"),
                        ("dp-shard", "dp sharding degree (-1: inferred)")]:
        p.add_argument(f"--{name}", type=int, default=None, help=help_)
    p.add_argument("--order", default=None, help="Megatron order, innermost first (default tp-cp-ep-dp-pp)")


def layout_from_args(args: argparse.Namespace, base: dict | None = None):
    """A Layout from the layout flags, over ``base`` (a plan's layout section)."""
    from .layout import Layout
    from .loader import pydantic_message
    data = dict(base or {})
    for k in ("tp", "pp", "cp", "ep", "etp", "vpp", "dp_replicate", "dp_shard", "order"):
        v = getattr(args, k, None)
        if v is not None:
            data[k] = v
    try:
        return Layout.model_validate(data)
    except Exception as e:
        raise PlanError(pydantic_message(e)) from None


def _ranks(args: argparse.Namespace) -> int:
    from .report import render
    resolved = layout_from_args(args).resolve(args.world_size)
    sys.stdout.write(render(resolved, args.format) + "\n")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from .schema import plan_schema
    sys.stdout.write(json.dumps(plan_schema(), indent=2) + "\n")
    return 0


def _build_parser() -> _Parser:
    parser = _Parser(prog="meshplan", description="Validate and inspect meshplan plans and layouts (no GPU needed).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("ranks", help="groups and per-rank coordinates of a layout (Megatron-exact)")
    _add_layout_flags(r, world_required=True)
    r.add_argument("--format", choices=("table", "json", "svg"), default="table")
    r.set_defaults(func=_ranks)
    s = sub.add_parser("schema", help="print the JSON Schema of plan files")
    s.set_defaults(func=_schema)
    for register in _EXTRA:
        register(sub)
    return parser


#: later subcommands (check, convert) register themselves here: fn(subparsers) -> None
_EXTRA: list[Callable] = []


def _load_extra() -> None:
    from . import cli_plans  # noqa: F401  (registers check/convert)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshplan`` console script and ``python -m meshplan``."""
    try:
        try:
            _load_extra()
        except ImportError:
            pass
        args = _build_parser().parse_args(argv)
        return args.func(args)
    except PlanError as e:
        print(f"meshplan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
