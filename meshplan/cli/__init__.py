"""The ``meshplan`` command (``meshplan.cli:main``): see :mod:`meshplan.cli.main`.

The subcommands are imported inside :func:`main`, so a Ctrl-C while they load (the first 0.1 s) is the one line
``meshplan: error: interrupted`` and exit 130, not a traceback.
"""

import sys

__all__ = ["main"]


def main(argv=None) -> int:
    """Entry point of the ``meshplan`` console script and ``python -m meshplan`` (:func:`meshplan.cli.main.main`)."""
    try:
        from meshplan.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("meshplan: error: interrupted\n")
        return 130
    return run(argv)
