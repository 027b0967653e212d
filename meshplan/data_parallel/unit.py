"""Data parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

Last in :data:`meshplan.axes.AXES`: ``prepare`` resolves it (whether it applies, the mode, every check that needs no
model change), ``apply`` checks the parameters the axes before it made (DTensors) before the blocks section changes
the model, and ``finish`` wraps FSDP2/HSDP/DDP after the blocks and the stages (each axis' finish before it),
returning the frozen record :func:`meshplan.parallelize` attaches. Its ``accumulate`` sets FSDP2's knobs per microbatch for ``train_step``.
Torch-free (the solver imports it): each callable imports this folder's torch code when called.
"""

from __future__ import annotations

import math
from typing import Any

from meshplan.axis import Axis
from meshplan.data_parallel.costs import TERMS
from meshplan.data_parallel.mode import check_data_parallel, data_parallel_problem, needed
from meshplan.errors import PlanError
from meshplan.plan_file.data_parallel import DataParallel

__all__ = ["AXIS"]


def _asks(layout: Any, others: tuple) -> tuple[bool, bool]:
    """``(asked, dtensor)``: an axis of the plan needs the data-parallel step; one makes DTensor parameters."""
    return (layout is not None and any(a.data_parallel(layout) for a in others)), any(a.dtensor for a in others)


def _check(model: Any, plan: Any, layout: Any, report: Any, others: tuple = ()) -> None:
    """``meshplan check``: the error :func:`_prepare` raises before anything changes (none: nothing added)."""
    asks = _asks(layout, others)
    problem = data_parallel_problem(plan, layout, *asks)
    if problem is None and model is not None and needed(plan, layout, asks[0]):
        problem = _ends_problem(model, plan, layout)
    if problem is not None:
        report.errors.append(problem)


def _ends_problem(model: Any, plan: Any, layout: Any) -> PlanError | None:
    """``ends: vocab_parallel``'s refusal of the model's ends (:func:`.ends.vocab_ends_problem`), or None."""
    section = plan.data_parallel
    if section is None or section.ends != "vocab_parallel" or layout is None:
        return None
    from meshplan.data_parallel.ends import vocab_ends_problem
    from meshplan.data_parallel.mode import resolve_mode
    from meshplan.plan_file.blocks import Blocks
    from meshplan.plan_file.patterns import match_pattern
    try:
        blocks = match_pattern(model, (plan.blocks or Blocks()).pattern, "blocks")
    except PlanError:  # reported where the blocks are checked (meshplan.blocks.block_paths)
        return None
    _, shard_axes, _ = resolve_mode(section, layout)
    text = vocab_ends_problem(model, blocks, math.prod(getattr(layout, a) for a in shard_axes))
    return PlanError(text) if text else None


def _prepare(model: Any, plan: Any, topology: Any, others: tuple = ()) -> DataParallel | None:
    """The section to apply (the defaults without one), or None when data parallelism does not apply."""
    layout = topology.layout if topology is not None else None
    asked, dtensor = _asks(layout, others)
    if not needed(plan, layout, asked):
        return None
    if topology is None:
        raise PlanError("the data_parallel section needs a meshplan Topology (meshplan.init or build_mesh), not a "
                        "bare DeviceMesh")
    problem = data_parallel_problem(plan, layout, asked, dtensor)
    if problem is not None:
        raise problem
    section = plan.data_parallel or DataParallel()
    check_data_parallel(model, section, topology)  # CPU offload without an accelerator, DTensors already there
    problem = _ends_problem(model, plan, layout)
    if problem is not None:
        raise problem
    return section


def _apply(model: Any, plan: Any, topology: Any, section: DataParallel, state: Any) -> None:
    """The checks again on the parameters the axes before made DTensors, before the blocks section changes the
    model; nothing applied (the record comes from :func:`_finish`)."""
    check_data_parallel(model, section, topology)


def _finish(model: Any, plan: Any, topology: Any, section: DataParallel, state: Any, others: tuple = (),
            roots: Any = None) -> Any:
    """FSDP2/HSDP/DDP on each block, then each root's embedding and head units (:mod:`.ends`) and the root
    (``roots``: handed in by :func:`meshplan.axes.finish_axes`); the model's one gradient finaliser handed to the
    wrapping; ``others``' :attr:`~meshplan.axis.Axis.data_shard` first (the experts over edp)."""
    from meshplan.data_parallel.wrap import wrap
    resolved = check_data_parallel(model, section, topology)
    return wrap(model, section, topology, resolved, state, state.grad_sync, others, roots)


def _accumulate(model: Any, state: Any, i: int, n: int) -> None:
    """FSDP2 knobs for microbatch ``i`` of ``n`` (i == n restores the defaults); nothing for one microbatch."""
    record = state.data_parallel
    if record.mode == "none" or n <= 1:
        return
    sec, last, ddp = record.section, i >= n - 1, record.mode == "ddp"
    keep_fwd = sec.accumulate_unsharded and not ddp and (sec.reshard_after_forward is None
                                                          or isinstance(sec.reshard_after_forward, bool))
    if sec.accumulate_unsharded:
        model.set_requires_gradient_sync(last)
        if not ddp:
            model.set_reshard_after_backward(last)
    model.set_is_last_backward(last)
    if keep_fwd and i == 0:
        model.set_reshard_after_forward(False)  # no re-gather in backward nor in the next microbatch
    if keep_fwd and i == n:
        for path in state.blocks.paths:
            model.get_submodule(path).set_reshard_after_forward(sec.reshard_after_forward is not False,
                                                                recurse=False)
        for unit, kept in record.ends:  # the embedding like a block, the head kept gathered (ends.py)
            unit[0].set_reshard_after_forward(not kept and sec.reshard_after_forward is not False, recurse=False)
        model.set_reshard_after_forward(False, recurse=False)  # torch's root default


def _blocks_reason(plan: Any, layout: Any) -> str:
    """FSDP2 shards each block: over data ranks (dp·cp), or for the section."""
    if layout is not None and layout.dp * layout.cp > 1:
        return f"data parallelism over dp({layout.dp}) x cp({layout.cp}) shards each block"
    return "the data_parallel section shards each block" if plan.data_parallel is not None else ""


def _no_share(state: Any, inputs: Any, targets: Any, shift: bool = False,
              ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """Every data rank takes its own batch: nothing to cut here."""
    return inputs, targets, shift


#: data parallelism: FSDP2/HSDP/DDP over ``dp_replicate × dp_shard`` (× ``cp``: cp ranks hold different tokens)
AXIS = Axis(name="dp", section="data_parallel", title="data parallelism", mesh_dims=("dp_replicate", "dp_shard"),
            state_field="data_parallel", report_key="data", check=_check, prepare=_prepare, apply=_apply,
            shard_batch=_no_share, report_lines=lambda summary: [], terms=TERMS, finish=_finish, data_axis=True,
            blocks_reason=_blocks_reason, accumulate=_accumulate,
            data_dims=("dp_replicate", "dp_shard", "cp"))
