"""The ``data_parallel`` plan section: FSDP2 / HSDP / replication (public entry points).

:func:`apply_data_parallel` runs after tensor parallelism and the blocks step (:func:`meshplan.blocks.apply_blocks`:
activation checkpointing, ``torch.compile`` per block), in torchtitan's order: FSDP2 ``fully_shard`` on each block,
then on the embedding and the [final norm, head] as units of their own (:mod:`.ends`), then on the root. The mode
follows the layout (``dp_shard``/``dp_replicate`` and the sequence ranks) unless the section's ``mode`` says
otherwise. Gradients are SUMMED over the data axes by default: meshplan's loss is normalised by the global
token count (see :mod:`meshplan.training.step`).

The unit lives in :mod:`.unit` (:func:`meshplan.parallelize` resolves it in ``prepare`` and wraps in ``finish``),
the resolution and checks in :mod:`.mode` (torch-free), the wrapping in :mod:`.wrap`. This module keeps the public
names; :func:`apply_data_parallel` used on its own attaches its record through :mod:`meshplan.standalone` (this
folder never touches the state module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from meshplan.data_parallel.mode import (DataParallelState, check_data_parallel, check_layout,
                                         data_parallel_problem, resolve_mode)
from meshplan.plan_file.blocks import Blocks
from meshplan.plan_file.data_parallel import DataParallel

if TYPE_CHECKING:
    import torch.nn as nn
    from meshplan.mesh.topology import Topology

__all__ = ["DataParallelState", "apply_data_parallel", "check_data_parallel", "check_layout", "resolve_mode",
           "data_parallel_problem", "data_parallel_state"]


def data_parallel_state(model: "nn.Module") -> DataParallelState | None:
    """The :class:`DataParallelState` in ``model``'s :func:`~meshplan.parallel_state`, or None."""
    from meshplan.standalone import data_parallel_state as read
    return read(model)


def apply_data_parallel(model: "nn.Module", section: DataParallel | Mapping[str, Any] | None = None,
                        topology: "Topology | None" = None, *,
                        blocks: Blocks | Mapping[str, Any] | None = None) -> "nn.Module":
    """Apply the ``data_parallel`` section to ``model`` in place (after tensor parallelism).

    The blocks step (:func:`meshplan.blocks.apply_blocks`) runs first unless it ran already (as in
    :func:`meshplan.parallelize`); FSDP2 then shards each of its blocks, its embedding and [final norm, head]
    units (:mod:`.ends`), then the root. Whether tp ranks hold
    different data (smp's ``sequence_parallel: batch``) is read from the model's :func:`~meshplan.parallel_state`.

    Args:
        model: the (tensor-parallel) model.
        section: a :class:`DataParallel`, its dict, or None (defaults from the layout). A dict in the old
            spelling (with ``blocks``/``activation_checkpointing``/``compile``) still works, with a
            ``FutureWarning``: pass those as ``blocks=``.
        topology: the :class:`~meshplan.Topology`; default: the active one.
        blocks: the ``blocks`` section (a :class:`~meshplan.plan_file.blocks.Blocks` or its dict) when the blocks
            step has not run; default ``layers.*`` with neither checkpointing nor compile.

    Returns:
        ``model``, with FSDP2/HSDP/replicate applied and recorded in its :class:`~meshplan.state.ParallelState`.

    Raises:
        PlanError: an invalid section, a mode that does not fit the layout, a blocks pattern that matches
            nothing, an unknown checkpoint op, CPU offload without an accelerator, a bad
            ``reshard_after_forward``, both spellings of the blocks, or data parallelism applied already.

    Example::

        with meshplan.init({"dp_shard": 4}) as topo:
            model = apply_data_parallel(build(args), {"param_dtype": "bfloat16"}, topo,
                                        blocks={"activation_checkpointing": {"mode": "full"}})
    """
    from meshplan.standalone import apply_data_parallel as apply
    return apply(model, section, topology, blocks=blocks)
