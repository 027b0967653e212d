"""Per-rank memory of a candidate: parameters, gradients, optimizer state and activations. Torch-free.

Parameters are listed tensor by tensor as meshplan shards them (colwise/rowwise over tp, the vocabulary over tp,
experts over ep and their FFN over etp, norms and routers whole), then FSDP2 cuts dim 0 of each local tensor into
``d`` padded chunks (``ceil(rows / d)`` rows on the rank holding the most; expert tensors whose local experts edp
does not divide: ``1/d`` of an inner dim, :func:`experts_even`): that is the exact local size
``meshplan.parallelize`` gives, so the bytes per rank are exact, not an average.

Activations are the tensors autograd keeps per microbatch, per token (``h`` hidden, ``f`` FFN, ``t`` tp, ``sh``
= t under sequence parallelism else 1, ``β`` the compute dtype's bytes): a dense block keeps
``(2·norm_saved + 2)·h/sh`` on the residual stream (each norm's kept tensors, the residual and the block output),
``q + k + v + o`` on its local heads (K and V at every query head when GQA repeats them), the attention's
log-sum-exp and the norms' ``rstd`` in float32, and ``4f/t`` in a SwiGLU MLP (``2f/t`` for GELU). That is
``10h + 4f`` at ``norm_saved = 2`` and ``t = 1``, what ``meshplan.memory`` measures on the example Llama.
Variants: without sequence parallelism the stream is whole; ``save_gathered_inputs`` keeps ``2h(1−1/t)`` more;
each axis unit keeps its own terms (``costs.block_activations``, :data:`meshplan.solver.units.UNITS`); an MoE
block keeps ``top_k·(3h + 4·f_e/etp)`` per routed token plus the dispatch buffers; full checkpointing keeps the
block input only; op-level checkpointing the matmul outputs; ``policy: megatron`` (:mod:`meshplan.recompute`)
``(q + 2·kv)/t + (m−1)·f/t`` of colwise matmul outputs and ``3h/sh`` (the two reduced row-parallel outputs and
the block's output) in a dense block (``20·s·b·h/t`` bytes on Megatron's GPT layer; an MoE block is counted as
without checkpointing, an upper bound). The pipeline schedule multiplies by the microbatches in flight
(``docs/pipeline.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.solver.units import COST_UNITS as UNITS  # the units the per-microbatch terms take (in_solver)
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.placement import Placement
from meshplan.solver.moe_costs import expert_imbalance
from meshplan.solver.shape import ModelShape
from meshplan.solver.terms import block_kinds
from meshplan.solver.terms import block_tensors as _block_tensors

__all__ = ["chunk_rows", "Memory", "rank_memory", "block_activations", "rank_tensors", "block_kinds"]

GiB = float(1 << 30)


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank (the device's; ``host`` is what CPU offload moved to the host).

    Attributes:
        params / grads / optimizer: as stored (master dtype), after tp/ep/FSDP sharding.
        activations: kept for backward, for the microbatches in flight.
        gathered: FSDP's unsharded parameters alive (the root, and the blocks kept gathered).
        transient: the largest short-lived buffers (a block's unsharded gradient, the loss's logits gradient).
        numel: local parameter elements. tensors: local parameter tensors.
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float
    transient: float
    host: float = 0.0
    numel: int = 0
    tensors: int = 0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered + self.transient

    def describe(self) -> str:
        parts = [("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                 ("activations", self.activations), ("gathered", self.gathered), ("transient", self.transient)]
        text = ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts)
        return text + (f"; {self.host / GiB:.2f} GiB on the host (cpu_offload)" if self.host else "")


def _end_tensors(s: ModelShape, c: Candidate, place: Placement, pp_rank: int) -> list:
    """The embedding (first stage), the final norm and the head (last stage; a tied head's copy when pipelined)."""
    first, last = place.ends_of(pp_rank)
    out = [(s.vocab // c.tp, s.hidden)] if first else []
    if last:
        out += [(s.hidden, 1)] * (1 if s.norm == "rmsnorm" else 2)
        if not s.tied_embeddings or (c.pp > 1 and not first):
            out.append((s.vocab // c.tp, s.hidden))
    return out


def end_units(s: ModelShape, c: Candidate, place: Placement, pp_rank: int) -> list[tuple[str, list]]:
    """The FSDP2 units of :func:`_end_tensors` (as parallelize wraps them, docs/data-parallel.md): ``[(kind,
    tensors)]``, ``embedding`` (resharded after forward like a block) then ``head`` (the final norm and the head:
    kept gathered); a head tied to the embedding on the same rank keeps both in the ``root`` unit. Under
    the plan's ``ends: vocab_parallel`` the embedding and head are no FSDP2 unit (their rows stay sharded): the
    ``root`` holds the final norm alone (:func:`vocab_end_tensors` lists the others)."""
    ends = _end_tensors(s, c, place, pp_rank)
    first, last = place.ends_of(pp_rank)
    if c.vocab_ends:
        vocab = vocab_end_tensors(s, c, place, pp_rank)
        norm = [t for t in ends if t not in vocab]
        return [("root", norm)] if norm else []
    if not ends or (first and last and s.tied_embeddings):
        return [("root", ends)] if ends else []
    emb, rest = (ends[:1], ends[1:]) if first else ([], ends)
    return [(k, t) for k, t in (("embedding", emb), ("head", rest)) if t]


def vocab_end_tensors(s: ModelShape, c: Candidate, place: Placement, pp_rank: int) -> list:
    """The tensors of :func:`_end_tensors` that the plan's ``ends: vocab_parallel`` shards by rows over the data
    ranks (the embedding, an untied head; their ``(vocab, hidden)`` rows): none without the option."""
    if not c.vocab_ends:
        return []
    return [t for t in _end_tensors(s, c, place, pp_rank) if t == (s.vocab // c.tp, s.hidden)]


def _is_moe(s: ModelShape, block: int) -> bool:
    return s.experts > 0 and block >= s.dense_layers


def rank_tensors(s: ModelShape, c: Candidate, place: Placement, pp_rank: int) -> tuple[list, list]:
    """Every local parameter tensor of pipeline rank ``pp_rank`` after tp/ep: ``(dense, expert)`` lists of
    ``(rows, elements per row)``."""
    dense, expert = [], []
    for b in place.blocks_of(pp_rank):
        d, e = _block_tensors(s, _is_moe(s, b), c)
        dense += d
        expert += e
    return dense + _end_tensors(s, c, place, pp_rank), expert


def chunk_rows(rows: int, d: int, index: int | None) -> int:
    """Rows of dim 0 in chunk ``index`` of ``d`` (torch.chunk's ``ceil(rows / d)``-row chunks, the last ones
    short or empty); ``index`` None: the largest chunk."""
    c = -(-rows // d)
    return c if index is None else max(0, min(c, rows - index * c))


def _numel(tensors: list, d: int, index: int | None = None) -> int:
    return sum(chunk_rows(rows, d, index) * per for rows, per in tensors)


def experts_even(s: ModelShape, c: Candidate, d: int) -> bool:
    """Whether FSDP2 over ``d`` edp ranks shards each expert tensor evenly on an inner dim (FFN or hidden) instead
    of chunking the local experts: ``d`` does not divide them (``ep · edp > num_experts``) and divides an inner
    dim (:func:`meshplan.expert_parallel.edp.expert_shard_placement`, which the solver's numbers follow)."""
    local, ffn = s.experts // c.ep, s.expert_width // c.etp
    return d > 1 and local % d != 0 and (ffn % d == 0 or s.hidden % d == 0)


def expert_numel(s: ModelShape, c: Candidate, tensors: list, d: int, index: int | None = None) -> int:
    """Elements of the expert ``tensors`` (``(local experts, elements per expert)``) on FSDP2 chunk ``index`` of
    ``d`` (None: the largest): ``1/d`` of each on every rank when :func:`experts_even`, else chunks of experts."""
    if experts_even(s, c, d):
        return sum(r * p for r, p in tensors) // d
    return _numel(tensors, d, index)


def shard_sizes(c: Candidate, place: Placement) -> tuple[int, int]:
    """``(d dense, d expert)``: how many ranks FSDP2 shards a dense and an expert tensor over (1: whole)."""
    mode = c.mode
    dense = place.groups["dp_shard"].size if mode in ("fsdp", "hsdp") else 1
    edp = place.layout.edp
    return dense, (edp if edp > 1 and mode != "ddp" else 1)


def block_activations(s: ModelShape, c: Candidate, tr: Training, moe: bool, checkpointed: bool) -> float:
    """Bytes one block (an MoE one or not, checkpointed or not) keeps for backward per microbatch on one rank."""
    t, h, b = c.tp, s.hidden, tr.act_bytes
    sh = t if tr.sequence_parallel and t > 1 else 1
    tokens = c.rank_tokens(tr.seq)
    if checkpointed:
        return tokens * h / sh * b
    if c.megatron and not moe:  # colwise matmul outputs, the reduced row-parallel outputs, the block's output
        return tokens * ((s.q_width + 2 * s.kv_width) / t + (s.mlp_matrices - 1) * s.ffn / t + 3 * h / sh) * b
    if c.ac == "selective" and c.ac_ops:  # op level: the matmul outputs (rowwise ones before their reduction)
        mm = (s.q_width + 2 * s.kv_width) / t + 2 * h + (s.mlp_matrices - 1) * s.ffn / t
        return tokens * (mm + h / sh) * b
    kvw = s.q_width if s.gqa_repeat else s.kv_width
    per = (2 * s.norm_saved + 2) * h / sh * b + 2 * 4 / sh + (2 * s.q_width + 2 * kvw) / t * b + s.heads / t * 4
    if tr.save_gathered_inputs and sh > 1:
        per += (1 if moe and c.etp == 1 else 2) * h * (1 - 1 / t) * b
    for axis in UNITS:  # the axes that are units: what they keep beyond the dense block
        per += axis.costs.block_activations(s, c, tr, kvw)
    if not moe:
        return tokens * (per + (4 if s.mlp == "swiglu" else 2) * s.ffn / t * b)
    return tokens * per + _moe_activations(s, c, tokens, b)


def _moe_activations(s: ModelShape, c: Candidate, tokens: float, b: int) -> float:
    """The MoE FFN: per routed token copy its sorted row, the expert's intermediates and output, the weighted
    row (one more received row across ep), on the ep rank whose experts drew the most tokens; per token the
    combined output and the router's scores; a shared expert."""
    h, k, width = s.hidden, s.top_k, (4 if s.mlp == "swiglu" else 2)
    routed = tokens if c.etp > 1 else tokens / c.tp  # etp 1: each tp rank routes its own share
    busiest = expert_imbalance(s, c.ep)  # the rank whose experts drew the most tokens (1 without loads or ep)
    per = (k * (3 * h + width * s.expert_width / c.etp) * b + (k * h * b if c.ep > 1 else 0)) * busiest + h * b
    per += 3 * s.experts * 4 + 3 * k * 8 + (width * s.shared_ffn + h) * b * (1 if s.shared_ffn else 0)
    return routed * per


def _end_activations(s: ModelShape, c: Candidate, tr: Training, first: bool, last: bool, n: int = 1) -> float:
    """Outside the blocks: token ids and the embedding output (first stage); the final norm, the head's input
    and logits and the loss's saved tensors (last stage). ``n``: the data ranks the plan's ``ends:
    vocab_parallel`` shards the ends over (1 without): the embedding keeps the ids of all ``n`` ranks, the head its
    input gathered from them."""
    t, h, b = c.tp, s.hidden, tr.act_bytes
    sh = t if tr.sequence_parallel and t > 1 else 1
    tokens = c.rank_tokens(tr.seq)
    out = tokens * (n - 1) * ((8 if first else 0) + (h * b if last else 0))
    if first:
        extra = sum(axis.costs.first_stage_activations(c) for axis in UNITS)
        out += tokens * ((9 if t > 1 else 8) + extra + h / sh * b)
    if last:
        gathered = sh > 1
        norm = (s.norm_saved - (1 if gathered else 0)) * h / sh * b + 4 / sh + (h * b if gathered else 0)
        loss = 22 if t > 1 and tr.loss_parallel else 8
        logits = s.vocab / t if tr.loss_parallel else s.vocab  # without loss_parallel the logits are gathered
        out += tokens * (norm + logits * b + loss)
    return out




def _per_block(s: ModelShape, c: Candidate, moe: bool, d_dense: int, d_expert: int, memo: dict,
               index: tuple = (None, None)) -> tuple:
    """``(local elements, tensors, unsharded elements)`` of one block (memoised in ``memo``) on the rank holding
    the most, or on the rank whose FSDP2 chunk ``index`` is given (``(dense, expert)``)."""
    key = ("block", moe, d_dense, d_expert, index)
    if key not in memo:
        dense, expert = _block_tensors(s, moe, c)
        memo[key] = (_numel(dense, d_dense, index[0]) + expert_numel(s, c, expert, d_expert, index[1]),
                     len(dense) + len(expert),
                     sum(r * p for r, p in dense + expert))
    return memo[key]


def rank_memory(s: ModelShape, c: Candidate, tr: Training, place: Placement, pp_rank: int,
                memo: dict | None = None, rank: int | None = None) -> Memory:
    """The memory of pipeline rank ``pp_rank``: on the rank of its stage that holds the most (FSDP2's chunks of
    ``ceil(rows / d)`` rows), or, given the global ``rank`` (of that stage), exactly that rank's (the last ranks
    of an FSDP2 group hold shorter chunks: ``benchmarks/rehearsal.py``); ``memo`` shares per-block results
    between the ranks of one candidate."""
    memo = {} if memo is None else memo
    d_dense, d_expert = shard_sizes(c, place)
    index = (None, None) if rank is None else place.shard_index(rank)
    index = tuple(i if d > 1 else None for i, d in zip(index, (d_dense, d_expert)))  # a whole tensor: no chunk
    ends = _end_tensors(s, c, place, pp_rank)
    numel, tensors, acts = _numel(ends, d_dense, index[0]), len(ends), 0.0
    kinds = block_kinds(s, c, place, pp_rank, memo)
    for (moe, ckpt), n in kinds.items():
        b_numel, b_tensors, _ = _per_block(s, c, moe, d_dense, d_expert, memo, index)
        numel, tensors = numel + n * b_numel, tensors + n * b_tensors
        key = ("act", moe, ckpt)
        if key not in memo:
            memo[key] = block_activations(s, c, tr, moe, ckpt)
        acts += n * memo[key]
    first, last = place.ends_of(pp_rank)
    mb, n = tr.master_bytes, (d_dense if c.vocab_ends else 1)
    params = grads = numel * mb
    optimizer = tr.optimizer_states * numel * mb + 4 * tensors
    acts = (acts + _end_activations(s, c, tr, first, last, n)) * math.prod(axis.costs.in_flight(c, pp_rank) for axis in UNITS)
    gathered, transient = _fsdp_buffers(s, c, tr, kinds, end_units(s, c, place, pp_rank), d_dense > 1 or d_expert > 1,
                                        memo)
    if n > 1 and first:  # torch's embedding backward makes the whole table's gradient (Replicate) on each rank;
        transient = max(transient, s.vocab * s.hidden * mb)  # cut to the rank's rows before it is accumulated
    if last:
        transient += c.rank_tokens(tr.seq) * s.vocab / c.tp * 4  # the loss's float32 logits gradient
        if n > 1:  # vocab_parallel ends: the head's [n·tokens, vocab/n] output beside its all-to-all's result
            transient += c.rank_tokens(tr.seq) * s.vocab * tr.act_bytes
    host = 0.0
    if tr.cpu_offload:
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
    return Memory(params, grads, optimizer, acts, gathered, transient, host, numel, tensors)


def _fsdp_buffers(s: ModelShape, c: Candidate, tr: Training, kinds: dict, ends: list, sharded: bool,
                  memo: dict) -> tuple[float, float]:
    """``(gathered, transient)``: FSDP2's unsharded parameters alive at the end of the forward (the head unit's,
    which it does not reshard, and a tied root's; the embedding's and every block's too while microbatches
    accumulate unsharded or without resharding), and the largest unit's gathered parameters and unsharded
    gradient during its backward (a block, or the embedding; the head's gathered half is counted already).
    ``ends``: :func:`end_units`."""
    if not sharded or not kinds:
        return 0.0, 0.0
    sizes = {moe: _per_block(s, c, moe, 1, 1, memo)[2] for moe, _ in kinds}
    size = {k: sum(r * p for r, p in t) for k, t in ends}
    kept = size.get("root", 0) + size.get("head", 0)
    # microbatches accumulated unsharded: train_step's (dp's knobs) and a pipeline stage's (torch's PipelineStage
    # keeps an FSDP2 stage unsharded from its first backward to the step's REDUCE_GRAD)
    keep_all = (c.microbatches > 1 and c.accumulate_unsharded) or not tr.reshard_after_forward
    b = tr.act_bytes
    if keep_all:
        every = sum(n * sizes[moe] for (moe, _), n in kinds.items()) + size.get("embedding", 0)
        return (kept + every) * b, every * b
    largest = max(2 * max(sizes.values()), 2 * size.get("embedding", 0), size.get("head", 0))
    return kept * b, largest * b  # during a block's backward: its gathered parameters and gradient
