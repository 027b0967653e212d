"""The reference block's measurement (meshplan/profile/block.py) and how the cost model prices it: a block's
element-wise bytes at the measured ``touch_rate`` and its launches at ``block_op_overhead``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.errors import PlanError
from meshplan.profile.block import BATCHES, REFERENCE, _Block, measure_block, whole_block_time
from meshplan.profile.run import block_costs, block_scale, cluster_from_measurement, reference_block_price
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.compute import OPS_PER_BLOCK, block_time, touches_per_token
from meshplan.solver.shape import ModelShape

BASE = {"world": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "threads": 1, "memory": 1e9,
        "matmul_rates": [[64, 1e9], [1024, 4e10]], "memory_rates": [[1e6, 1e10]], "hbm_bandwidth": 1e10,
        "op_overhead": 1e-5, "attention_rate": 1.2e10, "collectives": {}}
REF = REFERENCE["cpu"]
SHAPE = ModelShape(layers=1, hidden=REF["hidden"], heads=REF["heads"], kv_heads=REF["kv_heads"], ffn=REF["ffn"],
                   vocab=1)


def _measured(rate: float, per_op: float) -> dict:
    """A profile whose block times beyond the matmuls and attention are the bytes at ``rate`` + the launches."""
    times = [[b, OPS_PER_BLOCK * per_op + b * REF["seq"] * touches_per_token(SHAPE) * 4 / rate] for b in BATCHES]
    return {**BASE, "block_reference": dict(REF), "block_rest_times": times}


def test_the_block_times_become_the_touch_rate_and_the_launch_time():
    cl = cluster_from_measurement(_measured(3e9, 2e-5))
    assert cl.touch_rate == pytest.approx(3e9) and cl.block_op_overhead == pytest.approx(2e-5)
    assert Cluster.from_dict(cl.to_dict()) == cl


def test_a_profile_without_the_block_prices_as_before():
    cl = cluster_from_measurement(BASE)
    assert (cl.touch_rate, cl.block_op_overhead) == (0.0, 0.0)
    assert block_costs({**BASE, "block_reference": dict(REF), "block_rest_times": [[1, 1.0]]}) == {}


def test_noise_that_leaves_no_per_token_part_is_not_a_measurement():
    m = _measured(3e9, 2e-5)
    m["block_rest_times"] = [[1, 0.01], [4, 0.009]]  # the larger batch's rest smaller: no rate can be read from it
    assert block_costs(m) == {}


def test_a_launch_time_below_zero_is_clamped():
    m = _measured(3e9, 0.0)
    m["block_rest_times"][0][1] -= 1e-3  # the small batch's rest lies under the line through zero
    got = block_costs(m)
    assert got["block_op_overhead"] == 0.0 and got["touch_rate"] > 0


def test_block_time_prices_the_bytes_at_the_touch_rate():
    cl = cluster_from_measurement(BASE)
    tr = Training(seq=256, global_batch=8, dtype="float32")
    c = Candidate(micro_batch=8)
    slow, fast = (dataclasses.replace(cl, touch_rate=r, block_op_overhead=1e-5) for r in (1e9, 2e9))
    bytes_ = 8 * 256 * touches_per_token(SHAPE) * 4
    diff = block_time(SHAPE, c, tr, slow, False, False)[0] - block_time(SHAPE, c, tr, fast, False, False)[0]
    assert diff == pytest.approx(bytes_ / 1e9 - bytes_ / 2e9)


def test_the_measurement_subtracts_the_bare_matmuls_timed_beside_the_block():
    """The profile's code path with a fake clock: the whole block and its bare matmuls and attention alternate
    (three windows each per batch), and the rest is their medians' difference."""
    calls = []

    def timed(fn, reps, window):
        fn()
        calls.append(len(calls) % 2)
        return 3e-3 if calls[-1] == 0 else 1e-3  # whole, then bare
    out = measure_block(timed, lambda x: x, torch.device("cpu"), torch.float32)
    assert out["block_reference"] == REF
    assert out["block_rest_times"] == [[b, pytest.approx(2e-3)] for b in BATCHES]
    assert out["block_whole_times"] == [[b, pytest.approx(3e-3)] for b in BATCHES]
    assert len(calls) == 6 * len(BATCHES)


def test_the_bare_block_runs_the_same_matmuls():
    """`_Block.bare` multiplies by every weight (each gets a gradient) and attends over every head."""
    torch.manual_seed(0)
    block = _Block(hidden=32, heads=4, kv_heads=2, ffn=64, seq=8)
    x = torch.randn(2, 8, 32)
    block.bare(x).sum().backward()
    linear = [n for n, p in block.named_parameters() if not n.startswith("norms")]
    assert len(linear) == 7 and all(p.grad is not None for n, p in block.named_parameters() if n in linear)


def _priced(cl: Cluster, batch: int) -> float:
    return block_time(SHAPE, Candidate(micro_batch=batch), Training(seq=REF["seq"], global_batch=batch,
                                                                    dtype="float32"), cl, False, False)[0]


def test_the_whole_block_times_over_their_price_become_the_block_scale():
    """A block timed whole at 1.25× its price from the other rates prices every block 1.25× (and a profile from
    before the whole block was timed, or a preset, at 1×)."""
    m = _measured(3e9, 2e-5)
    plain = cluster_from_measurement(m)
    assert plain.block_scale == 1.0
    m["block_whole_times"] = [[b, 1.25 * _priced(plain, b)] for b in BATCHES]
    cl = cluster_from_measurement(m)
    assert cl.block_scale == pytest.approx(1.25) and block_scale(m, plain) == pytest.approx(1.25)
    assert Cluster.from_dict(cl.to_dict()) == cl
    assert _priced(cl, 8) == pytest.approx(1.25 * _priced(plain, 8))


def test_the_profiles_own_block_time_is_the_reference_blocks_price():
    """Under a profiled cluster the reference block's price over the profile's batches IS the whole block's time the
    profile measured (what a later ``whole_block_time`` is set beside: the host's drift)."""
    m = _measured(3e9, 2e-5)
    m["block_whole_times"] = [[b, 0.01 * b] for b in BATCHES]
    cl = cluster_from_measurement(m)
    assert reference_block_price(cl, REF, BATCHES) == pytest.approx(0.01 * sum(BATCHES))


def test_the_whole_block_is_timed_again_at_each_batch():
    """``whole_block_time`` (calibrate.py's worker, before each layout) sums the whole block's time over the
    profile's batches, each call the block's forward and backward."""
    calls = []

    def timed(fn, reps, window):
        fn()
        calls.append(reps)
        return 2e-3
    assert whole_block_time(timed, lambda x: 2 * x, torch.device("cpu"), torch.float32) == \
        pytest.approx(4e-3 * len(BATCHES))
    assert calls == [2] * len(BATCHES)


def test_a_cluster_file_with_a_block_scale_of_zero_is_refused():
    d = cluster_from_measurement(BASE).to_dict()
    with pytest.raises(PlanError, match="block_scale must be positive"):
        Cluster.from_dict({**d, "block_scale": 0.0}, "c.json")
