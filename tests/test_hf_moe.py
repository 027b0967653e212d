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
    plan = from_hf(arch, ep=2)
    assert plan["layout"] == {"tp": 2, "ep": 2, "etp": 1}
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
    fresh = from_hf("mixtral", ep=2)
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
