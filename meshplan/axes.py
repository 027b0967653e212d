"""The ordered parallelism axes that are units (:class:`~meshplan.axis.Axis`), and the loops over them.

:func:`meshplan.parallelize`, ``meshplan check``, :func:`meshplan.train_step`, explain and the solver iterate over
:data:`AXES` instead of naming an axis. Pipeline, context, expert and data parallelism are units so far; tensor
parallelism keeps its own code path (:data:`TP_AT`) until it joins, at its place in parallelize's order (stage split
→ tensor → context → expert → blocks → stages → data: the pipeline first (its apply prunes the model to this rank's
stages, its finish builds them after the blocks section); context parallelism's hooks (root, attention modules) and
expert parallelism's (experts, MoE blocks) touch different modules, and this order keeps ``meshplan check``'s lines
and errors and the solver's sums in the order they had before expert parallelism joined; data parallelism is last:
its ``finish`` wraps FSDP2 after the blocks section and the stages). Torch-free.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.context_parallel.unit import AXIS as _CONTEXT
from meshplan.data_parallel.unit import AXIS as _DATA
from meshplan.expert_parallel.unit import AXIS as _EXPERT
from meshplan.pipeline.unit import AXIS as _PIPELINE

__all__ = ["AXES", "COST_AXES", "check_axes", "prepare_axes", "apply_axes", "finish_axes", "step_runner",
           "shard_batch", "shard_sequence", "report_lines", "opaque_modules", "tp_rules", "TP_AT", "blocks_reason",
           "accumulate", "data_dims"]

#: the axes that are units, in parallelize's order
AXES: tuple[Axis, ...] = (_PIPELINE, _CONTEXT, _EXPERT, _DATA)
#: where in :data:`AXES` parallelize's tensor-parallel step runs until tensor parallelism is a unit (after the
#: pipeline's split, before context parallelism)
TP_AT = 1
#: the axes the solver's per-microbatch loops take (:attr:`~meshplan.axis.Axis.in_solver`)
COST_AXES: tuple[Axis, ...] = tuple(axis for axis in AXES if axis.in_solver)


def _others(axis: Axis, plan: Any) -> tuple:
    """What the data axis' check and prepare get besides the usual (:attr:`~meshplan.axis.Axis.data_axis`): the
    other axes whose sections ``plan`` has."""
    if not axis.data_axis:
        return ()
    return (tuple(a for a in AXES if a is not axis and getattr(plan, a.section, None) is not None),)


def check_axes(model: Any, plan: Any, layout: Any, report: Any) -> None:
    """``meshplan check``: every axis' check of its section against ``layout`` (resolved) and ``model``."""
    for axis in AXES:
        axis.check(model, plan, layout, report, *_others(axis, plan))


def prepare_axes(model: Any, plan: Any, topology: Any) -> dict[str, Any]:
    """``parallelize``'s checks before anything changes: ``{axis name: prepared}`` for the axes it applies (the
    static checks first, then the axes whose prepare rehearses on a throwaway copy:
    :attr:`~meshplan.axis.Axis.rehearses`)."""
    def opaque() -> tuple[str, ...]:  # asked for only by a rehearsal that runs
        return opaque_modules(model, plan)
    # the static checks first, then the axes that rehearse on a throwaway copy (the pipeline's split probe)
    prepared = {axis.name: axis.prepare(model, plan, topology, *_others(axis, plan),
                                        **({"opaque": opaque} if axis.rehearses else {}))
                for axis in sorted(AXES, key=lambda axis: axis.rehearses)}
    return {name: v for name, v in prepared.items() if v is not None}


def apply_axes(model: Any, plan: Any, topology: Any, prepared: dict[str, Any], state: Any,
               attach: Any, axes: tuple[Axis, ...] = AXES) -> bool:
    """Apply the prepared ``axes`` (default: all) in order, each record handed to ``attach(**{state field:
    record})`` (``parallelize`` owns the state module) before the next axis runs; ``state()`` gives the model's
    record so far. Returns whether an applied axis needs the data-parallel step
    (:attr:`~meshplan.axis.Axis.data_parallel`)."""
    data_parallel = False
    for axis in axes:
        if axis.name in prepared:
            attach(**{axis.state_field: axis.apply(model, plan, topology, prepared[axis.name], state())})
            data_parallel = data_parallel or axis.data_parallel(topology.layout)
    return data_parallel


def finish_axes(model: Any, plan: Any, topology: Any, prepared: dict[str, Any], state: Any, attach: Any) -> None:
    """The prepared axes' late phase (:attr:`~meshplan.axis.Axis.finish`), in order, after the ``blocks`` section;
    a record returned is attached as in :func:`apply_axes`."""
    for axis in AXES:
        if axis.name in prepared:
            record = axis.finish(model, plan, topology, prepared[axis.name], state())
            if record is not None:
                attach(**{axis.state_field: record})


def tp_rules(model: Any, rules: dict, state: Any) -> dict:
    """The ``tensor_parallel`` rules to apply to ``model`` once the axes before tensor parallelism applied: each
    axis whose record ``state`` holds keeps its own (:attr:`~meshplan.axis.Axis.tp_rules`)."""
    for axis in AXES:
        record = getattr(state, axis.state_field) if state is not None else None
        if record is not None:
            rules = axis.tp_rules(model, rules, record)
    return rules


def blocks_reason(plan: Any, layout: Any) -> str:
    """Why ``plan`` on the resolved ``layout`` (None: a bare DeviceMesh) needs the blocks for an axis
    (:attr:`~meshplan.axis.Axis.blocks_reason`), or "": the last axis' reason first (data parallelism wraps the
    blocks; an axis that asks it for its gradients names its own reason when nothing else applies it)."""
    return next((why for axis in reversed(AXES) if (why := axis.blocks_reason(plan, layout))), "")


def accumulate(model: Any, state: Any, i: int, n: int) -> None:
    """``train_step``'s knobs for microbatch ``i`` of ``n`` (``i == n``: the defaults back) of every axis whose record
    ``state`` holds (:attr:`~meshplan.axis.Axis.accumulate`)."""
    for axis in AXES:
        if axis.accumulate is not None and state is not None and getattr(state, axis.state_field) is not None:
            axis.accumulate(model, state, i, n)


def data_dims() -> tuple[str, ...]:
    """The mesh dims whose ranks hold different data (:attr:`~meshplan.axis.Axis.data_dims`), in order."""
    return tuple(d for axis in AXES for d in axis.data_dims)


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
