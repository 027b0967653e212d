"""An eager MoE expert loop's per-microbatch cost (:mod:`meshplan.solver.moe_costs`): the counts derived from the
shape and layout (local experts, ops, the weight slices' gradient bytes, one host sync), their price (a measured
rate or time times a count, nothing fitted), the profile's JSON turned into the fields, and a preset unchanged.
Pure arithmetic: no process group."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from meshplan.plan_file.document import Plan
from meshplan.profile.run import cluster_from_measurement
from meshplan.solver.candidate import Candidate
from meshplan.solver.cluster import Cluster
from meshplan.solver.moe_costs import (MOE_OPS_PER_EXPERT, MOE_ROUTING_OPS, expert_grad_bytes, local_experts,
                                       moe_block_ops, moe_block_time, moe_grad_bytes)
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import shape_from_config
from meshplan.solver.step import evaluate

pytestmark = pytest.mark.fast

#: calibrate.py's MoE: 8 experts (width 512) over hidden 256, top-2, 4 layers
MOE = shape_from_config(dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=1024,
                             moe_hidden=512, n_experts=8, top_k=2))
EP = yaml.safe_load(open("plans/moe.yaml"))["expert_parallel"]
MEASURED = dict(expert_grad_rate=3e10, host_sync_overhead=1e-6, op_overhead=3e-6)
STACKED = 8 * 3 * 256 * 512 * 4  # bytes of one block's expert weights in float32
C1 = Candidate()  # one rank, no parallelism


def _candidate(plan: dict, world: int, seq: int = 256, batch: int = 16):
    return candidate_from_plan(Plan.from_data({"version": 1, **plan}, "test"), world, seq, batch)


def test_grad_bytes_are_quadratic_in_local_experts():
    """Per stacked weight of W bytes and E local experts: E whole-weight zero fills and E - 1 in-place adds (3 W
    each): (4E - 3) W; ep divides the experts, etp each expert's width."""
    assert expert_grad_bytes(1, 100) == 100 and expert_grad_bytes(8, 100) == 2900
    assert [local_experts(MOE, ep) for ep in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert moe_grad_bytes(MOE, 1, 1, 4) == 29 * STACKED
    assert moe_grad_bytes(MOE, 2, 1, 4) == 13 * STACKED / 2
    assert moe_grad_bytes(MOE, 4, 1, 4) == 5 * STACKED / 4
    assert moe_grad_bytes(MOE, 1, 2, 2) == 29 * STACKED / 4  # etp halves the width, bfloat16 the bytes


def test_ops_are_the_routing_plus_each_local_expert():
    assert moe_block_ops(MOE, 1) == MOE_ROUTING_OPS + 8 * MOE_OPS_PER_EXPERT == 391  # counted: benchmarks/moe_ops.py
    assert moe_block_ops(MOE, 4) == MOE_ROUTING_OPS + 2 * MOE_OPS_PER_EXPERT == 151


def test_priced_as_measured_rate_times_count():
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    expected = 29 * STACKED / 3e10 + 391 * 3e-6 + 1e-6
    assert moe_block_time(MOE, C1, 4, cl, False) == pytest.approx(expected)
    assert moe_block_time(MOE, C1, 4, cl, True) == pytest.approx(expected + 391 / 3 * 3e-6)
    assert moe_block_time(MOE, C1, 4, cluster_preset("h100-80g"), False) == 0.0  # not measured: no loop term
    grouped = dataclasses.replace(MOE, expert_loop=False)  # grouped GEMMs: no slices, no loop
    assert moe_block_time(grouped, C1, 4, cl, False) == 0.0
    assert shape_from_config({**dict(dim=256, n_layers=4, n_heads=8, vocab_size=256, n_experts=8, top_k=2),
                              "expert_loop": False}).expert_loop is False


def test_step_pays_it_per_moe_block_and_microbatch():
    """The part is 4 MoE blocks x microbatches x the block's time; a dense model and a preset pay none of it."""
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    one, _ = _candidate({"layout": {}}, 1)
    sixteen = one.with_(micro_batch=1, microbatches=16)
    tr = _candidate({"layout": {}}, 1)[1]
    per_block = moe_block_time(MOE, C1, tr.act_bytes, cl, False)
    for c, m in ((one, 1), (sixteen, 16)):
        e = evaluate(MOE, c, tr, cl)
        assert e.parts["moe_microbatch"] == pytest.approx(4 * m * per_block)
    ep2, tr2 = _candidate({"layout": {"ep": 2}, "expert_parallel": EP}, 2)
    assert evaluate(MOE, ep2, tr2, cl).parts["moe_microbatch"] == pytest.approx(
        4 * ep2.microbatches * moe_block_time(MOE, ep2, tr2.act_bytes, cl, False))
    dense = shape_from_config(dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=1024))
    assert evaluate(dense, one, tr, cl).parts["moe_microbatch"] == 0.0
    assert evaluate(MOE, sixteen, tr, cluster_preset("h100-80g")).parts["moe_microbatch"] == 0.0


def test_sixteen_microbatches_of_a_pipeline_pay_it_sixteen_times():
    """The world-2 first choice this term was measured for: pp 2 x vpp 2 interleaved, 16 microbatches; the part
    grows with the microbatches, so the step's difference to one microbatch is what the loop costs."""
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    plan = {"layout": {"pp": 2, "vpp": 2}, "blocks": {"pattern": "layers.*"},
            "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 16}}
    c, tr = _candidate(plan, 2)
    e = evaluate(MOE, c, tr, cl)
    per_block = moe_block_time(MOE, C1, tr.act_bytes, cl, False)
    assert e.parts["moe_microbatch"] == pytest.approx(16 * 2 * per_block)  # each pipeline rank: 2 of the 4 blocks


def test_profile_json_becomes_the_fields_and_round_trips():
    fit = {"2": {"latency": 1e-5, "bandwidth": 1e9}}
    m = {"world": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "threads": 1, "memory": 1e9,
         "matmul_rates": [[64, 1e9]], "memory_rates": [[1e6, 1e10]], "hbm_bandwidth": 1e10, "op_overhead": 1e-5,
         "collectives": {k: fit for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")}}
    cl = cluster_from_measurement({**m, "expert_grad_rate": 3e10, "host_sync_overhead": 1e-6})
    assert (cl.expert_grad_rate, cl.host_sync_overhead) == (3e10, 1e-6)
    assert Cluster.from_dict(cl.to_dict()) == cl
    old = cluster_from_measurement(m)  # a profile from before: no loop term
    assert (old.expert_grad_rate, old.host_sync_overhead) == (0.0, 0.0)


def test_profile_measures_the_pattern_it_prices():
    """The profile's expert loop: every slice of the three stacked weights used once, each slice's backward a
    whole-weight gradient, priced bytes over seconds."""
    import torch
    from meshplan.profile import moe

    seen = []

    def timed(fn, reps, window=0.0):
        fn()
        seen.append(fn)
        return 0.5
    got = moe.measure_moe(timed, lambda v: v, torch.device("cpu"), torch.float32)
    weights = 3 * 8 * 256 * 512 * 4
    assert got["expert_grad_rate"] == pytest.approx(expert_grad_bytes(8, weights) / 0.5)
    assert got["host_sync_overhead"] == 0.0 and len(seen) == 3  # the loop; the sync and its bare computation
