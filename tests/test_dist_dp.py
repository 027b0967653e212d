"""Real torchrun/gloo launches (world 2, 4, 8): data parallelism ± TP vs one device, and collective counts.

Parity: train_step and hand-written loops (``loop_*``: loss / global count, ``backward`` per microbatch,
``meshplan.clip_grad_norm_``, ``opt.step``; with FSDP2 reducing every microbatch or only the last), 3 AdamW steps
with clipping (the reference's norm exceeds max_norm every step), float64, the same
global batch with very uneven valid-token counts per rank (one row has none); every parameter within
‖Δ‖/‖ref‖ ≤ ``RTOL``, the step's loss and pre-clip norm within ``RTOL`` relative (1e-9, fixed:
``tests/_float64.py``).
"""

import pytest

from _float64 import RTOL
from _launch import case_result

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def world2(shared_launch):
    return shared_launch("dp_worker", 2)


@pytest.fixture(scope="module")
def world4(shared_launch):
    return shared_launch("dp_worker", 4)


@pytest.fixture(scope="module")
def world8(shared_launch):
    return shared_launch("dp_worker", 8)


def _parity(results, case, n):
    values = case_result(results, case, n)
    first = values[0]
    assert first["worst"] <= RTOL, first
    assert all(v["tokens"] == first["tokens"] for v in values.values())  # one global count everywhere
    assert len(set(first["tokens"])) > 1 or first["tokens"][0] > 0


@pytest.mark.parametrize("case", ["fsdp", "fsdp_accum2", "fsdp_accum2_sharded", "ddp", "fsdp_ac_selective",
                                  "tp_only", "tp_only_batch", "tp_only_batch_no_dp_section", "loop_tp_only_accum2",
                                  "loop_tp_only_batch", "fsdp_vocab_ends", "fsdp_vocab_ends_accum2",
                                  "fsdp_vocab_ends_accum2_sharded", "fsdp_vocab_ends_tied",
                                  "loop_fsdp_vocab_ends_accum2", "fsdp_chunked_rs", "fsdp_chunked_rs_accum2_sharded",
                                  "fsdp_vocab_ends_chunked_rs_accum2", "fsdp_no_prefetch_accum2_sharded"])
def test_parity_world2(world2, case):
    _parity(world2, case, 2)


@pytest.mark.parametrize("case", ["fsdp_tp", "hsdp", "ddp_tp", "fsdp_tp_loss_parallel", "fsdp_tp_batch",
                                  "fsdp_reshard2_accum2", "loop_fsdp_tp", "loop_fsdp_tp_accum2", "loop_fsdp_tp_nosync2",
                                  "loop_ddp_tp_accum2", "loop_fsdp_tp_batch", "hsdp_chunked_rs"])
def test_parity_world4(world4, case):
    _parity(world4, case, 4)


@pytest.mark.parametrize("case", ["hsdp_tp_accum2", "loop_hsdp_tp_nosync2"])
def test_parity_world8(world8, case):
    _parity(world8, case, 8)


@pytest.mark.parametrize("case", ["regather_tp4", "regather_tp4_saved", "regather_tp2_fsdp_ac_full",
                                  "regather_tp2_fsdp_ac_selective", "regather_tp2_fsdp_ac_megatron",
                                  "regather_tp2_fsdp_every2", "regather_tp2_fsdp_saved"])
def test_sp_regather_parity_world4(world4, case):
    """save_gathered_inputs false (the default) and true, tp 4; tp 2 with FSDP, ± activation checkpointing."""
    _parity(world4, case, 4)


def test_sp_regather_parity_world8(world8):
    _parity(world8, "regather_tp4_fsdp2", 8)


def test_sp_regather_adds_one_backward_all_gather_per_block_input(world4):
    counts = case_result(world4, "regather_counts_tp4", 4)[0]
    saved, regather = counts["true"], counts["false"]
    assert regather["forward"] == saved["forward"]  # the same forward
    extra = {k: regather["backward"].get(k, 0) - v for k, v in saved["backward"].items()}
    assert extra == {"reduce_scatter@4": 0, "all_gather@4": 4, "all_reduce@4": 0}  # 2 layers x (attention, mlp)


def test_meta_init_and_load_under_fsdp_over_tp(world4):
    case_result(world4, "meta_init_and_load_fsdp_tp", 4)


def test_sharded_init_under_fsdp_over_tp(world4):
    """materialize(mode="sharded") at tp 2 × fsdp 2: shards are slices of one process's draws, replicas
    bit-identical, before and after 3 SGD steps with finite losses (tests/dist/init_sharded.py)."""
    values = case_result(world4, "sharded_init_fsdp_tp", 4)
    assert all(v["replicated"] > 0 and v["held"] < v["total"] for v in values.values()), values


def test_sharded_init_views_on_real_ranks(world4):
    """Writes through views of a tp 4 column-sharded weight land in each real rank's own columns."""
    values = case_result(world4, "sharded_init_views_tp4", 4)
    assert [values[r]["columns"] for r in range(4)] == [[0, 4], [4, 8], [8, 12], [12, 16]]


def test_mixed_precision(world2):
    case_result(world2, "mixed_precision", 2)


def test_mean_of_means_is_caught(world2):
    """Per-rank mean losses with averaged gradients miss the reference by far more than the tolerance."""
    assert case_result(world2, "control_mean_of_means", 2)[0] > 1e-3


def test_fsdp_collectives_per_step(world2):
    one = case_result(world2, "counts_fsdp", 2)[0]
    # the embedding, 2 blocks, [norm, output] (the root holds nothing): all-gather 4 in forward + 2 in backward
    # (the head stays gathered; the embedding's backward reads only the token ids), 4 reduce-scatters;
    # train_step adds 2 small all-reduces (token count; grad norm² + loss sum)
    assert one == {"all_gather@2": 6, "reduce_scatter@2": 4, "all_reduce@2": 2}
    accum = case_result(world2, "counts_fsdp_accum2", 2)[0]
    assert accum == {"all_gather@2": 4, "reduce_scatter@2": 4, "all_reduce@2": 2}  # gathered once per step
    sharded = case_result(world2, "counts_fsdp_accum2_sharded", 2)[0]
    assert sharded == {"all_gather@2": 12, "reduce_scatter@2": 8, "all_reduce@2": 2}
    assert case_result(world2, "counts_ddp_accum2", 2)[0] == {"all_reduce@2": 3}  # one bucket, once


def test_vocab_ends_collectives_per_step(world2):
    """``ends: vocab_parallel``: no all-gather or reduce-scatter of the embedding's or the head's weight; the tokens'
    activations move instead: the embedding all-gathers the token ids and reduce-scatters its output (forward),
    all-gathers the output's gradient (backward); the head all-gathers its input and exchanges the logits (gloo:
    DTensor's all-to-all is an all-gather), the same for the logits' gradient, and reduce-scatters the input's
    gradient; the root unit (the final norm) gathers once and reduce-scatters once; the blocks as before (4 + 2)."""
    assert case_result(world2, "counts_fsdp_vocab_ends", 2)[0] == {"all_gather@2": 4 + 2 + 3 + 1,
                                                                   "reduce_scatter@2": 2 + 1 + 1 + 1, "all_reduce@2": 2}


def test_chunked_reduce_scatter_equals_gloo_and_frees_its_input(world2):
    assert case_result(world2, "chunked_reduce_scatter", 2)[0] == "ChunkedReduceScatter(piece_bytes=64)"


def test_vocab_ends_from_meta_keep_their_rows_gradients(world2):
    assert case_result(world2, "vocab_ends_from_meta", 2)[0] <= RTOL


def test_vocab_ends_mean_divides_like_fsdp(world2):
    assert case_result(world2, "vocab_ends_mean", 2)[0] <= RTOL
    assert case_result(world2, "vocab_ends_mean_tied", 2)[0] <= RTOL


def test_hsdp_collectives_with_accumulation(world4):
    c = case_result(world4, "counts_hsdp_accum2", 4)[0]
    assert c == {"all_gather@2": 4, "reduce_scatter@2": 4, "all_reduce@2": 4, "all_reduce@4": 2}


def test_norm_grads_one_tp_all_reduce_per_step_under_fsdp(world4):
    # all_reduce@2 are the tp all-reduces (dp reduces with reduce-scatters, the step's own all-reduces are @4)
    eager = case_result(world4, "counts_fsdp_tp_eager", 4)[0]
    assert eager["all_reduce@2"] == 1  # a hand-written loop: ONE for the 5 norm grads (FSDP2 alone: 5)
    first, last = case_result(world4, "counts_fsdp_tp_eager_nosync2", 4)[0]
    assert "all_reduce@2" not in first and last["all_reduce@2"] == 1  # no-sync microbatch: nothing reduced yet
    step = case_result(world4, "counts_fsdp_tp", 4)[0]
    assert step["all_reduce@2"] == 1 and step["all_reduce@4"] == 2
    accum = case_result(world4, "counts_fsdp_tp_accum2", 4)[0]
    assert accum["all_reduce@2"] == 1  # still one for two microbatches
    tp_gathers = step["all_gather@2"] - 6  # the sequence-parallel all-gathers of one microbatch
    assert accum["all_gather@2"] == 4 + 2 * tp_gathers  # FSDP gathers each unit once per step


@pytest.mark.parametrize("case,data,microbatches", [
    ("counts_fsdp_vocab_ends", {"ends": "vocab_parallel"}, 1),
    ("counts_fsdp_vocab_ends_accum2", {"ends": "vocab_parallel"}, 2),
    ("counts_fsdp_vocab_ends_accum2_sharded", {"ends": "vocab_parallel", "accumulate_unsharded": False}, 2),
    ("counts_fsdp", {}, 1),
])
def test_vocab_ends_collectives_equal_estimate(world2, case, data, microbatches):
    """``ends: vocab_parallel`` on gloo world 2 (the tiny llama, 2 blocks): per microbatch the embedding's ids
    all-gather, output reduce-scatter and gradient all-gather, the head's input all-gather, its logits' all-to-all
    both ways (an all-gather on a CPU mesh) and its input-gradient reduce-scatter; FSDP2 gathers the blocks and
    the root (the norm alone). ``meshplan estimate``'s counts equal the run's."""
    import llama

    from meshplan.checks.model_shape import shape_of_model
    from meshplan.plan_file.document import Plan
    from meshplan.solver.collectives import step_collectives
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    measured = case_result(world2, case, 2)[0]
    shape = shape_of_model(llama.build(llama.tiny_args()))[0]
    plan = Plan.from_data({"layout": {"dp_shard": 2}, "data_parallel": data}, source=case)
    cand, train = candidate_from_plan(plan, 2, 16, 8, microbatches=microbatches)
    counts: dict[str, int] = {}
    for x in step_collectives(shape, cand, train, Placement(cand, shape.layers, 8), 0):
        kind = "all_gather" if x.kind == "all_to_all" else x.kind  # DTensor's CPU stand-in for the all-to-all
        counts[f"{kind}@{x.group.size}"] = counts.get(f"{kind}@{x.group.size}", 0) + x.count
    assert counts == measured
    expected = {"counts_fsdp_vocab_ends": (10, 5), "counts_fsdp_vocab_ends_accum2": (13, 7),
                "counts_fsdp_vocab_ends_accum2_sharded": (20, 10), "counts_fsdp": (6, 4)}[case]
    assert (measured["all_gather@2"], measured["reduce_scatter@2"]) == expected
