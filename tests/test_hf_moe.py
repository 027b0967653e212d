"""transformers' mixture-of-experts models in meshplan plans, offline: ``from_hf(model_type, ep=…)`` writes the
expert_parallel section from the config's base_model_ep_plan (experts with the topk interface, the router found in
each MoE block), keeps no tensor-parallel rule inside an MoE block, and ``meshplan check`` accepts the plan on the
meta device; what does not fit is refused with the reason."""

import pytest
import torch

import meshplan
from meshplan import PlanError
from meshplan.hf.convert import from_hf, plan_yaml

pytestmark = pytest.mark.fast

EXPERTS = {"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.gate": "ep_router"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_converted_plan_has_the_expert_section_and_checks(arch):
    import hf_models
    assert from_hf(arch, ep=2)["layout"] == {"tp": 1, "ep": 2, "etp": 1}  # ep alone: tp 1, not a silent tp 2
    plan = from_hf(arch, ep=2, tp=2)
    assert plan["layout"] == {"tp": 2, "ep": 2, "etp": 1}
    assert plan["blocks"] == {"pattern": "model.layers.*"}
    assert plan["expert_parallel"] == {"rules": EXPERTS}
    assert not [k for k in plan["tensor_parallel"]["rules"] if ".mlp." in k]  # every layer is sparse here
    plan.pop("_origin")
    with torch.device("meta"):
        model = getattr(hf_models, arch)()
    report = meshplan.check(model, plan, world_size=4)
    assert report.ok, report.errors
    assert report.experts["interface"] == ["topk"] and report.experts["per_rank"] == [2]


def test_plan_yaml_round_trips():
    text = plan_yaml(from_hf("mixtral", ep=2))
    assert "expert_parallel:\n  rules:\n    model.layers.*.mlp.experts: ep_dispatch_experts" in text
    assert meshplan.Plan.from_data(__import__("yaml").safe_load(text)).expert_parallel.rules[
        "model.layers.*.mlp.experts"].interface == "topk"


def test_checked_in_mixtral_plan_is_the_converters():
    import yaml
    with open("plans/hf_mixtral_ep.yaml") as f:
        committed = yaml.safe_load(f)
    fresh = from_hf("mixtral", ep=2, tp=2)
    fresh.pop("_origin")
    assert committed == fresh


def test_bad_ep_is_refused_with_the_valid_values():
    import hf_models
    plan = from_hf("mixtral", ep=4)
    plan.pop("_origin")
    with torch.device("meta"):
        model = hf_models.mixtral(num_local_experts=6)
    report = meshplan.check(model, plan, world_size=8)
    assert any("ep(4) does not divide the 6 experts of model.layers.0.mlp.experts; valid ep: 1, 2, 3, 6" in str(e)
               for e in report.errors), report.errors


def test_ep_for_a_dense_model_is_refused():
    with pytest.raises(PlanError, match="ep=2 given, but LlamaForCausalLM has no experts"):
        from_hf("llama", ep=2)


def test_ep_not_dividing_the_experts_is_refused_with_the_valid_values():
    """ep 3 for the tiny models' 4 experts (world 3: tp 1; world 6: tp 2)."""
    import hf_models
    with torch.device("meta"):
        model = hf_models.mixtral()
    for tp, world in ((1, 3), (2, 6)):
        plan = from_hf("mixtral", ep=3, tp=tp)
        plan.pop("_origin")
        report = meshplan.check(model, plan, world_size=world)
        assert not report.ok and any("ep(3) does not divide the 4 experts of model.layers.0.mlp.experts; valid ep: "
                                     "1, 2, 4" in str(e) for e in report.errors), report.errors


def _inside_moe_blocks(model, rules):
    """The module paths a tensor_parallel rule claims inside an MoE block (the experts' parent)."""
    from meshplan.plan_file.patterns import match_rules
    blocks = tuple(n.rpartition(".")[0] + "." for n, m in model.named_modules() if n.endswith(".mlp.experts"))
    claimed = [p for k in rules for p in match_rules(model, {k: k}, "", errors=[])]
    return [p for p in claimed if p.startswith(blocks) or p + "." in blocks]


@pytest.mark.parametrize("arch,config", [("qwen3_moe", {"mlp_only_layers": [0]}),
                                         ("qwen2_moe", {"decoder_sparse_step": 2})])
def test_dense_layers_of_a_mixed_model_keep_their_rules(tmp_path, arch, config):
    """Qwen3-MoE's mlp_only_layers / Qwen2-MoE's decoder_sparse_step: the dense MLPs keep transformers' colwise /
    rowwise rules (layers.*.mlp.gate_proj does not reach Qwen2-MoE's mlp.shared_expert.gate_proj), no rule claims a
    module inside an MoE block, and the plan checks on the model."""
    import json

    import hf_models
    (tmp_path / "config.json").write_text(json.dumps({"model_type": arch, "num_hidden_layers": 4, **config}))
    plan = from_hf(tmp_path, ep=2)
    plan.pop("_origin")
    rules = plan["tensor_parallel"]["rules"]
    assert {k: v for k, v in rules.items() if ".mlp." in k} == {
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise"}
    assert plan["expert_parallel"] == {"rules": EXPERTS}
    with torch.device("meta"):
        model = getattr(hf_models, arch)(**config)
    assert {type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers} == {True, False}
    assert _inside_moe_blocks(model, rules) == []
    report = meshplan.check(model, plan, world_size=4)
    assert report.ok, report.errors


def test_qwen2_moe_router_is_the_gate_not_the_shared_expert_gate():
    plan = from_hf("qwen2_moe", ep=2)
    assert "model.layers.*.mlp.shared_expert_gate" not in plan["expert_parallel"]["rules"]
    assert not [k for k in plan["tensor_parallel"]["rules"] if "shared_expert" in k]


@pytest.mark.parametrize("change,count", [("drop", 0), ("add", 2)])
def test_no_single_router_per_block_is_refused_naming_the_block(change, count):
    """No router candidate, or two (a gate and a router), in an MoE block: a PlanError naming the block."""
    import hf_models

    from meshplan.hf.moe import expert_rules
    with torch.device("meta"):
        model = hf_models.mixtral()
        block = model.model.layers[1].mlp
        if change == "drop":
            block.gate = torch.nn.Identity()
        else:
            block.router = torch.nn.Linear(64, 4, bias=False)
    with pytest.raises(PlanError, match=rf"mixtral: MoE block model.layers.1.mlp has {count} router candidates"):
        expert_rules(model, model.config, "model.", {}, "mixtral")


def test_cli_convert_writes_the_expert_section(capsys):
    from meshplan.cli.main import main
    assert main(["convert", "mixtral", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "  ep: 2\n  etp: 1\n" in out and "expert_parallel:\n  rules:\n" in out


def _tiny_plan(model_type, tmp_path, **kw):
    """``(tiny model, the plan from_hf writes from its config)``; ``config=`` overrides the tiny config."""
    import json

    from meshplan.hf.tiny_models import tiny_model
    model, why = tiny_model(model_type, **kw.pop("config", {}))
    assert model is not None, why
    data = {**model.config.to_dict(), "model_type": model.config.model_type, "architectures": [type(model).__name__]}
    (tmp_path / "config.json").write_text(json.dumps(data, default=str))
    plan = from_hf(tmp_path, **kw)
    plan.pop("_origin")
    return model, plan


def test_gpt_oss_reads_the_ep_plan_and_keeps_ep_alone(capsys):
    """gpt-oss's tp_plan shards only the embedding; its base_model_ep_plan dispatches the experts. `convert --ep 2`
    keeps the layout it was given (tp 1) and names the router transformers' plan leaves out."""
    from meshplan.cli.main import main
    assert main(["convert", "gpt_oss", "--ep", "2"]) == 0
    data = __import__("yaml").safe_load(capsys.readouterr().out)
    assert data["layout"] == {"tp": 1, "ep": 2, "etp": 1}
    assert data["blocks"] == {"pattern": "model.layers.*"}
    assert data["expert_parallel"]["rules"] == {"model.layers.*.mlp.experts": {"style": "experts", "interface": "topk"},
                                                "model.layers.*.mlp.router": {"style": "router"}}
    assert main(["convert", "gpt_oss", "--ep", "2", "--tp", "2"]) == 0
    assert __import__("yaml").safe_load(capsys.readouterr().out)["layout"] == {"tp": 2, "ep": 2, "etp": 1}


def test_hunyuan_router_is_found_by_its_expert_rows():
    """HunYuan-MoE's router holds its [E, hidden] weight in a submodule (gate.wg): the gate is the router."""
    plan = from_hf("hunyuan_v1_moe", ep=2)
    assert plan["expert_parallel"]["rules"] == {"model.layers.*.mlp.experts": "ep_dispatch_experts",
                                                "model.layers.*.mlp.gate": "ep_router"}


@pytest.mark.parametrize("model_type,sp", [("gpt_oss", False), ("ernie4_5_vl_moe_text", True)])
def test_tuple_returning_moe_plans_check_at_tp2_ep2(tmp_path, model_type, sp):
    """gpt-oss (MLP returns (hidden, router_scores)) and Ernie 4.5 VL (mlp holds text_moe and vision_moe, returns
    (hidden, router_logits)): the converted plan checks at tp 2 x ep 2 (world 4: dp 2, so blocks are needed)."""
    model, plan = _tiny_plan(model_type, tmp_path, ep=2, tp=2, sequence_parallel=sp)
    report = meshplan.check(model, plan, world_size=4)
    assert report.ok, report.errors
    assert report.experts["blocks"] >= 1


def test_router_logits_recorded_inside_a_token_region_are_refused(tmp_path):
    """gpt-oss records router_logits from its router, inside the MoE block: under tp 2 with etp 1 the router sees
    each tp rank's own tokens, so the load-balancing loss would not be one device's; Ernie 4.5 VL records the
    block's own (gathered) output and is accepted."""
    model, plan = _tiny_plan("gpt_oss", tmp_path, ep=2, tp=2, sequence_parallel=False)
    model.config.output_router_logits = True
    report = meshplan.check(model, plan, world_size=4)
    assert any("records router_logits for its load-balancing loss (GptOssConfig.output_router_logits: True) from "
               "model.layers.0.mlp.router (GptOssTopKRouter)" in str(e) and "layout.etp = tp" in str(e)
               for e in report.errors), report.errors
    plan["layout"] = {"ep": 2}  # tp 1: every rank routes its own data (per-rank statistics, as data parallelism)
    assert meshplan.check(model, plan, world_size=4).ok
    ernie, plan = _tiny_plan("ernie4_5_vl_moe_text", tmp_path, ep=2, tp=2)
    ernie.config.output_router_logits = True
    report = meshplan.check(ernie, plan, world_size=4)
    assert report.ok, report.errors


def test_check_refuses_dp_with_blocks_matching_nothing_naming_the_pattern(tmp_path):
    """The converted plan names the model's repeated blocks; without them (the default layers.*) dp 2 is refused by
    `meshplan check` with the pattern that matches, as parallelize refuses it (one function, blocks_problem)."""
    from meshplan.blocks import blocks_problem
    model, plan = _tiny_plan("qwen3_moe", tmp_path, ep=2)
    assert plan["blocks"] == {"pattern": "model.layers.*"}
    assert meshplan.check(model, plan, world_size=4).ok  # dp 4 x ep 2, edp 2
    del plan["blocks"]
    report = meshplan.check(model, plan, world_size=4)
    want = ("blocks: pattern 'layers.*' matched no module of Qwen3MoeForCausalLM (top-level children: model, lm_head) "
            "(data parallelism over dp(4) x cp(1) shards each block); expected the model's repeated blocks: write "
            "`blocks: {pattern: model.layers.*}`")
    assert [str(e) for e in report.errors] == [f"<plan>: {want}"]
    lay = meshplan.Plan.from_data(plan).layout.resolve(4)
    assert str(blocks_problem(model, meshplan.Plan.from_data(plan), lay)) == want


@pytest.mark.parametrize("model_type,interface", [("llama4_text", "dense"), ("longcat_flash", "topk")])
def test_experts_without_an_ep_plan_come_from_the_tp_plan(tmp_path, model_type, interface):
    """Llama 4 and LongCat-Flash ship no base_model_ep_plan (issue 24: refused 'the tp_plan shards experts but the
    config has no base_model_ep_plan'): the experts are the tp_plan's moe_tp_experts modules, the interface read
    from their forward, the router found in each block; no tensor-parallel rule inside an MoE block (Llama 4's
    shared expert stays whole); the plan checks at tp 2 (etp 2) and tp 2 etp 1."""
    model, plan = _tiny_plan(model_type, tmp_path)
    block = {"llama4_text": "model.layers.*.feed_forward", "longcat_flash": "model.layers.*.mlp"}[model_type]
    assert plan["expert_parallel"] == {"rules": {f"{block}.experts": "experts", f"{block}.router": "ep_router"}}
    assert not [k for k in plan["tensor_parallel"]["rules"] if k.startswith(block + ".")]
    for layout in ({"tp": 2}, {"tp": 2, "etp": 1}):
        report = meshplan.check(model, {**plan, "layout": layout}, world_size=2)
        assert report.ok, (layout, report.errors)
        assert report.experts["interface"] == [interface]


def test_llama4_base_model_is_found_under_its_attribute():
    """Llama4ForCausalLM's base_model_prefix is 'language_model' but its base model sits at 'model': the tp_plan's
    paths are prefixed 'model.' (they matched nothing before)."""
    plan = from_hf("llama4_text")
    assert "model.layers.*.self_attn.q_proj" in plan["tensor_parallel"]["rules"]
    # model type llama4 (the composite config) converts its causal LM from the text config: the same plan (it
    # failed building Llama4ForCausalLM from Llama4Config: 'no attribute pad_token_id')
    assert from_hf("llama4")["expert_parallel"] == plan["expert_parallel"]


def test_longcat_zero_computation_experts_are_refused_over_ep_with_the_fix(tmp_path):
    """LongCat's gate_up_proj holds its identity experts too (6 rows), down_proj the routed ones (4): ep cannot
    split them alike; the suggestion (ep 1) checks."""
    model, plan = _tiny_plan("longcat_flash", tmp_path, ep=2)
    report = meshplan.check(model, plan, world_size=2)
    assert any("disagree on the expert count (dim 0)" in str(e) and "cannot be split over ep: set layout.ep: 1"
               in str(e) for e in report.errors), report.errors
    assert meshplan.check(model, {**plan, "layout": {"tp": 2}}, world_size=2).ok
