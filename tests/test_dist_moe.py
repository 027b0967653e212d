"""Real torchrun/gloo launches (world 2 and 4) of ``tests/dist/moe_worker.py``: the example MoE decoder trained with
expert parallelism through ``meshplan.parallelize`` + ``meshplan.train_step`` matches one device over 3 AdamW steps
in float64 (parameters, losses and gradient norms within ``RTOL``, 1e-9 fixed: ``tests/_float64.py``), for ep over the data ranks (ep 2, 4; expert FSDP over edp, 1 local expert over edp 2 included;
DDP; HSDP), ep folded over tp (tp 2 × ep 2 and tp 2 × ep 4 with etp 1, with and without sequence parallelism;
the checked-in plans/moe.yaml), experts split over etp = tp 2, a shared expert with a dense first layer, activation checkpointing and pp 2 × ep 2.
"""

import pytest

from _float64 import RTOL
from _launch import case_result

pytestmark = pytest.mark.dist

CASES = {
    2: ["ep2", "ep2_shared_dense", "ep2_checkpointed", "ep2_ddp", "ep1_tp2", "ep2_tp2_sp", "etp2", "etp2_no_sp",
        "cp2_ep2"],
    4: ["ep4", "ep2_tp2_sp", "ep2_tp2_plan_file", "ep2_tp2_no_sp", "ep2_edp2", "ep2_edp2_one_expert", "ep2_hsdp", "ep4_tp2", "ep2_etp2",
        "ep2_etp2_no_sp", "pp2_ep2"],
    8: ["ep2_etp2_edp2", "ep4_tp2_edp2"],
}
META_INIT = {
    2: ["ep2_meta_init"],
    4: ["ep2_tp2_meta_init", "ep2_etp2_meta_init", "ep2_edp2_one_expert_meta_init"],
}


@pytest.fixture(scope="module")
def results(shared_launch):
    return lambda n: shared_launch("moe_worker", n)  # one launch per world size (tests/_launch.py)


@pytest.mark.parametrize("n,case", [(n, c) for n, cases in CASES.items() for c in cases])
def test_matches_one_device(results, n, case):
    value = case_result(results(n), case, n)
    assert all(v["worst"] <= RTOL for v in value.values()), value


@pytest.mark.parametrize("n,case", [(n, c) for n, cases in META_INIT.items() for c in cases])
def test_meta_init_equals_one_device(results, n, case):
    case_result(results(n), case, n)  # every parameter exactly the one-device one (expert shards included)


def test_sharded_init_then_training(results):
    """materialize(mode="sharded") at ep 2 × tp 2: experts and shards are slices of one process's draws, replicas
    bit-identical, before and after 3 SGD steps with finite losses (tests/dist/init_sharded.py)."""
    values = case_result(results(4), "ep2_tp2_sharded_init", 4)
    assert all(v["replicated"] > 0 and v["held"] < v["total"] for v in values.values()), values


def test_tp_ranks_route_each_token_once(results):
    values = case_result(results(4), "tokens_once", 4)
    assert {v["copies"] for v in values.values()} == {512}  # 4 × 32 tokens × top-2 × dp 2 = the global batch's copies
