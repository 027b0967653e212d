"""The ordered parallelism axes that are units (:class:`~meshplan.axis.Axis`), and the loops over them.

:func:`meshplan.parallelize`, ``meshplan check``, :func:`meshplan.train_step`, explain and the solver iterate over
:data:`AXES` instead of naming an axis. Every axis is a unit, in parallelize's order: the pipeline first (its apply
prunes the model to this rank's stages, its finish builds them after the blocks section), then tensor parallelism
(the rules the split kept), context parallelism's hooks (root, attention modules) and expert parallelism's (experts,
MoE blocks), which touch different modules (this order keeps ``meshplan check``'s lines and errors and the
solver's sums in the order they had before expert parallelism joined), and data parallelism last: its ``finish``
wraps FSDP2 after the blocks section and the stages. Torch-free.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis
from meshplan.context_parallel.unit import AXIS as _CONTEXT
from meshplan.data_parallel.unit import AXIS as _DATA
from meshplan.expert_parallel.unit import AXIS as _EXPERT
from meshplan.pipeline.unit import AXIS as _PIPELINE
from meshplan.tensor_parallel.unit import AXIS as _TENSOR

__all__ = ["AXES", "COST_AXES", "axis_meshes", "check_axes", "prepare_axes", "apply_axes", "finish_axes",
           "wraps_own_data", "step_runner", "shard_batch", "shard_sequence", "report_lines", "opaque_modules",
           "blocks_reason", "accumulate", "data_dims", "tp_exempt", "roots", "held_part", "held_whole", "timeline"]

#: the axes that are units, in parallelize's order
AXES: tuple[Axis, ...] = (_PIPELINE, _TENSOR, _CONTEXT, _EXPERT, _DATA)
#: the axes the solver's per-microbatch loops take (:attr:`~meshplan.axis.Axis.in_solver`)
COST_AXES: tuple[Axis, ...] = tuple(axis for axis in AXES if axis.in_solver)


def axis_meshes(given: Any) -> dict[str, Any]:
    """``{axis name: its mesh}`` for the axes with a :attr:`~meshplan.axis.Axis.mesh` of their own, from what
    ``parallelize`` was given (a Topology or a torch ``DeviceMesh``); raises the PlanError of a mesh they refuse."""
    return {axis.name: axis.mesh(given) for axis in AXES if axis.mesh is not None}


def _others(axis: Axis, plan: Any) -> tuple:
    """What the data axis' check, prepare and finish get besides the usual (:attr:`~meshplan.axis.Axis.data_axis`;
    check and prepare also for :attr:`~meshplan.axis.Axis.sees_others`): the other axes whose sections ``plan``
    has."""
    if not (axis.data_axis or axis.sees_others):
        return ()
    return (tuple(a for a in AXES if a is not axis and getattr(plan, a.section, None) is not None),)


def _regions(axis: Axis, model: Any, plan: Any) -> dict[str, Any]:
    """``{"token_regions": callable}`` for an axis that hears the others' token regions
    (:attr:`~meshplan.axis.Axis.hears_regions`): every other axis' :attr:`~meshplan.axis.Axis.token_regions`."""
    if not axis.hears_regions:
        return {}

    def token_regions() -> set[str]:  # asked for only by the checks that need them
        return {path for a in AXES if a is not axis for path in a.token_regions(model, plan)}
    return {"token_regions": token_regions}


def check_axes(model: Any, plan: Any, layout: Any, report: Any) -> None:
    """``meshplan check``: every axis' check of its section against ``layout`` (resolved) and ``model``."""
    for axis in AXES:
        axis.check(model, plan, layout, report, *_others(axis, plan), **_regions(axis, model, plan))


def prepare_axes(model: Any, plan: Any, topology: Any, meshes: dict[str, Any] | None = None) -> dict[str, Any]:
    """``parallelize``'s checks before anything changes: ``{axis name: prepared}`` for the axes it applies (the
    static checks first, then the axes whose prepare rehearses on a throwaway copy:
    :attr:`~meshplan.axis.Axis.rehearses`; ``meshes``: :func:`axis_meshes`, handed to those axes' ``prepare`` in
    place of the topology)."""
    meshes = meshes or {}

    def opaque() -> tuple[str, ...]:  # asked for only by a rehearsal that runs
        return opaque_modules(model, plan)
    # the static checks first, then the axes that rehearse on a throwaway copy (the pipeline's split probe)
    prepared = {axis.name: axis.prepare(model, plan, meshes.get(axis.name, topology), *_others(axis, plan),
                                        **({"opaque": opaque} if axis.rehearses else {}), **_regions(axis, model, plan))
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
            record = axis.apply(model, plan, topology, prepared[axis.name], state())
            attach(**{axis.state_field: record})
            plan = axis.narrow(model, plan, record)  # what the next axes apply (a split: its stages' rules)
            data_parallel = data_parallel or (topology is not None and axis.data_parallel(topology.layout))
    return data_parallel


def wraps_own_data(layout: Any) -> bool:
    """Whether an axis that shards modules over a data mesh of its own (:attr:`~meshplan.axis.Axis.data_shard`:
    the experts over ``edp``) needs the data axis' wrap at ``layout`` (a resolved layout) even in mode ``none``
    (:attr:`~meshplan.axis.Axis.data_parallel`)."""
    return any(axis.data_shard is not None and axis.data_parallel(layout) for axis in AXES)


def finish_axes(model: Any, plan: Any, topology: Any, prepared: dict[str, Any], state: Any, attach: Any) -> None:
    """The prepared axes' late phase (:attr:`~meshplan.axis.Axis.finish`), in order, after the ``blocks`` section;
    a record returned is attached as in :func:`apply_axes`."""
    for axis in AXES:
        if axis.name in prepared:
            extra = {"roots": roots(model, state())} if axis.data_axis else {}  # after the earlier finishes
            others = _others(axis, plan) if axis.data_axis else ()
            record = axis.finish(model, plan, topology, prepared[axis.name], state(), *others, **extra)
            if record is not None:
                attach(**{axis.state_field: record})


def blocks_reason(plan: Any, layout: Any) -> str:
    """Why ``plan`` on the resolved ``layout`` (None: a bare DeviceMesh) needs the blocks for an axis
    (:attr:`~meshplan.axis.Axis.blocks_reason`), or "": the last axis' reason first (data parallelism wraps the
    blocks; an axis that asks it for its gradients names its own reason when nothing else applies it)."""
    return next((why for axis in reversed(AXES) if (why := axis.blocks_reason(plan, layout))), "")


def _records(state: Any) -> list[tuple[Axis, Any]]:
    """``(axis, record)`` of every axis whose record ``state`` (a ParallelState or None) holds, in order."""
    return [(axis, r) for axis in AXES if state is not None and (r := getattr(state, axis.state_field)) is not None]


def accumulate(model: Any, state: Any, i: int, n: int) -> None:
    """``train_step``'s knobs for microbatch ``i`` of ``n`` (``i == n``: the defaults back) of every axis whose record
    ``state`` holds (:attr:`~meshplan.axis.Axis.accumulate`)."""
    for axis, _ in _records(state):
        if axis.accumulate is not None:
            axis.accumulate(model, state, i, n)


def data_dims() -> tuple[str, ...]:
    """The mesh dims whose ranks hold different data (:attr:`~meshplan.axis.Axis.data_dims`), in order."""
    return tuple(d for axis in AXES for d in axis.data_dims)


def step_runner(state: Any) -> Any:
    """The :attr:`~meshplan.axis.Axis.run_step` of the first axis whose record ``state`` holds and that takes the
    step over, else None (``train_step`` runs its own)."""
    return next((axis.run_step for axis, _ in _records(state) if axis.run_step is not None), None)


def shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """This rank's share of a batch: each axis whose record ``state`` holds takes its share, in order."""
    for axis, _ in _records(state):
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


def tp_exempt(model: Any, plan: Any, report: Any) -> list[Any]:
    """The :class:`~meshplan.axis.TpExempt` of every axis that shards modules of ``model`` itself
    (:attr:`~meshplan.axis.Axis.tp_exempt`; ``report``: the checked report, each axis reads its own summary)."""
    return [e for axis in AXES if (e := axis.tp_exempt(model, plan, getattr(report, axis.report_key))) is not None]


def roots(model: Any, state: Any) -> list[Any]:
    """The modules that run as their own roots (:attr:`~meshplan.axis.Axis.roots`: the pipeline's stage views,
    which the data axis wraps each as a root), else ``[model]``."""
    return next((list(found) for axis, r in _records(state) if (found := axis.roots(r)) is not None), [model])


def held_part(state: Any) -> "tuple[str, tuple[str, ...]] | None":
    """``(what, full keys)`` when ``state``'s records leave this rank only part of the model
    (:attr:`~meshplan.axis.Axis.part`: the pipeline's stages), else None (it holds every module)."""
    return next((part for axis, r in _records(state) if (part := axis.part(r)) is not None), None)


def held_whole(state: Any, model: Any) -> Any:
    """A context manager putting back the whole model's structure for a ``with`` block when ``state``'s records
    left this rank part of it (:attr:`~meshplan.axis.Axis.whole`), else None."""
    return next((w for axis, r in _records(state) if (w := axis.whole(r, model)) is not None), None)


def timeline(plan: Any, resolved: Any, report: Any, name: str, fmt: str) -> Any:
    """``meshplan check --schedule``: the picture of the first axis with a :attr:`~meshplan.axis.Axis.timeline`
    (the pipeline's executed schedule): a drawing for svg/png, else the text."""
    return next(axis.timeline for axis in AXES if axis.timeline is not None)(plan, resolved, report, name, fmt)
