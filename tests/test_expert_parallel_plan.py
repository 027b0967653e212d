"""The ``expert_parallel`` plan section and its checks, without processes (fake process groups): the rules and
their aliases, the validation with valid values, ``meshplan check``'s line, what ``parallelize`` builds at world 8
(expert shards over ep, FSDP2 over edp, the MoE blocks as tp token regions), and the ``topk`` interface on a
transformers experts module at ep 1 (one device's numbers)."""

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshplan
from meshplan import PlanError
from meshplan.checks.dry_run import fake_group
from meshplan.expert_parallel.apply import check_expert_parallel
from meshplan.plan_file.document import Plan
from meshplan.plan_file.expert_parallel import ExpertParallel, ExpertsRule, RouterRule
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.tensor_parallel import TensorParallel

pytestmark = pytest.mark.fast

RULES = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}


def meta_moe(**kw):
    import moe
    with torch.device("meta"):
        return moe.build(moe.tiny_args(**kw))


def resolved(world=8, **layout):
    return Layout.model_validate(layout).resolve(world)


def test_rules_short_long_and_transformers_spellings():
    s = ExpertParallel.model_validate({"rules": {**RULES, "x.experts": {"style": "experts", "interface": "topk"},
                                                 "y.experts": "ep_dispatch_experts", "y.gate": "ep_router"}})
    assert s.rules["layers.*.moe.experts"] == ExpertsRule(style="experts")
    assert s.rules["x.experts"].interface == "topk" and s.rules["y.experts"].interface == "topk"
    assert isinstance(s.rules["y.gate"], RouterRule)


@pytest.mark.parametrize("rules,match", [
    ({"layers.*.moe.router": "router"}, "names no experts module"),
    ({"a": "colwise"}, "does not match any of the expected tags|'experts', 'router'"),
    ({"a": {"style": "experts", "dim": 1}}, "Extra inputs are not permitted"),
    ({"a..b": "experts"}, "empty path segment"),
])
def test_bad_sections(rules, match):
    with pytest.raises(ValueError, match=match):
        Plan.from_data({"expert_parallel": {"rules": rules}})


def test_the_blocks_of_the_example():
    blocks = check_expert_parallel(meta_moe(n_experts=8), ExpertParallel(rules=RULES), resolved(ep=2))
    assert [(b.path, b.experts, b.router, b.num_experts, b.interface) for b in blocks] == [
        (f"layers.{i}.moe", f"layers.{i}.moe.experts", f"layers.{i}.moe.router", 8, "sorted") for i in range(2)]


@pytest.mark.parametrize("model_kw,layout,rules,match", [
    ({"n_experts": 6}, dict(ep=4), RULES, r"ep\(4\) does not divide the 6 experts of layers.0.moe.experts; "
                                          r"valid ep: 1, 2, 3, 6"),
    ({}, dict(tp=4, ep=2, etp=2), RULES, r"layout.etp\(2\) must be 1 .* or tp\(4\) .*; valid etp: 1, 4"),
    ({"moe_hidden": 90}, dict(tp=4, ep=2), RULES, r"etp\(4\) does not divide the FFN size 90 of w1 \(4, 90, 64\); "
                                                   r"valid etp: 1, 2, 3, 5, 6, 9"),
    ({"moe_hidden": 64}, dict(tp=2, ep=2), RULES, r"cannot tell the FFN dim of w1 \(4, 64, 64\) from the model dim"),
    ({}, dict(ep=2), {"layers.*.moe.experts": "experts"}, r"MoE block layers.0.moe .* holds 0 router modules"),
    ({}, dict(ep=2), {**RULES, "layers.*.attention": "router"}, r"router layers.0.attention is in no MoE block"),
    ({}, dict(ep=2), {"layers.*.moe.experts": "experts", "layers.*.moe.nothing": "router"},
     r"'layers.\*.moe.nothing': matches no module"),
    ({}, dict(ep=2), {"layers.*.moe.router": "experts", "layers.*.moe.experts": "router"},
     r"experts module layers.0.moe.router \(TopKRouter\) has no parameters of its own; expected grouped weights"),
])
def test_refusals_name_the_values(model_kw, layout, rules, match):
    with pytest.raises(PlanError, match=match):
        check_expert_parallel(meta_moe(**model_kw), ExpertParallel(rules=rules), resolved(**layout))


def test_ffn_dims_for_etp():
    blocks = check_expert_parallel(meta_moe(), ExpertParallel(rules=RULES), resolved(tp=2, ep=2))
    assert blocks[0].ffn == (("w1", 1, 1), ("w2", 2, 1), ("w3", 1, 1))  # [E, hidden, dim], [E, dim, hidden]


def test_top_k_above_the_expert_count():
    model = meta_moe(n_experts=4)
    model.layers[1].moe.router.top_k = 5
    with pytest.raises(PlanError, match=r"layers.1.moe routes each token to top_k\(5\) of 4 experts"):
        check_expert_parallel(model, ExpertParallel(rules=RULES), resolved(ep=2))


def test_no_tensor_parallel_rule_inside_a_block():
    with pytest.raises(PlanError, match=r"'layers.\*.moe.shared_expert.w1' \(colwise\) claims "
                                        r"layers.0.moe.shared_expert.w1, inside the MoE block layers.0.moe"):
        check_expert_parallel(meta_moe(shared_expert=True), ExpertParallel(rules=RULES),
                              resolved(tp=2, ep=2, etp=1), tp_rules=TensorParallel.model_validate({"rules": {"layers.*.moe.shared_expert.w1": "colwise"}}).rules)


def _check(*args, config='{"n_experts": 8, "shared_expert": true}'):
    return subprocess.run([sys.executable, "-m", "meshplan", "check", "plans/moe.yaml", "--model", "moe:build",
                           "--config", config, *args], capture_output=True, text=True, timeout=300)


def test_meshplan_check_line_and_json():
    text = _check("--world-size", "8")
    assert text.returncode == 0, text.stderr
    assert ("expert parallel: ep 2 × etp 1, edp 4 (expert gradients summed over edp, FSDP2/DDP over edp); experts: "
            "layers.*.moe.experts (4 blocks, 8 experts, 4 per rank, interface sorted)") in text.stdout
    assert "layers.*.moe.experts.w1" not in text.stdout  # sharded over ep: not listed as unsharded
    assert "layers.*.moe.router.gate.weight (in an MoE block: each tp rank routes its own tokens" in text.stdout
    doc = json.loads(_check("--world-size", "8", "--format", "json").stdout)
    assert doc["experts"]["per_rank"] == [4] and doc["experts"]["edp"] == 4


def test_meshplan_check_refuses_in_one_line():
    out = _check("--world-size", "8", "--ep", "4", config='{"n_experts": 6}')
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert "ep(4) does not divide the 6 experts of layers.0.moe.experts; valid ep: 1, 2, 3, 6" in out.stdout


def test_parallelize_at_world_8_on_a_fake_group():
    import moe
    plan = meshplan.load_plan("plans/moe.yaml")
    with fake_group(8):
        topo = meshplan.build_mesh(plan.layout)  # tp 2 × dp 2 ... ; ep 2, edp 4
        with torch.device("meta"):
            model = moe.build(moe.tiny_args(n_experts=8, shared_expert=True))
        meshplan.parallelize(model, plan, topo)
    state = meshplan.parallel_state(model)
    w1 = model.layers[0].moe.experts.w1
    assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names == ("edp", "ep")
    assert w1.to_local().shape == (1, 96, 64)  # 8 experts / ep 2 = 4 per rank, FSDP2 over edp 4 → 1
    assert state.expert_parallel.edp == 4 and len(state.expert_parallel.blocks) == 2
    assert "layers.0.moe.shared_expert.w1.weight" in state.grad_sync.plain  # summed over tp
    assert not any("experts" in n for n in state.grad_sync.names)


def test_ep_without_a_section_is_refused():
    import moe
    with fake_group(2):
        topo = meshplan.build_mesh({"ep": 2})
        with torch.device("meta"):
            model = moe.build(moe.tiny_args())
        with pytest.raises(PlanError, match=r"layout.ep\(2\) > 1 needs an expert_parallel section"):
            meshplan.parallelize(model, {"layout": {"ep": 2}}, topo)


def test_topk_interface_on_a_transformers_experts_module():
    """transformers' MixtralExperts under the experts style at ep 1 computes what it computes alone: the copies
    sorted by expert, local ids and weight 1 in, gate weights applied where the copies return; an index equal to
    the expert count (transformers' "no expert") adds nothing."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from meshplan.expert_parallel.experts import ExpertParallel as Style
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4)
    ref = MixtralExperts(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    mine = MixtralExperts(cfg)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(10, 16)
    idx = torch.randint(0, 4, (10, 2))
    idx[3, 1] = 4  # dropped
    w = torch.rand(10, 2)
    want = ref(x, idx, w)
    want.square().sum().backward()
    with fake_group(1):
        parallelize_module(mine, meshplan.build_mesh({})["ep"], Style(interface="topk"))
        got = mine(x, idx, w)
        got.square().sum().backward()
    assert torch.allclose(got, want, atol=1e-6)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.allclose(getattr(mine, name).grad.to_local(), getattr(ref, name).grad, atol=1e-5), name
    assert isinstance(mine.gate_up_proj, DTensor)  # the DTensors are back after the forward
