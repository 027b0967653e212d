"""`meshplan convert --from torch` on torchtitan's own llama3 parallelize files, as they are (tests/data/convert/,
origins in its README): options from --set, aliases followed, the newest file refused in one line; the converted
plans pass `meshplan check` on examples/llama.py at tp 2 and train equal to plans/llama.yaml (float64, SGD,
LocalTensorMode)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import llama
import meshplan
from _float64 import RTOL, float64_model, keep_float64
from _local import local_ranks
from meshplan.cli.main import main

pytestmark = pytest.mark.fast
DATA = Path(__file__).parent / "data" / "convert"
#: the three llama3 files that call parallelize_module on examples/llama.py's module names, and their options
LLAMA3 = {"torchtitan_llama_2024-08_36a00579.py": ["loss_parallel=true", "enable_float8=false"],
          "torchtitan_llama_2025-04_7090a7b6.py": ["loss_parallel=true", "enable_float8_tensorwise_tp=false"],
          "torchtitan_llama3_2026-01_0cb74355.py": ["loss_parallel=true", "enable_float8_tensorwise_tp=false"]}


def _convert(capsys, name, *extra):
    sets = [x for s in LLAMA3.get(name, []) for x in ("--set", s)]
    rc = main(["convert", str(DATA / name), "--from", "torch", "--to", "meshplan", "--tp", "2", *sets, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_torchtitan_llama3_reads_as_plans_llama(name, capsys, tmp_path):
    """Every rule of plans/llama.yaml that is a parameter's or the stream's (its dropout rules name modules
    torchtitan's Llama has none of), with sequence and loss parallelism; `check` passes at tp 2."""
    rc, text, err = _convert(capsys, name)
    assert rc == 0, err
    plan = meshplan.load_plan((tmp_path / "p.yaml").write_text(text) and tmp_path / "p.yaml")
    want = {k: r.style for k, r in meshplan.load_plan("plans/llama.yaml").tensor_parallel.rules.items()
            if "dropout" not in k}
    assert {k: r.style for k, r in plan.tensor_parallel.rules.items()} == want
    assert plan.tensor_parallel.sequence_parallel is True and plan.tensor_parallel.loss_parallel is True
    with torch.device("meta"):
        model = llama.build(llama.tiny_args())
    assert meshplan.check(model, plan, world_size=2).ok


def test_unset_options_are_reported_with_both_branches(capsys):
    rc = main(["convert", str(DATA / "torchtitan_llama3_2026-01_0cb74355.py"), "--from", "torch"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "loss_parallel (line 184: Shard(-1) if true, Replicate() if false)" in err
    assert "enable_float8_tensorwise_tp (line 192: PrepareFloat8ModuleInput if true, PrepareModuleInput if false)" in err


def test_float8_branch_drops_rules_and_exits_nonzero_unless_allowed(capsys):
    """The float8 branch aliases torchao's styles: every block rule is dropped, one line each, nothing written
    without --allow-drop."""
    name = "torchtitan_llama_2024-08_36a00579.py"
    rc, text, err = _convert(capsys, name, "--set", "enable_float8=true")
    assert rc == 2 and text == "" and err.count("\n") == 1 and "pass --allow-drop" in err
    assert "9 rule(s) for modules with parameters dropped ('layers.*.attention' (" in err
    rc, text, err = _convert(capsys, name, "--set", "enable_float8=true", "--allow-drop")
    assert rc == 0 and "layers.*.attention.wq" not in text and "output: lm_head" in text
    assert "dropped 'layers.*.attention.wq' (Float8ColwiseParallel: colwise_parallel())" in err
    assert sum("dropped 'layers." in x for x in err.splitlines()) == 9


def test_newest_parallelize_without_parallelize_module_is_refused_naming_it(capsys):
    rc = main(["convert", str(DATA / "torchtitan_llama3_2026-08_b5bcd76c.py"), "--from", "torch"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "no parallelize_module call" in err and "model.parallelize(parallel_dims) (line 41)" in err


def test_style_aliases_are_followed(tmp_path, capsys):
    src = tmp_path / "p.py"
    src.write_text("from torch.distributed.tensor.parallel import ColwiseParallel as CP, parallelize_module\n"
                   "import torch.distributed.tensor.parallel as tp\n"
                   "rowwise = tp.RowwiseParallel\n"
                   "def apply(model, mesh):\n"
                   "    for block in model.layers.values():\n"
                   "        parallelize_module(block, mesh, {'w1': CP(), 'w2': rowwise()})\n")
    assert main(["convert", str(src), "--from", "torch", "--to", "meshplan"]) == 0
    out = capsys.readouterr().out
    assert "layers.*.w1: colwise" in out and "layers.*.w2: rowwise" in out


def _train(model, tokens, labels, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = meshplan.cross_entropy(model(tokens), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
    return losses


def test_converted_torchtitan_plan_trains_equal_to_plans_llama(capsys, tmp_path):
    rc, text, err = _convert(capsys, "torchtitan_llama3_2026-01_0cb74355.py")
    assert rc == 0, err
    converted = meshplan.load_plan((tmp_path / "p.yaml").write_text(text) and tmp_path / "p.yaml")
    with keep_float64():
        torch.manual_seed(0)
        ref = float64_model(llama.build(llama.tiny_args(n_kv_heads=4)))
        tokens = torch.randint(0, 512, (4, 16))
        labels = torch.randint(0, 512, (4, 16))
        runs = []
        for plan in (converted, meshplan.load_plan("plans/llama.yaml")):
            with local_ranks(2):
                model = meshplan.parallelize(copy.deepcopy(ref), plan, meshplan.build_mesh({"tp": 2}))
                runs.append(_train(model, tokens, labels))
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(*runs)), runs
    assert runs[0][-1] < runs[0][0]


def test_plan_dicts_updated_under_conditions_and_loop_variable_paths(tmp_path, capsys):
    """llama4's shape: a block plan extended by .update() and item assignment under conditions, and a
    parallelize_module on a loop variable's submodule (block.moe.experts → layers.*.moe.experts)."""
    src = tmp_path / "p.py"
    src.write_text("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel\n"
                   "def apply(model, mesh, shared: bool, ep_mesh):\n"
                   "    for block in model.layers.values():\n"
                   "        plan = {'w1': ColwiseParallel()}\n"
                   "        if shared:\n"
                   "            plan.update({'shared.w1': ColwiseParallel()})\n"
                   "        plan['w2'] = RowwiseParallel()\n"
                   "        parallelize_module(block, mesh, plan)\n"
                   "        if ep_mesh is None and shared:\n"
                   "            parallelize_module(block.moe.experts, mesh, ColwiseParallel())\n")
    base = ["convert", str(src), "--from", "torch", "--to", "meshplan"]
    assert main(base) == 2
    assert "shared (line 5: {'shared.w1': ColwiseParallel()} if true, … if false)" in \
        capsys.readouterr().err
    assert main(base + ["--set", "shared=true", "--set", "ep_mesh=none"]) == 0
    out = capsys.readouterr().out
    for rule in ("layers.*.w1: colwise", "layers.*.shared.w1: colwise", "layers.*.w2: rowwise",
                 "layers.*.moe.experts: colwise"):
        assert rule in out, (rule, out)
    assert main(base + ["--set", "shared=false", "--set", "ep_mesh=none"]) == 0
    out = capsys.readouterr().out
    assert "shared.w1" not in out and "moe.experts" not in out and "layers.*.w2: rowwise" in out


#: the other rows of docs/conversion.md's table: file, --set options, exit code, rules written, a stderr line
ROWS = [("torchtitan_llama3_2026-04_703b72ef.py", ["enable_loss_parallel=true", "enable_float8_tensorwise_tp=false",
                                                  "use_fused_qkv=false"], 0, 13, "assumed enable_sp: True"),
        ("qwen3_2026-01_d12ff2fc.py", ["loss_parallel=true", "enable_float8_tensorwise_tp=false",
                                       "cp_enabled=false", "moe_enabled=false"], 0, 15, ""),
        ("qwen3_2026-01_d12ff2fc.py", ["loss_parallel=true", "enable_float8_tensorwise_tp=false",
                                       "cp_enabled=false"], 2, 0, "transformer_block.moe_enabled (line 270: "),
        ("deepseek_v3_2026-01_1e8f9acd.py", ["loss_parallel=true", "cp_enabled=false", "q_lora_rank=0",
                                             "moe_enabled=true"], 0, 12,
         "assumed 'layers.*.attention.kv_norm' (NoParallel(use_local_output=False)): torchtitan's NoParallel"),
        ("llama4_2026-01_a33d0e36.py", ["loss_parallel=true", "enable_float8_tensorwise_tp=false", "tp_mesh=true",
                                        "ep_mesh=none", "shared_experts=true", "moe_enabled=true"], 2, 0,
         "2 rule(s) for modules with parameters dropped ('layers.*.moe.experts' (TensorParallel())")]


@pytest.mark.parametrize("name,sets,code,rules,line", ROWS, ids=[f"{r[0]}-{len(r[1])}" for r in ROWS])
def test_other_torchtitan_files_give_the_documented_result(name, sets, code, rules, line, capsys):
    rc, text, err = _convert(capsys, name, *[x for s in sets for x in ("--set", s)])
    assert rc == code and sum(x.startswith("    ") for x in text.splitlines()) == rules and line in err, err
    if code == 0:
        meshplan.plan_file.document.Plan.from_data(__import__("yaml").safe_load(text))


def test_a_plan_changed_in_ways_not_followed_is_refused(tmp_path, capsys):
    src = tmp_path / "p.py"
    src.write_text("from torch.distributed.tensor.parallel import ColwiseParallel\n"
                   "def apply(model, mesh):\n"
                   "    plan = {'w1': ColwiseParallel(), 'w2': ColwiseParallel()}\n"
                   "    del plan['w2']\n"
                   "    parallelize_module(model, mesh, plan)\n")
    assert main(["convert", str(src), "--from", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "p.py:4: cannot follow \"del plan['w2']\" on the plan 'plan'" in err
