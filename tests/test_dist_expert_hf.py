"""Real torchrun/gloo launches (world 2 and 4) of ``tests/dist/ep_hf_worker.py``: transformers' Mixtral, Qwen3-MoE
and Qwen2-MoE (gated shared expert), unmodified, with the plan ``meshplan.hf.from_hf(model_type, ep=…)`` writes,
match one device over 3 SGD steps in float64 (parameters, losses and gradient norms within ``RTOL``, 1e-9): ep over the data ranks
(ep 2, ep 4, expert FSDP over edp 2), ep folded over tp (tp 2 × ep 2, etp 1, with and without sequence
parallelism; Qwen3-MoE with a dense MLP layer, which keeps its tp rules), and Mixtral's packed gate_up split over
etp = tp 2. MoE blocks that return tuples (gpt-oss's ``(hidden, router_scores)``, Ernie 4.5 VL's mlp holding text
and vision experts, ``(hidden, router_logits)``) at tp 2 x ep 2 and ep 2 x edp 2, with the router scores each rank
sees equal to one device's. Llama 4 (experts taking every token, interface dense; etp 2 and etp 1; dense and MoE
layers interleaved) and LongCat-Flash (identity experts, etp 2) at tp 2 and tp 2 × dp 2 (the fix of its ep refusal), converted without a
base_model_ep_plan. gpt-oss's experts over etp = tp (interleaved gate/up,
biases; tp 2 and tp 2 x ep 2 x etp 2), MuseSpark (a norm inside its experts, etp 1) and Gemma 4 with its MoE block
(tp 2, ep 2) at world 2. Every converted plan passes ``meshplan check`` first (blocks included: dp > 1)."""

import pytest

from _float64 import RTOL
from _launch import case_result

pytestmark = pytest.mark.dist

CASES = {
    2: ["mixtral_ep2", "qwen2_moe_ep2", "llama4_text_tp2", "llama4_text_tp2_etp1", "longcat_flash_tp2",
        "llama4_mixed_tp2", "gpt_oss_tp2_etp2", "muse_spark_text_tp2_etp1", "gemma4_moe_tp2_etp2", "gemma4_moe_ep2"],
    4: ["mixtral_ep4", "mixtral_tp2_ep2", "mixtral_tp2_etp2", "qwen3_moe_ep2_edp2", "qwen3_moe_tp2_ep2",
        "qwen3_moe_mixed_tp2_ep2", "qwen2_moe_tp2_ep2", "qwen2_moe_tp2_ep2_no_sp", "gpt_oss_ep2_edp2",
        "gpt_oss_tp2_ep2", "gpt_oss_extras_tp2_ep2", "gpt_oss_tp2_ep2_etp2", "ernie_vl_tp2_ep2",
        "ernie_vl_tp2_ep2_no_sp", "longcat_flash_tp2_dp2"],
}


@pytest.fixture(scope="module")
def results(shared_launch):
    return lambda n: shared_launch("ep_hf_worker", n)  # one launch per world size (tests/_launch.py)


@pytest.mark.parametrize("n,case", [(n, c) for n, cases in CASES.items() for c in cases])
def test_matches_one_device(results, n, case):
    value = case_result(results(n), case, n)
    assert all(v["worst"] <= RTOL for v in value.values()), value
