"""Real torchrun/gloo launches (world 2 and 4): expert-parallel dispatch and combine (``tests/dist/ep_worker.py``):
the rows each rank sends equal the router's assignment per destination, uniform and skewed routing, and the
backward returns every row its expert's gradient; the example MoE layer with ExpertParallel experts matches one
device (outputs, expert and router gradients)."""

import pytest

from _launch import case_result

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[2, 4])
def world(request, shared_launch):
    return request.param, shared_launch("ep_worker", request.param)


@pytest.mark.parametrize("case", ["uniform", "skewed", "one_expert_each"])
def test_dispatch_follows_the_router(world, case):
    n, results = world
    values = case_result(results, case, n)
    sent = [v["sent"] for v in values.values()]
    received = [values[r]["received"] for r in range(n)]
    assert [[sent[s][d] for s in range(n)] for d in range(n)] == received  # what leaves s for d arrives at d


@pytest.mark.parametrize("case", ["moe_layer", "moe_layer_shared"])
def test_moe_layer_matches_one_device(world, case):
    n, results = world
    case_result(results, case, n)
