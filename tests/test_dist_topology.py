"""Real torchrun/gloo launches (world 4 and 8) for init and topology."""

import pytest

from _launch import case_result, launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[4, 8])
def results(request):
    return request.param, launch("tests/dist/topology_worker.py", request.param)


def test_groups_reduce_over_engine_ranks(results):
    n, res = results
    values = case_result(res, "init_and_groups", n)
    assert len({tuple(v) for v in values.values()}) == 1  # same fingerprints everywhere


def test_layout_mismatch_fails_on_every_rank(results):
    n, res = results
    assert set(case_result(res, "mismatch", n).values()) == {"raised"}


@pytest.mark.parametrize("case, where", [("init_plan_mismatch", "meshplan.init"),
                                         ("parallelize_plan_mismatch", "meshplan.parallelize")])
def test_plan_mismatch_fails_on_every_rank_with_a_diff(results, case, where):
    n, res = results
    values = case_result(res, case, n)
    messages = {v["message"] for v in values.values()}
    assert len(messages) == 1, messages  # the same one line everywhere
    msg = messages.pop()
    assert "\n" not in msg
    assert msg.startswith(f"ranks disagree on the plan given to {where}: "), msg
    assert "tensor_parallel.sequence_parallel: rank 0 has false, rank 1 has true" in msg, msg
    assert "tensor_parallel.rules.'layers.*.b'.style: rank 0 has \"rowwise\", rank 1 has \"colwise\"" in msg, msg
    assert msg.endswith("every rank must load the same plan"), msg
    if case == "parallelize_plan_mismatch":
        assert "rank(s) [1] pass another plan than they gave meshplan.init" in msg, msg
    assert max(v["seconds"] for v in values.values()) < 30  # no hang until the process-group timeout (120 s)
