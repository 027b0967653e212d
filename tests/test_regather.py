"""``tensor_parallel.save_gathered_inputs`` without processes (fake process groups: exact shapes and bytes,
counted collectives): the saved activation bytes per layer are one device's / tp with the option off (the
default), the forward's collectives are unchanged and the backward adds one all-gather per SP block input, and
under activation checkpointing the re-gather stands aside. (Numerics: real gloo runs in tests/test_dist_dp.py.)"""

import pytest
import torch

import meshplan
from meshplan.checks.dry_run import fake_group
from meshplan.plan_file.tensor_parallel import TensorParallel

pytestmark = pytest.mark.fast

TP_RULES = {
    "tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm", "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise", "norm": "norm", "output": "lm_head",
}


def _model(tp, save, blocks=None):
    import llama
    args = llama.tiny_args(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=64, n_layers=2)
    torch.manual_seed(0)
    model = llama.build(args)
    plan = {"layout": {"tp": tp}, "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True,
                                                      "rules": TP_RULES, "save_gathered_inputs": save}}
    if blocks:
        plan["blocks"] = blocks
    meshplan.parallelize(model, plan, meshplan.build_mesh(plan["layout"]))
    x = torch.randint(0, args.vocab_size, (2, 64))
    return model, x


def _saved_per_layer(tp, save, blocks=None):
    with fake_group(tp):
        model, x = _model(tp, save, blocks)
        return meshplan.memory(model, lambda: meshplan.cross_entropy(model(x), x)).per_layer()


def test_default_is_off():
    assert TensorParallel().save_gathered_inputs is False


@pytest.mark.parametrize("tp", [2, 4])
def test_saved_bytes_per_layer_are_one_devices_over_tp(tp):
    one = _saved_per_layer(1, True)
    assert _saved_per_layer(tp, False) == one / tp
    assert _saved_per_layer(tp, True) > one / tp  # stock DTensor TP+SP keeps each gathered block input


def _counts(tp, save, blocks=None):
    from benchmarks._comm import CommLog  # counts by op and group; CommDebugMode's module tracker fails on recompute
    with fake_group(tp):
        model, x = _model(tp, save, blocks)
        with CommLog() as fwd:
            loss = meshplan.cross_entropy(model(x), x)
        with CommLog() as bwd:
            loss.backward()
        return dict(fwd.by_group()), dict(bwd.by_group())


def test_backward_adds_one_all_gather_per_block_input():
    (f_saved, b_saved), (f_re, b_re) = _counts(2, True), _counts(2, False)
    assert f_re == f_saved
    gather = "all_gather@2"
    assert b_re[gather] - b_saved[gather] == 4  # 2 layers x (attention, feed_forward)
    assert {k: v for k, v in b_re.items() if k != gather} == {k: v for k, v in b_saved.items() if k != gather}


def test_stands_aside_under_activation_checkpointing():
    full = {"pattern": "layers.*", "activation_checkpointing": {"mode": "full"}}
    assert _counts(2, False, full) == _counts(2, True, full)  # the recompute gathers; nothing more
    assert _saved_per_layer(2, False, full) == _saved_per_layer(2, True, full)


def test_a_forward_without_backward_leaves_nothing_alive():
    """A forward whose backward never runs frees its graph with the model: the pack hook keeps a tensor it does
    not replace detached, so a saved output (SDPA's, rsqrt's) holds no reference cycle through its own grad_fn,
    which Python's gc cannot see (found as ~440 MiB a phase on pp 2 x tp 2's first stage, docs/scale.md)."""
    import gc
    import weakref
    with fake_group(2):
        model, x = _model(2, False)
        loss = meshplan.cross_entropy(model(x), x)
        ref = weakref.ref(model.layers[0].attention.wq.weight)
        del model, loss
        gc.collect()
        assert ref() is None
