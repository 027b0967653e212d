"""Op-level checkpointing policies of the ``blocks`` section (``activation_checkpointing: {mode: selective, …}``).

``ops: [...]`` keeps the outputs of the listed ops. ``policy: megatron`` keeps what Megatron-LM's selective
recomputation keeps sharded (Korthikanti et al. 2022: the attention core recomputed, the rest kept sharded over
the sequence or the heads), and less:

* kept: the outputs of matmuls (``aten.mm``, ``aten.addmm``, ``aten._grouped_mm``) whose output is not a
  :class:`~torch.distributed.tensor.Partial` DTensor: the colwise projections (q, k, v, the FFN's up/gate), this
  rank's heads or FFN columns;
* kept: the reduced row-parallel outputs: ``_c10d_functional.reduce_scatter_tensor`` (sequence parallel: this
  rank's sequence share), ``all_reduce`` (without it) and ``all_to_all_single`` (routed tokens), so the recompute
  repeats no reduction;
* recomputed: everything else, the attention core (``bmm``, softmax, dropout, fused SDPA), the row-parallel
  matmuls (their unreduced output is the whole sequence: keeping it does not shrink with tp), norms, activations,
  dropout and the all-gathers of the block inputs.

Per layer of Megatron's GPT with sequence parallelism that is ``20·s·b·h/t`` bytes (block input 2, q|k|v 6,
fc1 8, two reduced outputs 4) against the paper's ``34·s·b·h/t`` (``benchmarks/memory.py`` measures it); the
price is the forward of the row-parallel matmuls and of the element-wise ops once more in backward, and one
all-gather per block input (:mod:`meshplan.solver.compute`, :mod:`meshplan.tensor_parallel.costs`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from meshplan.errors import PlanError

__all__ = ["MATMULS", "REDUCTIONS", "context_fn", "megatron_policy"]

#: matmuls whose output is kept unless it is an unreduced (Partial) row-parallel output (``namespace::name``)
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::_grouped_mm"})
#: collectives whose (reduced, sharded) output is kept
REDUCTIONS = frozenset({"_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_reduce",
                        "_c10d_functional::all_to_all_single"})


def _partial(out: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(out, DTensor) and any(p.is_partial() for p in out.placements)


def megatron_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``policy: megatron`` decision for one op (torch's selective-checkpoint policy signature: called after
    the op ran, ``ctx.op_output`` its output).

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for a colwise matmul or a reduction, else ``PREFER_RECOMPUTE``.
    """
    from torch.utils.checkpoint import CheckpointPolicy
    name = func.name().split(".")[0]
    if name in REDUCTIONS or (name in MATMULS and not _partial(ctx.op_output)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(ops: list, policy: str | None) -> Callable | None:
    """The ``context_fn`` of a checkpointed block: selective contexts keeping ``ops``' outputs or following the
    named ``policy``; None for plain (full) recomputation.

    Raises:
        PlanError: an unknown policy name (the plan model admits ``megatron`` only).
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    if policy is None:
        return partial(create_selective_checkpoint_contexts, ops) if ops else None
    if policy != "megatron":
        raise PlanError(f"blocks.activation_checkpointing.policy: {policy!r} is not a policy; expected megatron")
    return partial(create_selective_checkpoint_contexts, megatron_policy)
