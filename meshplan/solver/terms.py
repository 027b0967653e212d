"""The solver's shared cost vocabulary, below every term module and every axis unit's ``costs``: a collective
(:class:`Collective`), the blocks a pipeline rank holds (:func:`block_kinds`) and the local tensors of a block
(:func:`block_tensors`); an axis unit as the solver sees it is :class:`meshplan.axis.AxisTerms`. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.solver.candidate import Candidate
from meshplan.solver.placement import Group, Placement
from meshplan.solver.shape import ModelShape

__all__ = ["block_tensors", "Collective", "block_kinds"]


@dataclass(frozen=True)
class Collective:
    """``count`` calls of one collective per step.

    Attributes:
        axis: ``tp``, an axis unit's name, ``pp``, ``dp`` or ``step``. kind: ``all_gather``, ``reduce_scatter``,
        ``all_reduce``, ``all_to_all``, ``send`` or ``recv``. group: the ranks it spans. nbytes: per call, the
        full buffer (as :meth:`meshplan.solver.cluster.Cluster.comm_time` takes it). count: calls per step.
        what: what it moves. hidden: data-parallel or pipeline traffic that can overlap compute.
    """

    axis: str
    kind: str
    group: Group
    nbytes: float
    count: int
    what: str
    hidden: bool = False


def block_kinds(s: ModelShape, c: Candidate, place: Placement, pp_rank: int,
                memo: dict | None = None) -> dict[tuple[bool, bool], int]:
    """How many blocks of each kind ``(MoE, checkpointed)`` pipeline rank ``pp_rank`` holds (memoised in ``memo``)."""
    if memo is not None:
        key = ("kinds", pp_rank)
        if key not in memo:
            memo[key] = block_kinds(s, c, place, pp_rank)
        return memo[key]
    out: dict[tuple[bool, bool], int] = {}
    every = c.ac_every if c.ac == "selective" and not c.op_level else 0
    for lo, hi in place.ranges_of(pp_rank):
        for moe, (a, b) in ((False, (lo, min(hi, s.dense_layers) if s.experts else hi)),
                            (True, (max(lo, s.dense_layers), hi) if s.experts else (0, 0))):
            if b <= a:
                continue
            ckpt = (b // every - a // every) if every else (b - a if c.ac == "full" else 0)  # blocks k, 2k, … from 1
            for key, n in (((moe, True), ckpt), ((moe, False), b - a - ckpt)):
                if n:
                    out[key] = out.get(key, 0) + n
    return out


def block_tensors(s: ModelShape, moe: bool, c: Candidate) -> tuple[list, list]:
    """``(dense, expert)`` local tensors of one block after tp/ep: ``(rows, elements per row)`` each."""
    t, h, q, kv = c.tp, s.hidden, s.q_width, s.kv_width
    dense = [(q // t, h), (kv // t, h), (kv // t, h), (h, q // t)] + [(h, 1)] * (2 if s.norm == "rmsnorm" else 4)
    if s.bias or s.qkv_bias:
        dense += [(q // t, 1), (kv // t, 1), (kv // t, 1)] + ([(h, 1)] if s.bias else [])
    expert: list = []
    if not moe:
        f = s.ffn // t
        dense += [(f, h)] * (s.mlp_matrices - 1) + [(h, f)] + ([(f, 1)] * (s.mlp_matrices - 1) + [(h, 1)] if s.bias else [])
        return dense, expert
    e, fe = s.experts // c.ep, s.expert_width // c.etp
    expert = [(e, fe * h)] * (s.mlp_matrices - 1) + [(e, h * fe)]
    dense.append((s.experts, h))  # the router, whole on every tp rank
    if s.shared_ffn:
        dense += [(s.shared_ffn, h)] * (s.mlp_matrices - 1) + [(h, s.shared_ffn)]
    return dense, expert
