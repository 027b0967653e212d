"""The ``blocks`` section in ``meshplan check``: the function :func:`meshplan.parallelize` runs before it changes the
model (:func:`meshplan.blocks.blocks_problem`), so a plan ``check`` passes finds its blocks, dp > 1 included. The
axes' sections are their units' checks (:func:`meshplan.axes.check_axes`)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["check_data"]


def check_data(model: nn.Module, plan: Any, layout: Any, report: Any) -> None:
    """Add to ``report.errors`` what parallelize would refuse in ``plan``'s blocks on the resolved ``layout``, before
    the axes' checks (parallelize's order)."""
    from meshplan.blocks import blocks_problem
    problem = blocks_problem(model, plan, layout, report.source)
    if problem is not None:
        report.errors.append(problem)
