"""What runs besides the FLOPs and the bytes: DTensor dispatch, FSDP2's hooks and a pipeline schedule's actions,
each a count from the layout times a time ``meshplan profile`` measured (:mod:`meshplan.profile.overheads`; a
preset cluster measures none of them: 0). Torch-free.

Counts (recorded on ``examples/llama.py`` with a DTensor dispatch counter, ``tests/test_solver_overheads.py``):

* **DTensor ops** per microbatch on a tensor-parallel rank, by kind (:data:`TP_BLOCK_OPS` per block,
  :data:`TP_END_OPS` for the embedding, final norm, head and loss on the last stage); a block's 7 linears issue
  3 ``mm`` each (forward, input and weight gradients), its layout changes and transposes the ``view`` ops, its
  sequence-parallel norms and residual adds the ``pointwise`` ones;
* **redistributions**: one per tensor-parallel collective of the step (the layout's own collective list), each
  priced at the profile's ``redistribute`` (a DTensor redistribution's time beyond the same plain collective);
* **optimizer DTensor ops**: AdamW's :data:`OPTIMIZER_OPS_PER_TENSOR` pointwise ops per parameter tensor, once
  per step, when the parameters are DTensors (tp, FSDP or ep shards them; DDP's ``replicate`` replicates them);
* **FSDP2 hooks**: one pre/post forward and backward per unit (each block, an MoE block's experts, the root) and
  microbatch, plus their copies into and out of the collectives' buffers per byte of the units' parameters (at
  the gathered dtype); DDP (torch's ``replicate``, built on FSDP2) one unit per root, holding all its parameters;
* **pipeline actions**: a forward and a backward per stage and microbatch (the zero-bubble schedules split the
  backward in two);
* **tensor-parallel style hooks** (:func:`tp_overhead`): the forward pre/post hook calls per microbatch
  (:data:`TP_BLOCK_HOOKS` per block, :data:`TP_END_HOOKS` at the ends), each priced at the profile's
  ``tp_hook_overhead``, and each tensor-parallel collective's ``collective_busy`` (its time beyond the fit when the
  ranks compute between collectives, as in a step) where the profile did not measure ``sync_loss``;
* **the wait at blocking collectives** (:func:`sync_overhead`): each collective of an axis whose collectives sit
  between computes (:attr:`meshplan.axis.AxisCosts.blocking`) ends a segment of the microbatch's compute at the
  slowest rank of its group, priced at the profile's ``sync_loss`` for that group size and segment length.
"""

from __future__ import annotations

import math

from meshplan.plan_file.stages import SPLIT_BACKWARD
from meshplan.solver.candidate import Candidate
from meshplan.solver.cluster import Cluster
from meshplan.solver.placement import Placement
from meshplan.solver.shape import ModelShape
from meshplan.solver.terms import block_kinds

__all__ = ["DTENSOR_KINDS", "TP_BLOCK_OPS", "TP_END_OPS", "OPTIMIZER_OPS_PER_TENSOR", "dtensor_ops",
           "pipeline_actions", "replicate_units", "microbatch_overhead", "step_overhead", "TP_BLOCK_HOOKS",
           "TP_END_HOOKS", "tp_hooks", "tp_overhead", "sync_loss", "sync_overhead"]

#: the DTensor op kinds the model counts and the profile times
DTENSOR_KINDS = ("mm", "view", "pointwise")
#: DTensor ops of one tensor-parallel block per microbatch, forward and backward
TP_BLOCK_OPS = {"mm": 21, "view": 94, "pointwise": 47}
#: DTensor ops of the ends (embedding, final norm, head, loss) per microbatch, forward and backward
TP_END_OPS = {"mm": 3, "view": 16, "pointwise": 20}
#: forward hook calls of one tensor-parallel block per microbatch (recorded on examples/llama.py under
#: plans/llama.yaml: 11 styled modules, the attention and feed-forward conversions and the two dropouts' norm styles
#: holding two hooks of each kind: 34 of 144 per step over 4 blocks, benchmarks/tp_residual.py)
TP_BLOCK_HOOKS = 34
#: forward hook calls at the ends per microbatch: ``(first stage: the root and the embedding, last stage: the
#: final norm and the head)``
TP_END_HOOKS = (4, 4)
#: AdamW's ops per DTensor parameter per step (two mul_, lerp_, addcmul_, sqrt, div, add_, addcdiv_)
OPTIMIZER_OPS_PER_TENSOR = 8


def dtensor_ops(s: ModelShape, c: Candidate, place: Placement, pp_rank: int, memo: dict | None = None) -> dict:
    """DTensor ops per microbatch of pipeline rank ``pp_rank``, by kind (none without tensor parallelism)."""
    if c.tp == 1:
        return {k: 0 for k in DTENSOR_KINDS}
    blocks = sum(block_kinds(s, c, place, pp_rank, memo).values())
    last = place.ends_of(pp_rank)[1]
    return {k: blocks * TP_BLOCK_OPS[k] + (TP_END_OPS[k] if last else 0) for k in DTENSOR_KINDS}


def params_are_dtensors(c: Candidate, fsdp: bool) -> bool:
    """Whether the optimizer steps DTensors: tensor, expert or any data parallelism (FSDP2, HSDP, and DDP: torch's
    ``replicate`` is built on FSDP2 and leaves ``Replicate`` DTensor parameters)."""
    return c.tp > 1 or c.ep > 1 or fsdp or c.mode == "ddp"


def replicate_units(c: Candidate) -> int:
    """FSDP2 units of ``data_parallel`` mode ddp (``replicate`` on FSDP2: one unit per root, each virtual stage of
    a pipeline rank); 0 in any other mode (FSDP's units are counted by their shards)."""
    return (c.vpp if c.pp > 1 else 1) if c.mode == "ddp" else 0


def pipeline_actions(c: Candidate) -> int:
    """Forward and backward actions one pipeline rank runs per step."""
    if c.pp == 1 or c.schedule is None:
        return 0
    backward = 2 if c.schedule in SPLIT_BACKWARD else 1
    return c.vpp * c.microbatches * (1 + backward)


def microbatch_overhead(s: ModelShape, c: Candidate, cl: Cluster, place: Placement, pp_rank: int, units: int,
                        memo: dict | None = None, redistributions: float = 0.0, unit_bytes: float = 0.0) -> float:
    """Seconds per microbatch on pipeline rank ``pp_rank``: its DTensor ops, its ``redistributions`` (the
    tensor-parallel collectives: each one's DTensor planning and wrapping beyond its bytes) and the hooks of its
    ``units`` FSDP units holding ``unit_bytes`` of parameters unsharded (0 without FSDP)."""
    ops = dtensor_ops(s, c, place, pp_rank, memo)
    dispatch = sum(n * cl.dtensor_overheads.get(k, 0.0) for k, n in ops.items())
    fsdp = units * cl.fsdp_unit_overhead + unit_bytes * cl.fsdp_byte_overhead
    return dispatch + redistributions * cl.dtensor_overheads.get("redistribute", 0.0) + fsdp


def step_overhead(c: Candidate, cl: Cluster, tensors: int, fsdp: bool) -> dict[str, float]:
    """Seconds per step: the optimizer's DTensor ops over ``tensors`` local parameter tensors and the pipeline
    schedule's actions."""
    opt = OPTIMIZER_OPS_PER_TENSOR * tensors * cl.dtensor_overheads.get("pointwise", 0.0)
    return {"optimizer_dispatch": opt if params_are_dtensors(c, fsdp) else 0.0,
            "pp_actions": pipeline_actions(c) * cl.pipeline_action_overhead}


def tp_hooks(s: ModelShape, c: Candidate, place: Placement, pp_rank: int, memo: dict | None = None) -> int:
    """Tensor-parallel style hook calls per microbatch on pipeline rank ``pp_rank`` (none without tensor
    parallelism)."""
    if c.tp == 1:
        return 0
    first, last = place.ends_of(pp_rank)
    blocks = sum(block_kinds(s, c, place, pp_rank, memo).values())
    return blocks * TP_BLOCK_HOOKS + TP_END_HOOKS[0] * bool(first) + TP_END_HOOKS[1] * bool(last)


def tp_overhead(s: ModelShape, c: Candidate, cl: Cluster, place: Placement, pp_rank: int, collectives: float,
                memo: dict | None = None) -> float:
    """Seconds per microbatch on pipeline rank ``pp_rank`` of its style hooks and of its ``collectives``
    tensor-parallel collectives' time beyond their fits between computes (0 on a cluster that measured neither)."""
    hooks = tp_hooks(s, c, place, pp_rank, memo)  # the collectives' wait: sync_overhead where it is measured
    return hooks * cl.tp_hook_overhead + (0.0 if cl.sync_loss else collectives * cl.collective_busy)


def sync_loss(cl: Cluster, group: int, segment: float) -> float:
    """Seconds a blocking collective over ``group`` ranks costs beyond its fit after ``segment`` seconds of compute:
    the measured group size nearest ``group`` (in ratio; a larger one on a tie), linear in the segment between
    its measured points and proportional to it beyond them (0 where nothing was measured).

    Example::

        >>> cl = Cluster(..., sync_loss=((2, 0.01, 0.001), (2, 0.04, 0.006)))
        >>> sync_loss(cl, 2, 0.02), sync_loss(cl, 2, 0.08), sync_loss(cl, 4, 0.005)
        (0.0026..., 0.012, 0.0005)
    """
    if group <= 1 or not cl.sync_loss or segment <= 0:
        return 0.0
    near = min({g for g, _, _ in cl.sync_loss}, key=lambda g: (abs(math.log(g / group)), -g))
    pts = sorted((t, x) for g, t, x in cl.sync_loss if g == near)
    if segment <= pts[0][0] or len(pts) == 1:
        (t, x) = pts[0] if segment <= pts[0][0] else pts[-1]
        return x * segment / t
    for (t0, x0), (t1, x1) in zip(pts, pts[1:]):
        if segment <= t1:
            return x0 + (segment - t0) / (t1 - t0) * (x1 - x0)
    return pts[-1][1] * segment / pts[-1][0]


def sync_overhead(colls: list, blocking: tuple[str, ...], compute: float, microbatches: int, cl: Cluster) -> float:
    """Seconds per microbatch the blocking collectives of ``colls`` (those of the ``blocking`` axes, a step's
    worth over ``microbatches``) cost beyond their fits: each ends a segment of the microbatch's ``compute``
    seconds, split evenly between them, and costs :func:`sync_loss` for its group."""
    mine = [x for x in colls if x.axis in blocking and x.group.size > 1]
    calls = sum(x.count for x in mine) / microbatches
    if not calls or not cl.sync_loss:
        return 0.0
    segment = compute / calls
    return sum(x.count / microbatches * sync_loss(cl, x.group.size, segment) for x in mine)
