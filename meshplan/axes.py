"""The ordered parallelism axes that are units (:class:`~meshplan.axis.Axis`), and the loops over them.

:func:`meshplan.parallelize`, ``meshplan check``, :func:`meshplan.train_step`, explain and the solver iterate over
:data:`AXES` instead of naming an axis. Tensor, context and expert parallelism are units so far; the others keep
their own code paths and join the list one by one, at their place in parallelize's order (stage split → tensor → context →
expert → blocks → stages → data: context parallelism's hooks (root, attention modules) and expert parallelism's
(experts, MoE blocks) touch different modules, and this order keeps ``meshplan check``'s lines and errors and the
solver's sums in the order they had before expert parallelism joined). Torch-free.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.context_parallel.unit import AXIS as _CONTEXT
from meshplan.expert_parallel.unit import AXIS as _EXPERT
from meshplan.tensor_parallel.unit import AXIS as _TENSOR

__all__ = ["AXES", "axis_meshes", "check_axes", "prepare_axes", "apply_axes", "finish_axes", "step_runner", "shard_batch", "shard_sequence", "report_lines",
           "opaque_modules"]

#: the axes that are units, in parallelize's order
AXES: tuple[Axis, ...] = (_TENSOR, _CONTEXT, _EXPERT)


def axis_meshes(given: Any) -> dict[str, Any]:
    """``{axis name: its mesh}`` for the axes with a :attr:`~meshplan.axis.Axis.mesh` of their own, from what
    ``parallelize`` was given (a Topology or a torch ``DeviceMesh``); raises the PlanError of a mesh they refuse."""
    return {axis.name: axis.mesh(given) for axis in AXES if axis.mesh is not None}


def check_axes(model: Any, plan: Any, layout: Any, report: Any) -> None:
    """``meshplan check``: every axis' check of its section against ``layout`` (resolved) and ``model``."""
    for axis in AXES:
        axis.check(model, plan, layout, report)


def prepare_axes(model: Any, plan: Any, topology: Any, meshes: dict[str, Any] | None = None) -> dict[str, Any]:
    """``parallelize``'s checks before anything changes: ``{axis name: prepared}`` for the axes it applies
    (``meshes``: :func:`axis_meshes`, handed to those axes' ``prepare`` in place of the topology)."""
    meshes = meshes or {}
    prepared = {axis.name: axis.prepare(model, plan, meshes.get(axis.name, topology)) for axis in AXES}
    return {name: v for name, v in prepared.items() if v is not None}


def apply_axes(model: Any, plan: Any, topology: Any, prepared: dict[str, Any], state: Any,
               attach: Any) -> bool:
    """Apply the prepared axes in order, each record handed to ``attach(**{state field: record})`` (``parallelize``
    owns the state module) before the next axis runs; ``state()`` gives the model's record so far. Returns whether
    an applied axis needs the data-parallel step (:attr:`~meshplan.axis.Axis.data_parallel`)."""
    data_parallel = False
    for axis in AXES:
        if axis.name in prepared:
            attach(**{axis.state_field: axis.apply(model, plan, topology, prepared[axis.name], state())})
            data_parallel = data_parallel or (topology is not None and axis.data_parallel(topology.layout))
    return data_parallel


def finish_axes(model: Any, plan: Any, topology: Any, prepared: dict[str, Any], state: Any, attach: Any) -> None:
    """The prepared axes' late phase (:attr:`~meshplan.axis.Axis.finish`), in order, after the ``blocks`` section;
    a record returned is attached as in :func:`apply_axes`."""
    for axis in AXES:
        if axis.name in prepared:
            record = axis.finish(model, plan, topology, prepared[axis.name], state())
            if record is not None:
                attach(**{axis.state_field: record})


def step_runner(state: Any) -> Any:
    """The :attr:`~meshplan.axis.Axis.run_step` of the first axis whose record ``state`` holds and that takes the
    step over, else None (``train_step`` runs its own)."""
    for axis in AXES:
        if axis.run_step is not None and state is not None and getattr(state, axis.state_field) is not None:
            return axis.run_step
    return None


def shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """This rank's share of a batch: each axis whose record ``state`` holds takes its share, in order."""
    for axis in AXES:
        if state is not None and getattr(state, axis.state_field) is not None:
            inputs, targets, shift = axis.shard_batch(state, inputs, targets, shift, ignore_index)
    return inputs, targets, shift


def shard_sequence(model: Any, inputs: Any, targets: Any = None) -> tuple[Any, Any]:
    """This rank's share of a batch of whole sequences, for calling a context-parallel model yourself (an eval loop,
    a custom step); :func:`meshplan.train_step` does it for you.

    Args:
        model: a model :func:`meshplan.parallelize` gave a ``context_parallel`` section (else nothing changes).
        inputs: whole sequences: a tensor, tuple or dict, as the model takes them.
        targets: per-token targets (already shifted if the loss does not shift), or None.

    Returns:
        ``(inputs, targets)`` of this cp rank: its head-tail chunks of every sequence-long tensor.

    Raises:
        PlanError: a length the layout cannot split (with valid lengths), or a padding ``attention_mask``.

    Example::

        >>> x, y = meshplan.shard_sequence(model, tokens, labels)
        >>> loss = meshplan.cross_entropy(model(x), y)   # this rank's tokens; sum over cp for the global loss
    """
    from meshplan.state import parallel_state
    state = parallel_state(model)
    if state is None:
        return inputs, targets
    sharded, shard_targets, _ = shard_batch(state, inputs, inputs if targets is None else targets)
    return sharded, (None if targets is None else shard_targets)


def report_lines(report: Any) -> list[str]:
    """The text report's lines of every axis' summary."""
    return [line for axis in AXES for line in axis.report_lines(getattr(report, axis.report_key))]


def opaque_modules(model: Any, plan: Any) -> tuple[str, ...]:
    """The module paths of ``model`` a rehearsal on a throwaway copy replaces by a stand-in (every axis'
    :attr:`~meshplan.axis.Axis.opaque`), sorted."""
    return tuple(sorted({path for axis in AXES for path in axis.opaque(model, plan)}))
