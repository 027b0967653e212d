"""The ``meshplan`` command (``meshplan.cli:main``): see :mod:`meshplan.cli.main`."""

from meshplan.cli.main import main

__all__ = ["main"]
