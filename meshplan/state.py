"""ONE record of what meshplan applied to a model: :class:`ParallelState`, on ``model._meshplan_state``.

:func:`meshplan.parallelize` attaches it and each step (tensor parallelism, blocks, data parallelism) records
what it did with :func:`attach_state`; :func:`meshplan.train_step`, clipping and loading read it with
:func:`parallel_state`. No other attribute of the model holds meshplan state. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshplan.mesh.topology import Topology
    from meshplan.plan_file.document import Plan

__all__ = ["ParallelState", "parallel_state", "attach_state", "DATA_AXES"]

_ATTR = "_meshplan_state"
#: mesh keys whose ranks always hold different data (``tp`` joins them in smp's batch mode)
DATA_AXES = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True)
class ParallelState:
    """What meshplan applied to a model; each step replaces the record with its own field set.

    The record fields are typed ``Any``: this module imports no axis (the axes' records are theirs, named below),
    so no import cycle runs through the one record (issue 26).

    Attributes:
        plan: the :class:`~meshplan.Plan` :func:`meshplan.parallelize` applied (None: steps applied one by one).
        topology: the :class:`~meshplan.Topology` the model was parallelized on (None: a bare ``DeviceMesh``).
        tensor_parallel: the :class:`~meshplan.tensor_parallel.apply.TpApplied` of
            :func:`~meshplan.tensor_parallel.apply.apply_tensor_parallel` (torch plan, head counts, grad finaliser,
            RNG, sequence-parallel mode), or None.
        blocks: the :class:`~meshplan.blocks.AppliedBlocks` of the blocks step (section, block paths), or None.
        data_parallel: the :class:`~meshplan.data_parallel.fsdp.DataParallelState` (mode, section), or None.
        pipeline: the :class:`~meshplan.pipeline.stages.PipelineApplied` (this rank's stages, views, schedule),
            or None.
        context_parallel: the :class:`~meshplan.context_parallel.apply.CpApplied` (section, ``cp`` mesh, the
            runtime routing attention), or None.
        expert_parallel: the :class:`~meshplan.expert_parallel.apply.EpApplied` (MoE blocks, expert-sharded
            parameters, the parameters summed over tp), or None.
        gradients: the model's one :class:`~meshplan.gradients.GradFinalizer`, created by
            :func:`meshplan.parallelize` before any axis applies and handed to the axes through this record (tensor
            and expert parallelism track parameters in it, data parallelism re-installs it), or None.
    """

    plan: "Plan | None" = None
    topology: "Topology | None" = None
    tensor_parallel: Any = None
    blocks: Any = None
    data_parallel: Any = None
    pipeline: Any = None
    context_parallel: Any = None
    expert_parallel: Any = None
    gradients: Any = None

    def recompute_contexts(self, inner: Any) -> Any:
        """A checkpoint ``context_fn`` around ``inner`` (a selective policy's, or None) that carries each applied
        axis' per-forward state from a block's forward to its recompute: a record with a
        ``recompute_contexts(inner)`` method wraps it (context parallelism's position rows and documents)."""
        for f in fields(self):
            wrap = getattr(getattr(self, f.name), "recompute_contexts", None)
            if f.name not in ("plan", "topology") and callable(wrap):
                inner = wrap(inner)
        return inner

    @property
    def grad_sync(self) -> Any:
        """The ONE :class:`~meshplan.gradients.GradFinalizer` of the model when it tracks anything: the one
        ``parallelize`` handed to the axes, else the one data parallelism made for DTensor parameters it found
        (tensor parallelism applied outside meshplan), else None."""
        if self.gradients is not None and self.gradients.active:
            return self.gradients
        return self.data_parallel.grad_sync if self.data_parallel is not None else None

    @property
    def sequence_parallel(self) -> bool | str:
        """The plan's ``tensor_parallel.sequence_parallel`` (``"batch"``: tp ranks hold different samples)."""
        return self.tensor_parallel.sequence_parallel if self.tensor_parallel is not None else False

    @property
    def stream_dim(self) -> str | None:
        """The mesh dim the residual stream between blocks is a DTensor over (tensor parallelism's styles applied,
        at tp 1 too: a one-rank DTensor), else None: what the pipeline's stage boundaries convert."""
        return "tp" if self.tensor_parallel is not None else None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh keys whose ranks hold different data: :data:`DATA_AXES`, + ``tp`` in smp's batch mode."""
        return DATA_AXES + (("tp",) if self.sequence_parallel == "batch" else ())


def parallel_state(model: Any) -> ParallelState | None:
    """The :class:`ParallelState` meshplan attached to ``model``, or None (a plain model).

    Args:
        model: an ``nn.Module``.

    Returns:
        The record, or None when meshplan applied nothing to ``model``.

    Example::

        >>> state = meshplan.parallel_state(model)
        >>> state.data_parallel.mode, state.blocks.paths, state.grad_sync
    """
    return getattr(model, _ATTR, None)


def attach_state(model: Any, **fields: Any) -> ParallelState:
    """Record ``fields`` in ``model``'s :class:`ParallelState` (created when it has none); the other fields stay.

    Args:
        model: an ``nn.Module``.
        **fields: :class:`ParallelState` fields.

    Returns:
        The new record (also on the model).

    Raises:
        TypeError: an unknown field.

    Example::

        >>> attach_state(model, plan=plan, topology=topo)
    """
    old = parallel_state(model)
    state = dataclasses.replace(old, **fields) if old is not None else ParallelState(**fields)
    setattr(model, _ATTR, state)
    return state
