"""Errors meshplan raises for bad user input."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan, layout or model does not fit together.

    The message always says where (plan file, plan key, module path), what was
    found and what was expected, e.g.
    ``tp(3) does not divide world_size(16); valid tp: 1, 2, 4, 8, 16``.
    It is a ``ValueError`` so callers that catch user errors generically keep working.
    """
