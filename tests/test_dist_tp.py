"""Real torchrun/gloo launches (world 2 and 4): TP parity over 3 AdamW steps in float64 (dropout 0 and > 0), dropout
streams."""

import pytest

from _float64 import RTOL
from _launch import case_result

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[2, 4])
def results(request, shared_launch):
    return request.param, shared_launch("tp_worker", request.param)


def test_three_adamw_steps_match_one_device(results):
    """float64: every parameter after 3 AdamW steps within ``RTOL`` (1e-9, fixed) of one device."""
    n, res = results
    values = case_result(res, "parity", n)
    for rank, per_config in values.items():
        assert len(per_config) == (6 if n == 2 else 12)
        assert max(per_config.values()) <= RTOL, per_config


def test_three_adamw_steps_with_dropout_match_one_device(results):
    """dropout_rng single_device: dropout 0.1 everywhere, SP off/on/batch, loss_parallel on/off, checkpointing."""
    n, res = results
    values = case_result(res, "dropout_parity", n)
    for rank, per_config in values.items():
        assert len(per_config) == (6 if n == 2 else 12) + 2
        assert max(per_config.values()) <= RTOL, per_config


def test_dropout_streams_per_shard_and_shared(results):
    n, res = results
    assert set(case_result(res, "dropout_streams", n).values()) == {"ok"}


def test_dropout_training_keeps_replicas_in_sync(results):
    n, res = results
    case_result(res, "dropout_training", n)
