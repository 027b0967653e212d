"""The optimizer step and gradient clipping per rank (:mod:`meshplan.solver.host_step`): a measured seconds per
element by tensor size times the rank's local parameters, the preset's byte count unchanged, the profile's JSON
turned into the fields. Pure arithmetic but one smoke of the measurement (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.plan_file.document import Plan
from meshplan.profile.run import cluster_from_measurement
from meshplan.profile.step_costs import SETS, measure_step_costs
from meshplan.solver.candidate import Training
from meshplan.solver.cluster import Cluster
from meshplan.solver.host_step import clip_time, optimizer_time, per_element
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import shape_from_config
from meshplan.solver.step import evaluate

pytestmark = pytest.mark.fast

#: calibrate.py's Llama (benchmarks/calibrate.py model_config("llama"))
LLAMA = shape_from_config(dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=1024))
CURVE = ((1024.0, 2e-8), (65536.0, 2e-9), (1048576.0, 5e-9))
TR = Training(seq=256, global_batch=16, dtype="float32")


def _ddp(world: int, cluster: Cluster):
    cand, train = candidate_from_plan(Plan.from_data({"version": 1, "layout": {"dp_replicate": world}}, "t"),
                                      world, 256, 16)
    return evaluate(LLAMA, cand, train, cluster)


def test_a_preset_prices_the_optimizer_by_its_bytes_and_no_clipping():
    """GPU numbers unchanged: no measured curve, AdamW's (3·2+4) passes at the memory rate, clipping 0."""
    cl = cluster_preset("h100-80g")
    assert optimizer_time(cl, TR, 4e6, 39) == pytest.approx(4e6 * 4 * 10 / cl.hbm_bandwidth)
    assert clip_time(cl, TR, 4e6, 39) == 0.0


def test_a_measured_curve_prices_each_element_at_the_mean_tensor_size():
    """Log-linear between the measured sizes, flat above, a constant per-tensor time below the smallest."""
    cl = dataclasses.replace(cluster_preset("h100-80g"), optimizer_rates=CURVE, clip_rates=CURVE)
    assert per_element(CURVE, 65536 * 10, 10) == pytest.approx(2e-9)
    assert per_element(CURVE, 262144 * 4, 4) == pytest.approx(2e-9 + 0.5 * 3e-9)  # halfway in log size
    assert per_element(CURVE, 1 << 24, 1) == pytest.approx(5e-9)
    assert 64 * 512 * per_element(CURVE, 64 * 512, 64) == pytest.approx(64 * 1024 * 2e-8)  # per tensor below
    assert optimizer_time(cl, TR, 65536 * 10, 10) == pytest.approx(65536 * 10 * 2e-9)
    assert clip_time(cl, TR, 65536 * 10, 10) == pytest.approx(65536 * 10 * 2e-9)
    assert clip_time(cl, dataclasses.replace(TR, clip=False), 65536 * 10, 10) == 0.0
    offload = dataclasses.replace(TR, cpu_offload=True)
    assert optimizer_time(cl, offload, 1e6, 1) == pytest.approx(1e6 * 4 * 12 / cl.host_bandwidth)


def test_the_step_adds_the_measured_optimizer_and_clip_on_the_local_parameters():
    """calibrate.py's ddp2 Llama: every rank steps the whole replica (39 tensors, 4,065,536 elements)."""
    base = cluster_preset("h100-80g")
    measured = dataclasses.replace(base, optimizer_rates=CURVE, clip_rates=CURVE)
    a, b = _ddp(2, base), _ddp(2, measured)
    assert (b.memory.tensors, b.memory.numel) == (39, 4065536)
    each = 4065536 * per_element(CURVE, 4065536, 39)
    assert b.parts["optimizer"] == pytest.approx(each) and b.parts["clip"] == pytest.approx(each)
    assert a.parts["clip"] == 0.0
    assert b.step_time - a.step_time == pytest.approx(2 * each - a.parts["optimizer"])


def test_profile_json_becomes_the_curves_and_round_trips():
    m = {"world": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "threads": 1, "memory": 1e9,
         "matmul_rates": [[64, 1e9]], "memory_rates": [[1e6, 1e10]], "hbm_bandwidth": 1e10, "op_overhead": 1e-5,
         "collectives": {}, "optimizer_rates": [list(p) for p in CURVE], "clip_rates": [[1024, 1e-9]]}
    cl = cluster_from_measurement(m)
    assert cl.optimizer_rates == CURVE and cl.clip_rates == ((1024.0, 1e-9),)
    assert Cluster.from_dict(cl.to_dict()) == cl
    assert cluster_from_measurement({**m, "optimizer_rates": [], "clip_rates": []}).optimizer_rates == ()


def test_the_measurement_returns_one_point_per_set():
    """The profile's code path, with a fixed clock: seconds per element = the time over the set's elements."""
    sets = ((4, 16), (2, 64))
    out = measure_step_costs(lambda fn, reps, window: (fn(), 1e-3)[1], lambda x: x, torch.device("cpu"), sets)
    assert out["optimizer_rates"] == out["clip_rates"] == [[n, 1e-3 / (t * n)] for t, n in sets]
    assert max(n for _, n in SETS) == 1 << 20  # 4 MiB tensors: with gradient and states past a core's cache
