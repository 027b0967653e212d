"""``meshplan convert`` between meshplan, transformers, torch, DeepSpeed and accelerate: round trips for every
pair, one stderr line per dropped item, converted plans that pass ``meshplan check``, a torch plan that torch runs,
sources read without running them."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import meshplan
from meshplan.cli.main import main
from meshplan.convert.formats import FORMATS, Options, convert, model_modules, read
from meshplan.convert.common import Notes
from meshplan.plan_file.document import Plan

pytestmark = pytest.mark.fast
EXT = {"meshplan": "yaml", "hf": "json", "torch": "py", "deepspeed": "json", "accelerate": "yaml"}


@pytest.fixture(scope="module")
def llama():
    from examples.hf_models import llama as build
    with torch.device("meta"):
        return build()


def _plan(fmt: str, path, opts: Options) -> Plan:
    return Plan.from_data(read(fmt, str(path), opts, Notes()))


def _write(tmp_path, name: str, text: str):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("a, b", list(itertools.product(FORMATS, FORMATS)))
def test_round_trip_every_pair(a, b, tmp_path, llama):
    """A → B → A keeps what both hold: a second round trip changes nothing, and whatever the first lost was
    reported as dropped."""
    opts = Options(modules=model_modules(llama), world_size=4)
    src_text, _ = convert("plans/hf_llama.yaml", "meshplan", a, opts)
    src = _write(tmp_path, f"src.{EXT[a]}", src_text)
    mid_text, there = convert(str(src), a, b, opts)
    mid = _write(tmp_path, f"mid.{EXT[b]}", mid_text)
    back_text, _ = convert(str(mid), b, a, opts)
    back = _write(tmp_path, f"back.{EXT[a]}", back_text)
    again_text, _ = convert(str(_write(tmp_path, f"mid2.{EXT[b]}", convert(str(back), a, b, opts)[0])), b, a, opts)
    again = _write(tmp_path, f"again.{EXT[a]}", again_text)
    assert _plan(a, again, opts) == _plan(a, back, opts)  # a fixed point after one trip
    if _plan(a, back, opts) != _plan(a, src, opts):
        assert there.dropped, f"{a}->{b} lost something without a dropped line"


EXPECTED_DROPS = {
    "meshplan": [],
    "hf": ["tensor_parallel.loss_parallel"],
    "torch": ["layout.tp (2)", "the one input conversion per block"],
    "deepspeed": ["tensor_parallel.sequence_parallel (True)", "tensor_parallel.loss_parallel",
                  "rule 'model.embed_tokens' (embedding)"] + [f"rule {r!r} (norm)" for r in (
                      "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm")],
    "accelerate": ["the tensor_parallel rules"],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_line_per_dropped_item(fmt, capsys, tmp_path):
    out = tmp_path / f"x.{EXT[fmt]}"
    assert main(["convert", "plans/hf_llama.yaml", "--from", "meshplan", "--to", fmt, "--world-size", "4",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    dropped = [x.removeprefix("meshplan convert: dropped ").split(":")[0] for x in err if " dropped " in x]
    assert len(dropped) == len(EXPECTED_DROPS[fmt]) and all(
        any(d.startswith(want) for d in dropped) for want in EXPECTED_DROPS[fmt]), err


@pytest.mark.parametrize("fmt", ["hf", "torch", "deepspeed"])
def test_converted_plans_pass_check(fmt, tmp_path, llama):
    """meshplan → F → meshplan on transformers' Llama: the plan checks (meta device, dry run at tp 2)."""
    opts = Options(modules=model_modules(llama), world_size=4, tp=2)
    text, _ = convert("plans/hf_llama.yaml", "meshplan", fmt, opts)
    mid = _write(tmp_path, f"m.{EXT[fmt]}", text)
    back = _write(tmp_path, "back.yaml", convert(str(mid), fmt, "meshplan", opts)[0])
    report = meshplan.check(llama, str(back), world_size=4)
    assert report.ok, report.errors
    rules = meshplan.load_plan(back).tensor_parallel.rules
    assert rules["lm_head"].style == "lm_head" and rules["model.layers.*.self_attn.q_proj"].style == "colwise"


def test_torch_plan_runs_in_torch_and_matches_one_device(tmp_path):
    """The emitted parallelize_plan, applied by torch's own parallelize_module at tp 2 (ranks simulated): the
    logits of transformers' Llama equal one device's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from examples.hf_models import llama as build
    from meshplan._torch import simulated_ranks
    from meshplan.mesh.topology import build_mesh
    text, _ = convert("plans/hf_llama.yaml", "meshplan", "torch", Options())
    namespace: dict = {}
    exec(compile(text, "plan.py", "exec"), namespace)  # the test runs the generated file; meshplan never does
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    want = model(input_ids=ids).logits
    with simulated_ranks(2):
        mesh = build_mesh({"tp": 2})["tp"]
        parallelize_module(model, mesh, namespace["parallelize_plan"])
        got = model(input_ids=ids).logits
        got = got.full_tensor() if isinstance(got, DTensor) else got
        from meshplan._torch import rank_tensors
        for value in rank_tensors(got).values():
            torch.testing.assert_close(value, want, atol=1e-5, rtol=1e-5)


TORCHTITAN_LIKE = '''
import sys
sys.exit("meshplan must not run this file")
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

def apply_tp(model, tp_mesh):
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer_id, transformer_block in model.layers.items():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=layer_plan)
'''


def test_torchtitan_style_source_reads_as_the_meshplan_plan(tmp_path):
    """torchtitan's shape of plan (a top-level dict, a per-block dict in a loop, PrepareModuleInput fan-outs),
    parsed without running the file: the rules of plans/llama.yaml's styles, SP and loss parallel on."""
    src = _write(tmp_path, "tp.py", TORCHTITAN_LIKE)
    text, notes = convert(str(src), "torch", "meshplan", Options(tp=2))
    plan = meshplan.load_plan(_write(tmp_path, "p.yaml", text))
    tp = plan.tensor_parallel
    assert tp.sequence_parallel is True and tp.loss_parallel is True and plan.layout.tp == 2
    styles = {k: r.style for k, r in tp.rules.items()}
    assert styles["tok_embeddings"] == "embedding" and styles["output"] == "lm_head"
    assert styles["layers.*.attention.wq"] == "colwise" and styles["layers.*.feed_forward.w2"] == "rowwise"
    assert "layers.*.attention" not in styles and all(not r.overrides() for r in tp.rules.values())
    from examples.llama import Transformer, tiny_args
    with torch.device("meta"):
        model = Transformer(tiny_args())
    assert meshplan.check(model, plan, world_size=2).ok


def test_torch_source_that_needs_running_is_refused(tmp_path, capsys):
    """A condition is reported with both branches (one line) until --set decides it; a call that is not a literal,
    a style or a bound name is refused with its line."""
    src = _write(tmp_path, "p.py", 'from torch.distributed.tensor.parallel import ColwiseParallel\n'
                                   'from torch.distributed.tensor import Shard, Replicate\n'
                                   'lp = True\nplan = {"output": ColwiseParallel(output_layouts=Shard(-1) if lp '
                                   'else Replicate())}\n')
    assert main(["convert", str(src), "--from", "torch", "--to", "meshplan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lp (line 4: Shard(-1) if true, Replicate() if false)" in err
    assert "--set" in err
    assert main(["convert", str(src), "--from", "torch", "--to", "meshplan", "--set", "lp=false"]) == 0
    out = capsys.readouterr().out
    assert "output: lm_head" in out and "loss_parallel: false" in out
    src = _write(tmp_path, "q.py", 'from torch.distributed.tensor.parallel import ColwiseParallel\n'
                                   'plan = {"output": ColwiseParallel(output_layouts=layout_of(3))}\n')
    assert main(["convert", str(src), "--from", "torch", "--to", "meshplan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "q.py:2: cannot read 'layout_of(3)'" in err


def test_every_transformers_style_string_is_known():
    """Every string transformers' ParallelInterface registers reads as a meshplan rule or a dropped line."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from meshplan.convert.hf_document import _rules
    notes = Notes()
    rules, _ = _rules({f"m{i}": s for i, s in enumerate(ALL_PARALLEL_STYLES)}, None, notes)
    assert len(rules) + len(notes.dropped) == len(list(ALL_PARALLEL_STYLES))
    Plan.from_data({"tensor_parallel": {"rules": rules}})


def test_deepspeed_presets_resolved_against_the_model(tmp_path, llama):
    """DeepSpeed's llama preset regexes (".*\\.self_attn\\.[qkv]_proj\\.weight$", …) need the model's parameter
    names; with --model they become the module patterns of plans/hf_llama.yaml."""
    cfg = {"tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.(up|gate)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True}]}},
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    src = _write(tmp_path, "ds.json", json.dumps(cfg))
    with pytest.raises(meshplan.PlanError, match="pass --model"):
        convert(str(src), "deepspeed", "meshplan", Options())
    text, _ = convert(str(src), "deepspeed", "meshplan", Options(modules=model_modules(llama)))
    plan = meshplan.load_plan(_write(tmp_path, "p.yaml", text))
    want = meshplan.load_plan("plans/hf_llama.yaml").tensor_parallel.rules
    got = plan.tensor_parallel.rules
    assert {k: r.style for k, r in got.items()} == {k: r.style for k, r in want.items() if r.style != "norm"
                                                      and k != "model.embed_tokens"}
    assert plan.data_parallel.reshard_after_forward is False and plan.data_parallel.param_dtype == "bfloat16"


def test_accelerate_sources(tmp_path):
    cfg = _write(tmp_path, "acc.yaml", "distributed_type: FSDP\nparallelism_config:\n"
                 "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
                 "  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n")
    notes = Notes()
    data = read("accelerate", str(cfg), Options(), notes)
    assert data["layout"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    r = Plan.from_data(data).layout.resolve(8)
    assert r.mesh_grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # accelerate's (dp_rep, dp_shard, cp, tp)
    py = _write(tmp_path, "acc.py", "raise SystemExit\nfrom accelerate import ParallelismConfig\n"
                                    "pc = ParallelismConfig(tp_size=4, cp_size=2, dp_shard_size=1)\n")
    with pytest.raises(meshplan.PlanError, match="cp 2 needs a context_parallel section"):  # no model: refused
        read("accelerate", str(py), Options(), Notes())
    py.write_text(py.read_text().replace("cp_size=2", "cp_size=1"))
    assert read("accelerate", str(py), Options(), Notes())["layout"] == {"tp": 4, "dp_shard": 1}


def test_hf_document_pipeline_and_degrees(tmp_path):
    text, notes = convert("plans/llama_3d.yaml", "meshplan", "hf", Options(world_size=8))
    doc = json.loads(text)
    assert doc["tp_size"] == 2 and doc["pp_size"] == 2 and doc["fsdp_size"] == 2
    assert doc["pp_plan"]["layers"] == [["hidden_states", "attention_mask"], ["hidden_states"]]
    assert any(d.startswith("pipeline.schedule (1f1b)") for d in notes.dropped)
    back = Plan.from_data(read("hf", str(_write(tmp_path, "d.json", text)), Options(), Notes()))
    assert back.layout.pp == 2 and back.blocks.pattern == "layers.*" and back.pipeline.schedule == "gpipe"
