"""The ``blocks`` and ``data_parallel`` sections in ``meshplan check``: the functions :func:`meshplan.parallelize`
runs before it changes the model (:func:`meshplan.blocks.blocks_problem`,
:func:`meshplan.data_parallel.fsdp.data_parallel_problem`), so a plan ``check`` passes finds its blocks and a mode
that fits the layout, dp > 1 included."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["check_data"]


def check_data(model: nn.Module, plan: Any, layout: Any, report: Any) -> None:
    """Add to ``report.errors`` what parallelize would refuse in ``plan``'s blocks and data parallelism on the
    resolved ``layout``."""
    from meshplan.blocks import blocks_problem
    from meshplan.data_parallel.fsdp import data_parallel_problem
    found = [blocks_problem(model, plan, layout, report.source), data_parallel_problem(plan, layout)]
    report.errors += [e for e in found if e is not None]
