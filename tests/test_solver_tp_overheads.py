"""The tensor-parallel terms beyond DTensor dispatch (:func:`meshplan.solver.overheads.tp_overhead`): the style
hooks per block and at the ends, the collectives' time between computes, their price (a measured time times a
count from the layout), the profile fields' round trip and the measurement's shape. No process group but a fake
one."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from meshplan.plan_file.document import Plan
from meshplan.profile.run import cluster_from_measurement
from meshplan.solver.cluster import Cluster
from meshplan.solver.overheads import TP_BLOCK_HOOKS, TP_END_HOOKS, tp_hooks
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import shape_from_config
from meshplan.solver.step import evaluate

pytestmark = pytest.mark.fast

TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
SHAPE = shape_from_config(dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256))
TP_MEASURED = dict(tp_hook_overhead=1e-4, collective_busy=1e-3)


def _candidate(plan: dict, world: int):
    return candidate_from_plan(Plan.from_data({"version": 1, **plan}, "test"), world, 64, 8)


def test_hooks_per_block_and_at_each_end():
    """tp2 over 4 blocks: 4·34 + 8 hook calls per microbatch (144: benchmarks/tp_residual.py counted 144 per step
    of calibrate.py's Llama); under pp2 each stage holds 2 blocks and one end; without tp none."""
    c, _ = _candidate({"layout": {"tp": 2}, "tensor_parallel": TP}, 2)
    assert tp_hooks(SHAPE, c, Placement(c, SHAPE.layers, 8), 0) == 4 * TP_BLOCK_HOOKS + sum(TP_END_HOOKS) == 144
    c, _ = _candidate({"layout": {"tp": 2, "pp": 2}, "tensor_parallel": TP, "blocks": {"pattern": "layers.*"},
                       "pipeline": {"schedule": "1f1b", "microbatches": 4}}, 4)
    place = Placement(c, SHAPE.layers, 8)
    assert [tp_hooks(SHAPE, c, place, r) for r in (0, 1)] == [2 * TP_BLOCK_HOOKS + TP_END_HOOKS[0],
                                                              2 * TP_BLOCK_HOOKS + TP_END_HOOKS[1]]
    c, _ = _candidate({"layout": {}}, 2)
    assert tp_hooks(SHAPE, c, Placement(c, SHAPE.layers, 8), 0) == 0


def test_priced_as_hooks_and_tp_collectives_times_the_measured_times():
    """tp2: 144 hook calls and 48 tp collectives per microbatch (one microbatch), each at the profile's time; a
    preset (nothing measured) and a layout without tp price nothing."""
    cl = cluster_preset("h100-80g")
    c, tr = _candidate({"layout": {"tp": 2}, "tensor_parallel": TP}, 4)
    base, priced = evaluate(SHAPE, c, tr, cl), evaluate(SHAPE, c, tr, dataclasses.replace(cl, **TP_MEASURED))
    tp_colls = sum(x.count for x in priced.collectives if x.axis == "tp")
    assert tp_colls == 48 and c.microbatches == 1
    assert priced.parts["tp_overheads"] == pytest.approx(144 * 1e-4 + 48 * 1e-3)
    assert base.parts["tp_overheads"] == 0
    assert priced.step_time - base.step_time == pytest.approx(priced.parts["tp_overheads"])
    c, tr = _candidate({"layout": {"dp_replicate": 2}}, 2)
    assert evaluate(SHAPE, c, tr, dataclasses.replace(cl, **TP_MEASURED)).parts["tp_overheads"] == 0


def test_profile_fields_round_trip():
    fit = {"2": {"latency": 1e-5, "bandwidth": 1e9}}
    m = {"world": 2, "backend": "gloo", "device": "cpu", "dtype": "float32", "threads": 1, "memory": 1e9,
         "matmul_rates": [[64, 1e9]], "hbm_bandwidth": 1e10, "op_overhead": 1e-5,
         "collectives": {k: fit for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")},
         **TP_MEASURED}
    cl = cluster_from_measurement(m)
    assert (cl.tp_hook_overhead, cl.collective_busy) == (1e-4, 1e-3)
    assert Cluster.from_dict(cl.to_dict()) == cl
    old = {k: v for k, v in m.items() if k not in TP_MEASURED}  # a profile written before these fields
    assert cluster_from_measurement(old).tp_hook_overhead == cluster_from_measurement(old).collective_busy == 0
    with pytest.raises(ValueError, match="collective_busy = -1"):
        Cluster.from_dict({**cl.to_dict(), "collective_busy": -1})


def test_recorded_hook_counts_match_the_parallelized_model(fake_pg):
    """TP_BLOCK_HOOKS and TP_END_HOOKS are the forward pre/post hooks parallelize installs on examples/llama.py
    under plans/llama.yaml's tp rules (1 and 2 blocks: the difference is one block); each module runs once per
    microbatch, so each hook is one call."""
    from test_solver_overheads import tp_llama
    counts = []
    for layers in (1, 2):
        with fake_pg(2):
            model = tp_llama(layers)
            counts.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))
    assert counts[1] - counts[0] == TP_BLOCK_HOOKS
    assert 2 * counts[0] - counts[1] == sum(TP_END_HOOKS)


def test_profile_measures_hooks_and_busy_collectives(fake_pg):
    """The profile's hook time is styled minus plain per hook call, less the DTensor ops it dispatches; the busy
    collectives' time is each collective after a compute minus both alone (a fake group: shape and signs only)."""
    import torch
    from meshplan.profile import overheads, tp_overheads
    seen = []

    def timed(fn, reps, window=0.0):
        fn()
        seen.append(fn)
        return 1e-3 * len(seen)  # later calls "take longer": every difference positive
    with fake_pg(2):
        world, _ = overheads._rank_mesh(torch.device("cpu"))
        got = tp_overheads.measure_tp_overheads(timed, lambda v: v, world, torch.device("cpu"), 1e-4,
                                                lambda fn: overheads._dtensor_ops(fn, at_least=0))
    assert set(got) == {"tp_hook_overhead", "collective_busy"} and min(got.values()) >= 0
    assert len(seen) == 2 + 1 + 2 * 3  # styled, plain; the compute alone; each collective idle and busy
