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
