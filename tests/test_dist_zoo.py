"""Real torchrun/gloo launches (world 2, 4 and 8) of ``tests/dist/zoo_worker.py``: a slice of the transformers zoo
(``benchmarks/zoo.py``), tiny float64 models with the zoo's plans on tp 2, pp 2, cp 2, ep 2, the 3-D layouts and the
vocab_parallel ends (vocab: dp_shard 2; ppvocab: pp 2 x dp_shard 2),
one ``train_step`` vs one device: loss and every gradient within 1e-9 relative."""

import os
import sys

import pytest

from _launch import case_result

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from zoo_plans import WORLD  # noqa: E402
from zoo_worker import ETP, ZOO  # noqa: E402


@pytest.fixture(scope="module")
def results(shared_launch):
    return lambda n: shared_launch("zoo_worker", n)  # one launch per world size (tests/_launch.py)


@pytest.mark.parametrize("model_type,axis", list(ZOO))
def test_zoo_axis_matches_one_device(results, model_type, axis):
    n = WORLD[axis]
    value = case_result(results(n), f"{model_type}_{axis}", n)
    bad = {r: v for r, v in value.items() if not v["ok"]}
    assert not bad, f"{model_type} {axis} ({ZOO[model_type, axis]}): {bad}"
    assert all(v["worst"] <= 1e-9 and v["loss_err"] <= 1e-9 for v in value.values()), value


@pytest.mark.parametrize("model_type", list(ETP))
def test_etp_with_edp_trains_and_checkpoints_like_one_device(results, model_type):
    """tp 2 x ep 2 x etp 2 x dp_shard 4 (edp 2): 3 clipped SGD steps (momentum) equal one device (loss, norm, every
    gradient by ``full_tensor``, the parameters), and the checkpoint loads into a plain model and into a
    parallelized one with its optimizer (parameters and momentum buffers)."""
    value = case_result(results(8), f"{model_type}_etp", 8)
    for v in value.values():
        assert v["worst"] <= 1e-9 and v["loaded_worst"] <= 1e-9, value
        assert "_StridedShard(dim=0" not in v["placements"]["gate_up_proj"], v["placements"]
