"""``from_hf`` on the MoE models whose ep plans hold more than experts (issue 24's last tp refusals), offline.

Gemma 4 and DiffusionGemma ship tp styles for the dense MLP in ``base_model_ep_plan``; MuseSpark a
``replicated_with_grad_allreduce`` on a norm inside its experts; gpt-oss keeps biases beside its experts and
interleaves ``gate|up``; Inkling's router also scores its shared expert. Each converts, and ``meshplan check``
accepts the plan or refuses it with a fix that checks. Real gloo runs: tests/dist/zoo_worker.py (tp 2)."""

import pytest
import torch

import meshplan
from meshplan import PlanError
from test_hf_moe import _tiny_plan  # (tiny model, the plan from_hf writes); config= overrides the tiny config

pytestmark = pytest.mark.fast


def test_gemma4_without_experts_is_dense(tmp_path):
    """Without enable_moe_block Gemma 4 holds no experts: a dense plan (no expert section), checked at tp 2."""
    model, plan = _tiny_plan("gemma4_text", tmp_path, sequence_parallel=False, loss_parallel=False)
    assert "expert_parallel" not in plan and plan["layout"] == {"tp": 2}
    assert plan["tensor_parallel"]["rules"]["model.layers.*.mlp.gate_proj"] == "colwise"
    report = meshplan.check(model, plan, world_size=2)
    assert report.ok, report.errors
    with pytest.raises(PlanError, match="has no experts"):
        _tiny_plan("gemma4_text", tmp_path, ep=2)


GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48}


@pytest.mark.parametrize("model_type,prefix,config", [("gemma4_text", "model.", GEMMA4_MOE),
                                                      ("diffusion_gemma_text", "", {})])
def test_gemma4_moe_ep_plan_dense_entries_are_the_tp_plans(tmp_path, model_type, prefix, config):
    """Gemma 4 with experts: the ep plan's 'mlp.gate_proj: colwise' is the tp plan's rule (not a refusal); the
    experts and the router (children of the decoder layer, the MoE block) go to the expert section; the plan
    checks at tp 2 (etp 2: the layer sees the tp group's tokens) and at ep 2."""
    model, plan = _tiny_plan(model_type, tmp_path, sequence_parallel=False, loss_parallel=False, config=config)
    assert plan["expert_parallel"]["rules"] == {f"{prefix}layers.*.experts": "ep_dispatch_experts",
                                                f"{prefix}layers.*.router": "ep_router"}
    assert plan["layout"] == {"tp": 2, "etp": 2}  # the MoE block is the decoder layer: it needs all its tokens
    for layout in ({"tp": 2}, {"ep": 2}):
        report = meshplan.check(model, {**plan, "layout": layout}, world_size=2)
        assert report.ok, (layout, report.errors)
    refused = meshplan.check(model, {**plan, "layout": {"tp": 2, "etp": 1}}, world_size=2)
    assert any(f"MoE block {prefix}layers.0 is a whole layer" in str(e) and "set layout.etp: 2" in str(e)
               for e in refused.errors), refused.errors
    _, plan = _tiny_plan(model_type, tmp_path, ep=2, tp=2, config=config)
    assert plan["layout"] == {"tp": 2, "ep": 2, "etp": 2}


def test_ep_plan_tp_style_without_a_tp_rule_becomes_one():
    """An ep-plan entry in a transformers tp style that the tp_plan does not rule becomes that tp rule; an entry
    inside the experts is left to the experts rule; a style meshplan does not know is refused, naming it."""
    from meshplan.hf.moe import _ep_entries
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.up = torch.nn.Linear(4, 8)
    model.mlp.experts = torch.nn.Module()
    model.mlp.experts.norm = torch.nn.LayerNorm(4)
    ep_plan = {"mlp.up": "colwise", "mlp.experts.norm": "replicated_with_grad_allreduce",
               "mlp.experts": "ep_dispatch_experts", "mlp.experts.w": "grouped_gemm"}
    assert _ep_entries(model, ep_plan, "", {}, "toy") == ({"mlp.experts": "ep_dispatch_experts"}, {"mlp.up": "colwise"})
    assert _ep_entries(model, ep_plan, "", {"mlp.up": "rowwise"}, "toy")[1] == {}  # the tp_plan's rule stands
    with pytest.raises(PlanError, match=r"toy: base_model_ep_plan rule 'mlp.up': transformers style 'fancy' has no "
                                        r"meshplan equivalent \(meshplan maps ep_dispatch_experts, ep_router"):
        _ep_entries(model, {"mlp.up": "fancy"}, "", {}, "toy")


def test_muse_spark_norm_inside_the_experts(tmp_path):
    """MuseSpark runs post_expert_norm inside its experts: etp = tp would normalise partial sums and ep > 1 would
    leave the norm's gradient one ep rank's; both are refused with the fix, and the fix (etp 1) checks."""
    model, plan = _tiny_plan("muse_spark_text", tmp_path, sequence_parallel=False, loss_parallel=False)
    assert plan["expert_parallel"]["rules"] == {"layers.*.mlp.experts": "ep_dispatch_experts",
                                                "layers.*.mlp.gate": "ep_router"}
    assert not [k for k in plan["tensor_parallel"]["rules"] if "post_expert_norm" in k]
    refused = meshplan.check(model, {**plan, "layout": {"tp": 2}}, world_size=2)
    assert any("also runs post_expert_norm (MuseSparkTextInputScaledRMSNorm, with parameters) inside the experts"
               in str(e) and "set layout.etp: 1" in str(e) for e in refused.errors), refused.errors
    assert meshplan.check(model, plan, world_size=2).ok  # from_hf's own layout: tp 2, etp 1
    refused = meshplan.check(model, {**plan, "layout": {"ep": 2}}, world_size=2)
    assert any("with ep(2) > 1 its gradient would cover one ep rank's experts only; set layout.ep: 1" in str(e)
               for e in refused.errors), refused.errors


def test_inkling_router_scores_the_shared_expert_too(tmp_path):
    """Inkling's gate.weight is [routed + shared, hidden]: the gate is the router, and etp reads the model dim."""
    from meshplan.expert_parallel.etp import model_dim
    model, plan = _tiny_plan("inkling_text", tmp_path, sequence_parallel=False, loss_parallel=False)
    assert plan["expert_parallel"]["rules"]["model.layers.*.mlp.gate"] == "ep_router"
    block = model.model.layers[0].mlp
    assert model_dim(block.gate, block.experts.num_experts) == model.config.hidden_size
    report = meshplan.check(model, {**plan, "layout": {"tp": 2}}, world_size=2)
    assert report.ok, report.errors


def test_gpt_oss_etp_splits_interleaved_pairs_and_adds_the_out_bias_once():
    """gpt-oss' experts at etp 2: the 2-D gate_up bias follows gate_up on the FFN side, split contiguously (the
    gate/up pairs are interleaved, is_concatenated False), and down_proj_bias [E, dim] has no FFN dim."""
    from meshplan.expert_parallel.etp import MODEL_SIDE, ffn_dims
    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model("gpt_oss")
    assert model is not None, why
    experts = model.model.layers[0].mlp.experts
    dim = model.config.hidden_size
    assert experts.is_concatenated is False
    assert ffn_dims(experts, dim, 2, "x") == {"gate_up_proj": (2, 1), "gate_up_proj_bias": (1, 1),
                                              "down_proj": (1, 1), "down_proj_bias": MODEL_SIDE}
    experts.is_concatenated = True  # a [gate | up] layout: the halves split separately
    assert ffn_dims(experts, dim, 2, "x")["gate_up_proj"] == (2, 2)
    with pytest.raises(PlanError, match=r"x: etp\(3\) does not divide the FFN size"):
        ffn_dims(experts, dim, 3, "x")


def test_etp_once_adds_on_the_first_rank_and_passes_the_gradient():
    from meshplan.expert_parallel.etp import EtpOnce
    for first in (True, False):
        x = torch.arange(3.0, requires_grad=True)
        y = EtpOnce.apply(x, first)
        assert torch.equal(y, x.detach() if first else torch.zeros(3))
        y.backward(torch.ones(3))
        assert torch.equal(x.grad, torch.ones(3))  # every etp rank: the whole gradient of the summed rows


def test_no_structure_rule_inside_a_decoder_layer_moe_block(tmp_path):
    """DiffusionGemma's MoE block is the whole decoder layer: the stream norms inside it get no rule (at ep 2 with
    sequence parallelism a norm rule there made the attention's input a DTensor: a crash on real gloo), and check
    refuses such a rule even at tp 1, where a tensor_parallel section still makes the block a token region."""
    model, plan = _tiny_plan("diffusion_gemma_text", tmp_path, ep=2)
    assert not [k for k in plan["tensor_parallel"]["rules"] if k.startswith("layers.")], plan["tensor_parallel"]
    model, plan = _tiny_plan("diffusion_gemma_text", tmp_path, ep=2, sequence_parallel=False, loss_parallel=False)
    assert meshplan.check(model, plan, world_size=2).ok
    plan["tensor_parallel"]["rules"]["layers.*.input_layernorm"] = "norm"
    refused = meshplan.check(model, plan, world_size=2)
    assert any("'layers.*.input_layernorm' (norm) claims layers.0.input_layernorm, inside the MoE block layers.0, a "
               "token region of plain tensors" in str(e) for e in refused.errors), refused.errors


def test_token_region_of_a_layer_list_is_each_layer():
    """Decoder layers holding experts (numbered children of a list) are each their own region; named siblings
    (Ernie's text_moe and vision_moe) share their parent."""
    from meshplan.expert_parallel.apply import token_region_of
    assert token_region_of(["model.layers.0", "model.layers.1"]) == {"model.layers.0": "model.layers.0",
                                                                     "model.layers.1": "model.layers.1"}
    assert token_region_of(["l.0.mlp.text_moe", "l.0.mlp.vision_moe"]) == {"l.0.mlp.text_moe": "l.0.mlp",
                                                                           "l.0.mlp.vision_moe": "l.0.mlp"}
