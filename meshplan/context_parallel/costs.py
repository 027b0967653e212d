"""Context parallelism's terms in the solver's cost model (torch-free; :mod:`meshplan.solver` reaches them through
:data:`TERMS` (listed in :data:`meshplan.solver.units.UNITS`), the rest of meshplan through
:data:`meshplan.context_parallel.unit.AXIS`).

* collectives: ``allgather_kv``: one all-gather of K|V per attention forward (again in a recompute) and one
  reduce-scatter of dK|dV per backward, K|V of the whole sequence for this rank's heads; ``ring`` and
  ``torch_ring``: ``cp − 1`` K/V hops per forward (again in a recompute), ``cp − 1`` K/V hops and ``cp`` dK/dV
  hops per backward, each hop ``1/cp`` of the sequence's K/V (``(3·cp − 2)/cp`` of K/V per layer and step against
  all-gather's ``2·(cp − 1)/cp``, but overlapped with the blocks' attention);
* activations: ``allgather_kv`` keeps the gathered K and V of the other ``cp − 1`` shards and the chunked output;
  the rings keep only the local shards (O(S/cp)); the first stage keeps the positions of this rank's tokens
  (16 bytes a token);
* refusals: a sequence the head-tail chunks (then sequence parallelism) cannot split; ``torch_ring`` off CUDA;
* attention work: with sliding windows the ring computes the key blocks a window reaches, all-gather each
  chunk's whole reached span (:func:`cp_attention_share`); attention time: a rank's blocks and merges cost more
  than their FLOPs at the attention rate, by the factor ``meshplan profile`` measured (:func:`cp_attention_time`);
* ``meshplan estimate``'s line: each method's step time and memory at the length, the cheaper named, and with
  windows each method's attention pairs on the busiest rank.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import AxisCosts, AxisTerms
from meshplan.context_parallel.chunks import check_seq_len, method_pairs

__all__ = ["TERMS", "cp_collectives", "cp_block_activations", "cp_first_stage_activations", "cp_sequence_problem",
           "cp_run_problem", "cp_method_line", "cp_attention_share", "cp_attention_time"]


def cp_collectives(s: Any, c: Any, tr: Any, place: Any, pp_rank: int, memo: dict) -> list:
    """The cp collectives of pipeline rank ``pp_rank`` in one step
    (:class:`~meshplan.solver.collectives.Collective`)."""
    from meshplan.solver.terms import Collective
    from meshplan.solver.terms import block_kinds
    g = place.groups["cp"]
    kvw = (s.q_width if s.gqa_repeat else s.kv_width) / c.tp
    kv = 2 * kvw * c.micro_batch * tr.seq * tr.act_bytes  # K|V of the whole sequence, this rank's heads
    kinds = block_kinds(s, c, place, pp_rank, memo)
    blocks, recompute = sum(kinds.values()), sum(n for (_, ckpt), n in kinds.items() if ckpt)
    if tr.cp_method in ("ring", "torch_ring"):
        hop = kv / c.cp
        n = ((c.cp - 1) * (2 * blocks + recompute) + c.cp * blocks) * c.microbatches
        return [Collective("cp", "send", g, hop, n, "ring attention: K/V hops (forward, backward), dK/dV hops")]
    return [Collective("cp", "all_gather", g, kv, (blocks + recompute) * c.microbatches, "K|V (forward)"),
            Collective("cp", "reduce_scatter", g, kv, blocks * c.microbatches, "dK|dV (backward)")]


def cp_block_activations(s: Any, c: Any, tr: Any, kv_width: float) -> float:
    """Bytes per token a block keeps for cp beyond the dense ones: the gathered K and V and the chunked output."""
    if c.cp > 1 and tr.cp_method == "allgather_kv":
        return (2 * kv_width * (c.cp - 1) + s.q_width) / c.tp * tr.act_bytes
    return 0


def cp_first_stage_activations(c: Any) -> float:
    """Bytes per token the first stage keeps for cp: this rank's token positions."""
    return 16 if c.cp > 1 else 0


def cp_sequence_problem(seq: int, cp: int, tp_sequence: int) -> str | None:
    """Why ``seq`` cannot be cut into ``cp`` ranks' head-tail chunks, then ``tp_sequence`` sequence-parallel
    shards (with the lengths that can), or None."""
    return check_seq_len(seq, cp, cp > 1, tp_sequence) if cp > 1 or tp_sequence > 1 else None


def cp_run_problem(c: Any, tr: Any, device: str) -> tuple[str, str] | None:
    """``method: torch_ring`` on a CPU cluster, refused as :func:`meshplan.parallelize` refuses it."""
    if device == "cpu" and tr.cp_method == "torch_ring" and c.cp > 1:
        return "device", ("context_parallel.method: torch_ring runs torch's ring attention, CUDA only in torch "
                          "2.13; method: ring runs on any device")
    return None


def cp_method_line(evaluate: Any, s: Any, c: Any, tr: Any, cl: Any) -> str | None:
    """``meshplan estimate``'s line comparing the cp methods at this sequence length: each one's step time and
    peak memory per rank under the same model (``evaluate``: :func:`meshplan.solver.step.evaluate`), and which is
    cheaper in each; None at cp 1.

    The model counts every cp transfer as exposed (the ring's hops hide behind the blocks' attention when a hop
    takes less than a block's math, which it does not credit), so the ring's time is an upper bound.
    """
    from dataclasses import replace
    if c.cp <= 1:
        return None
    methods = ("allgather_kv", "ring") + (("torch_ring",) if cl.device == "cuda" else ())
    est = {m: evaluate(s, c, replace(tr, cp_method=m), cl) for m in methods}
    usable = cl.memory * cl.usable_memory
    fits = [m for m in methods if est[m].memory.total <= usable]
    fast = min(fits, key=lambda m: est[m].step_time) if fits else "none fits"
    small = min(methods, key=lambda m: est[m].memory.total)
    each = "; ".join(f"{m} {est[m].step_time:.4g} s, {est[m].memory.total / 2 ** 30:.2f} GiB"
                     + ("" if est[m].memory.total <= usable else " (does not fit)") for m in methods)
    return (f"context_parallel.method at seq {tr.seq}, cp {c.cp}: {each} per step and rank -> fastest that fits: "
            f"{fast}; least memory: {small} (ring hops counted as exposed: an upper bound on its time)"
            + _window_clause(s, c, tr))


def _window_clause(s: Any, c: Any, tr: Any) -> str:
    """With sliding windows: each method's attention pairs on the busiest rank in a sliding layer (computed, of
    which kept), which the times above count."""
    if not s.window or s.window >= tr.seq or tr.seq % (2 * c.cp):
        return ""
    pairs = {m: method_pairs(tr.seq, c.cp, True, m, s.window) for m in ("allgather_kv", "ring")}
    kept = pairs["ring"][1]
    layers = f"{s.window_layers} of {s.layers}" if s.window_layers else f"all {s.layers}"
    return (f"; sliding window {s.window} ({layers} layers): attention pairs per row and head on the busiest rank "
            f"in such a layer: allgather_kv {pairs['allgather_kv'][0]:,}, ring {pairs['ring'][0]:,} "
            f"({kept:,} kept)")


def cp_attention_share(s: Any, c: Any, tr: Any) -> float:
    """The busiest cp rank's attention work with the model's sliding windows, per layer on average, as a share of
    the causal half (1.0 without a window or cp): the ring computes the key blocks a window reaches, all-gather
    the whole span of gathered keys each local chunk's window reaches (:func:`~meshplan.context_parallel.chunks.
    method_pairs`, the head-tail layout)."""
    if c.cp <= 1 or not s.window or s.window >= tr.seq or tr.seq % (2 * c.cp):
        return 1.0
    full = method_pairs(tr.seq, c.cp, True, tr.cp_method)[0]
    slid = method_pairs(tr.seq, c.cp, True, tr.cp_method, s.window)[0]
    n = s.window_layers or s.layers
    return (n * slid + (s.layers - n) * full) / (s.layers * full)


def cp_attention_time(s: Any, c: Any, tr: Any, cl: Any) -> float:
    """A cp rank's attention seconds over those of its FLOPs at the attention rate: the profile's measured
    ``sharded_attention`` factor at ``c.cp`` (:mod:`meshplan.context_parallel.profile`) under ``allgather_kv``,
    the method it times; 1 without cp, under a ring (not measured) or on an unprofiled cluster."""
    if c.cp <= 1 or tr.cp_method != "allgather_kv":
        return 1.0
    return cl.sharded_attention_factor(c.cp)


def cp_training(plan: Any) -> dict:
    """The solver's settings the section decides: its method."""
    return {"cp_method": plan.context_parallel.method if plan.context_parallel else "allgather_kv"}


#: the unit as the solver sees it (the same terms as :data:`meshplan.context_parallel.unit.AXIS`)
TERMS = AxisTerms(name="cp", section="context_parallel", training=cp_training, example_plan="plans/llama_cp.yaml",
                  costs=AxisCosts(collectives=cp_collectives, block_activations=cp_block_activations,
                                  first_stage_activations=cp_first_stage_activations,
                                  sequence_problem=cp_sequence_problem, run_problem=cp_run_problem,
                                  estimate_line=cp_method_line, attention_share=cp_attention_share,
                                  attention_time=cp_attention_time, blocking=True))
