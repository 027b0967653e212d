"""DTensor sharding rule for the CPU fused attention kernel.

On CPU, :func:`torch.nn.functional.scaled_dot_product_attention` with
``dropout_p == 0`` dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``
(forward) and ``aten._scaled_dot_product_flash_attention_for_cpu_backward``
(backward). torch 2.13 ships DTensor sharding strategies for the CUDA kernels
(flash, memory-efficient, cuDNN) but none for these two, so a tensor-parallel
model whose q/k/v reach SDPA as DTensors (``use_local_output=False``) fails on
CPU with::

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
    does not have a sharding strategy registered.

(The forward op is in ``torch._decomp.decomposition_table``, so without a rule
DTensor first tries its decomposition-based propagation: a non-causal forward
is traced through every candidate placement, about a minute on the first call,
a causal one gives up at once, and the backward op has no decomposition, so
training fails either way. A registered strategy is consulted first.)

:func:`register_cpu_attention_rule` registers the same strategies torch uses
for ``aten._scaled_dot_product_flash_attention``: all-Replicate, head-sharded
(``Shard(1)`` of ``(batch, heads, seq, head_dim)``) and batch-sharded
(``Shard(0)``).

.. warning::
    The registration is **process-wide**: it mutates DTensor's global sharding
    propagator (``DTensor._op_dispatcher.sharding_propagator``) and affects
    every DTensor in the process, not only meshplan models. It is idempotent,
    and it never replaces a rule that torch (or anyone else) already registered.

Dropout. CPU SDPA never uses the fused kernel when ``dropout_p > 0`` (the
kernel itself raises ``Currently do not support dropout > 0``); it falls back
to the composite math path, which DTensor sees as ``bmm``/``_safe_softmax``/
``bernoulli_`` etc., so this rule is not involved. On a CPU mesh DTensor has no
RNG tracker (``is_rng_supported_mesh`` is ``False`` and warns), so
``bernoulli_`` draws from each rank's own CPU generator: with the usual equal
seed on every rank, every head shard gets the *same* dropout mask, and the
result differs from single-device dropout. With ``is_causal=True`` the math
path builds a plain-tensor causal mask and fails with ``aten.add.Tensor got
mixed torch.Tensor and DTensor``. Plain local q/k/v (``use_local_output=True``)
run SDPA locally; meshplan gives them per-shard masks (``dropout_rng: per_shard``,
:mod:`meshplan.tensor_parallel.dropout.per_shard`) or the single-device masks (``dropout_rng: single_device``,
:mod:`meshplan.tensor_parallel.dropout.single_device`), which is how dropout inside TP regions should run.

The torch-private DTensor internals this rule needs come from
:mod:`meshplan._torch`, pinned by ``tests/test_torch_private.py`` and
``tests/test_attention_rule.py``.
"""

from __future__ import annotations

import threading

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from meshplan._torch import (
    CPU_FLASH_ATTENTION,
    CPU_FLASH_ATTENTION_BACKWARD,
    OpOverload,
    OpSchema,
    OpStrategy,
    StrategyType,
    expand_to_full_mesh_op_strategy,
    is_tensor_evenly_shardable_on_dim,
    sharding_propagator,
)

__all__ = ["CPU_ATTENTION_OPS", "register_cpu_attention_rule"]

#: The ops this module knows how to shard.
CPU_ATTENTION_OPS = (CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD)

_LOCK = threading.Lock()


def _mask_placement(mask: OpStrategy | None, dim: int) -> list[Placement]:
    """Placement of ``attn_mask`` when q/k/v are sharded on ``dim`` (0 or 1).

    The mask broadcasts against ``(batch, heads, seq, seq)`` from the right, so a
    size-1 or missing leading dim is replicated and a full-size one is sharded.
    """
    if mask is None:
        return []
    mdim = dim - (4 - mask.ndim)
    if mdim >= 0 and mask.shape[mdim] > 1:
        return [Shard(mdim)]
    return [Replicate()]


def _strategies(
    op_schema: OpSchema, n_out: int, n_tensors: int, q_idx: int
) -> StrategyType:
    """Enumerate Replicate / head-sharded / batch-sharded placements and expand them."""
    args = op_schema.args_schema
    q, k = args[q_idx], args[q_idx + 1]
    mask = op_schema.kwargs_schema.get("attn_mask")
    mask = mask if isinstance(mask, OpStrategy) else None
    mesh = op_schema.get_mesh_from_args(validate=False)

    single_dim: list[list[Placement | None]] = [
        [Replicate()] * (n_out + n_tensors + (mask is not None))
    ]
    if q.ndim == 4:
        for dim in (1, 0):
            single_dim.append([Shard(dim)] * (n_out + n_tensors) + _mask_placement(mask, dim))

    gqa = q.shape[1] != k.shape[1]

    def valid(input_specs, output_specs) -> bool:
        # With GQA the local q-heads/kv-heads ratio must equal the global one,
        # which only holds when both head counts shard evenly.
        if not gqa:
            return True
        return all(
            is_tensor_evenly_shardable_on_dim(s.shape, s, 1)
            for s in input_specs[:n_tensors]
            if s.tensor_meta is not None
        )

    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, single_dim, input_index=n_out, is_valid_strategy_cb=valid
    )


def _cpu_flash_fwd_strategy(op_schema: OpSchema) -> StrategyType:
    # (output, logsumexp) <- (query, key, value, [attn_mask])
    return _strategies(op_schema, n_out=2, n_tensors=3, q_idx=0)


def _cpu_flash_bwd_strategy(op_schema: OpSchema) -> StrategyType:
    # (grad_q, grad_k, grad_v) <- (grad_out, q, k, v, out, logsumexp, [attn_mask])
    return _strategies(op_schema, n_out=3, n_tensors=6, q_idx=1)


_RULES = {
    CPU_ATTENTION_OPS[0]: _cpu_flash_fwd_strategy,
    CPU_ATTENTION_OPS[1]: _cpu_flash_bwd_strategy,
}


def _has_rule(propagator, op) -> bool:
    return any(
        op in getattr(propagator, table, {})
        for table in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    )


def register_cpu_attention_rule() -> list[OpOverload]:
    """Register DTensor sharding strategies for the CPU flash-attention ops.

    The registration is **process-wide**: it is stored in DTensor's global
    sharding propagator and applies to every DTensor operation in this process.
    Calling it again is harmless, and an op that already has a rule (for example
    in a later torch release) is left untouched; torch's decomposition-based
    fallback does not count as a rule.

    Strategies registered for ``aten._scaled_dot_product_flash_attention_for_cpu``
    (outputs ``out``, ``logsumexp``) and its ``_backward`` (outputs ``grad_q``,
    ``grad_k``, ``grad_v``), on each mesh dimension:

    * all tensors ``Replicate()``;
    * all tensors ``Shard(1)`` (heads), ``attn_mask`` sharded on its heads dim if
      it has one of full size, else replicated;
    * all tensors ``Shard(0)`` (batch), ``attn_mask`` likewise.

    With GQA (fewer kv heads than q heads) head sharding is offered only when
    both head counts divide evenly; otherwise DTensor falls back to replicating.

    Returns:
        The ops newly registered by this call (empty if there was nothing to do).
    """
    propagator = sharding_propagator()
    added = []
    with _LOCK:
        for op, fn in _RULES.items():
            if not _has_rule(propagator, op):
                propagator.register_op_strategy(op, fn)
                added.append(op)
    return added
