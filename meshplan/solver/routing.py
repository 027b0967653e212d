"""The routing's measured load per expert, as the cost model reads it: rows of tokens per expert checked, and the
share of the busiest of the ranks that split the experts between them over the mean rank's
(:func:`meshplan.solver.moe_costs.expert_imbalance` prices it; :attr:`meshplan.solver.shape.ModelShape.expert_loads`
holds the rows). Torch-free.

Example::

    >>> loads = check_loads([[20, 10, 10, 0], [10, 10, 10, 10]], 4)
    >>> busiest_share(loads, 4, 2), busiest_share(loads, 4, 4)   # layer 1: 30 of 40 vs 20, 20 of 40 vs 10
    (1.25, 1.5)
"""

from __future__ import annotations

import functools
import math
from typing import Any

from meshplan.errors import PlanError

__all__ = ["check_loads", "busiest_share"]


def check_loads(value: Any, experts: int) -> tuple[tuple[float, ...], ...]:
    """``value`` (rows of ``experts`` token counts; one row alone may be a flat list) as a tuple of float tuples,
    hashable; ``()`` for none.

    Raises:
        PlanError: not a list, the model has no experts, a row's length is not ``experts``, a count is negative,
            infinite or not a number, or a row sums to 0.
    """
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return ()
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"model shape: expert_loads is a list of rows of token counts per expert; got "
                        f"{type(value).__name__} {value!r}")
    rows = [value] if all(isinstance(v, (int, float)) for v in value) else list(value)
    if not experts or any(not isinstance(r, (list, tuple)) or len(r) != experts for r in rows):
        raise PlanError(f"model shape: expert_loads holds rows of experts({experts}) token counts (one per MoE layer "
                        f"and sample batch); got {[len(r) if isinstance(r, (list, tuple)) else r for r in rows]} "
                        "counts per row")
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < math.inf for r in rows for v in r) \
            or any(sum(r) <= 0 for r in rows):
        raise PlanError(f"model shape: expert_loads holds token counts per expert, each >= 0 and each row's sum > 0; "
                        f"got {[list(r) for r in rows]}")
    return tuple(tuple(float(v) for v in r) for r in rows)


@functools.lru_cache(maxsize=256)  # the search prices every candidate's blocks, all-to-alls and memory with it
def busiest_share(loads: tuple[tuple[float, ...], ...], experts: int, ranks: int) -> float:
    """The tokens of the busiest of ``ranks`` ranks, each holding a contiguous run of ``experts / ranks`` experts,
    over the mean rank's, averaged over the rows; 1 without rows or with one rank."""
    if ranks <= 1 or not loads:
        return 1.0
    per = max(experts // ranks, 1)
    ratios = []
    for row in loads:
        groups = [sum(row[i:i + per]) for i in range(0, len(row), per)]
        ratios.append(max(groups) / (sum(groups) / len(groups)))
    return sum(ratios) / len(ratios)
