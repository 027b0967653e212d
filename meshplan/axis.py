"""The shape of a parallelism axis as a unit: :class:`Axis`, one frozen value each axis folder exports.

An axis folder (every axis: :data:`meshplan.axes.AXES`) says
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

__all__ = ["Axis", "AxisCosts", "AxisTerms", "TpExempt"]


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
        per_microbatch: whether its collectives are exposed in each microbatch (inside the pipeline's compute);
            False: they are the axis' own exposed time (:attr:`exposed`). Default True.
        exposed: ``(collectives, cluster, candidate) -> float``: seconds of its collectives not hidden behind
            compute, an estimate part of its own (the pipeline's sends); None: none. Default None.
        stretch: ``(candidate, oversubscription) -> float``: how much the axis stretches a rank's busy time to the
            step (the pipeline's bubble) on a host running ``oversubscription`` ranks per core. Default 1.
        in_flight: ``(candidate, pp_rank) -> float``: microbatches' worth of activations a rank keeps at once (a
            pipeline schedule's). Default 1.
        step_collectives: ``(candidate, training, placement, units) -> [Collective]``, or None: what the axis issues
            once per step over the parameter units of one pipeline rank (``(kind, parameters, shard degree,
            count)``; data parallelism's gradient reduction), after the per-microbatch terms.
        estimate_line: ``(evaluate, shape, candidate, training, cluster) -> str | None``, or None: a line
            ``meshplan estimate`` adds (which of its methods is cheaper at this length, say).
        attention_share: ``(shape, candidate, training) -> float``: the busiest rank's attention work as a share
            of the causal half the compute model counts (a sharded sequence under sliding windows). Default 1.
        attention_time: ``(shape, candidate, training, cluster) -> float``: the busiest rank's attention seconds
            over those of its FLOPs at the cluster's attention rate (a sharded sequence's smaller blocks and
            merges, as the profile measured them). Default 1.
        blocking: whether its collectives sit between computes, every rank of the group waiting for the slowest
            to arrive (tensor parallelism's, say; not the gradient reductions, prefetched and overlapped): each is
            charged the profile's ``sync_loss`` (:func:`meshplan.solver.overheads.sync_overhead`). Default False.
    """

    collectives: Callable[..., list]
    block_activations: Callable[..., float]
    first_stage_activations: Callable[[Any], float]
    sequence_problem: Callable[[int, int, int], "str | None"]
    run_problem: Callable[[Any, Any, str], "tuple[str, str] | None"]
    per_microbatch: bool = True
    exposed: "Callable[[list, Any, Any], float] | None" = None
    stretch: Callable[[Any, float], float] = lambda c, o: 1.0
    in_flight: Callable[[Any, int], float] = lambda c, pp_rank: 1.0
    step_collectives: "Callable[[Any, Any, Any, list], list] | None" = None
    estimate_line: "Callable[..., str | None] | None" = None
    attention_share: Callable[[Any, Any, Any], float] = lambda s, c, tr: 1.0
    attention_time: Callable[[Any, Any, Any, Any], float] = lambda s, c, tr, cl: 1.0
    blocking: bool = False


@dataclass(frozen=True)
class TpExempt:
    """Modules an axis shards itself, which tensor parallelism leaves whole (``meshplan check``'s totals).

    Attributes:
        modules: their paths; a parameter of one counts ``1/degree`` per rank, and is not listed as unsharded when
            ``degree`` > 1.
        degree: how many ways the axis shards them.
        regions: path prefixes (ending in ``"."``) of the axis' regions, whose other parameters tp leaves whole.
        module_reason: why a parameter of ``modules`` is unsharded (``degree`` 1).
        region_reason: why a parameter inside ``regions`` is unsharded.
    """

    modules: frozenset[str]
    degree: int
    regions: tuple[str, ...]
    module_reason: str
    region_reason: str

    def reason(self, path: str) -> str | None:
        """Why the parameters of the module at ``path`` stay whole on every tp rank, or None: not the axis'."""
        if path in self.modules:
            return self.module_reason
        if (path + ".").startswith(self.regions):
            return self.region_reason
        return None


@dataclass(frozen=True)
class AxisTerms:
    """An axis unit as the solver sees it: the torch-free half of its :class:`Axis`, which holds it as ``terms``
    (name, section, cost terms, solver settings, example plan), exported by the folder's ``costs.py`` as ``TERMS``
    and listed in :data:`meshplan.solver.units.UNITS`. The solver reads these, never the unit itself, whose
    callables reach the runtime (``tests/test_axes.py`` holds the two lists in step).

    Attributes:
        name: the layout key of its degree. section: its plan key. costs: its :class:`AxisCosts`.
        training: ``(plan) -> {field: value}``: the :class:`~meshplan.solver.candidate.Training` settings its
        section decides. example_plan: a plan file in ``plans/`` with its section, for messages.
        written: ``(candidate, base section) -> section | None``: the section ``meshplan solve --write`` writes
        for a candidate (the pipeline's schedule); None: the section is rules, copied from the base plan.
        in_solver: the solver's per-microbatch loops take it (its degree a ``Candidate`` field); data
        parallelism's collectives run once per step (``costs.step_collectives``), its degrees enumerated apart.
        decides: ``(plan, resolved layout) -> {candidate field: value}``: the
        :class:`~meshplan.solver.candidate.Candidate` fields its section sets when a plan is read as a candidate
        (the pipeline's microbatches and schedule); default: none.
    """

    name: str
    section: str
    costs: AxisCosts
    training: Callable[[Any], dict]
    example_plan: str
    written: "Callable[[Any, Any], Any] | None" = None
    in_solver: bool = True
    decides: Callable[[Any, Any], dict] = lambda plan, layout: {}

    def degree(self, layout: Any) -> int:
        """The axis' degree in ``layout`` (a resolved layout or a solver candidate)."""
        return getattr(layout, self.name)


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
        terms: its torch-free half (:class:`AxisTerms`: cost terms, solver settings, example plan, the section
            ``solve --write`` writes), the folder's ``costs.py`` ``TERMS``, which the solver reads through
            :data:`meshplan.solver.units.UNITS`; :attr:`costs`, :attr:`training`, :attr:`example_plan`,
            :attr:`written` and :attr:`in_solver` read it.
        data_parallel: ``(layout) -> bool``: whether the applied axis needs the data-parallel step even without a
            ``data_parallel`` section (its gradients summed over data ranks of its own).
        opaque: ``(model, plan) -> {module path}``: modules whose forward a rehearsal on a throwaway copy (the
            pipeline split probe, the shadow run) cannot run (data-dependent routing, the axis' own collectives)
            and replaces by :func:`~meshplan.model_copies.stand_in`.
        finish: ``(model, plan, topology, prepared, state) -> record | None``: the axis' late phase, run in order
            after every axis' ``apply`` and the ``blocks`` section (pipeline stages, FSDP2's wrapping); a record
            returned replaces the one ``apply`` returned. Default: nothing.
        run_step: ``(model, state, batch, loss_fn, optimizer, **options) -> StepResult``, or None: the axis takes
            :func:`meshplan.train_step` over when the state holds its record (a pipeline's schedule); ``options``:
            ``topology``, ``max_grad_norm``, ``ignore_index``, ``shard_batch`` (:func:`meshplan.axes.shard_batch`,
            every axis' share of a batch, handed in: a folder never imports the loop over the axes) and ``attach``
            (``attach(**{state field: record})`` attaches a record the step made, returns the state: the pipeline's
            traced stages, made on the first step).
        narrow: ``(model, plan, record) -> plan``: the plan the axes after it apply, once its record is attached (a
            pipeline leaves out the ``tensor_parallel`` rules that name only other stages' modules, which its apply
            pruned). Default: ``plan``.
        rehearses: its ``prepare`` runs a rehearsal on a throwaway copy of the model (the pipeline's split probe)
            and takes ``opaque=``, a callable giving every axis' :attr:`opaque` modules
            (:func:`meshplan.axes.opaque_modules`), called only when the rehearsal runs.
            Default False.
        data_axis: the data-parallel axis (last): its ``check``, ``prepare`` and ``finish`` get one more argument,
            the other axes whose sections the plan has (their :attr:`data_parallel`, :attr:`dtensor` and
            :attr:`data_shard` decide with it), and its ``finish`` gets ``roots=``, the modules it wraps as roots
            (:func:`meshplan.axes.roots`).
        dtensor: its apply makes DTensor parameters (what FSDP2's integer ``reshard_after_forward`` refuses).
        blocks_reason: ``(plan, layout) -> str``: why the axis needs the blocks (``parallelize`` then runs the
            ``blocks`` section even without one; the text a pattern that matches nothing is refused with), or "".
        accumulate: ``(model, state, i, n) -> None``, or None: its knobs for microbatch ``i`` of ``n`` in
            :func:`meshplan.train_step` (``i == n`` restores the defaults), when the state holds its record.
        data_dims: the mesh dims whose ranks hold different data (``train_step`` counts the tokens over them).
        mesh: ``(given) -> mesh``, or None: the axis' own mesh from what ``parallelize`` was given (a Topology or
            a torch ``DeviceMesh``; raises :class:`~meshplan.errors.PlanError` for one it cannot use); when set,
            ``prepare`` gets it in place of the topology, which is None for a bare ``DeviceMesh`` (tensor
            parallelism: a ``DeviceMesh`` with a ``tp`` dim).
        data_shard: ``(model, state, topology, mode, policies, reshard) -> None``, or None: the data axis' wrap
            calls it, when the state holds the axis' record, before it wraps the blocks: the axis wraps the modules
            it shards over a data mesh of its own (the MoE experts, FSDP2 or DDP over ``edp``;
            ``mode``: ``"ddp"`` or an FSDP2 one, ``policies``: FSDP2's ``mp_policy``/``offload_policy``,
            ``reshard``: ``reshard_after_forward``). The data axis wraps too when :attr:`data_parallel` of such an
            axis holds, even in mode ``"none"``.
        tp_exempt: ``(model, plan, summary) -> TpExempt | None``: the modules the axis shards itself, which tensor
            parallelism leaves whole, for ``meshplan check``'s parameter totals (``summary``: the axis' own from
            the report). Default: None.
        token_regions: ``(model, plan) -> {module path}``: the modules the applied axis runs on each tp rank's own
            tokens (the MoE blocks), which tensor parallelism's static checks take as token
            regions (no rules inside, no sequence-parallel norms to list there). Default: none.
        hears_regions: its ``check`` and ``prepare`` take ``token_regions=``, a callable giving every other axis'
            :attr:`token_regions` for the plan (:mod:`meshplan.axes`), called when the checks need them
            (tensor parallelism's static checks). Default False.
        roots: ``(record) -> [module] | None``: the modules that run as their own roots once its record is attached
            (the pipeline's stage views: the data axis wraps each as a root); None (default): the model.
        part: ``(record) -> (what, full keys) | None``: when its record leaves this rank only part of the model
            (the pipeline's stages), how messages name that part (``"pipeline stages [0]"``) and the full model's
            state-dict keys (a full checkpoint holds them; the weight loaders and ``materialize`` ask); None
            (default): the rank holds every module.
        whole: ``(record, model) -> context manager | None``: with :attr:`part`, the full model's structure put
            back for a ``with`` block (the pipeline's other stages as meta modules, when the model was split on
            the meta device), so its initializer walks the one-device module sequence; None (default): none.
        timeline: ``(plan, resolved layout, report, plan name, format) -> drawing | str``, or None: ``meshplan check
            --schedule``'s picture of the axis' section (a :class:`~meshplan.viz.drawing.Drawing` for svg/png, else
            the text): the pipeline's executed schedule.
        graphs: ``(plan) -> str``: the plan key with which its apply leaves graphs where modules were
            (``"pipeline.split: trace"``: no attention module left to route), or "" (default).
        sees_others: its ``check`` and ``prepare`` get the other axes of the plan, as the data axis' do
            (an axis that routes modules asks them for :attr:`graphs`). Default False.
        rank_share: ``(plan, coordinates, sizes, shape, modules) -> dict | None``: what the axis gives one rank,
            for ``check --rank R`` and the model picture (``modules``: the rank's modules of its
            :attr:`tp_exempt`; ``shape``: the model's solver shape or None): ``{text, label, cells, data}``, a
            line, and a strip of ``[label, mine]`` cells under ``label`` (empty: no strip); None (default).
        profile: ``(timed, mean, device, dtype, reference shape) -> dict``: what ``meshplan profile`` measures
            for the axis' cost terms, its JSON keys (:mod:`meshplan.profile.worker`); None (default): nothing.
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
    terms: AxisTerms
    data_parallel: Callable[[Any], bool] = lambda layout: False
    opaque: Callable[[Any, Any], set] = lambda model, plan: set()
    finish: Callable[[Any, Any, Any, Any, Any], Any] = lambda model, plan, topology, prepared, state: None
    run_step: "Callable[..., Any] | None" = None
    narrow: Callable[[Any, Any, Any], Any] = lambda model, plan, record: plan
    rehearses: bool = False
    data_axis: bool = False
    dtensor: bool = False
    blocks_reason: Callable[[Any, Any], str] = lambda plan, layout: ""
    accumulate: "Callable[[Any, Any, int, int], None] | None" = None
    data_dims: tuple[str, ...] = ()
    mesh: "Callable[[Any], Any] | None" = None
    data_shard: "Callable[..., None] | None" = None
    tp_exempt: Callable[[Any, Any, dict], "TpExempt | None"] = lambda model, plan, summary: None
    token_regions: Callable[[Any, Any], set] = lambda model, plan: set()
    hears_regions: bool = False
    roots: Callable[[Any], Any] = lambda record: None
    part: Callable[[Any], Any] = lambda record: None
    whole: Callable[[Any, Any], Any] = lambda record, model: None
    timeline: "Callable[..., Any] | None" = None
    graphs: Callable[[Any], str] = lambda plan: ""
    sees_others: bool = False
    rank_share: Callable[..., Any] = lambda plan, coords, sizes, shape, modules: None
    profile: "Callable[..., dict] | None" = None

    def degree(self, layout: Any) -> int:
        """The axis' degree in ``layout`` (a resolved layout or a solver candidate)."""
        return getattr(layout, self.name)

    @property
    def costs(self) -> AxisCosts:
        """Its terms in the solver's cost model (:attr:`AxisTerms.costs`)."""
        return self.terms.costs

    @property
    def training(self) -> Callable[[Any], dict]:
        """The solver's settings its section decides (:attr:`AxisTerms.training`)."""
        return self.terms.training

    @property
    def example_plan(self) -> str:
        """A plan file in ``plans/`` with its section, for messages."""
        return self.terms.example_plan

    @property
    def written(self) -> "Callable[[Any, Any], Any] | None":
        """The section ``meshplan solve --write`` writes for a candidate (:attr:`AxisTerms.written`)."""
        return self.terms.written

    @property
    def in_solver(self) -> bool:
        """Whether the solver's per-microbatch loops take it (:attr:`AxisTerms.in_solver`)."""
        return self.terms.in_solver
