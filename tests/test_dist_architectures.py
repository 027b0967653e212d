"""Real torchrun/gloo (tp=2, one launch): Gemma2, Gemma3, Qwen3, Phi3 (gathered and packed), Olmo with
clip_qkv and torch's test Transformer with DTensor q/k/v, each with its plan from ``plans/``."""

import pytest

from _launch import case_result, launch
from examples.architectures import FACTORIES

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results():
    return launch("tests/dist/arch_worker.py", 2)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_three_adamw_steps_match_one_device(results, name):
    """Loss at each of 3 AdamW steps and every gradient of the first: relative error <= 1e-5. Later gradients
    and every parameter after 3 steps: <= max(1e-5, 3 x the noise floor), the larger distance of two one-device
    runs that only sum in other orders (see arch_worker.py: Gemma2's floor is ~4e-5; for the others it is
    below 1e-5, so they are held to 1e-5). Key biases are judged by their gradients (tests/test_dist_hf.py).
    Through train_step with the model's own loss: the same loss each step and the same parameters after 3
    steps; the token count is the shifted one."""
    for rank, per_model in case_result(results, "parity", 2).items():
        worst = per_model[name]
        grad_tol, param_tol = max(1e-5, 3 * worst["floor_grad"]), max(1e-5, 3 * worst["floor_param"])
        assert worst["loss"] <= 1e-5 and worst["first_step_grad"] <= 1e-5, (rank, worst)
        assert worst["grad"] <= grad_tol and worst["param"][1] <= param_tol, (rank, worst)
        if "train_step_param" in worst:
            assert worst["train_step_loss"] <= 1e-5 and worst["train_step_param"] <= param_tol, (rank, worst)
            assert worst["train_step_tokens"] is True, (rank, worst)
