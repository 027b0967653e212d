"""What an MoE block costs per microbatch beyond its FLOPs and a dense block's ops: the eager expert loop. Torch-free.

An MoE block whose experts run in a Python loop over stacked weights (``examples/moe.py``'s ``GroupedExperts``,
transformers' eager experts: Mixtral, Qwen2-MoE, OLMoE) pays, per microbatch and independent of its tokens:

* **the weight slices' dense gradients** (the dominant part): each local expert indexes its slice ``w[e]`` of each
  stacked weight, and the slice's backward (``select_backward``) writes a zero-filled gradient of the WHOLE stacked
  weight, which autograd then sums in place over the experts. Per stacked weight of ``W`` bytes and ``E`` local
  experts: ``E`` fills (``E·W`` written) and ``E − 1`` in-place adds (``3·(E − 1)·W`` read and written), so
  :func:`expert_grad_bytes` = ``(4E − 3)·W`` over all of the block's expert weights, quadratic in the local
  experts (measured on calibrate.py's MoE, one process, 8 tokens: 15.1 ms per forward and backward with 8 local
  experts vs 1.5 ms with 2; ``aten::fill_`` 81% of the CPU time under the torch profiler). Priced at
  :attr:`~meshplan.solver.cluster.Cluster.expert_grad_rate`, which ``meshplan profile`` measures on this very
  pattern (fresh allocations: on a CPU the pages fault in);
* **the ops**: :data:`MOE_ROUTING_OPS` for the router, top-k, sort, gather and combine and
  :data:`MOE_OPS_PER_EXPERT` per local expert (forward and backward, ``benchmarks/moe_ops.py``: examples/moe.py
  71 + 40 per expert; transformers' Mixtral with eager experts 48 + 55), at the profile's ``op_overhead``, beyond
  the dense block's :data:`~meshplan.solver.compute.OPS_PER_BLOCK` (whose ~20 FFN ops are not subtracted);
* **one host sync** (the routing counts read on the host, ``counts.tolist()``) at ``host_sync_overhead``.

**The routing's imbalance** (:func:`expert_imbalance`, any expert layout, loop or grouped GEMMs): an expert-parallel
step waits at each combine for the rank whose experts drew the most tokens, so the expert matmuls, their
element-wise ops, the received rows and their memory are priced on that rank: the mean times the busiest ep rank's
share of the routed tokens over the mean share, from the model's measured ``expert_loads`` (tokens per expert, a row
per MoE layer and sample batch: the routers' counts, or a run's ``tokens_per_expert`` log). 1 without loads or ep.
calibrate.py's untrained MoE (random router, vocabulary 256) routed its batches 1.09× at ep 2, 1.21× at ep 4 and
1.50× at ep 8 (its worst layer 2.1×); a model trained with a balancing loss is nearer 1.

A preset cluster does not measure the loop (``expert_grad_rate`` 0) and gets no term at all: published GPU runs
use grouped GEMMs (Megatron, torchtitan), which index no weight slices and loop over no experts, so their
predictions do not change; a model shape says the same with ``expert_loop: false``.

Example (calibrate.py's MoE: 8 experts of width 512 over hidden 256, float32, ep 1 then ep 2)::

    >>> from meshplan.solver.shape import ModelShape
    >>> s = ModelShape(layers=4, hidden=256, heads=8, kv_heads=4, ffn=1024, vocab=256, experts=8, top_k=2,
    ...                moe_ffn=512)
    >>> local_experts(s, 1), round(moe_grad_bytes(s, 1, 1, 4) / 2**20, 1)   # 29 x 12 MiB
    (8, 348.0)
    >>> local_experts(s, 2), round(moe_grad_bytes(s, 2, 1, 4) / 2**20, 1)   # 13 x 6 MiB: ep 2 is 4.5x less
    (4, 78.0)
"""

from __future__ import annotations

from meshplan.solver.candidate import Candidate
from meshplan.solver.cluster import Cluster
from meshplan.solver.routing import busiest_share
from meshplan.solver.shape import ModelShape

__all__ = ["MOE_ROUTING_OPS", "MOE_OPS_PER_EXPERT", "MOE_HOST_SYNCS", "local_experts", "expert_grad_bytes",
           "moe_grad_bytes", "moe_block_ops", "moe_block_time", "expert_imbalance"]

#: ops of one MoE block's router, top-k, sort, gather and combine per microbatch, forward and backward
#: (examples/moe.py, counted by ``benchmarks/moe_ops.py``)
MOE_ROUTING_OPS = 71
#: ops per local expert per microbatch, forward and backward: three weight slices, their transposes and matmuls,
#: the SwiGLU, the split rows, and their backward (examples/moe.py: 40; transformers' eager Mixtral: 55)
MOE_OPS_PER_EXPERT = 40
#: host syncs of one MoE block per microbatch: the routing counts read on the host (``counts.tolist()``)
MOE_HOST_SYNCS = 1


def local_experts(s: ModelShape, ep: int) -> int:
    """Experts one expert-parallel rank holds and loops over."""
    return max(s.experts // max(ep, 1), 1)


def expert_imbalance(s: ModelShape, ep: int) -> float:
    """The busiest of ``ep`` expert-parallel ranks' routed tokens over the mean rank's, averaged over the rows of
    :attr:`~meshplan.solver.shape.ModelShape.expert_loads` (an MoE layer on a sample batch each; each rank holds a
    contiguous run of ``experts / ep`` experts, as expert parallelism shards them); 1 without loads or with ``ep``
    1 (:func:`meshplan.solver.routing.busiest_share`).

    Example::

        >>> s = ModelShape(layers=2, hidden=8, heads=2, kv_heads=2, ffn=8, vocab=8, experts=4, top_k=1,
        ...                expert_loads=((20, 10, 10, 0), (10, 10, 10, 10)))
        >>> expert_imbalance(s, 2), expert_imbalance(s, 4), expert_imbalance(s, 1)   # layer 1: 30 vs 10, 20 vs 10
        (1.25, 1.5, 1.0)
    """
    return busiest_share(s.expert_loads, s.experts, ep)


def expert_grad_bytes(experts: int, stacked_bytes: float) -> float:
    """Bytes the weight slices' backward moves for stacked weights of ``stacked_bytes`` in all (the experts' weights
    of one block, summed over the stacked tensors) looped over by ``experts`` experts: ``(4·experts − 3)·bytes``
    (a zero-filled whole-weight gradient per slice, then ``experts − 1`` in-place adds: read 2, write 1)."""
    return (4 * experts - 3) * stacked_bytes


def moe_grad_bytes(s: ModelShape, ep: int, etp: int, nbytes: int) -> float:
    """:func:`expert_grad_bytes` of one MoE block on one rank: its local experts' weights (``etp`` splits each
    expert's width) of ``nbytes`` per element (the compute dtype's: the gradient of the weights the loop read)."""
    e = local_experts(s, ep)
    return expert_grad_bytes(e, e * s.mlp_matrices * s.hidden * s.expert_width / max(etp, 1) * nbytes)


def moe_block_ops(s: ModelShape, ep: int) -> int:
    """Ops one MoE block adds per microbatch beyond a dense block's, forward and backward."""
    return MOE_ROUTING_OPS + MOE_OPS_PER_EXPERT * local_experts(s, ep)


def moe_block_time(s: ModelShape, c: Candidate, nbytes: int, cl: Cluster, checkpointed: bool) -> float:
    """Seconds one MoE block adds per microbatch on one rank of layout ``c``: its weight slices' gradients (of
    ``nbytes`` per element) at the measured ``expert_grad_rate``, its ops at ``op_overhead`` (a checkpointed
    block's forward, a third of them, once more) and its host sync; 0 for a cluster that did not measure the loop
    (a preset: grouped GEMMs, above) or a model whose experts are grouped GEMMs (``expert_loop`` False)."""
    if not (cl.expert_grad_rate > 0 and s.expert_loop):
        return 0.0
    grads = moe_grad_bytes(s, c.ep, c.etp, nbytes) / cl.expert_grad_rate
    ops = moe_block_ops(s, c.ep) * (4 / 3 if checkpointed else 1) * cl.op_overhead
    return grads + ops + MOE_HOST_SYNCS * cl.host_sync_overhead
