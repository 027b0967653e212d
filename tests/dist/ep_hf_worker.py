"""Real gloo processes: transformers' mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated
shared expert; gpt-oss and Ernie 4.5 VL, whose MoE blocks return tuples, built by meshplan.hf.tiny_models),
unmodified, trained with the plan ``meshplan.hf.from_hf(model_type, ep=…)`` writes (experts from
the config's ``base_model_ep_plan``, ``interface: topk``) through ``meshplan.parallelize`` + ``meshplan.train_step``
with the model's own loss, vs one device over 3 SGD steps (momentum), in float64 (``tests/_float64.py``): every
parameter within ‖Δ‖/‖ref‖ ≤ ``RTOL``, each step's loss and gradient norm within ``RTOL`` relative (1e-9, fixed). transformers' default experts implementation (``grouped_mm``) runs on the local experts.
"""

import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from cp_worker import _compare, _train_ref, global_batch
from meshplan.hf.convert import from_hf

WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH = 4


def sgd(params):
    """SGD with momentum (chosen when this ran in float32, where AdamW amplified reduction-order noise)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def hf_moe_case(arch, layout, sequence_parallel=True, **overrides):
    """``arch`` (an examples/hf_models factory) under ``layout`` with the converted plan vs one device."""
    import hf_models
    factory = getattr(hf_models, arch)
    source = arch
    if overrides:  # the converter reads the model's own config (e.g. its dense layers), as a config.json
        source = os.path.join(tempfile.mkdtemp(prefix="meshplan-ep-hf-"), "config.json")
        with open(source, "w") as f:
            json.dump({"model_type": arch, **overrides}, f)
    return _train_both(lambda: factory(**overrides), source, layout, sequence_parallel)


def tiny_moe_case(model_type, layout, sequence_parallel=True, **overrides):
    """``meshplan.hf.tiny_models.tiny_model(model_type, **overrides)`` (any transformers MoE; a base model without a
    head is trained on :func:`hidden_loss`) under ``layout``, with the plan ``from_hf`` writes from its config, vs
    one device."""
    from meshplan.hf.tiny_models import tiny_model

    def factory():
        model, why = tiny_model(model_type, seed=0, **overrides)
        assert model is not None, why
        return model.train()
    source = _converted(model_type, layout, sequence_parallel, **overrides)[0]
    return _train_both(factory, source, layout, sequence_parallel)


def llama4_mixed_case(layout):
    """Llama 4 with dense and MoE layers interleaved (``interleave_moe_layer_step: 2``: layers 1 and 3 are MoE):
    the dense layers' feed_forward keeps transformers' colwise/rowwise rules beside the MoE blocks."""
    import transformers
    config = {"model_type": "llama4_text", "num_hidden_layers": 4, "interleave_moe_layer_step": 2,
              "hidden_size": 64, "intermediate_size": 48, "intermediate_size_mlp": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "vocab_size": 128}
    source = os.path.join(tempfile.mkdtemp(prefix="meshplan-ep-llama4-"), "config.json")
    with open(source, "w") as f:
        json.dump(config, f)
    factory = lambda: transformers.Llama4ForCausalLM(transformers.AutoConfig.for_model(**config))  # noqa: E731
    return _train_both(factory, source, layout, True)


def hidden_loss(out, y):
    """A base model's loss: per valid target, the square of its last hidden state times a fixed pattern of
    (position, feature), summed (train_step divides by the global count)."""
    h = out.last_hidden_state
    h = h.full_tensor() if isinstance(h, DTensor) else h
    pattern = torch.arange(h.shape[1] * h.shape[2], dtype=h.dtype).reshape(h.shape[1:]).mul(0.7).sin()
    return ((h * pattern).square().sum(-1) * (y != -100)).sum()


def gpt_oss_extras_case(layout):
    """gpt-oss's MLP returns ``(hidden, router_scores [B·S, top_k])``: under tp 2 x ep 2 the scores each rank gets
    (one forward, this data rank's rows) are one device's, whole and in its token order."""
    from meshplan.hf.tiny_models import tiny_model
    ref = tiny_model("gpt_oss", seed=0)[0]
    _, plan = _converted("gpt_oss", layout, False)
    topo = meshplan.build_mesh(layout)
    model = meshplan.parallelize(tiny_model("gpt_oss", seed=0)[0], plan, topo)
    seen = {}
    for name, m in (("ref", ref), ("par", model)):
        m.model.layers[0].mlp.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, out[1]))
    rows, r = GLOBAL_BATCH // topo.data_world_size, topo.data_rank
    y = global_batch(0, ref.config.vocab_size)[1].clamp(min=0)
    ref(input_ids=y)
    model(input_ids=y[r * rows:(r + 1) * rows])
    seq = y.shape[1]
    want = seen["ref"][r * rows * seq:(r + 1) * rows * seq]
    assert seen["par"].shape == want.shape, (seen["par"].shape, want.shape)
    err = float((seen["par"] - want).norm() / want.norm())
    assert err <= 1e-5, err
    return {"worst": err, "shape": list(want.shape)}


def _converted(model_type, layout, sequence_parallel, **overrides):
    """``(config.json folder, the plan from_hf writes for the tiny model_type under layout)``."""
    from meshplan.hf.tiny_models import tiny_model
    model = tiny_model(model_type, seed=0, **overrides)[0]
    folder = tempfile.mkdtemp(prefix="meshplan-ep-tiny-")
    data = {**model.config.to_dict(), "model_type": model.config.model_type, "architectures": [type(model).__name__]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(data, f, default=str)
    plan = from_hf(folder, ep=layout.get("ep", 1), tp=layout.get("tp", 1), sequence_parallel=sequence_parallel)
    plan.pop("_origin")
    plan["layout"] = layout
    return folder, plan


def _train_both(factory, source, layout, sequence_parallel):
    """The model ``factory()`` builds trained 3 SGD steps on one device, then with the converted plan under
    ``layout``; compared by :func:`_compare`."""
    torch.manual_seed(0)
    ref = float64_model(factory())
    vocab = ref.config.vocab_size
    own = ref.get_output_embeddings() is not None  # a causal LM: its own loss; a base model: hidden_loss
    count = lambda y: (y != -100).sum().clamp(min=1)  # noqa: E731
    ref_loss = ((lambda m, y: m(input_ids=y.clamp(min=0), labels=y).loss) if own else
                (lambda m, y: hidden_loss(m(input_ids=y.clamp(min=0)), y) / count(y)))
    ref_losses, ref_norms = _train_ref(ref, lambda s: (global_batch(s, vocab)[1],), ref_loss, sgd)
    plan = from_hf(source, ep=layout.get("ep", 1), tp=layout.get("tp", 1), sequence_parallel=sequence_parallel,
                   loss_parallel=own)
    plan.pop("_origin")
    plan["layout"] = layout
    report = meshplan.check(ref, plan, world_size=WORLD)  # check ok => it runs (the blocks included, at dp > 1)
    assert report.ok, report.errors
    topo = meshplan.build_mesh(layout)
    torch.manual_seed(0)
    model = meshplan.parallelize(float64_model(factory()), plan, topo)
    opt = sgd(model.parameters())
    rows, r = GLOBAL_BATCH // topo.data_world_size, topo.data_rank
    results = []
    for s in range(3):
        y = global_batch(s, vocab)[1][r * rows:(r + 1) * rows]
        batch = {"input_ids": y.clamp(min=0), "labels": y} if own else ({"input_ids": y.clamp(min=0)}, y)
        results.append(meshplan.train_step(model, batch, None if own else hidden_loss, opt, max_grad_norm=0.5))
    return _compare(model, ref, results, ref_losses, ref_norms)


#: Gemma 4 with its MoE block (the tiny config has none: enable_moe_block is False by default)
GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48}

CASES = {
    2: {
        "mixtral_ep2": lambda: hf_moe_case("mixtral", {"ep": 2}),
        "qwen2_moe_ep2": lambda: hf_moe_case("qwen2_moe", {"ep": 2}),
        # no base_model_ep_plan: experts from the tp_plan's moe_tp_experts. Llama 4: experts(x) takes every token
        # once per expert (interface dense), the block returns [B·S, hidden]; its FFN split over etp = tp 2.
        # LongCat-Flash: identity (zero-computation) experts beside the routed ones, counted once over etp
        "llama4_text_tp2": lambda: tiny_moe_case("llama4_text", {"tp": 2}),
        "llama4_text_tp2_etp1": lambda: tiny_moe_case("llama4_text", {"tp": 2, "etp": 1}),
        "longcat_flash_tp2": lambda: tiny_moe_case("longcat_flash", {"tp": 2}),
        "llama4_mixed_tp2": lambda: llama4_mixed_case({"tp": 2}),
        # issue 24: gpt-oss's experts split over etp = tp (interleaved gate/up, 2-D biases, down bias added once);
        # MuseSpark's post_expert_norm inside the experts (etp 1: whole, summed over tp); Gemma 4's experts beside
        # its dense MLP in the decoder layer (the ep plan's tp entries), at tp 2 (etp 2) and ep 2
        "gpt_oss_tp2_etp2": lambda: tiny_moe_case("gpt_oss", {"tp": 2, "etp": 2}, sequence_parallel=False),
        "muse_spark_text_tp2_etp1": lambda: tiny_moe_case("muse_spark_text", {"tp": 2, "etp": 1},
                                                          sequence_parallel=False),
        "gemma4_moe_tp2_etp2": lambda: tiny_moe_case("gemma4_text", {"tp": 2, "etp": 2}, sequence_parallel=False,
                                                     **GEMMA4_MOE),
        "gemma4_moe_ep2": lambda: tiny_moe_case("gemma4_text", {"ep": 2}, sequence_parallel=False, **GEMMA4_MOE),
    },
    4: {
        "mixtral_ep4": lambda: hf_moe_case("mixtral", {"ep": 4}),
        "mixtral_tp2_ep2": lambda: hf_moe_case("mixtral", {"tp": 2, "ep": 2, "etp": 1}),
        "mixtral_tp2_etp2": lambda: hf_moe_case("mixtral", {"tp": 2, "ep": 2, "etp": 2}),
        "qwen3_moe_ep2_edp2": lambda: hf_moe_case("qwen3_moe", {"ep": 2}),
        "qwen3_moe_tp2_ep2": lambda: hf_moe_case("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1}),
        "qwen2_moe_tp2_ep2": lambda: hf_moe_case("qwen2_moe", {"tp": 2, "ep": 2, "etp": 1}),
        # dense MLP layers (mlp_only_layers) keep transformers' colwise/rowwise rules beside the MoE blocks
        "qwen3_moe_mixed_tp2_ep2": lambda: hf_moe_case("qwen3_moe", {"tp": 2, "ep": 2, "etp": 1},
                                                       mlp_only_layers=[0]),
        "qwen2_moe_tp2_ep2_no_sp": lambda: hf_moe_case("qwen2_moe", {"tp": 2, "ep": 2, "etp": 1},
                                                       sequence_parallel=False),
        # MoE blocks returning tuples: gpt-oss (hidden, router_scores [B·S, k]); Ernie 4.5 VL (hidden, router_logits)
        # from an mlp holding text_moe and vision_moe (one token region around both) and a shared expert
        # transformers' gpt-oss tp_plan covers no attention module: sequence_parallel false (attention whole per rank)
        "gpt_oss_ep2_edp2": lambda: tiny_moe_case("gpt_oss", {"ep": 2}, sequence_parallel=False),
        "gpt_oss_tp2_ep2": lambda: tiny_moe_case("gpt_oss", {"tp": 2, "ep": 2, "etp": 1}, sequence_parallel=False),
        "gpt_oss_extras_tp2_ep2": lambda: gpt_oss_extras_case({"tp": 2, "ep": 2, "etp": 1}),
        "gpt_oss_tp2_ep2_etp2": lambda: tiny_moe_case("gpt_oss", {"tp": 2, "ep": 2, "etp": 2},
                                                      sequence_parallel=False),
        "ernie_vl_tp2_ep2": lambda: tiny_moe_case("ernie4_5_vl_moe_text", {"tp": 2, "ep": 2, "etp": 1}),
        "ernie_vl_tp2_ep2_no_sp": lambda: tiny_moe_case("ernie4_5_vl_moe_text", {"tp": 2, "ep": 2, "etp": 1},
                                                        sequence_parallel=False),
        # LongCat-Flash's identity experts are refused over ep: the fix (ep 1) runs, here beside dp 2 (FSDP2)
        "longcat_flash_tp2_dp2": lambda: tiny_moe_case("longcat_flash", {"tp": 2, "ep": 1}),
    },
}

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return CASES[WORLD], keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
