"""Issue 24's last tensor-parallel crashes and refusals of the transformers zoo, on tiny float64 models at tp 2
(simulated ranks): each plan ``check`` passes equals one device within ``RTOL`` (1e-9, ``tests/_float64.py``), and
each refusal names a rule that, followed, passes ``check`` and equals one device.

* MuseGlimmer's input embedding holds a weight-less norm as a child: the vocab-parallel style refused the child
  ('style embedding needs an nn.Embedding, got MuseGlimmerRMSNorm') after ``check`` ok.
* ESMC normalises the whole q/k projection with a LayerNorm: ``projection_norm`` passed ``check`` and crashed
  (DTensor gathers a layer_norm over the sharded dim; the output is now sliced back to this rank's shard).
* NeoMME's ``exclusive_self_attention`` child holds ``alpha`` per head: the refusal named no rule.
* GLM-5-Next's ``layers.*.self_attn.o_proj`` spans linear-attention and MLA layers: the refusal now names the
  per-layer rules.
"""

import pytest
import torch
from _float64 import RTOL, keep_float64
from _heads import tiny

import meshplan
from meshplan.checks.numerics import check_numerics

pytestmark = pytest.mark.fast
ATTN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


def _plan(rules: dict) -> dict:
    return {"version": 1, "layout": {"tp": 2}, "blocks": {"pattern": "layers.*"},
            "tensor_parallel": {"sequence_parallel": False, "loss_parallel": False, "rules": rules}}


def _errors(model, rules: dict) -> str:
    return " | ".join(str(e) for e in meshplan.check(model, _plan(rules), world_size=2).errors)


def _loss(model, batch):
    """A base model's hidden states through a fixed projection, squared (the zoo's loss): the default mean square
    of a normalised output is ~1 with gradients that nearly cancel."""
    h = model(input_ids=batch["input_ids"]).last_hidden_state
    return (h @ torch.arange(h.shape[-1], dtype=h.dtype).mul(0.7).sin()).square().sum()


def _equal(model, rules: dict) -> None:
    report = meshplan.check(model, _plan(rules), world_size=2)
    assert report.ok, report.errors
    with keep_float64():
        rep = check_numerics(model, _plan(rules), tp=2, tol=RTOL, loss_fn=_loss)
    assert rep.ok, rep.summary()


def test_vocab_embedding_with_a_child_norm_equals_one_device():
    model = tiny("muse_glimmer_text")
    assert type(model.embed_tokens.embed_norm).__name__ == "MuseGlimmerRMSNorm"
    _equal(model, {"embed_tokens": "embedding", **ATTN, "layers.*.self_attn.gate_proj": "colwise"})


def test_layernorm_over_the_whole_projection():
    model = tiny("esmc")
    assert isinstance(model.layers[0].self_attn.q_norm, torch.nn.LayerNorm)
    msg = _errors(model, ATTN)
    assert "expected 'layers.*.self_attn.q_norm: projection_norm'" in msg, msg
    _equal(model, {**ATTN, "layers.*.self_attn.q_norm": "projection_norm",
                   "layers.*.self_attn.k_norm": "projection_norm"})
    import json
    import os
    import tempfile

    from meshplan.hf.convert import from_hf
    with tempfile.TemporaryDirectory() as d:  # a base model: the config.json names its class
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "esmc", "architectures": ["EsmcModel"]}, f)
        rules = from_hf(d)["tensor_parallel"]["rules"]
    assert rules["layers.*.self_attn.q_norm"] == rules["layers.*.self_attn.k_norm"] == "projection_norm", rules


def test_per_head_parameter_of_a_child_is_refused_with_head_params():
    model = tiny("neomme")
    rules = {**{k: v for k, v in ATTN.items() if "o_proj" not in k},
             "layers.*.self_attn.output_projection.gate_proj": "colwise",
             "layers.*.self_attn.output_projection.o_proj": "rowwise"}
    msg = _errors(model, rules)
    assert "expected 'layers.*.self_attn.exclusive_self_attention': {style: head_params, sharded: [alpha]}" in msg, msg
    rules["layers.*.self_attn.exclusive_self_attention"] = {"style": "head_params", "sharded": ["alpha"]}
    msg = _errors(model, rules)  # its value embeddings are whole: the attention runs unsharded
    assert "'layers.*.self_attn.exclusive_self_attention'" not in msg and "leave the module unsharded" in msg, msg
    _equal(model, {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})


def test_rowwise_over_layers_of_two_kinds_names_the_per_layer_rules():
    model = tiny("glm5_next_text")
    assert model.config.layer_types[:2] == ["linear_attention", "indexed_attention"], model.config.layer_types
    latent = {"layers.*.self_attn.q_a_proj": "latent", "layers.*.self_attn.q_a_layernorm": "latent",
              "layers.*.self_attn.q_b_proj": "latent_colwise", "layers.*.self_attn.kv_a_proj_with_mqa": "latent",
              "layers.*.self_attn.kv_a_layernorm": "latent", "layers.*.self_attn.kv_b_proj": "latent_colwise",
              "layers.*.self_attn.indexer": "latent"}
    msg = _errors(model, {**latent, "layers.*.self_attn.o_proj": "rowwise"})
    assert ("the layers differ in kind, so replace 'layers.*.self_attn.o_proj' by one rule per such module "
            "('layers.1.self_attn.o_proj')") in msg, msg
    _equal(model, {**latent, "layers.1.self_attn.o_proj": "rowwise"})
