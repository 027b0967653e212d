"""Real torchrun/gloo launches (world 2, 4, 8): context parallelism ± TP (SP, loss parallel) ± FSDP ± pipeline, on the
example Llama and transformers' Llama, vs one device in float64 (see ``tests/dist/cp_worker.py``): parameters, losses and
norms within ``RTOL`` (1e-9, fixed: ``tests/_float64.py``) after 3 AdamW steps; refusals stop the step before a parameter
moves."""

import pytest

from _float64 import RTOL
from _launch import case_result

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def world2(shared_launch):
    return shared_launch("cp_worker", 2)


@pytest.fixture(scope="module")
def world4(shared_launch):
    return shared_launch("cp_worker", 4)


def _check(results, case, n):
    values = case_result(results, case, n)
    assert all(v["worst"] <= RTOL for v in values.values()), values
    assert len({tuple(v["loss"]) for v in values.values()}) == 1  # every rank reports the global loss


@pytest.mark.parametrize("case", ["cp2", "cp2_unbalanced", "cp2_microbatches", "cp2_hf_llama", "cp2_hf_qwen2", "cp2_checkpointed",
                                  "cp2_checkpointed_block_reads_table",
                                  # packed documents (position ids restarting) and sliding windows (issue 30)
                                  "cp2_hf_packed", "cp2_hf_packed_cached", "cp2_mistral_window", "cp2_mistral_window_packed",
                                  "cp2_qwen2_window", "cp2_gemma3", "cp2_cohere2", "cp2_ministral", "cp2_olmo3",
                                  "cp2_exaone4",
                                  # meshplan's own ring attention (issue 30)
                                  "ring_kernel", "ring_cp2", "ring_cp2_unbalanced_checkpointed", "ring_cp2_hf_llama",
                                  # the ring with documents, windows, soft-caps
                                  "ring_cp2_hf_packed", "ring_cp2_mistral_window_packed", "ring_cp2_gemma3",
                                  "ring_cp2_cohere2"])
def test_cp2(world2, case):
    _check(world2, case, 2)


def test_wrong_positions_are_seen(world2):
    assert all("missed" in v for v in case_result(world2, "teeth", 2).values())


def test_shard_sequence_for_an_own_loop(world2):
    assert len(case_result(world2, "eval_shards", 2)) == 2


def test_hand_checkpoint_is_refused(world2):
    """A checkpoint the plan did not apply would recompute with the full RoPE table: backward stops, naming the fix."""
    values = case_result(world2, "hand_checkpoint_refused", 2)
    assert len(values) == 2 and all("outside the model's forward" in v["refused"] for v in values.values()), values


def test_refusals(world2):
    values = case_result(world2, "refusals", 2)
    assert len(values) == 2


@pytest.fixture(scope="module")
def world8(shared_launch):
    return shared_launch("cp_worker", 8)


@pytest.mark.parametrize("case", ["cp4", "cp2_tp2_sp", "cp2_dp_shard2", "cp2_tp2_hf_llama", "cp2_tp2_hf_packed",
                                  "cp2_tp2_gemma3_softcap", "pp2_cp2", "ring_kernel_cp4",
                                  "ring_cp4", "ring_cp2_tp2_sp", "ring_cp2_tp2_hf_llama", "ring_cp4_hf_packed",
                                  "ring_cp4_mistral_window", "ring_cp2_tp2_hf_packed", "ring_cp2_tp2_gemma3_softcap",
                                  # packed documents laid out per document, balanced by work
                                  "ring_cp2_tp2_hf_packed_by_docs"])
def test_cp_composed(world4, case):
    _check(world4, case, 4)


@pytest.mark.parametrize("case", ["pp2_cp2_tp2", "cp2_tp2_dp_shard2"])
def test_cp_on_8_ranks(world8, case):
    _check(world8, case, 8)
