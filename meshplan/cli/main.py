"""The ``meshplan`` command: inspect layouts and plans without a GPU.

Exit codes:

* 0: done (``--help`` and ``--version`` too, and a bare ``meshplan``, which prints the help on stdout, as pip does:
  an error would have to be one line);
* 2: bad input: ONE line ``meshplan: error: …`` on stderr (several problems joined
  with ``"; "``), never a traceback; so is an output that cannot be written (a full disk:
  ``meshplan ranks … > /dev/full``);
* 130: interrupted (Ctrl-C, during the imports too): the line ``meshplan: error: interrupted``; 128 + SIGINT,
  the Unix shells' convention;
* 141: the reader of stdout went away (``meshplan ranks … | head``): nothing printed, the status of a
  coreutils command killed by SIGPIPE (128 + 13).

Sizes are bounded so that bad input fails instead of exhausting memory: every
degree and world size is at most :data:`~meshplan.plan_file.layout.MAX_RANKS` (2**20), and
``meshplan ranks`` prints worlds of at most :data:`meshplan.cli.ranks.MAX_TABLE_RANKS` (2**16) ranks.
Commands that run longer than a second show what they do on a status line when stderr is a terminal
(:mod:`meshplan.cli.progress`).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from meshplan.cli import checkpoints, convert, plans, ranks, solve, train
from meshplan.cli.args import Parser, error_line
from meshplan.cli.progress import Progress
from meshplan.errors import PlanError
from meshplan.version import __version__

__all__ = ["main", "build_parser", "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_BROKEN_PIPE"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def build_parser() -> Parser:
    """The ``meshplan`` parser: ``ranks``, ``schema``, ``checkpoints`` (torch-free), ``check``, ``convert``,
    ``export``, ``estimate``, ``solve`` and ``profile``."""
    parser = Parser(prog="meshplan", description="Validate and inspect meshplan plans and layouts (no GPU needed).",
                    epilog="`meshplan COMMAND --help` describes a command.")
    parser.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    ranks.register(sub)
    plans.register(sub)
    convert.register(sub)
    checkpoints.register(sub)
    solve.register(sub)
    train.register(sub)
    return parser


def _discard_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered cannot fail again when the interpreter exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (captured by a test): nothing to flush at exit
        pass


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stdout)
        return 0
    args = parser.parse_args(argv)
    with Progress(f"meshplan {args.command}") as progress:
        args.progress = progress
        code = args.func(args)
    try:
        sys.stdout.flush()  # a full disk fails here, not in the interpreter's exit
    except BrokenPipeError:
        raise
    except OSError as e:
        _discard_stdout()
        raise PlanError(f"cannot write standard output: {e.strerror or e}") from None
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshplan`` console script and ``python -m meshplan``."""
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    except PlanError as e:
        print(error_line(str(e)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(error_line("interrupted"), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `meshplan ranks … | head`: quiet, as coreutils are
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a write that failed (a full disk), outside write_output's own checks
        if getattr(e, "filename", None) is None:
            _discard_stdout()
        where = e.filename if getattr(e, "filename", None) is not None else "standard output"
        print(error_line(f"cannot write {where}: {e.strerror or e}"), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
