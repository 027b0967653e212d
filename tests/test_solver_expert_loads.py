"""The routing's imbalance (:func:`meshplan.solver.moe_costs.expert_imbalance`): a model shape's measured
``expert_loads`` checked and read from a config; an expert-parallel layout priced on its busiest rank (the expert
matmuls' FLOPs, the rows its all-to-alls move, the memory of its received rows), nothing else moved, and a layout
without ep, or a balanced routing, priced exactly as before. Pure arithmetic: no process group."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from meshplan.errors import PlanError
from meshplan.expert_parallel.costs import ep_collectives
from meshplan.plan_file.document import Plan
from meshplan.solver.compute import block_time
from meshplan.solver.moe_costs import expert_imbalance
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import ModelShape, shape_from_config
from meshplan.solver.step import evaluate, peak_memory

pytestmark = pytest.mark.fast

#: calibrate.py's MoE: 8 experts (width 512) over hidden 256, top-2, 4 layers
CONFIG = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=1024, moe_hidden=512,
              n_experts=8, top_k=2)
BALANCED = shape_from_config(CONFIG)
#: two sample rows: experts 0-3 draw 3/4 of the tokens in the first, the second is even
LOADS = ((30, 20, 15, 10, 5, 5, 5, 10), (10,) * 8)
SKEWED = shape_from_config({**CONFIG, "expert_loads": [list(r) for r in LOADS]})
EP = yaml.safe_load(open("plans/moe.yaml"))["expert_parallel"]


def _candidate(plan: dict, world: int, seq: int = 256, batch: int = 16):
    return candidate_from_plan(Plan.from_data({"version": 1, **plan}, "test"), world, seq, batch)


def test_imbalance_is_the_busiest_contiguous_rank_over_the_mean_averaged_over_rows():
    # ep 2: (75, 25) and (40, 40) -> 1.5 and 1; ep 4: (50, 25, 10, 15) over 25 -> 2, and 1; ep 8: 30/12.5 -> 2.4, 1
    assert expert_imbalance(SKEWED, 2) == pytest.approx(1.25)
    assert expert_imbalance(SKEWED, 4) == pytest.approx(1.5)
    assert expert_imbalance(SKEWED, 8) == pytest.approx(1.7)
    assert expert_imbalance(SKEWED, 1) == 1.0 and expert_imbalance(BALANCED, 8) == 1.0
    even = shape_from_config({**CONFIG, "expert_loads": [7] * 8})  # one row alone: a flat list
    assert even.expert_loads == ((7.0,) * 8,) and expert_imbalance(even, 4) == 1.0


def test_loads_are_checked_and_hashable():
    assert SKEWED.expert_loads == tuple(tuple(float(v) for v in r) for r in LOADS) and hash(SKEWED)
    with pytest.raises(PlanError, match=r"rows of experts\(8\) token counts .*got \[7\] counts per row"):
        shape_from_config({**CONFIG, "expert_loads": [1] * 7})
    with pytest.raises(PlanError, match="a list of rows of token counts per expert; got int 5"):
        shape_from_config({**CONFIG, "expert_loads": 5})
    for bad in ([[1] * 7 + [-1]], [[0] * 8], [[True] * 8], [[float("nan")] + [1] * 7], [[float("inf")] * 8]):
        with pytest.raises(PlanError, match="each >= 0 and each row's sum > 0"):
            shape_from_config({**CONFIG, "expert_loads": bad})
    with pytest.raises(PlanError, match=r"experts\(0\)"):
        ModelShape(layers=1, hidden=8, heads=1, kv_heads=1, ffn=8, vocab=8, expert_loads=(1, 1))
    dense = shape_from_config({k: v for k, v in {**CONFIG, "expert_loads": [1] * 8}.items() if k != "n_experts"})
    assert dense.expert_loads == ()  # a dense config's loads are dropped with its other MoE fields


def test_ep_block_pays_the_busiest_ranks_expert_flops_and_nothing_else():
    cl = cluster_preset("h100-80g")
    for plan, world in (({"layout": {"ep": 2}, "expert_parallel": EP}, 2),
                        ({"layout": {"ep": 4}, "expert_parallel": EP}, 4)):
        c, tr = _candidate(plan, world)
        r = expert_imbalance(SKEWED, c.ep)
        (t0, f0), (t1, f1) = (block_time(s, c, tr, cl, True, False) for s in (BALANCED, SKEWED))
        tokens = c.rank_tokens(tr.seq)
        experts = 2 * tokens * 2 * 3 * 256 * 512 * 3  # rows x (gate, up, down) x forward and backward
        assert f1 - f0 == pytest.approx((r - 1) * experts)
        assert t1 > t0
        assert block_time(SKEWED, c, tr, cl, False, False) == block_time(BALANCED, c, tr, cl, False, False)
    one, tr = _candidate({"layout": {}}, 2)  # no ep: every rank runs every expert on its own tokens
    assert block_time(SKEWED, one, tr, cl, True, False) == block_time(BALANCED, one, tr, cl, True, False)
    assert evaluate(SKEWED, one, tr, cl).step_time == evaluate(BALANCED, one, tr, cl).step_time


def test_ep_all_to_all_moves_the_busiest_ranks_rows_and_memory_holds_them():
    c, tr = _candidate({"layout": {"ep": 4}, "expert_parallel": EP}, 4)
    place = Placement(c, 4, 8)
    (counts0, rows0), (counts1, rows1) = (ep_collectives(s, c, tr, place, 0, {}) for s in (BALANCED, SKEWED))
    assert counts1 == counts0
    assert rows1.nbytes == pytest.approx(1.5 * rows0.nbytes) and rows1.count == rows0.count
    m0, m1 = (peak_memory(s, c, tr, place)[0] for s in (BALANCED, SKEWED))
    assert m1.activations > m0.activations and m1.params == m0.params
    one, tr1 = _candidate({"layout": {}}, 4)
    place1 = Placement(one, 4, 8)
    assert peak_memory(SKEWED, one, tr1, place1)[0] == peak_memory(BALANCED, one, tr1, place1)[0]


def test_a_balanced_routing_prices_exactly_as_no_loads():
    even = dataclasses.replace(BALANCED, expert_loads=((5,) * 8, (9,) * 8))
    cl = cluster_preset("h100-80g")
    for plan, world in (({"layout": {"ep": 2}, "expert_parallel": EP}, 2), ({"layout": {}}, 2)):
        c, tr = _candidate(plan, world)
        assert evaluate(even, c, tr, cl).step_time == evaluate(BALANCED, c, tr, cl).step_time


def test_calibrate_measures_the_routers_counts_of_the_model_it_runs():
    """benchmarks/calibrate.py's loads: a row per MoE layer and batch, every token's top-2 copies counted (no
    capacity drops), and the MoE's config carries them into the shape the solver prices."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate.py"
    spec = importlib.util.spec_from_file_location("calibrate_under_test", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    rows = cal.expert_loads(steps=1)
    assert len(rows) == cal.LAYERS and all(len(r) == 8 and sum(r) == cal.BATCH * cal.SEQ * 2 for r in rows)
    shape = shape_from_config(cal.model_config("moe"))
    assert len(shape.expert_loads) == 3 * cal.LAYERS and expert_imbalance(shape, 8) > 1
    assert "expert_loads" not in cal.model_config("llama")
