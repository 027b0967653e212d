"""The axes that are units, as the solver sees them: each folder's torch-free ``TERMS``
(:class:`~meshplan.axis.AxisTerms`), in :data:`meshplan.axes.AXES`' order.

The solver is part of the spec layer (``docs/house.md``): it never imports the runtime, at any depth, so it
cannot iterate :data:`meshplan.axes.AXES`, whose units' callables import their folders' torch code. This is the
same list, cut at the torch-free half of each unit; ``tests/test_axes.py`` checks that names, order, sections,
cost terms and example plans equal ``AXES``'.
"""

from __future__ import annotations

from meshplan.context_parallel.costs import TERMS as _CONTEXT
from meshplan.data_parallel.costs import TERMS as _DATA
from meshplan.pipeline.costs import TERMS as _PIPELINE
from meshplan.expert_parallel.costs import TERMS as _EXPERT
from meshplan.axis import AxisTerms
from meshplan.tensor_parallel.costs import TERMS as _TENSOR

__all__ = ["UNITS", "COST_UNITS"]

#: parallelize's order (:data:`meshplan.axes.AXES`)
UNITS: tuple[AxisTerms, ...] = (_PIPELINE, _TENSOR, _CONTEXT, _EXPERT, _DATA)
#: the units the solver's per-microbatch loops take (:attr:`~meshplan.axis.AxisTerms.in_solver`)
COST_UNITS: tuple[AxisTerms, ...] = tuple(unit for unit in UNITS if unit.in_solver)
