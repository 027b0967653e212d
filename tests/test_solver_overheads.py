"""What the cost model prices beside FLOPs and bytes (:mod:`meshplan.solver.overheads`): the counts per layout,
their price (a measured time times a count, nothing fitted), the profile's JSON turned into those fields, and
``estimate``'s ± band. Pure arithmetic: no process group."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from meshplan.plan_file.document import Plan
from meshplan.profile.run import cluster_from_measurement
from meshplan.solver.cluster import Cluster, Fit
from meshplan.solver.overheads import (OPTIMIZER_OPS_PER_TENSOR, TP_BLOCK_OPS, TP_END_OPS, dtensor_ops,
                                       pipeline_actions)
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import shape_from_config
from meshplan.solver.step import evaluate

pytestmark = pytest.mark.fast

TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
SHAPE = shape_from_config(dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256))
MEASURED = dict(dtensor_overheads={"mm": 1e-5, "view": 2e-5, "pointwise": 3e-5}, fsdp_unit_overhead=1e-3,
                pipeline_action_overhead=5e-4)


def _candidate(plan: dict, world: int):
    return candidate_from_plan(Plan.from_data({"version": 1, **plan}, "test"), world, 64, 8)


def test_dtensor_ops_count_tp_blocks_and_the_last_stage_ends():
    c, _ = _candidate({"layout": {"tp": 2}, "tensor_parallel": TP}, 2)
    place = Placement(c, SHAPE.layers, 8)
    assert dtensor_ops(SHAPE, c, place, 0) == {k: 4 * TP_BLOCK_OPS[k] + TP_END_OPS[k] for k in TP_BLOCK_OPS}
    c, _ = _candidate({"layout": {}}, 2)
    assert set(dtensor_ops(SHAPE, c, Placement(c, SHAPE.layers, 8), 0).values()) == {0}


@pytest.mark.parametrize("schedule,vpp,actions", [("gpipe", 1, 8), ("1f1b", 1, 8), ("interleaved_1f1b", 2, 16),
                                                   ("zbv_zero_bubble", 2, 24)])
def test_pipeline_actions_per_schedule(schedule, vpp, actions):
    c, _ = _candidate({"layout": {"pp": 2, "vpp": vpp}, "blocks": {"pattern": "layers.*"},
                       "pipeline": {"schedule": schedule, "microbatches": 4}}, 2)
    assert pipeline_actions(c) == actions


def test_priced_as_measured_time_times_count():
    """tp2 × FSDP2: per microbatch 4 blocks' and the ends' DTensor ops and 6 FSDP units' hooks (4 blocks, the embedding, the
    final norm + head; the root holds nothing); per step AdamW's
    ops on every local DTensor parameter. A preset (nothing measured) prices none of it."""
    cl = cluster_preset("h100-80g")
    c, tr = _candidate({"layout": {"tp": 2}, "tensor_parallel": TP}, 4)
    base, priced = evaluate(SHAPE, c, tr, cl), evaluate(SHAPE, c, tr, dataclasses.replace(cl, **MEASURED))
    per_op = MEASURED["dtensor_overheads"]
    dispatch = sum((4 * TP_BLOCK_OPS[k] + TP_END_OPS[k]) * per_op[k] for k in per_op)
    assert priced.parts["overheads"] == pytest.approx(dispatch + 6 * 1e-3)
    assert priced.parts["optimizer_dispatch"] == pytest.approx(OPTIMIZER_OPS_PER_TENSOR * priced.memory.tensors * 3e-5)
    assert base.parts["overheads"] == base.parts["optimizer_dispatch"] == base.parts["pp_actions"] == 0
    assert priced.step_time - base.step_time == pytest.approx(priced.parts["overheads"]
                                                              + priced.parts["optimizer_dispatch"])


def test_ddp_pays_its_one_unit_and_the_optimizers_dispatch_and_a_pipeline_pays_its_actions():
    """DDP is torch's ``replicate`` on FSDP2 (test_ddp_parameters_are_replicated_dtensors): one unit's hooks per
    microbatch and AdamW's ops on DTensor parameters, no block dispatch (the blocks compute on local tensors)."""
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    c, tr = _candidate({"layout": {"dp_replicate": 2}}, 2)
    e = evaluate(SHAPE, c, tr, cl)
    assert e.parts["overheads"] == pytest.approx(1e-3)
    assert e.parts["optimizer_dispatch"] == pytest.approx(OPTIMIZER_OPS_PER_TENSOR * e.memory.tensors * 3e-5)
    c, tr = _candidate({"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"},
                        "pipeline": {"schedule": "1f1b", "microbatches": 4}}, 2)
    assert evaluate(SHAPE, c, tr, cl).parts["pp_actions"] == pytest.approx(8 * 5e-4)


def test_uneven_all_to_all_is_priced_from_its_own_fit():
    cl = dataclasses.replace(cluster_preset("h100-80g"), collectives={
        "all_to_all": {4: Fit(1e-5, 1e9)}, "all_to_all_v": {4: Fit(2e-5, 5e8)}})
    assert cl.comm_time("all_to_all", 4, 1, 1e6) == pytest.approx(2e-5 + 1e6 / 5e8)


def test_fsdp_copies_are_priced_per_byte_of_the_units_parameters():
    """FSDP2's copies into and out of its collectives' buffers: ``fsdp_byte_overhead`` × the unsharded parameter
    bytes of the units a rank holds (FSDP2: the sharded units; DDP: the whole root), per microbatch."""
    from meshplan.solver.collectives import fsdp_units
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    for plan in ({"layout": {"dp_replicate": 2}}, {"layout": {"dp_shard": 2}}):
        c, tr = _candidate(plan, 2)
        held = fsdp_units(SHAPE, c, Placement(c, SHAPE.layers, 8), 0, {})
        params = sum(n * k for _, n, _, k in held)
        without = evaluate(SHAPE, c, tr, cl).parts["overheads"]
        priced = evaluate(SHAPE, c, tr, dataclasses.replace(cl, fsdp_byte_overhead=1e-9)).parts["overheads"]
        assert priced - without == pytest.approx(params * tr.act_bytes * 1e-9)


def test_a_fit_with_points_follows_them():
    """A profiled collective follows its measured points (the time per byte grows past the caches), along the
    last segment beyond them and flat below the smallest; the line alone without points."""
    f = Fit(0.02, 5e8, points=((8192, 0.02), (1 << 22, 0.034), (1 << 24, 0.094)))
    assert f.time(1024) == f.time(8192) == 0.02
    assert f.time(1 << 22) == pytest.approx(0.034)
    assert f.time(10 << 20) == pytest.approx(0.034 + 0.5 * 0.06)
    assert f.time(1 << 25) == pytest.approx(0.094 + 0.06 / 12 * 16)  # the last segment's 5 ms per MiB
    assert Fit(0.02, 5e8).time(1e6) == pytest.approx(0.022)
    cl = dataclasses.replace(cluster_preset("h100-80g"), collectives={"all_reduce": {8: f}})
    assert Cluster.from_dict(cl.to_dict()) == cl and cl.comm_time("all_reduce", 8, 1, 1 << 24) == 0.094


def _measurement(**extra) -> dict:
    fit = {"2": {"latency": 1e-5, "bandwidth": 1e9}}
    return {"world": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "threads": 1, "memory": 1e9,
            "matmul_rates": [[64, 1e9]], "memory_rates": [[1e6, 1e10]], "hbm_bandwidth": 1e10, "op_overhead": 1e-5,
            "collectives": {k: fit for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")},
            **extra}


def test_profile_json_becomes_the_cluster_fields():
    """The ranks per core a bubble can hand over: the measured parallelism's inverse, at most the job's ranks per
    core (8 ranks on 2 cores: 0.25 cores per rank measured gives 4; 0.2, other load taking a share, still 4; 2
    ranks on 2 loaded cores, 0.63 measured: 1, the whole bubble)."""
    cl = cluster_from_measurement(_measurement(**MEASURED, world=8, cores=2, parallelism=0.25, repeat_spread=0.04,
                                               all_to_all_v={"2": {"latency": 3e-5, "bandwidth": 2e8}}))
    assert cl.oversubscription == 4.0 and cl.repeat_spread == 0.04
    assert cluster_from_measurement(_measurement(**MEASURED, world=8, cores=2, parallelism=0.2)).oversubscription == 4
    assert cluster_from_measurement(_measurement(**MEASURED, cores=2, parallelism=0.63)).oversubscription == 1.0
    assert cl.dtensor_overheads == MEASURED["dtensor_overheads"] and cl.fsdp_unit_overhead == 1e-3
    assert cluster_from_measurement(_measurement(fsdp_byte_overhead=4e-9)).fsdp_byte_overhead == 4e-9
    assert cl.collectives["all_to_all_v"][2] == Fit(3e-5, 2e8)
    assert Cluster.from_dict(cl.to_dict()) == cl


def test_estimate_reports_its_band_and_where_it_comes_from():
    from meshplan.solver.report import band_text, uncertainty
    cl = dataclasses.replace(cluster_preset("h100-80g"), repeat_spread=0.03)
    assert uncertainty(cl)["band"] == pytest.approx((0.03 ** 2 + 0.09 ** 2) ** 0.5)
    assert "±9%" in band_text(cl) and "published runs" in band_text(cl)
    profiled = cluster_from_measurement(_measurement(repeat_spread=0.05))
    assert "±5%" in band_text(profiled) and "no calibration" in band_text(profiled)


def tp_llama(layers: int):
    """examples/llama.py (dim 64, ``layers`` blocks) under plans/llama.yaml's tp rules at tp 2, on the fake group the
    caller holds (the hook and DTensor-op counting tests)."""
    import sys
    import torch
    import meshplan
    sys.path.insert(0, "examples")
    import llama
    plan = {"version": 1, "layout": {"tp": 2}, "tensor_parallel": TP}
    topo = meshplan.init(plan)
    torch.manual_seed(0)
    return meshplan.parallelize(llama.build(llama.ModelArgs(
        dim=64, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256, max_seq_len=32,
        dropout=0.0)), plan, topo)


def test_recorded_dtensor_counts_match_a_tp_step(fake_pg):
    """TP_BLOCK_OPS and TP_END_OPS are what one forward and backward of examples/llama.py under plans/llama.yaml's
    tp rules dispatches through DTensor (1 and 2 blocks: the difference is one block), by kind."""
    import torch
    from torch.distributed.tensor import DTensor
    from meshplan._torch import TorchDispatchMode, tree_leaves

    kinds = {"aten.mm.default": "mm", **{f"aten.{v}": "view" for v in (
        "t.default", "view.default", "_unsafe_view.default", "detach.default", "expand.default")}}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {k: 0 for k in TP_BLOCK_OPS}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {}))):
                self.n[kinds.get(str(func), "pointwise")] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for layers in (1, 2):
        with fake_pg(2):
            model = tp_llama(layers)
            with Count() as mode:
                out = model(torch.randint(0, 256, (2, 32)))
                (out.full_tensor() if isinstance(out, DTensor) else out).float().sum().backward()
            counts.append(mode.n)
    assert {k: counts[1][k] - counts[0][k] for k in TP_BLOCK_OPS} == TP_BLOCK_OPS
    assert {k: 2 * counts[0][k] - counts[1][k] for k in TP_BLOCK_OPS} == TP_END_OPS


def test_each_tp_collective_pays_one_redistribution():
    """tp2 with sequence parallelism over 4 blocks: 48 tp collectives per step, each a DTensor redistribution
    priced at the profile's ``redistribute`` (5 per block: the two gathers and two scatters of Megatron-SP and the
    re-gather of a saved block input; 4 at the embedding and head; loss_parallel's 3; the replicated parameters'
    one coalesced reduction)."""
    cl = dataclasses.replace(cluster_preset("h100-80g"), **MEASURED)
    with_redistribution = dataclasses.replace(cl, dtensor_overheads={**MEASURED["dtensor_overheads"],
                                                                     "redistribute": 1e-4})
    c, tr = _candidate({"layout": {"tp": 2}, "tensor_parallel": TP}, 4)
    base, priced = evaluate(SHAPE, c, tr, cl), evaluate(SHAPE, c, tr, with_redistribution)
    assert sum(x.count for x in priced.collectives if x.axis == "tp") == 5 * 8 + 4 + 3 + 1
    assert priced.parts["overheads"] - base.parts["overheads"] == pytest.approx(48 * 1e-4)
    c, tr = _candidate({"layout": {"dp_replicate": 2}}, 2)
    assert evaluate(SHAPE, c, tr, with_redistribution).parts["overheads"] == evaluate(SHAPE, c, tr, cl).parts[
        "overheads"]


def test_attention_efficiency_is_the_measured_attention_rate_over_the_matmul_peak():
    """A profile that measured attention (causal SDPA forward and backward) sets the efficiency from it; an older
    profile keeps the 0.5 assumed on a CPU."""
    assert cluster_from_measurement(_measurement(attention_rate=3e8)).attention_efficiency == pytest.approx(0.3)
    assert cluster_from_measurement(_measurement()).attention_efficiency == 0.5


def test_profile_times_dtensor_ops_with_their_backward(fake_pg):
    """The profile's DTensor kinds run forward AND backward under autograd (a tp step's ops: the backward's
    matmuls, views and pointwise ops are DTensor ops too; measured without autograd the profile saw 5-9 µs per
    op where a tp step pays ~40-130), and a redistribution is timed beside the plain collective."""
    import time
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from meshplan.profile import overheads

    calls = []

    def timed(fn, reps, window=0.0):
        t = time.perf_counter()
        fn()
        calls.append(fn)
        return time.perf_counter() - t
    with fake_pg(2):
        world, _ = overheads._rank_mesh(torch.device("cpu"))
        x = distribute_tensor(torch.randn(4, 4), world, [Replicate()])
        w = distribute_tensor(torch.randn(4, 8), world, [Shard(1)]).requires_grad_()
        assert overheads._dtensor_ops(lambda: torch.mm(x, w).backward(torch.ones_like(torch.mm(x, w)))) >= 3
        got = overheads._dtensor(timed, lambda v: v, world, torch.device("cpu"))
    assert set(got) == {"mm", "view", "pointwise", "redistribute"} and min(got.values()) >= 0
    assert len(calls) == 2 * 3 + 2  # each kind as DTensor and local; the redistribution and its plain collective


def test_ddp_parameters_are_replicated_dtensors(fake_pg):
    """``data_parallel`` mode ddp (torch's ``replicate`` on FSDP2) leaves every parameter a ``Replicate`` DTensor:
    AdamW steps DTensors (the model's ``optimizer_dispatch``), as under FSDP2."""
    import sys
    import torch
    from torch.distributed.tensor import DTensor, Replicate
    import meshplan
    sys.path.insert(0, "examples")
    import llama
    with fake_pg(2):
        plan = {"version": 1, "layout": {"dp_replicate": 2}}
        topo = meshplan.init(plan)
        torch.manual_seed(0)
        model = meshplan.parallelize(llama.build(llama.ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=4,
                                                                 vocab_size=256, ffn_dim=256, max_seq_len=32)),
                                     plan, topo)
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in params)
