"""Real torchrun/gloo launches (world 2 and 8) of ``tests/dist/zoo_worker.py``: a slice of the transformers zoo
(``benchmarks/zoo.py``), tiny float64 models with the zoo's plans on tp 2, pp 2, cp 2, ep 2 and the 3-D layouts,
one ``train_step`` vs one device: loss and every gradient within 1e-9 relative."""

import os
import sys

import pytest

from _launch import case_result, launch

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from zoo_plans import WORLD  # noqa: E402
from zoo_worker import ZOO  # noqa: E402


@pytest.fixture(scope="module")
def results():
    launches: dict = {}

    def of(n: int) -> dict:
        if n not in launches:  # one launch per world size
            launches[n] = launch("tests/dist/zoo_worker.py", n)
        return launches[n]
    return of


@pytest.mark.parametrize("model_type,axis", list(ZOO))
def test_zoo_axis_matches_one_device(results, model_type, axis):
    n = WORLD[axis]
    value = case_result(results(n), f"{model_type}_{axis}", n)
    bad = {r: v for r, v in value.items() if not v["ok"]}
    assert not bad, f"{model_type} {axis} ({ZOO[model_type, axis]}): {bad}"
    assert all(v["worst"] <= 1e-9 and v["loss_err"] <= 1e-9 for v in value.values()), value
