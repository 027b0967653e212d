"""Per-head parts of attention beside its projections (issue 24), on tiny transformers models at tp=2 (simulated
ranks, float64): gpt-oss's sinks (``head_params`` sharded), DiffLlama's lambdas (``head_params`` summed, q/k/v
packed 2 for its head pairs), Olmo2's norm over the whole q/k projection (``projection_norm``) and lara_mini's
gathered ``linear_attn.out_proj`` (its own input conversion), Doge's dynamic mask (``A`` per KV head,
``dt_proj`` onto the KV heads, reduce-scattered). Each plan equals one device within 1e-5 (the
models compute parts in float32: DiffLlama's lambdas, Olmo2's norm); without the rule ``check`` refuses naming
the parameter or module and the rule, which is the plan that passes."""

import os
import tempfile

import pytest
import torch
from _heads import LAMBDAS, RULES, plan, tiny

import meshplan
from meshplan import PlanError
from meshplan.checks.numerics import check_numerics

pytestmark = pytest.mark.fast
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    return {t: tiny(t) for t in RULES}


def _errors(model, rules: dict) -> str:
    p = plan("gpt_oss")
    p["tensor_parallel"]["rules"] = rules
    return " | ".join(str(e) for e in meshplan.check(model, p, world_size=2).errors)


@pytest.mark.parametrize("model_type", sorted(RULES))
def test_plan_checks_and_equals_one_device(models, model_type):
    report = meshplan.check(models[model_type], plan(model_type), world_size=2)
    assert report.ok, report.errors
    rep = check_numerics(models[model_type], plan(model_type), tp=2, tol=TOL)
    assert rep.ok, rep.summary()


def test_sinks_without_a_rule_are_refused_with_the_rule(models):
    rules = {k: v for k, v in RULES["gpt_oss"].items() if k != "model.layers.*.self_attn"}
    msg = _errors(models["gpt_oss"], rules)
    assert "model.layers.0.self_attn" in msg and "sinks [4]" in msg, msg
    assert "'model.layers.*.self_attn': {style: head_params, sharded: [sinks]}" in msg, msg


def test_sinks_are_sharded_with_the_heads(models):
    from meshplan._torch import simulated_ranks
    from meshplan.mesh.topology import build_mesh
    model = tiny("gpt_oss")
    with simulated_ranks(2):
        meshplan.parallelize(model, plan("gpt_oss"), build_mesh({"tp": 2}))
        attn = model.model.layers[0].self_attn
        assert attn.sinks.placements == (torch.distributed.tensor.Shard(0),) and attn.sinks.to_local().shape == (2,)
        assert "sinks" not in attn.__dict__  # the local slice lives only while the forward runs


def test_lambdas_without_a_rule_are_refused_as_summed(models):
    rules = {k: v for k, v in RULES["diffllama"].items() if k != "model.layers.*.self_attn"}
    msg = _errors(models["diffllama"], rules)
    assert f"summed: [{', '.join(LAMBDAS)}]" in msg and "lambda_q1 [16]" in msg, msg


def test_whole_projection_head_norm_is_refused_naming_projection_norm(models):
    rules = {**RULES["olmo2"], "model.layers.*.self_attn.q_norm": "head_norm"}
    msg = _errors(models["olmo2"], rules)
    assert "'model.layers.0.self_attn.q_norm'" in msg and "normalized size 64, expected 16" in msg, msg
    assert "'model.layers.*.self_attn.q_norm: projection_norm'" in msg, msg


def test_projection_norm_on_a_per_head_norm_is_refused(models):
    rules = {**RULES["lara_mini"], "model.layers.*.self_attn.q_norm": "projection_norm"}
    msg = _errors(models["lara_mini"], rules)
    assert "one head" in msg and "'model.layers.*.self_attn.q_norm: head_norm'" in msg, msg


def test_unruled_projection_beside_a_converted_colwise_is_refused(models):
    rules = {**RULES["lara_mini"], "model.layers.*.linear_attn.out_proj": {"style": "colwise",
                                                                           "output_layouts": "replicate"}}
    msg = _errors(models["lara_mini"], rules)
    assert "linear_attn.in_proj" in msg and "expected input_layouts: replicate" in msg, msg


@pytest.mark.parametrize("bad, why", [({"style": "head_params"}, "names no parameter"),
                                      ({"style": "head_params", "sharded": ["a"], "summed": ["a"]}, "more than one")])
def test_head_params_rule_is_validated(bad, why):
    with pytest.raises(PlanError, match=why):
        meshplan.Plan.from_data({"tensor_parallel": {"rules": {"attn": bad}}})


def test_head_params_names_checked_against_the_module(models):
    rules = {**RULES["gpt_oss"], "model.layers.*.self_attn": {"style": "head_params", "sharded": ["sink"]}}
    msg = _errors(models["gpt_oss"], rules)
    assert "no parameter 'sink' of its own, nor has any module the rule matches; found ['sinks']" in msg, msg


def test_from_hf_merges_parameter_entries_and_gives_gathered_colwise_its_input():
    from meshplan.hf.convert import from_hf, to_hf
    granite = from_hf("granite_swa")
    assert granite["tensor_parallel"]["rules"]["model.layers.*.self_attn"] == {"style": "head_params",
                                                                               "sharded": ["sinks"]}
    hf = to_hf({k: v for k, v in granite.items() if k != "_origin"})
    assert hf["model.layers.*.self_attn"] == "local_params" and hf["model.layers.*.self_attn.sinks"] == "colwise"
    lara = from_hf("lara_mini")["tensor_parallel"]["rules"]
    assert lara["model.layers.*.linear_attn.out_proj"]["input_layouts"] == "replicate"


def test_convert_document_merges_local_params():
    from meshplan.convert.common import Notes
    from meshplan.convert.hf_document import _rules
    notes = Notes()
    rules, _ = _rules({"layers.*.attn": "local_params", "layers.*.attn.sinks": "colwise",
                       "layers.*.attn.q_proj": "colwise", "other": "local_params"}, None, notes)
    assert rules == {"layers.*.attn.q_proj": "colwise",
                     "layers.*.attn": {"style": "head_params", "sharded": ["sinks"]}}
    assert any("other" in line for line in notes.dropped)


def test_from_hf_gives_latent_rules_no_input_layouts():
    """glm5_next_text (MLA beside unruled indexer projections): the latent rules were given ``input_layouts``,
    which their style has not, and convert failed on its own plan; now the plan validates and ``check`` judges
    it."""
    import json
    from meshplan.hf.convert import from_hf
    with tempfile.TemporaryDirectory() as d:  # a base model: the config.json names its class
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "glm5_next_text", "architectures": ["Glm5NextTextModel"]}, f)
        rules = from_hf(d)["tensor_parallel"]["rules"]
    latent = {k: v for k, v in rules.items() if k.endswith(("q_a_proj", "kv_a_proj_with_mqa", "indexer"))}
    assert len(latent) == 3 and set(latent.values()) == {"latent"}, latent


def test_per_head_rowwise_reduced_whole_is_refused_with_the_rule(models):
    """Doge at tp 2 with transformers' plain ``dt_proj: rowwise``: each rank got all 4 KV heads' rates beside its 2
    heads (``A`` sharded) and crashed after ``check`` ok ('size of tensor a (2) must match ... b (4)'); with 2 KV
    heads a rank's one local head would broadcast silently. ``check`` now refuses it naming the rule, and the rule
    is the plan that passes (test_plan_checks_and_equals_one_device[doge])."""
    rules = {**RULES["doge"], "model.layers.*.self_attn.dt_proj": "rowwise"}
    msg = _errors(models["doge"], rules)
    assert "module 'model.layers.0.self_attn.dt_proj' (rowwise) outputs one value per head (4 features" in msg, msg
    assert ("'model.layers.*.self_attn.dt_proj': {style: rowwise, output_layouts: shard(-1), use_local_output: true}"
            in msg), msg
    rules["model.layers.*.self_attn.dt_proj"] = {"style": "rowwise", "output_layouts": "shard(-1)"}
    assert "use_local_output None" in _errors(models["doge"], rules)
    # the rule's plan: the cross-shard shadow run keeps dt_proj's output a DTensor like A (it ran, no note), and
    # its shard(-1) output is no residual-stream redistribute
    assert meshplan.check(models["doge"], plan("doge"), world_size=2).warnings == []


def test_from_hf_reduce_scatters_a_per_head_rowwise():
    """transformers' Doge plan reduces ``dt_proj`` whole; ``from_hf`` gives it this rank's heads and shards ``A``."""
    from meshplan.hf.convert import from_hf
    rules = from_hf("doge", sequence_parallel=False, loss_parallel=False)["tensor_parallel"]["rules"]
    assert rules["model.layers.*.self_attn.dt_proj"] == {"style": "rowwise", "output_layouts": "shard(-1)",
                                                         "use_local_output": True}
    assert rules["model.layers.*.self_attn"] == {"style": "head_params", "sharded": ["A"]}
    assert rules["model.layers.*.self_attn.o_proj"] == "rowwise"  # onto the hidden size: reduced whole
