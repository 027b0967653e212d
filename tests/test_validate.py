"""meshplan.check: every validation rule and its message (plan file, rule, module path, found vs expected),
all errors collected, the meta-device dry run, the model left untouched."""

import copy

import pytest
import torch
import torch.nn as nn

import llama
import meshplan
from examples.hf_models import gpt2
from examples.hf_models import llama as hf_llama
from meshplan import PlanError

pytestmark = pytest.mark.fast
HF = meshplan.load_plan("plans/hf_llama.yaml").model_dump(exclude_unset=True)


def meta(factory, *a, **k):
    with torch.device("meta"):
        return factory(*a, **k)


@pytest.fixture(scope="module")
def model():
    return meta(hf_llama)


def plan(update=None, drop=(), **tp):
    d = copy.deepcopy(HF)
    d["tensor_parallel"]["rules"].update(update or {})
    for k in drop:
        d["tensor_parallel"]["rules"].pop(k)
    d["tensor_parallel"].update(tp)
    d.pop("layout")
    return d


def errors(model, p, **kw):
    report = meshplan.check(model, p, **kw)
    assert not report.ok
    return [str(e) for e in report.errors]


@pytest.mark.parametrize("factory, path, world", [
    (hf_llama, "plans/hf_llama.yaml", 2), (gpt2, "plans/gpt2.yaml", 2),
    (lambda: llama.build(llama.tiny_args()), "plans/llama.yaml", 8),
])
def test_shipped_plans_are_valid(factory, path, world):
    report = meshplan.check(meta(factory), path, world_size=world)
    assert report.ok, report.errors
    assert report.tp == 2 and report.totals["parameters_per_rank"] < report.totals["parameters"]
    assert all(r["torch_style"] for r in report.modules)


def test_unmatched_rule_names_closest_paths(model):
    (e,) = errors(model, plan({"model.layers.*.self_attn.qproj": "colwise"}))
    assert e.startswith("tensor_parallel.rules.'model.layers.*.self_attn.qproj': matches no module of LlamaForCausalLM")
    assert "found none, expected at least one; closest module paths: model.layers.0.self_attn.q_proj" in e


def test_conflicting_rules(model):
    (e,) = errors(model, plan({"model.layers.*.*.o_proj": "colwise"}))
    assert ("module 'model.layers.0.self_attn.o_proj' is claimed by 'model.layers.*.self_attn.o_proj' (rowwise) and "
            "'model.layers.*.*.o_proj' (colwise)") in e and "(and 1 more module(s) of the same rule)" in e


def test_style_must_fit_module(model):
    es = errors(model, plan({"model.layers.*.input_layernorm": "colwise", "model.layers.*.mlp": "embedding"}))
    assert any("module 'model.layers.0.mlp' is LlamaMLP; style embedding expects nn.Embedding" in e for e in es)
    assert any("'model.layers.0.input_layernorm' is LlamaRMSNorm; style colwise expects nn.Linear" in e for e in es)


def test_heads_and_config_divisibility(model):
    es = errors(model, "plans/hf_llama.yaml", world_size=4, layout={"tp": 4})
    assert len(es) == 3, es
    assert es[0].startswith("plans/hf_llama.yaml: tensor_parallel.rules.'model.layers.*.self_attn.k_proj': module "
                            "'model.layers.0.self_attn.k_proj': tp(4) does not divide its 2 heads (out_features 32 / "
                            "head_dim 16); found 2 heads, expected a multiple of 4")
    assert es[2] == ("plans/hf_llama.yaml: tensor_parallel.rules: model config LlamaConfig.num_key_value_heads: tp(4) "
                     "does not divide num_key_value_heads(2); found 2, expected a multiple of 4; valid tp: 1, 2")


def test_features_vocab_and_packed_divisibility():
    es = errors(meta(gpt2), "plans/gpt2.yaml", world_size=3, layout={"tp": 3})
    assert any("'transformer.wte': module 'transformer.wte': tp(3) does not divide num_embeddings(128); found 128, "
               "expected a multiple of 3" in e for e in es)
    assert any("module 'transformer.h.0.attn.c_attn': packed(3) x tp(3) does not divide out_features(192); found 192, "
               "expected a multiple of 9" in e for e in es)
    assert any("'transformer.h.0.attn.c_proj': tp(3) does not divide in_features(64)" in e for e in es)
    assert any("module 'lm_head': tp(3) does not divide out_features(128)" in e for e in es)


def test_rowwise_needs_colwise_sibling(model):
    (e,) = errors(model, plan(drop=["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"]))
    assert ("module 'model.layers.0.mlp.down_proj' (rowwise) expects its input sharded on the last dim by a colwise "
            "sibling, but 'model.layers.0.mlp' has no colwise child; found input layout shard(1), expected shard(-1)") in e


def test_rowwise_after_gathered_colwise(model):
    (e,) = errors(model, plan({"model.layers.*.mlp.up_proj": "colwise_rep"}))
    assert "'model.layers.0.mlp.down_proj' (rowwise) expects shard(-1) input" in e and "found replicate" in e


def test_lm_head_input_must_be_the_stream(model):
    (e,) = errors(model, plan({"lm_head": {"style": "lm_head", "input_layouts": "replicate"}}))
    assert e == ("tensor_parallel.rules.'lm_head': module 'lm_head' (lm_head) input_layouts replicate does not match "
                 "the residual stream (sequence_parallel: True); found replicate, expected shard(1)")


def test_colwise_input_layouts_overridden_inconsistently(model):
    (e,) = errors(model, plan({"model.layers.*.self_attn.q_proj": {"style": "colwise", "input_layouts": "shard(1)"}}))
    assert "module 'model.layers.0.self_attn.q_proj' (colwise) overrides input_layouts (shard(1)) but its colwise " \
           "siblings model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj take" in e
    rules = {f"model.layers.*.self_attn.{p}_proj": {"style": "colwise", "input_layouts": "shard(1)"} for p in "qkv"}
    es = errors(model, plan(rules, sequence_parallel=False))
    assert len(es) == 3 and all("(colwise) input_layouts shard(1) does not match the residual stream; found "
                                "shard(1), expected replicate" in e for e in es)


def test_gather_needs_partial_output(model):
    (e,) = errors(model, plan({"model.layers.*.mlp": "gather"}))
    assert "module 'model.layers.0.mlp' declares a partial output to reduce (gather/all_reduce), but no rowwise " \
           "rule below it outputs partial; found shard(1) outputs, expected partial" in e


def test_sequence_parallel_needs_every_stream_norm(model):
    (e,) = errors(model, plan(drop=["model.norm"]))
    assert e == ("tensor_parallel.rules: module 'model.norm' (LlamaRMSNorm) runs on the sequence-sharded residual "
                 "stream but no rule covers it; found no rule, expected 'model.norm': norm")
    assert meshplan.check(model, plan(drop=["model.norm", "model.layers.*.input_layernorm",
                                            "model.layers.*.post_attention_layernorm"], sequence_parallel=False)).ok


def test_layout_error(model):
    (e,) = errors(model, "plans/hf_llama.yaml", world_size=6, layout={"tp": 4})
    assert e == "plans/hf_llama.yaml: layout: tp(4) does not divide world_size(6); valid tp: 1, 2, 3, 6"


def test_all_errors_collected_and_raised_together(model):
    p = plan({"model.layers.*.self_attn.qproj": "colwise", "model.layers.*.*.o_proj": "colwise"}, drop=["model.norm"])
    report = meshplan.check(model, p)
    assert len(report.errors) == 3 and all(isinstance(e, PlanError) for e in report.errors)
    with pytest.raises(PlanError, match=r"3 problem\(s\) in <plan>:\n  1\. .*qproj.*\n  2\. .*o_proj.*\n  3\. .*norm"):
        report.raise_if_errors()
    assert report.to_dict()["ok"] is False and len(report.to_dict()["errors"]) == 3


def test_unsharded_parameters_listed():
    report = meshplan.check(meta(gpt2), "plans/gpt2.yaml")
    assert report.unsharded["transformer.h.0.ln_1.weight"] == "replicated by rule 'transformer.h.*.ln_1' (norm)"
    assert report.unsharded["transformer.h.0.attn.c_proj.bias"] == "replicated by rule 'transformer.h.*.attn.c_proj' (rowwise)"
    assert "transformer.h.0.attn.c_attn.bias" not in report.unsharded
    p = {"tensor_parallel": {"sequence_parallel": False, "rules": {"transformer.h.*.mlp.c_fc": "colwise",
                                                                   "transformer.h.*.mlp.c_proj": "rowwise"}}}
    report = meshplan.check(meta(gpt2), p)
    assert report.ok and report.unsharded["transformer.wte.weight"] == "no rule"


def test_local_shapes_from_the_dry_run():
    report = meshplan.check(meta(gpt2), "plans/gpt2.yaml")
    row = next(r for r in report.modules if r["module"] == "transformer.h.0.attn.c_attn")
    assert row["params"]["weight"] == {"global": [64, 192], "local": [64, 96], "placement": "StridedShard(1,sf=3)"}
    assert row["torch_style"].startswith("PackedColwiseParallel(packed=3")


def test_model_untouched_and_cpu_model_accepted():
    torch.manual_seed(0)
    cpu = llama.build(llama.tiny_args())
    before = {k: v.clone() for k, v in cpu.state_dict().items()}
    report = meshplan.check(cpu, "plans/llama.yaml", world_size=2)
    assert report.ok
    assert all(torch.equal(before[k], v) and not isinstance(v, torch.distributed.tensor.DTensor)
               for k, v in cpu.state_dict().items())
    assert cpu.layers[0].attention.n_heads == 4  # head counts not divided on the user's model


def test_unsupported_module_for_packed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 8, 1)
            self.b = nn.Linear(8, 4)
    p = {"tensor_parallel": {"sequence_parallel": False, "rules": {"a": {"style": "colwise", "packed": 2}, "b": "rowwise"}}}
    (e,) = errors(meta(M), p)
    assert "module 'a' is Conv2d; style colwise expects nn.Linear, Conv1D or nn.Embedding" in e
