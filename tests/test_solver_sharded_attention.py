"""A cp rank's attention beyond its FLOPs (:mod:`meshplan.context_parallel.profile`): what the profile measures,
how the cluster keeps it, and how the compute model prices it (``allgather_kv`` only, the method timed)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from meshplan.context_parallel.costs import cp_attention_time
from meshplan.context_parallel.profile import DEGREES, measure_sharded_attention
from meshplan.profile.run import cluster_from_measurement
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.compute import block_time
from meshplan.solver.shape import ModelShape
from tests.test_solver_overheads import _measurement

pytestmark = pytest.mark.fast

SHAPE = ModelShape(layers=1, hidden=256, heads=8, kv_heads=4, ffn=1024, vocab=1)
POINTS = ((2, 1.5), (4, 2.0), (8, 3.0))


def test_the_factor_is_one_unsharded_or_unmeasured_and_the_curve_between():
    cl = cluster_from_measurement(_measurement(sharded_attention=[list(p) for p in POINTS]))
    assert cl.sharded_attention == POINTS and Cluster.from_dict(cl.to_dict()) == cl
    assert cl.sharded_attention_factor(1) == 1.0 and cluster_from_measurement(_measurement()).sharded_attention_factor(4) == 1
    assert [cl.sharded_attention_factor(n) for n in (2, 4, 8, 16)] == [1.5, 2.0, 3.0, 3.0]  # flat past the last
    assert cl.sharded_attention_factor(3) == pytest.approx(1.5 + 0.5 * math.log(1.5) / math.log(2))
    one = dataclasses.replace(cl, sharded_attention=((4, 2.5),))
    assert one.sharded_attention_factor(2) == pytest.approx(1 + 1.5 / 3)  # linear from 1 at one rank


def test_only_the_gathered_method_is_priced_by_the_factor():
    cl = cluster_from_measurement(_measurement(sharded_attention=[list(p) for p in POINTS]))
    tr = Training(seq=256, global_batch=8, dtype="float32")
    assert cp_attention_time(SHAPE, Candidate(cp=4, dp_shard=2, micro_batch=4), tr, cl) == 2.0
    assert cp_attention_time(SHAPE, Candidate(micro_batch=4), tr, cl) == 1.0
    ring = dataclasses.replace(tr, cp_method="ring")
    assert cp_attention_time(SHAPE, Candidate(cp=4, micro_batch=4), ring, cl) == 1.0


def test_block_time_multiplies_the_attention_seconds_alone():
    """The factor scales the attention's seconds (forward and two backward passes), not its FLOPs nor the rest."""
    plain = cluster_from_measurement(_measurement())
    cl = dataclasses.replace(plain, sharded_attention=((2, 3.0),))
    tr = Training(seq=256, global_batch=8, dtype="float32")
    c = Candidate(cp=2, micro_batch=4)
    (t0, f0), (t1, f1) = (block_time(SHAPE, c, tr, x, False, False) for x in (plain, cl))
    attn = 2 * c.rank_tokens(256) * 256 * SHAPE.q_width
    assert f1 == f0
    assert t1 - t0 == pytest.approx(2 * 3 * attn / (plain.peak("float32") * plain.attention_efficiency)
                                    * plain.block_scale)


def test_the_profile_times_each_degree_that_splits_the_sequence():
    def timed(fn, reps, window=0.1):
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    shape = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32}
    got = measure_sharded_attention(timed, lambda x: x, torch.device("cpu"), torch.float32, shape)
    assert [n for n, _ in got["sharded_attention"]] == list(DEGREES) and all(f > 0 for _, f in got["sharded_attention"])
    short = measure_sharded_attention(timed, lambda x: x, torch.device("cpu"), torch.float32, {**shape, "seq": 8})
    assert [n for n, _ in short["sharded_attention"]] == [2, 4]  # 8 tokens do not split into 16 chunks
