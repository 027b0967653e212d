"""`meshplan convert` on accelerate's and DeepSpeed's own example configs (tests/data/convert/, origins in its
README): every field carried, dropped or assumed on one stderr line; a cp degree brings a context_parallel
section or a refusal; a dropped rule for parameters exits 2 unless --allow-drop; the written plan always loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import meshplan
from meshplan.cli.main import main
from meshplan.convert.formats import verify_plan_text

pytestmark = pytest.mark.fast
DATA = Path(__file__).parent / "data" / "convert"


def _run(capsys, *argv):
    rc = main(["convert", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_accelerate_fsdp_settings_are_carried_or_reported(capsys):
    """cp.yaml: bf16 and fsdp_reshard_after_forward were dropped with no line, and cp 8 came without a
    context_parallel section (check refused the plan)."""
    rc, out, err = _run(capsys, DATA / "accelerate_cp_7b981788.yaml", "--from", "accelerate")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "cp 8 needs a context_parallel section" in err and "--model" in err
    src = DATA / "accelerate_tp_hsdp_7b981788.yaml"
    rc, out, err = _run(capsys, src, "--from", "accelerate", "--allow-drop")
    assert rc == 0, err
    plan = meshplan.plan_file.document.Plan.from_data(__import__("yaml").safe_load(out))
    dp = plan.data_parallel
    assert dp.param_dtype == "bfloat16" and dp.reshard_after_forward is True and dp.cpu_offload is False
    assert (plan.layout.tp, plan.layout.dp_shard, plan.layout.dp_replicate) == (2, 2, 2)
    lines = err.splitlines()
    for key in ("fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading", "num_processes", "tp_size 2"):
        assert sum(key in x and "dropped" in x for x in lines) == 1, key
    assert any("assumed data_parallel.reduce_dtype bfloat16" in x for x in lines)
    rc, out, err = _run(capsys, src, "--from", "accelerate")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "tp_size 2" in err and "pass --allow-drop" in err


def test_accelerate_cp_with_a_model_gets_its_attention_modules(capsys):
    rc, out, err = _run(capsys, DATA / "accelerate_cp_7b981788.yaml", "--from", "accelerate", "--model",
                        "examples.hf_models:llama")
    assert rc == 0, err
    assert "context_parallel:\n  attention:\n  - model.layers.*.self_attn" in out
    assert "assumed context_parallel" in err


def test_deepspeed_minimal_autotp_config_is_refused_or_writes_a_valid_plan(capsys):
    """The minimal AutoTP config (DeepSpeed applies the model's tp_plan) wrote `rules:` empty, a plan meshplan
    refused ('Input should be a valid dictionary')."""
    src = DATA / "deepspeed_autotp_minimal_aa3914df.json"
    rc, out, err = _run(capsys, src, "--from", "deepspeed")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "AutoTP's built-in specs" in err
    rc, out, err = _run(capsys, src, "--from", "deepspeed", "--allow-drop")
    assert rc == 0 and "  rules: {}" in out
    assert "dropped train_micro_batch_size_per_gpu (1): a DeepSpeed training setting" in err
    verify_plan_text(out)
    assert "stage" not in out and "param_dtype: bfloat16" in out and "reshard_after_forward: false" in out


def test_deepspeed_equal_shape_parts_are_packed_and_blocks_follow_the_rules(capsys, tmp_path):
    """shape [[64, 64, 64], -1] is three equal parts (was 'dropped'); the blocks pattern comes from the rules
    (was the default layers.*, which --numerics then failed on)."""
    rc, out, err = _run(capsys, DATA / "deepspeed_autotp_fused_qkv_aa3914df.json", "--from", "deepspeed")
    assert rc == 0, err
    assert "qkv_proj: {style: colwise, packed: 3}" in out and "dropped" not in err
    assert "blocks:\n  pattern: model.layers.*" in out and "assumed blocks: {pattern: model.layers.*}" in err


def test_a_written_plan_that_would_be_refused_is_not_written():
    with pytest.raises(meshplan.PlanError, match="would be refused"):
        verify_plan_text("version: 1\ntensor_parallel:\n  rules:\n")
    with pytest.raises(meshplan.PlanError, match="no context_parallel section"):
        verify_plan_text("version: 1\nlayout:\n  cp: 2\n")


def test_every_target_is_read_back_before_it_is_written(capsys):
    """A cp plan goes to accelerate (its read-back does not ask for the attention modules the text cannot hold)."""
    rc, out, err = _run(capsys, "plans/hf_llama_cp.yaml", "--from", "meshplan", "--to", "accelerate",
                        "--world-size", "4")
    assert rc == 0 and "parallelism_config_cp_size: 2" in out, err


def test_deepspeed_minimal_autotp_config_with_a_transformers_model_reads_its_tp_plan(capsys):
    """AutoTP without layer_specs applies the model's transformers tp_plan (DeepSpeed's tutorial): with --model
    meshplan does the same, and drops the embedding AutoTP leaves whole."""
    rc, out, err = _run(capsys, DATA / "deepspeed_autotp_minimal_aa3914df.json", "--from", "deepspeed", "--model",
                        "examples.hf_models:llama")
    assert rc == 0, err
    assert "model.layers.*.self_attn.q_proj: colwise" in out and "model.layers.*.mlp.down_proj: rowwise" in out
    assert "lm_head: lm_head" in out and "embed_tokens" not in out
    assert "dropped tp_plan 'model.embed_tokens' (embedding_rowwise)" in err


def test_an_ep_plan_style_meshplan_cannot_map_is_a_dropped_rule(tmp_path, capsys):
    """An ep_plan entry with a style meshplan has no mapping for was left out with no line."""
    src = tmp_path / "doc.json"
    src.write_text('{"tp_size": 1, "ep_size": 2, "tp_plan": {}, "ep_plan": {"model.layers.*.mlp.experts": '
                   '"ep_dispatch_experts", "model.layers.*.mlp.gate": "grouped_gemm_magic"}}')
    rc, out, err = _run(capsys, src, "--from", "hf")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "ep_plan 'model.layers.*.mlp.gate' (grouped_gemm_magic)" in err
