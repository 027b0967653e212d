"""FLOPs and compute time. Torch-free.

Two counts:

* **model FLOPs** per token, the convention MFU is reported in (Megatron-LM's and torchtitan's): ``6·N`` for the
  ``N`` matmul parameters a token meets (the output projection included, the embedding not), plus
  ``12·layers·seq·q_width`` for attention scores and values, without halving for the causal mask;
* **executed FLOPs** per microbatch on one rank, what the time is computed from: the rank's share of each matmul
  (forward ×3 with the backward), attention over the causal half (times each axis unit's
  ``costs.attention_share``: a sharded sequence under sliding windows computes the busiest rank's reached
  blocks), a checkpointed block's forward once more;
  op-level checkpointing runs the attention once more, and ``policy: megatron`` (:mod:`meshplan.recompute`)
  also the row-parallel matmuls, the element-wise ops and the launches (it keeps colwise matmul outputs and
  reduced row-parallel outputs only).

Time = matmuls at the cluster's matmul rate (measured by size with ``meshplan profile``, else peak × efficiency)
+ attention at its efficiency (times each axis unit's ``costs.attention_time``: a sharded sequence's blocks and
merges, as measured) + element-wise traffic at memory bandwidth (a profiled cluster: at the ``touch_rate`` a
reference block measured, :mod:`meshplan.profile.block`) + the operator launches. The
whole is scaled by the cluster's ``block_scale``: a profiled reference block's measured time over this price (1 on
a preset). An expert-parallel MoE block is priced on the rank whose experts drew the most tokens
(:func:`~meshplan.solver.moe_costs.expert_imbalance`). The element-wise traffic counts the tensors the block's
element-wise operators read and write, forward and backward (:data:`TOUCHES`, per token in units of the tensor's
width): an eager block touches the residual stream ~90 times (two RMSNorms computed in float32, the residual
adds), its local q/k/v ~60 times (RoPE, the GQA repeat, the layout changes around attention) and the FFN's hidden
~15 times (SwiGLU); fused kernels a third of that.
"""

from __future__ import annotations

from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.moe_costs import expert_imbalance
from meshplan.solver.shape import ModelShape
from meshplan.solver.units import COST_UNITS

__all__ = ["model_flops_per_token", "block_time", "end_time", "touches_per_token", "OPS_PER_BLOCK", "TOUCHES"]

#: operators one block launches, forward and backward (eager PyTorch, the example Llama's block: ~45 forward)
OPS_PER_BLOCK = 135
#: element-wise reads and writes per token and block, forward and backward: (stream, heads, FFN) widths, eager
TOUCHES = (90, 60, 15)


def model_flops_per_token(s: ModelShape, seq: int) -> float:
    """Model FLOPs per token (forward and backward), as MFU is reported."""
    active = s.active_parameters() - s.embedding_params() - s.layers * 2 * s.norm_params() - s.norm_params()
    if s.tied_embeddings:
        active += s.embedding_params()
    return 6 * active + 12 * s.layers * seq * s.q_width


def _matmuls(s: ModelShape, c: Candidate, moe: bool, tokens: float) -> list[tuple[float, float, float]]:
    """``(m, n, k)`` of one block's matmuls on one rank (forward)."""
    t, h = c.tp, s.hidden
    out = [(tokens, s.q_width / t, h), (tokens, 2 * s.kv_width / t, h), (tokens, h, s.q_width / t)]
    if not moe:
        return out + [(tokens, (s.mlp_matrices - 1) * s.ffn / t, h), (tokens, h, s.ffn / t)]
    routed = (tokens if c.etp > 1 else tokens / t) * s.top_k  # rows an ep rank computes: its share of every rank's
    per_expert = routed * expert_imbalance(s, c.ep) / max(s.experts // c.ep, 1)  # on the busiest ep rank
    fe = s.expert_width / c.etp
    experts = [(per_expert, (s.mlp_matrices - 1) * fe, h), (per_expert, h, fe)] * max(s.experts // c.ep, 1)
    shared = [(tokens / t, s.mlp_matrices * s.shared_ffn, h)] if s.shared_ffn else []
    return out + [(tokens / (t if c.etp == 1 else 1), s.experts, h)] + experts + shared


def block_time(s: ModelShape, c: Candidate, tr: Training, cl: Cluster, moe: bool,
               checkpointed: bool) -> tuple[float, float]:
    """``(seconds, executed FLOPs)`` of one block's forward and backward for one microbatch on one rank."""
    tokens = c.rank_tokens(tr.seq)
    passes = 3 + (1 if checkpointed else 0)  # forward + backward (2×), a recompute adds a forward
    mm_time = mm_flops = 0.0
    for i, (m, n, k) in enumerate(_matmuls(s, c, moe, tokens)):
        f = 2 * m * n * k * (passes + (1 if i in _recomputed_matmuls(s, c, moe) else 0))
        if f:
            mm_flops += f
            mm_time += f / cl.matmul_rate((m * n * k) ** (1 / 3), tr.matmul_dtype or tr.dtype)
    attn = 2 * tokens * tr.seq * s.q_width / c.tp  # QK^T and AV over the causal half, this rank's heads
    for axis in COST_UNITS:  # an axis that changes the attention's work (a sharded sequence under sliding windows)
        attn *= axis.costs.attention_share(s, c, tr)
    attn_time = attn / (cl.peak(tr.dtype) * cl.attention_efficiency)
    for axis in COST_UNITS:  # an axis that runs the attention in more, smaller pieces (a sharded sequence's blocks)
        attn_time *= axis.costs.attention_time(s, c, tr, cl)
    attn_passes = passes + (1 if c.op_level else 0)  # op level: attention recomputed
    replay = passes + (1 if c.megatron else 0)  # policy megatron: the element-wise ops and launches once more
    sh = c.tp if tr.sequence_parallel and c.tp > 1 else 1
    ffn = (s.expert_width * s.top_k / c.etp * (1 / c.tp if c.etp == 1 else 1) * expert_imbalance(s, c.ep)) if moe \
        else s.ffn / c.tp
    touched = touches_per_token(s, c.tp, sh, ffn)
    # a measured reference block's rate (meshplan profile), else the bytes at the memory rate of their size
    rate = cl.touch_rate or cl.memory_rate(tokens * s.hidden / sh * tr.act_bytes)
    elementwise = tokens * touched * tr.act_bytes / rate * (replay / 3) / (1 if s.kernels == "eager" else 3)
    launch = cl.block_op_overhead or cl.op_overhead
    seconds = mm_time + attn_time * attn_passes + elementwise + OPS_PER_BLOCK * (replay / 3) * launch
    return seconds * cl.block_scale, mm_flops + attn * attn_passes


def touches_per_token(s: ModelShape, tp: int = 1, sp: int = 1, ffn: float | None = None) -> float:
    """Elements one token's element-wise ops read and write in a block, forward and backward (:data:`TOUCHES`
    weights over the stream, this rank's heads and its FFN width; ``sp``: the stream's sequence-parallel cut)."""
    stream, heads, hidden = TOUCHES
    return stream * s.hidden / sp + heads * s.q_width / tp + hidden * (s.ffn / tp if ffn is None else ffn)


def _recomputed_matmuls(s: ModelShape, c: Candidate, moe: bool) -> tuple[int, ...]:
    """Indices into :func:`_matmuls` of the matmuls ``policy: megatron`` runs again in backward: the row-parallel
    ones (their output is unreduced, :mod:`meshplan.recompute`): the attention output and, in a dense block, the
    FFN's down projection; none without tp (nothing is Partial)."""
    if not c.megatron or c.tp == 1:
        return ()
    return (2,) if moe else (2, 4)


def end_time(s: ModelShape, c: Candidate, tr: Training, cl: Cluster, first: bool, last: bool) -> float:
    """The embedding and the head (output projection and loss) for one microbatch on one rank."""
    tokens = c.rank_tokens(tr.seq)
    out = 0.0
    if last:
        m, n, k = tokens, s.vocab / c.tp, s.hidden
        out += 3 * 2 * m * n * k / cl.matmul_rate((m * n * k) ** (1 / 3), tr.dtype)
        logits = tokens * s.vocab / c.tp * 4
        out += 4 * logits / cl.memory_rate(logits)  # softmax and its gradient in float32
    if first:
        rows = tokens * s.hidden * tr.act_bytes
        out += 3 * rows / cl.memory_rate(rows)
    return out + 20 * (first + last) * cl.op_overhead
