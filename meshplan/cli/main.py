"""The ``meshplan`` command: inspect layouts and plans without a GPU.

Exit codes:

* 0: done (``--help`` too);
* 2: bad input: ONE line ``meshplan: error: …`` on stderr (several problems joined
  with ``"; "``), never a traceback;
* 130: interrupted (Ctrl-C): the line ``meshplan: error: interrupted``; 128 + SIGINT,
  the Unix shells' convention.

Sizes are bounded so that bad input fails instead of exhausting memory: every
degree and world size is at most :data:`~meshplan.plan_file.layout.MAX_RANKS` (2**20), and
``meshplan ranks`` prints worlds of at most :data:`meshplan.cli.ranks.MAX_TABLE_RANKS` (2**16) ranks.
"""

from __future__ import annotations

import sys
from typing import Sequence

from meshplan.cli import checkpoints, convert, plans, ranks, solve, train
from meshplan.cli.args import Parser, error_line
from meshplan.errors import PlanError

__all__ = ["main", "build_parser"]


def build_parser() -> Parser:
    """The ``meshplan`` parser: ``ranks``, ``schema``, ``checkpoints`` (torch-free), ``check``, ``convert``,
    ``export``, ``estimate``, ``solve`` and ``profile``."""
    parser = Parser(prog="meshplan", description="Validate and inspect meshplan plans and layouts (no GPU needed).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    ranks.register(sub)
    plans.register(sub)
    convert.register(sub)
    checkpoints.register(sub)
    solve.register(sub)
    train.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshplan`` console script and ``python -m meshplan``."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except PlanError as e:
        print(error_line(str(e)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(error_line("interrupted"), file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
