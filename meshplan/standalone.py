"""Axis steps applied on their own, without :func:`meshplan.parallelize`: the public functions that attach their
axis' record themselves (an axis folder never imports the state module; :func:`meshplan.parallelize` attaches the
records when it applies the axes). Today: data parallelism's
:func:`meshplan.data_parallel.fsdp.apply_data_parallel` (its public name and docs live there).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Mapping

from meshplan.errors import PlanError
from meshplan.state import attach_state, parallel_state

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["apply_data_parallel", "data_parallel_state"]


def data_parallel_state(model: "nn.Module") -> Any:
    """The ``data_parallel`` record in ``model``'s :func:`~meshplan.parallel_state`, or None."""
    state = parallel_state(model)
    return state.data_parallel if state is not None else None


def apply_data_parallel(model: "nn.Module", section: Any = None, topology: "Topology | None" = None, *,
                        blocks: Mapping[str, Any] | Any = None) -> "nn.Module":
    """:func:`meshplan.data_parallel.fsdp.apply_data_parallel`: every check, the blocks step unless it ran, the
    wrapping (:func:`meshplan.data_parallel.wrap.wrap`, handed the model's one gradient finaliser), the record
    attached here."""
    from meshplan.axes import AXES, roots
    from meshplan.blocks import apply_blocks
    from meshplan.data_parallel.mode import check_data_parallel, sections
    from meshplan.data_parallel.wrap import wrap
    from meshplan.mesh.topology import current_topology
    section, blocks = sections(section, blocks)
    topology = topology or current_topology()
    if topology is None:
        raise PlanError("apply_data_parallel needs a Topology (meshplan.init / build_mesh, or `with topo:`)")
    state = parallel_state(model)
    if state is not None and state.data_parallel is not None:
        raise PlanError(f"data_parallel was already applied to this {type(model).__name__}")
    resolved = check_data_parallel(model, section, topology)
    if section.ends == "vocab_parallel":  # before the blocks step changes anything
        from meshplan.blocks import block_paths
        from meshplan.data_parallel.ends import vocab_ends_problem
        ran = blocks is None and state is not None and state.blocks is not None
        problem = vocab_ends_problem(model, state.blocks.paths if ran else block_paths(model, blocks),
                                     math.prod(getattr(topology.layout, a) for a in resolved[1] or ()))
        if problem is not None:
            raise PlanError(problem)
    if blocks is not None or state is None or state.blocks is None:
        apply_blocks(model, blocks)
    state = parallel_state(model)
    record = wrap(model, section, topology, resolved, state, state.grad_sync, AXES, roots(model, state))  # the experts over edp first
    attach_state(model, topology=topology, data_parallel=record)
    return model
