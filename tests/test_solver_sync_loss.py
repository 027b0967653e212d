"""The ranks' wait at blocking collectives (:mod:`meshplan.profile.sync`, :func:`meshplan.solver.overheads.sync_loss`
and :func:`~meshplan.solver.overheads.sync_overhead`): what the profile measures, how the cluster keeps it, which
axes' collectives it prices (tensor, context and expert parallelism: not the data-parallel or pipeline ones), and
that it replaces ``collective_busy``. No process group but a fake one."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.profile.run import cluster_from_measurement
from meshplan.solver.cluster import Cluster
from meshplan.solver.overheads import sync_loss
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import shape_from_config
from meshplan.solver.step import evaluate
from meshplan.solver.units import UNITS
from tests.test_solver_overheads import _measurement

pytestmark = pytest.mark.fast

TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
CP = yaml.safe_load(open("plans/llama_cp.yaml"))["context_parallel"]
MOE = yaml.safe_load(open("plans/moe.yaml"))["expert_parallel"]
SHAPE = shape_from_config(dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256))
POINTS = ((2, 0.01, 0.001), (2, 0.04, 0.006), (8, 0.01, 0.004))


def _cluster(**extra) -> Cluster:
    return dataclasses.replace(cluster_preset("h100-80g"), **extra)


def _candidate(plan: dict, world: int):
    return candidate_from_plan(Plan.from_data({"version": 1, **plan}, "test"), world, 64, 8)


def test_the_profile_field_round_trips_and_a_malformed_one_is_refused():
    cl = cluster_from_measurement(_measurement(sync_loss=[list(p) for p in POINTS]))
    assert cl.sync_loss == POINTS and Cluster.from_dict(cl.to_dict()) == cl
    assert cluster_from_measurement(_measurement()).sync_loss == ()  # an older profile: not priced
    with pytest.raises(PlanError, match="sync_loss: points of the wrong length"):
        Cluster.from_dict({**cl.to_dict(), "sync_loss": [[2, 0.01]]})
    with pytest.raises(PlanError, match="matmul_rates: points of the wrong length"):
        Cluster.from_dict({**cl.to_dict(), "matmul_rates": [[64, 1e9, 3]]})


def test_the_loss_by_group_and_segment():
    """Linear between a group's measured segments, proportional below and beyond them; the nearest measured group
    (a larger one on a tie); nothing for one rank, no segment, or nothing measured."""
    cl = _cluster(sync_loss=POINTS)
    assert sync_loss(cl, 2, 0.01) == pytest.approx(0.001) and sync_loss(cl, 2, 0.04) == pytest.approx(0.006)
    assert sync_loss(cl, 2, 0.02) == pytest.approx(0.001 + 0.005 / 3)
    assert sync_loss(cl, 2, 0.08) == pytest.approx(0.012) and sync_loss(cl, 2, 0.005) == pytest.approx(0.0005)
    assert sync_loss(cl, 8, 0.02) == pytest.approx(0.008)  # one point: proportional
    assert sync_loss(cl, 4, 0.01) == pytest.approx(0.004)  # 4 is as far from 2 as from 8: the larger
    assert sync_loss(cl, 16, 0.01) == pytest.approx(0.004)
    assert sync_loss(cl, 1, 0.01) == sync_loss(cl, 2, 0) == sync_loss(_cluster(), 2, 0.01) == 0


def test_the_blocking_axes_are_tensor_context_and_expert_parallelism():
    assert {a.name for a in UNITS if a.costs.blocking} == {"tp", "cp", "ep"}


@pytest.mark.parametrize("plan, world, axis", [
    ({"layout": {"tp": 2}, "tensor_parallel": TP}, 2, "tp"),
    ({"layout": {"cp": 2}, "context_parallel": CP}, 2, "cp"),
])
def test_each_blocking_collective_ends_an_even_share_of_the_compute(plan, world, axis):
    """Each of the axis' collectives per microbatch costs the loss after ``compute / collectives`` seconds; the
    step grows by exactly that; the collective_busy of an older profile is then not charged."""
    c, tr = _candidate(plan, world)
    base = evaluate(SHAPE, c, tr, _cluster(collective_busy=1e-3))
    priced = evaluate(SHAPE, c, tr, _cluster(sync_loss=POINTS, collective_busy=1e-3))
    calls = sum(x.count for x in priced.collectives if x.axis == axis) / c.microbatches
    assert calls > 0 and base.parts["sync"] == 0
    compute = priced.parts["compute"] / c.microbatches
    want = calls * sync_loss(_cluster(sync_loss=POINTS), 2, compute / calls) * c.microbatches
    assert priced.parts["sync"] == pytest.approx(want) and want > 0
    busy = 48 * 1e-3 if axis == "tp" else 0.0
    assert priced.parts["tp_overheads"] == pytest.approx(base.parts["tp_overheads"] - busy)
    assert priced.step_time - base.step_time == pytest.approx(want - busy)


def test_data_parallel_and_pipeline_collectives_are_not_charged():
    for plan, world in (({"layout": {"dp_replicate": 2}}, 2), ({"layout": {}}, 4),
                        ({"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"},
                          "pipeline": {"schedule": "1f1b", "microbatches": 4}}, 2)):
        c, tr = _candidate(plan, world)
        assert evaluate(SHAPE, c, tr, _cluster(sync_loss=POINTS)).parts["sync"] == 0, plan


def test_expert_parallel_all_to_alls_are_charged_over_their_group():
    moe = shape_from_config(dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256,
                                 moe_hidden=128, n_experts=8, top_k=2))
    c, tr = candidate_from_plan(Plan.from_data({"version": 1, "layout": {"ep": 2}, "expert_parallel": MOE}, "t"),
                                2, 64, 8)
    priced = evaluate(moe, c, tr, _cluster(sync_loss=POINTS))
    assert priced.parts["sync"] > 0 and all(x.group.size == 2 for x in priced.collectives if x.axis == "ep")


def test_the_measurement_times_each_group_and_segment(fake_pg):
    """Under a fake group of 4: groups of 2 and 4, each at every segment; losses never negative."""
    import torch
    from meshplan.profile import sync
    with fake_pg(4):
        got = sync.measure_sync_loss(lambda v: v, torch.device("cpu"), reps=1)["sync_loss"]
    assert [g for g, _, _ in got] == [2] * 3 + [4] * 3
    assert all(t > 0 and x >= 0 for _, t, x in got)
    with fake_pg(1):
        assert sync.measure_sync_loss(lambda v: v, torch.device("cpu"))["sync_loss"] == []
