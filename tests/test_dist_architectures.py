"""Real torchrun/gloo (tp=2, one launch): Gemma2, Gemma3, Qwen3, Phi3 (gathered and packed), Olmo with
clip_qkv and torch's test Transformer with DTensor q/k/v, each with its plan from ``plans/``, in float64."""

import pytest

from _float64 import RTOL
from _launch import case_result
from examples.architectures import FACTORIES

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(shared_launch):
    return shared_launch("arch_worker", 2)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_three_adamw_steps_match_one_device(results, name):
    """float64, 3 AdamW steps: the loss and every gradient at each step, every parameter after them (key biases
    included), relative error <= ``RTOL`` (1e-9, fixed: see ``tests/_float64.py``; worst seen 8e-13, Gemma2).
    Through train_step with the model's own loss: the same loss each step and the same parameters after 3
    steps; the token count is the shifted one."""
    for rank, per_model in case_result(results, "parity", 2).items():
        worst = per_model[name]
        for kind in ("loss", "grad", "param", "train_step_loss", "train_step_param"):
            assert worst[kind][1] <= RTOL, (rank, kind, worst[kind])
        if "train_step_tokens" in worst:
            assert worst["train_step_tokens"] is True, (rank, worst)


def test_init_blocks_release_their_groups(results):
    """10 ``meshplan.init`` blocks in one launch: the threads of each rank stay flat (the groups each topology made
    are destroyed at its end, the world group stays), and the live outer topology's groups still reduce."""
    for rank, value in case_result(results, "release", 2).items():
        assert value["threads"] == value["threads"][:1] * 10, (rank, value)
        assert value["outer"][0] == value["outer"][1] >= 2, (rank, value)
