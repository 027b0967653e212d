"""`meshplan check` (table and json, exit codes, the MODULE:FACTORY convention) and `meshplan convert`."""

import json
import subprocess
import sys

import pytest

from meshplan.cli.main import main

pytestmark = pytest.mark.fast
LLAMA_CFG = json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 128})


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_fits_a_terminal_width():
    """On a terminal the table leaves out the torch style column when it is too wide, then the shapes, then cuts
    its widest column; the text lines wrap."""
    from examples.hf_models import llama
    from meshplan.checks.explain import render_table
    from meshplan.checks.offline import check
    from meshplan.plan_file.document import load_plan
    import torch
    with torch.device("meta"):
        model = llama()
    report = check(model, load_plan("plans/hf_llama.yaml"), world_size=2)
    wide = render_table(report).splitlines()
    assert max(map(len, wide)) > 120 and "torch style" in wide[2]
    lines = render_table(report, width=140).splitlines()
    assert "torch style" not in lines[2] and "local params" in lines[2] and all(len(x) <= 140 for x in lines)
    assert "(left out to fit 140 columns: torch style; --format json or a wider terminal shows them)" in lines
    for narrow in (100, 80, 60):  # then the shapes, then the widest column is cut
        lines = render_table(report, width=narrow).splitlines()
        assert all(len(x) <= narrow for x in lines), (narrow, max(map(len, lines)))
        assert "local params" not in lines[2] and "torch style, local params" in "\n".join(lines)
    assert render_table(report, width=300).splitlines()[:17] == wide[:17]  # a table that fits is left alone


def test_table(capsys):
    code, out, err = run(capsys, "check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--tp", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "meshplan check: plans/hf_llama.yaml  model LlamaForCausalLM  tp=2  world_size=2"
    header = lines[2].split()
    assert header[:3] == ["module", "(pattern)", "n"] and "bytes on rank 0" in lines[2]
    row = next(x for x in lines if x.startswith("model.layers.*.self_attn.q_proj "))
    assert row.split()[1:] == ["2", "colwise", "ColwiseParallel(in=R,", "out=S(-1),", "local)", "weight[32x64]", "-",
                               "-", "16.0", "KiB"]
    conv = next(x for x in lines if x.startswith("model.layers.*.self_attn "))
    assert "input conversion" in conv and "all_gather" in conv and "reduce_scatter" in conv
    assert "collectives per forward: 5 all_gather, 5 reduce_scatter" in out
    # + one re-gather per SP block input (save_gathered_inputs: false): 2 layers x (self_attn, mlp)
    assert "collectives per backward: 9 all_gather, 1 all_reduce, 5 reduce_scatter" in out
    assert "unsharded parameters (5, every tp rank holds them whole): model.layers.*.input_layernorm.weight" in out
    assert lines[-1] == "ok"


def test_plan_without_tensor_parallel_counts_the_whole_model_per_rank(capsys):
    """No tensor_parallel section: no tp dry run, but the rank view counts the whole model on its one rank."""
    code, out, _ = run(capsys, "check", "plans/single.yaml", "--model", "examples.llama:build", "--config", LLAMA_CFG)
    line = next(x for x in out.splitlines() if x.startswith("parameters: "))
    total = line.split()[1]
    assert code == 0 and f"global, {total} per rank (rank 0: " in line and " 0 per rank" not in line


def test_json(capsys):
    code, out, _ = run(capsys, "check", "plans/gpt2.yaml", "--model", "examples.hf_models:gpt2",
                       "--world-size", "4", "--tp", "2", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert {"ok", "errors", "modules", "totals"} <= set(data) and data["ok"] is True and data["errors"] == []
    assert data["tp"] == 2 and data["world_size"] == 4
    t = data["totals"]
    assert t["forward"] == {"all_gather": 5, "reduce_scatter": 6}
    assert t["parameters"] == 112384 and t["bytes_per_rank"] == 4 * t["parameters_per_rank"]
    attn = next(m for m in data["modules"] if m["module"] == "transformer.h.1.attn.c_attn")
    assert attn["params"]["bias"] == {"global": [192], "local": [96], "placement": "StridedShard(0,sf=3)"}
    # rank 0's bytes: the tp shard [64, 96] + [96], then FSDP2's dim-0 half over dp_shard 2 (world 4 / tp 2)
    assert attn["forward"] == [] and attn["bytes_per_rank"] == (64 // 2 * 96 + 96 // 2) * 4


def test_invalid_plan_exit_2_with_all_errors(capsys):
    code, out, err = run(capsys, "check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--tp", "4",
                         "--format", "json")
    assert code == 2 and err == ""
    data = json.loads(out)
    assert data["ok"] is False and len(data["errors"]) == 3
    assert "tp(4) does not divide num_key_value_heads(2)" in data["errors"][2]
    code, out, _ = run(capsys, "check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--tp", "4")
    assert code == 2 and out.splitlines()[-4] == "3 error(s):"


@pytest.mark.parametrize("spec, config", [
    ("llama:build", LLAMA_CFG),                                   # FACTORY(Args(**config)), examples/ on the path
    ("examples.llama:build", LLAMA_CFG),
    ("examples.hf_models:llama", '{"num_hidden_layers": 3}'),     # FACTORY(**config)
    ("transformers:LlamaForCausalLM", json.dumps(                 # a PreTrainedModel class: cls(Config(**config))
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128})),
])
def test_model_conventions(capsys, spec, config):
    plan = "plans/llama.yaml" if "llama:build" in spec else "plans/hf_llama.yaml"
    code, out, err = run(capsys, "check", plan, "--model", spec, "--config", config, "--world-size", "2",
                         "--format", "json")
    assert code == 0, err
    assert json.loads(out)["ok"] is True


def test_config_from_file(capsys, tmp_path):
    f = tmp_path / "cfg.json"
    f.write_text(LLAMA_CFG)
    code, out, _ = run(capsys, "check", "plans/llama.yaml", "--model", "llama:build", "--config", str(f), "--tp", "2")
    assert code == 0 and out.rstrip().endswith("ok")


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope_module:x"], "--model 'nope_module:x': cannot import 'nope_module': ModuleNotFoundError"),
    (["--model", "examples.hf_models"], "--model 'examples.hf_models': expected MODULE:FACTORY"),
    (["--model", "examples.hf_models:nope"], "module 'examples.hf_models' has no attribute 'nope'"),
    (["--model", "examples.hf_models:llama", "--config", "{bad"], "--config: not valid JSON"),
    (["--model", "examples.hf_models:llama", "--config", "[1]"], "neither a JSON object nor a .json file"),
    (["--model", "examples.hf_models:llama", "--config", '{"vocab_size": -1}'], "the factory failed: "),
    (["--model", "examples.hf_models:FACTORIES"], "'FACTORIES' is not callable"),
    (["--model", "examples.hf_models:llama", "--tp", "3", "--world-size", "4"],
     "tp(3) does not divide world_size(4)"),
])
def test_bad_input_one_line(capsys, argv, message):
    code, out, err = run(capsys, "check", "plans/hf_llama.yaml", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meshplan: error: ") and message in err, err


def test_missing_plan_file(capsys):
    code, _, err = run(capsys, "check", "nope.yaml", "--model", "examples.hf_models:llama")
    assert code == 2 and err == "meshplan: error: nope.yaml: no such plan file\n"


def test_no_traceback_from_console():
    proc = subprocess.run([sys.executable, "-m", "meshplan", "check", "plans/hf_llama.yaml", "--model", "x.y:z"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_convert_to_stdout_and_file(capsys, tmp_path):
    code, out, _ = run(capsys, "convert", "llama", "--from", "hf", "--to", "meshplan")
    assert code == 0 and "    model.layers.*.self_attn.q_proj: colwise\n" in out and "    lm_head: lm_head\n" in out
    f = tmp_path / "qwen2.yaml"
    code, out, _ = run(capsys, "convert", "qwen2", "-o", str(f), "--no-loss-parallel")
    assert code == 0 and out == "" and "loss_parallel: false" in f.read_text()
    code, out, _ = run(capsys, "check", str(f), "--model", "examples.hf_models:qwen2", "--tp", "2")
    assert code == 0


def test_convert_back_to_hf(capsys):
    code, out, _ = run(capsys, "convert", "plans/hf_llama.yaml", "--from", "meshplan", "--to", "hf")
    assert code == 0
    hf = json.loads(out)["tp_plan"]  # transformers' document: tp_plan (full paths), tp_size, …
    assert hf["model.layers.*.self_attn.q_proj"] == "colwise" and hf["model.embed_tokens"] == "embedding_rowwise"


@pytest.mark.parametrize("argv, message", [
    (["convert", "falcon_x"], "unknown transformers model type 'falcon_x'"),
    (["convert", "llama", "--from", "meshplan", "--to", "xml"], "argument --to: invalid choice: 'xml'"),
    (["convert", "missing/config.json"], "missing/config.json: no such config file"),
])
def test_convert_bad_input(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_context_parallel_line(capsys):
    """The context_parallel section is checked against the model and summarised (text and json)."""
    code, out, _ = run(capsys, "check", "plans/llama_cp.yaml", "--model", "examples.llama:build", "--config", LLAMA_CFG)
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("context parallel: "))
    assert "cp 2, allgather_kv" in line and "rank r holds chunks r and 2·cp−1−r" in line
    assert "attention: layers.*.attention (2 modules); positions: buffer freqs_cis (dim 0)" in line
    code, out, _ = run(capsys, "check", "plans/hf_llama_cp.yaml", "--model", "examples.hf_models:llama",
                       "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["context"] == {"cp": 2, "method": "allgather_kv", "load_balance": True,
                                            "attention": ["model.layers.*.self_attn"], "attention_modules": 2,
                                            "positions": "kwarg position_ids"}


def test_context_parallel_refusals(capsys):
    """cp > 1 without a section, and a model that cannot say where its positions come from, exit 2 with a reason."""
    code, out, _ = run(capsys, "check", "plans/hf_llama.yaml", "--model", "examples.hf_models:llama", "--cp", "2")
    assert code == 2 and "layout.cp(2) > 1 needs a context_parallel section" in out
    code, out, _ = run(capsys, "check", "plans/hf_llama_cp.yaml", "--model", "examples.hf_models:qwen2",
                       "--config", json.dumps({"layer_types": ["full_attention", "chunked_attention"]}))
    assert code == 2 and "layer types ['chunked_attention', 'full_attention'] (config.layer_types)" in out


def test_context_parallel_windows_line(capsys):
    """A sliding window is honoured under cp now (issue 30), and check says so."""
    code, out, _ = run(capsys, "check", "plans/hf_llama_cp.yaml", "--model", "examples.hf_models:mistral",
                       "--config", json.dumps({"sliding_window": 8}))
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("context parallel: "))
    assert line.endswith("; sliding window 8 tokens (2 of them: each rank reads the key chunks it reaches)"), line
