"""A pipeline's bubble on a host running more ranks than cores (meshplan/pipeline/costs.py ``stretch``): walked
slot by slot, not as a fluid share of the cores. Pure arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.pipeline.costs import idle_fraction, stretch
from meshplan.solver.candidate import Candidate, Training
from meshplan.solver.presets import cluster_preset
from meshplan.solver.shape import ModelShape
from meshplan.solver.step import evaluate

pytestmark = pytest.mark.fast


def _pp(p: int, m: int, schedule: str = "gpipe", v: int = 1, **kw) -> Candidate:
    return Candidate(pp=p, vpp=v, schedule=schedule, microbatches=m, micro_batch=1, **kw)


@pytest.mark.parametrize("c", [_pp(2, 4), _pp(4, 4), _pp(4, 8, "1f1b"), _pp(2, 4, "interleaved_1f1b", 2),
                               _pp(4, 8, "zbv_zero_bubble", 2)])
def test_a_core_per_rank_idles_the_whole_bubble(c):
    for o in (0.5, 1.0):
        assert stretch(c, o) == pytest.approx(1 / (1 - idle_fraction(c)))


def test_the_fill_and_drain_slots_by_hand():
    """GPipe, 4 stages, 4 microbatches, 2 ranks per core: stages busy per slot 1 2 3 4 3 2 1, each slot
    max(1, 2k/4) = 1 1 1.5 2 1.5 1 1 = 9 of a rank alone, over the 8 of a fluid share (4 busy slots × 2)."""
    assert stretch(_pp(4, 4), 2.0) == pytest.approx(9 / 8)
    # 2 stages, 4 microbatches, 2 per core: slots 1 2 2 2 1 → 1 2 2 2 1 = 8 over 8: the bubble is taken over
    assert stretch(_pp(2, 4), 2.0) == pytest.approx(1.0)
    # 4 stages, 4 per core: slots 1 2 3 4 3 2 1 → 1 2 3 4 3 2 1 = 16 over 16
    assert stretch(_pp(4, 4), 4.0) == pytest.approx(1.0)
    # 4 stages, 1.5 per core: max(1, 1.5k/4) = 1 1 1.125 1.5 1.125 1 1 = 7.75 over 6
    assert stretch(_pp(4, 4), 1.5) == pytest.approx(7.75 / 6)


def test_the_stretch_falls_from_the_bubble_to_one_as_ranks_per_core_grow():
    c = _pp(4, 4)
    got = [stretch(c, o) for o in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0)]
    assert got == sorted(got, reverse=True) and got[0] == pytest.approx(7 / 4) and got[-1] == pytest.approx(1.0)
    assert stretch(Candidate(), 2.0) == 1.0  # no pipeline


def test_the_step_prices_the_stretch():
    """``evaluate``: GPipe over 4 stages and 4 microbatches idles 3/4 of its busy time with a core per rank, 1/8 of
    it at 2 ranks per core (the same busy time: compute is priced from the cluster's rates either way)."""
    s = ModelShape(layers=4, hidden=256, heads=8, kv_heads=4, ffn=1024, vocab=256)
    tr = Training(seq=256, global_batch=4, dtype="float32")
    base = dataclasses.replace(cluster_preset("h100-80g"), gpus_per_node=4)
    one, two = (evaluate(s, _pp(4, 4), tr, dataclasses.replace(base, oversubscription=o)) for o in (1.0, 2.0))
    assert two.parts["compute"] == pytest.approx(one.parts["compute"])
    assert one.parts["bubble"] == pytest.approx(3 * two.parts["bubble"] * 8 / 4)
    assert two.parts["bubble"] > 0
