"""The ``meshplan`` command: inspect layouts and plans without a GPU.

Exit codes:

* 0: done (``--help`` too);
* 2: bad input: ONE line ``meshplan: error: …`` on stderr (several problems joined
  with ``"; "``), never a traceback;
* 130: interrupted (Ctrl-C): the line ``meshplan: error: interrupted``; 128 + SIGINT,
  the Unix shells' convention.

Sizes are bounded so that bad input fails instead of exhausting memory: every
degree and world size is at most :data:`~meshplan.layout.MAX_RANKS` (2**20), and
``meshplan ranks`` prints worlds of at most :data:`MAX_TABLE_RANKS` (2**16) ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from .errors import PlanError

__all__ = ["main", "MAX_TABLE_RANKS"]

#: ``meshplan ranks`` refuses larger worlds: the JSON of 2**16 ranks is 16 MB and takes ~2.5 s on a laptop
#: core; 2**20 ranks would be 280 MB (svg: 1 GB) and take a minute.
MAX_TABLE_RANKS = 1 << 16

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise PlanError(f"{self.prog}: {message}")


def int_arg(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]``; the error names the bound (and ``why``)."""
    def parse(text: str) -> int:
        shown = text if len(text) <= 40 else f"{text[:40]}… ({len(text)} characters)"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {shown!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}]{why}, got {shown}")
        return value
    return parse


def _add_layout_flags(p: argparse.ArgumentParser, world_required: bool, max_world: int | None = None,
                      why: str = " (2**20)") -> None:
    from .layout import MAX_RANKS
    hi = max_world or MAX_RANKS
    p.add_argument("--world-size", type=int_arg(1, hi, why), required=world_required,
                   help=f"number of ranks, 1 to {hi}")
    for name, help_ in [("tp", "tensor parallel"), ("pp", "pipeline parallel"), ("cp", "context parallel"),
                        ("ep", "expert parallel"), ("etp", "expert tensor parallel (default: tp)"),
                        ("vpp", "virtual stages per pp rank"), ("dp-replicate", "dp replicas"),
                        ("dp-shard", "dp sharding degree (-1: inferred)")]:
        lo = -1 if name == "dp-shard" else 1
        p.add_argument(f"--{name}", type=int_arg(lo, MAX_RANKS, " (2**20)"), default=None, help=help_)
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
    _add_layout_flags(r, world_required=True, max_world=MAX_TABLE_RANKS,
                      why=" (2**16: the tables of larger worlds take minutes and gigabytes to print)")
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
        _error(str(e))
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _error(message: str) -> None:
    """The one stderr line of a failure: every run of whitespace (newlines included) becomes one space."""
    print(f"meshplan: error: {' '.join(message.split())}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
