"""The shape of a parallelism axis as a unit: :class:`Axis`, one frozen value each axis folder exports.

An axis folder (three today, the others join one by one: :data:`meshplan.axes.AXES`) says
everything the rest of meshplan needs to know about it in one :class:`Axis`: its name, its plan section, its mesh
dims, its check, its apply (returning a frozen record that :func:`meshplan.parallelize` alone attaches to the
model's :class:`~meshplan.state.ParallelState`), its share of a batch for :func:`meshplan.train_step`, its report
lines and its cost terms for ``meshplan estimate``/``solve``. :mod:`meshplan.axes` holds the ordered list that
``parallelize``, ``check``, ``train_step``, explain and the solver iterate over. Torch-free: the callables import
their folder's torch code when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Axis", "AxisCosts"]


@dataclass(frozen=True)
class AxisCosts:
    """An axis' terms in the solver's cost model (torch-free; each takes the solver's own values).

    Attributes:
        collectives: ``(shape, candidate, training, placement, pp_rank, memo) -> [Collective]``: what the axis
            issues in one step of the ranks at stage position ``pp_rank``, called when the axis' degree is above 1.
        block_activations: ``(shape, candidate, training, kv_width) -> float``: bytes per token a (not
            checkpointed) block keeps beyond the dense ones (``kv_width``: the K/V width attention stores).
        first_stage_activations: ``(candidate) -> float``: bytes per token the first stage keeps beyond the dense
            ones (the positions the axis builds, say).
        sequence_problem: ``(seq, degree, tp_sequence) -> str | None``: why ``seq`` cannot be split ``degree``
            ways (times tp for sequence parallelism), with the lengths that can; None when it can.
        run_problem: ``(candidate, training, device) -> (key, reason) | None``: why the axis cannot run there.
    """

    collectives: Callable[..., list]
    block_activations: Callable[..., float]
    first_stage_activations: Callable[[Any], float]
    sequence_problem: Callable[[int, int, int], "str | None"]
    run_problem: Callable[[Any, Any, str], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Axis:
    """One parallelism axis, end to end.

    Attributes:
        name: the layout key and mesh dim of its degree.
        section: the plan key of its section.
        title: how messages name it.
        mesh_dims: the :class:`~meshplan.mesh.topology.Topology` dims it runs over.
        state_field: the :class:`~meshplan.state.ParallelState` field ``parallelize`` attaches its record to.
        report_key: the :class:`~meshplan.checks.report.Report` field its check summary goes in.
        check: ``(model, plan, layout, report) -> None``: ``meshplan check``'s static check and resolution, errors,
            warnings and the summary into ``report`` (the same functions ``prepare`` runs).
        prepare: ``(model, plan, topology) -> Any``: ``parallelize``'s check before anything changes; raises
            :class:`~meshplan.errors.PlanError`; None when the axis is not applied, else what ``apply`` takes.
        apply: ``(model, plan, topology, prepared, state) -> record``: applies the axis and returns its frozen
            record (the axis never touches the state module: ``state`` is the model's record so far, read only,
            handed in by ``parallelize``: the tensor-parallel record and its one gradient finaliser, say).
        shard_batch: ``(state, inputs, targets, shift, ignore_index) -> (inputs, targets, shift)``: this rank's
            share of a batch, called by ``train_step`` when the state holds the axis' record.
        report_lines: ``(summary) -> [str]``: the text report's lines for its summary (none when empty).
        costs: its :class:`AxisCosts`.
        training: ``(plan) -> {field: value}``: the solver's :class:`~meshplan.solver.candidate.Training` settings
            its section decides.
        example_plan: a plan file in ``plans/`` with its section, for messages.
        data_parallel: ``(layout) -> bool``: whether the applied axis needs the data-parallel step even without a
            ``data_parallel`` section (its gradients summed over data ranks of its own).
        opaque: ``(model, plan) -> {module path}``: modules whose forward a rehearsal on a throwaway copy (the
            pipeline split probe, the shadow run) cannot run (data-dependent routing, the axis' own collectives)
            and replaces by :func:`~meshplan.model_copies.stand_in`.
        finish: ``(model, plan, topology, prepared, state) -> record | None``: the axis' late phase, run in order
            after every axis' ``apply`` and the ``blocks`` section (pipeline stages, FSDP2's wrapping); a record
            returned replaces the one ``apply`` returned. Default: nothing.
        run_step: ``(model, state, batch, loss_fn, optimizer, **options) -> StepResult``, or None: the axis takes
            :func:`meshplan.train_step` over when the state holds its record (a pipeline's schedule).
        mesh: ``(given) -> mesh``, or None: the axis' own mesh from what ``parallelize`` was given (a Topology or
            a torch ``DeviceMesh``; raises :class:`~meshplan.errors.PlanError` for one it cannot use); when set,
            ``prepare`` gets it in place of the topology, which is None for a bare ``DeviceMesh`` (tensor
            parallelism: a ``DeviceMesh`` with a ``tp`` dim).
    """

    name: str
    section: str
    title: str
    mesh_dims: tuple[str, ...]
    state_field: str
    report_key: str
    check: Callable[[Any, Any, Any, Any], None]
    prepare: Callable[[Any, Any, Any], Any]
    apply: Callable[[Any, Any, Any, Any, Any], Any]
    shard_batch: Callable[..., tuple]
    report_lines: Callable[[dict], list]
    costs: AxisCosts
    training: Callable[[Any], dict]
    example_plan: str
    data_parallel: Callable[[Any], bool] = lambda layout: False
    opaque: Callable[[Any, Any], set] = lambda model, plan: set()
    finish: Callable[[Any, Any, Any, Any, Any], Any] = lambda model, plan, topology, prepared, state: None
    run_step: "Callable[..., Any] | None" = None
    mesh: "Callable[[Any], Any] | None" = None

    def degree(self, layout: Any) -> int:
        """The axis' degree in ``layout`` (a resolved layout or a solver candidate)."""
        return getattr(layout, self.name)
