"""Pipeline parallelism without processes: stage assignment, the split of a block stack (examples' Llama and
transformers' LlamaForCausalLM), stage views and pruning (keys, original names, the model untouched, chained
stages equal to the whole model), the schedule checks against what torch's schedule classes accept, the plan
section's validation and ``meshplan check`` on pipeline plans (API and CLI)."""

import copy
import json
import logging

import pytest
import torch
import torch.nn as nn
import yaml

import meshplan
from llama import build, tiny_args
from meshplan import PlanError
from meshplan.checks.explain import render_table
from meshplan.cli.main import main
from meshplan.pipeline.split import balanced, local_stage_ids, plan_split, prune, stage_view
from meshplan.pipeline.stages import check_schedule, schedule_class
from meshplan.plan_file.document import as_plan
from meshplan.plan_file.pipeline import MULTI_STAGE_SCHEDULES, SCHEDULES, V_SCHEDULES, Pipeline

pytestmark = pytest.mark.fast
LLAMA_CFG = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "ffn_dim": 128}


def section(**kw):
    return Pipeline(**{"microbatches": 4, **kw})


def meta_llama(**kw):
    with torch.device("meta"):
        return build(tiny_args(**kw))


def hf_llama(n_layers=4, device=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="eager")
    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------ stage assignment

def test_balanced():
    assert balanced(10, 4) == [3, 3, 2, 2]                     # no end weights: the first stages take the rest
    assert balanced(8, 4) == [2, 2, 2, 2]
    assert balanced(8, 1) == [8]
    assert balanced(10, 4, fewer_first=1) == [1, 3, 3, 3]      # 11 slots; the rest to stages without an end
    assert balanced(10, 4, fewer_last=1) == [3, 3, 3, 1]
    assert balanced(6, 4, 1, 1) == [1, 2, 2, 1]
    assert balanced(8, 3, 1, 1) == [2, 4, 2]
    assert balanced(5, 2, fewer_first=1) == [2, 3]
    assert balanced(4, 4, fewer_first=2) == [-1, 2, 2, 1]      # plan_split rejects the empty stage


@pytest.mark.parametrize("n", range(1, 20))
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_balanced_properties(n, stages):
    """Every block placed; the busiest stage (an end module weighing its fewer_* blocks) as light as it can be;
    a stage asked for fewer blocks has fewer than every middle stage."""
    for f, g in [(0, 0), (1, 0), (0, 2), (1, 1), (2, 1)]:
        sizes = balanced(n, stages, f, g)
        load = [*sizes]
        load[0] += f
        load[-1] += g
        assert sum(sizes) == n and max(load) == -(-(n + f + g) // stages)
        if stages > 2 and min(sizes) >= 1:
            assert (not f or sizes[0] < min(sizes[1:-1])) and (not g or sizes[-1] < min(sizes[1:-1]))


@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 1), (2, 2), (4, 2), (3, 3)])
def test_local_stage_ids_loop(pp, vpp):
    ids = {r: local_stage_ids(r, pp, vpp, "interleaved_1f1b") for r in range(pp)}
    assert ids[0] == list(range(0, pp * vpp, pp))                       # r, r+pp, …
    assert sorted(s for v in ids.values() for s in v) == list(range(pp * vpp))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_local_stage_ids_v(schedule):
    assert [local_stage_ids(r, 4, 2, schedule) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert local_stage_ids(0, 2, 2, schedule) == [0, 3]                # rank 0 holds both ends


# ------------------------------------------------------------------ plan_split

def test_split_examples_llama():
    sp = plan_split(meta_llama(n_layers=8), section(), "layers.*", 4)
    assert sp.container == "layers" and sp.num_stages == 4
    assert sp.keys == (("0", "1"), ("2", "3"), ("4", "5"), ("6", "7"))
    assert sp.first == ("tok_embeddings",) and sp.last == ("norm", "output")
    tied = plan_split(meta_llama(n_layers=8, tie_embeddings=True), section(), "layers.*", 4)
    assert tied.first == ("tok_embeddings",) and tied.last == ("norm", "output")


def test_split_hf_llama():
    model = hf_llama(device="meta")
    sp = plan_split(model, section(), "model.layers.*", 2)
    assert sp.container == "model.layers" and sp.keys == (("0", "1"), ("2", "3"))
    assert sp.first == ("model.embed_tokens",) and sp.last == ("model.norm", "lm_head")  # in module order
    assert "model.rotary_emb" not in sp.first + sp.last       # no parameters: every stage keeps it
    view = stage_view(model, sp, 1)
    assert isinstance(view.model.rotary_emb, type(model.model.rotary_emb))
    assert isinstance(view.model.embed_tokens, nn.Identity)


def test_split_explicit_points_and_fewer_blocks():
    model = meta_llama(n_layers=8)
    sp = plan_split(model, section(split_points=["layers.3", "layers.4", "layers.7"]), "layers.*", 4)
    assert [len(k) for k in sp.keys] == [3, 1, 3, 1]
    sp = plan_split(model, section(first_stage_fewer_blocks=1, last_stage_fewer_blocks=1), "layers.*", 3)
    assert sp.keys == (("0", "1"), ("2", "3", "4", "5"), ("6", "7"))
    sp = plan_split(model, section(first_stage_modules=["tok_embeddings"], last_stage_modules=["output"]),
                    "layers.*", 2)
    assert sp.first == ("tok_embeddings",) and sp.last == ("output",)


@pytest.mark.parametrize("kw, pattern, stages, message", [
    ({}, "layers.*.attention", 2, "pipeline: the blocks 'layers.0.attention', … have 4 parents (layers.0, layers.1, "
                                  "layers.2, layers.3); pipelining cuts the children of ONE container; found 4, "
                                  "expected 1"),
    ({}, "layers", 2, "pipeline: the blocks 'layers', … are children of '(root)', a Transformer; found no block "
                      "container, expected the children of a ModuleList/ModuleDict/Sequential"),
    ({}, "blocks.*", 2, "pipeline (the stage unit, blocks.pattern): pattern 'blocks.*' matched no module of "
                        "Transformer (top-level children: tok_embeddings, layers, norm, output)"),
    ({}, "layers.*", 5, "pipeline: 4 blocks in 'layers' cannot fill 5 stages (pp·vpp); expected at least 5 blocks"),
    ({"split_points": ["layers.2"]}, "layers.*", 4,
     "pipeline.split_points: 4 stages (pp·vpp) need 3 split points, got 1: ['layers.2']"),
    ({"split_points": ["layers.9"]}, "layers.*", 2,
     "pipeline.split_points[0]: 'layers.9' is not a block; found none, expected one of 'layers.1' … 'layers.3'"),
    ({"split_points": ["norm"]}, "layers.*", 2, "pipeline.split_points[0]: 'norm' is not a block"),
    ({"split_points": ["layers.3", "layers.1"]}, "layers.*", 3,
     "pipeline.split_points: ['layers.3', 'layers.1'] start stages 1… at blocks [3, 1] of 'layers.0' … 'layers.3'; "
     "found a stage with no block, expected block indices increasing from 1"),
    ({"split_points": ["layers.0"]}, "layers.*", 2, "found a stage with no block"),
    ({"first_stage_modules": ["tok_embedding"]}, "layers.*", 2,
     "pipeline.first_stage_modules: Transformer has no module 'tok_embedding'; found none, expected a module path "
     "(closest: tok_embeddings"),
    ({"last_stage_modules": ["norm", "head"]}, "layers.*", 2,
     "pipeline.last_stage_modules: Transformer has no module 'head'"),
    ({"first_stage_fewer_blocks": 2}, "layers.*", 4,
     "pipeline: 4 blocks cannot fill 4 stages (pp·vpp) with first_stage_fewer_blocks 2 and last_stage_fewer_blocks "
     "0; found [-1, 2, 2, 1] blocks per stage, expected at least 1 each"),
])
def test_split_errors(kw, pattern, stages, message):
    with pytest.raises(PlanError) as e:
        plan_split(meta_llama(n_layers=4), section(**kw), pattern, stages)
    assert message in str(e.value)


def test_split_sequential_root():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    sp = plan_split(model, section(), "*", 2)
    assert sp.container == "" and sp.keys == (("0", "1"), ("2", "3")) and sp.first == sp.last == ()
    x = torch.randn(2, 4)
    assert torch.equal(stage_view(model, sp, 1)(stage_view(model, sp, 0)(x)), model(x))
    assert list(stage_view(model, sp, 1).state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]


# ------------------------------------------------------------------ stage views and pruning

LAYOUTS = [(2, 1, "1f1b"), (4, 1, "1f1b"), (2, 2, "interleaved_1f1b"), (4, 2, "interleaved_1f1b"),
           (2, 2, "zbv_zero_bubble"), (4, 2, "dualpipev")]


@pytest.fixture(scope="module")
def cpu_llamas():
    torch.manual_seed(0)
    return {tied: build(tiny_args(n_layers=8, tie_embeddings=tied)).eval() for tied in (False, True)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp, vpp, schedule", LAYOUTS)
def test_pruned_state_dicts_partition_the_model(cpu_llamas, tied, pp, vpp, schedule):
    model = cpu_llamas[tied]
    full = set(model.state_dict())
    sp = plan_split(model, section(schedule=schedule), "layers.*", pp * vpp)
    owner, seen = {}, set()
    for r in range(pp):
        ids = local_stage_ids(r, pp, vpp, schedule)
        part = copy.deepcopy(model)
        prune(part, sp, ids)
        keys = set(part.state_dict())
        assert not keys & seen, keys & seen                 # no key on two ranks
        seen |= keys
        owner.update({k: r for k in keys})
        if tied and 0 in ids and sp.num_stages - 1 in ids:  # V: both ends here, still one tensor
            assert part.output.weight is part.tok_embeddings.weight
    assert seen == full
    if tied:  # the tied weight: the first stage's rank and the last stage's rank both hold it
        assert owner["tok_embeddings.weight"] == local_stage_ids(0, pp, vpp, schedule)[0] == 0
        assert sp.num_stages - 1 in local_stage_ids(owner["output.weight"], pp, vpp, schedule)


@pytest.mark.parametrize("pp, vpp, schedule", LAYOUTS)
def test_stage_views_keep_names_and_leave_the_model(cpu_llamas, pp, vpp, schedule):
    model = cpu_llamas[False]
    sp = plan_split(model, section(schedule=schedule), "layers.*", pp * vpp)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    union = []
    for s in range(sp.num_stages):
        view = stage_view(model, sp, s)
        view.register_forward_hook(lambda *a: None)
        view.layers.register_forward_pre_hook(lambda *a: None)
        keys = list(view.state_dict())
        blocks = {k.split(".")[1] for k in keys if k.startswith("layers.")}
        assert blocks == set(sp.keys[s])                    # original block keys, not renumbered
        assert ("tok_embeddings.weight" in keys) == (s == 0) and ("output.weight" in keys) == (s == sp.num_stages - 1)
        assert all(view.get_parameter(k) is model.get_parameter(k) for k in keys)  # shared, not copied
        union += keys
    assert sorted(union) == sorted(before)                  # each key in exactly one stage
    assert len(model.layers) == 8 and isinstance(model.tok_embeddings, nn.Embedding)
    assert isinstance(model.output, nn.Linear) and isinstance(model.norm, nn.Module)
    assert not model._forward_hooks and not model.layers._forward_pre_hooks
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _chain(model, sp, x):
    h = x
    for s in range(sp.num_stages):
        out = stage_view(model, sp, s)(h)
        h = getattr(out, "logits", out)                      # transformers' output: the next stage's input
    return h


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp, vpp, schedule", LAYOUTS)
def test_chained_stages_equal_the_model(cpu_llamas, tied, pp, vpp, schedule):
    model = cpu_llamas[tied]
    sp = plan_split(model, section(schedule=schedule), "layers.*", pp * vpp)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(_chain(model, sp, x), model(x))


@pytest.mark.parametrize("stages", [2, 4])
def test_chained_stages_equal_hf_llama(stages):
    """transformers' LlamaForCausalLM takes the hidden state where it takes token ids: ``embed_tokens`` is an
    ``Identity`` on later stages, the mask and positions come from the embeddings' shape, ``rotary_emb`` runs
    on every stage, and a non-last stage's "logits" are its hidden state (``lm_head`` an ``Identity``)."""
    model = hf_llama(n_layers=4)
    sp = plan_split(model, section(), "model.layers.*", stages)
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(_chain(model, sp, x), model(x).logits)
    model.train()
    ref = model(x).logits
    ref.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = _chain(model, sp, x)
    out.square().sum().backward()
    assert torch.equal(out, ref) and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


# ------------------------------------------------------------------ schedules

@pytest.mark.parametrize("s, m, pp, vpp, message", [
    ("zbv_zero_bubble", 4, 2, 1, "pipeline.schedule: zbv_zero_bubble runs two stages per rank in a V; found "
                                 "layout.vpp(1), expected vpp = 2"),
    ("dualpipev", 8, 2, 3, "pipeline.schedule: dualpipev runs two stages per rank in a V; found layout.vpp(3)"),
    ("1f1b", 4, 2, 2, "pipeline.schedule: 1f1b runs one stage per rank; found layout.vpp(2), expected vpp = 1 or a "
                      "multi-stage schedule (interleaved_1f1b, looped_bfs"),
    ("gpipe", 4, 2, 2, "pipeline.schedule: gpipe runs one stage per rank"),
    ("1f1b", 3, 4, 1, "pipeline.microbatches: 1f1b needs at least pp(4) microbatches to fill the pipeline; found 3, "
                      "expected >= 4 (or schedule: gpipe)"),
    ("dualpipev", 6, 4, 2, "pipeline.microbatches: dualpipev needs at least one microbatch per stage (torch's "
                           "ScheduleDualPipeV), 2·pp(4) = 8 stages; found 6, expected >= 8"),
    ("interleaved_1f1b", 6, 4, 2, "pipeline.microbatches: interleaved_1f1b with vpp(2) runs microbatches in rounds "
                                  "of pp(4); found 6, expected a multiple of 4"),
    ("interleaved_1f1b", 9, 4, 1, "pipeline.microbatches: torch's interleaved_1f1b cuts the microbatches into "
                                  "m // pp(4) = 2 rounds of equal size; found 9, not a multiple of 2; expected one "
                                  "of 4, 5, 6, 7, 8, 10, 12, 15, 16, …"),
    ("interleaved_zero_bubble", 5, 2, 1, "pipeline.microbatches: torch's interleaved_zero_bubble cuts the "
                                         "microbatches into m // pp(2) = 2 rounds"),
])
def test_check_schedule_messages(s, m, pp, vpp, message):
    with pytest.raises(PlanError) as e:
        check_schedule(section(schedule=s, microbatches=m), pp, vpp)
    assert str(e.value).startswith(message)


def _torch_schedule(schedule, pp, vpp, m):
    """Build torch's schedule class for rank 0 of ``pp`` (it computes every rank's order) over the fake group."""
    from torch.distributed.pipelining import PipelineStage
    n = pp * vpp
    stages = [PipelineStage(nn.Linear(2, 2), i, n, torch.device("cpu"))
              for i in local_stage_ids(0, pp, vpp, schedule)]
    cls = schedule_class(schedule)
    return cls(stages if schedule in MULTI_STAGE_SCHEDULES else stages[0], m, loss_fn=lambda o, t: o.sum(),
               scale_grads=False)


@pytest.mark.parametrize("pp", [2, 4])
def test_check_schedule_accepts_only_what_torch_builds(fake_pg, pp):
    """Every (schedule, vpp, m) check_schedule lets through builds in torch; torch's own rejections (DualPipeV
    below 2·pp microbatches, the interleaved schedules' rounds at vpp = 1) are rejected by the check first."""
    logging.disable(logging.WARNING)
    accepted = 0
    try:
        with fake_pg(pp):
            for schedule in SCHEDULES:
                for vpp in (1, 2):
                    for m in range(1, 3 * pp + 2):
                        try:
                            check_schedule(section(schedule=schedule, microbatches=m), pp, vpp)
                        except PlanError:
                            continue
                        _torch_schedule(schedule, pp, vpp, m)
                        accepted += 1
            for schedule, vpp, m in [("dualpipev", 2, 2 * pp - 1), ("interleaved_1f1b", 1, 2 * pp + 1),
                                     ("interleaved_zero_bubble", 1, 2 * pp + 1)]:
                with pytest.raises(ValueError):
                    _torch_schedule(schedule, pp, vpp, m)
                with pytest.raises(PlanError):
                    check_schedule(section(schedule=schedule, microbatches=m), pp, vpp)
    finally:
        logging.disable(logging.NOTSET)
    assert accepted > 30


@pytest.mark.parametrize("data, message", [
    ({"schedule": "zb1p", "microbatches": 2}, "<plan>: pipeline.schedule: Input should be 'gpipe', '1f1b'"),
    ({"microbatches": 0}, "<plan>: pipeline.microbatches: Input should be greater than or equal to 1 (got 0)"),
    ({"schedule": "1f1b"}, "pipeline.microbatches"),
    ({"microbatches": 2, "split_points": ["layers.*"]},
     "<plan>: pipeline.split_points: [0] = 'layers.*' is not a module path (dot-separated names, no '*')"),
    ({"microbatches": 2, "split_points": ["layers.2", "layers.2"]}, "repeated module paths"),
    ({"microbatches": 2, "first_stage_fewer_blocks": -1}, "pipeline.first_stage_fewer_blocks"),
    ({"microbatches": 2, "schedule_name": "1f1b"}, "pipeline.schedule_name"),
])
def test_section_validation(data, message):
    with pytest.raises(PlanError) as e:
        as_plan({"pipeline": data})
    assert message in str(e.value)


# ------------------------------------------------------------------ meshplan check

def _plan(tp=2, pp=2, vpp=1, **pipeline):
    d = yaml.safe_load(open("plans/llama.yaml"))
    d["layout"] = {"tp": tp, "pp": pp, "vpp": vpp}
    d["pipeline"] = {"schedule": "1f1b", "microbatches": 4, **pipeline}
    return d


def test_check_pipeline_plan():
    model = meta_llama(n_layers=4)
    report = meshplan.check(model, _plan())
    assert report.ok, report.errors
    assert report.world_size == 4 and report.pipeline["schedule"] == "1f1b"
    rows = report.pipeline["stages"]
    assert [(r["stage"], r["pp_rank"], r["blocks"]) for r in rows] == [
        (0, 0, ["layers.0", "layers.1"]), (1, 1, ["layers.2", "layers.3"])]
    params = sum(p.numel() for p in model.parameters())
    assert sum(r["parameters"] for r in rows) == params
    text = render_table(report).splitlines()
    assert "pipeline: 1f1b, 4 microbatches, 2 stages (pp 2 x vpp 1)" in text
    assert f"stage 0 (pp rank 0): tok_embeddings, layers.0-1  ({rows[0]['parameters']:,} parameters)" in text
    assert f"stage 1 (pp rank 1): layers.2-3, norm, output  ({rows[1]['parameters']:,} parameters)" in text
    assert json.loads(json.dumps(report.to_dict()))["pipeline"]["stages"][1]["last_modules"] == ["norm", "output"]
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 4        # the model untouched


@pytest.mark.parametrize("path, world", [("plans/llama_pp.yaml", 2), ("plans/llama_3d.yaml", 8)])
def test_shipped_pipeline_plans(path, world):
    """The default world size counts the data-parallel degrees a layout fixes (llama_3d: tp·pp·dp_shard = 8)."""
    report = meshplan.check(meta_llama(n_layers=4), path)
    assert report.ok, report.errors
    assert report.world_size == world and [len(r["blocks"]) for r in report.pipeline["stages"]] == [2, 2]


def test_check_pipeline_v_and_interleaved_ranks():
    # tp 1: a split-backward schedule runs with pipeline parallelism alone (test_split_backward_refused_beside_tp)
    report = meshplan.check(meta_llama(n_layers=8), _plan(tp=1, pp=2, vpp=2, schedule="zbv_zero_bubble"))
    assert report.ok, report.errors
    assert [r["pp_rank"] for r in report.pipeline["stages"]] == [0, 1, 1, 0]
    report = meshplan.check(meta_llama(n_layers=8), _plan(pp=2, vpp=2, schedule="interleaved_1f1b"))
    assert [r["pp_rank"] for r in report.pipeline["stages"]] == [0, 1, 0, 1]


@pytest.mark.parametrize("plan, message", [
    (_plan(split_points=["layers.9"]), "pipeline.split_points[0]: 'layers.9' is not a block"),
    (_plan(tp=1, schedule="dualpipev", vpp=2, microbatches=2), "pipeline.microbatches: dualpipev needs at least one "
                                                         "microbatch per stage"),
    (_plan(pp=8, tp=1, microbatches=8), "pipeline: 4 blocks in 'layers' cannot fill 8 stages"),
    ({"layout": {"pp": 2}}, "<plan>: layout.pp(2) > 1 needs a pipeline section; found none"),
])
def test_check_pipeline_errors(plan, message):
    report = meshplan.check(meta_llama(n_layers=4), plan)
    assert not report.ok and len(report.errors) == 1 and message in str(report.errors[0])
    assert message in render_table(report)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"])
def test_split_backward_refused_beside_tp(schedule):
    report = meshplan.check(meta_llama(n_layers=8), _plan(pp=2, vpp=2, schedule=schedule, microbatches=4))
    assert [e for e in report.errors if f"{schedule} splits each backward" in str(e) and "found tp(2)" in str(e)]


def test_check_pipeline_collects_every_error():
    report = meshplan.check(meta_llama(n_layers=2), _plan(tp=1, schedule="dualpipev", vpp=2, microbatches=2))
    assert [str(e).split(":")[0] for e in report.errors] == ["pipeline.microbatches", "pipeline"]
    assert "cannot fill 4 stages" in str(report.errors[1]) and report.pipeline == {}


def test_check_pipeline_hf_needs_its_block_pattern():
    model = hf_llama(device="meta")
    plan = {"layout": {"pp": 2}, "pipeline": {"microbatches": 2}}
    (e,) = meshplan.check(model, plan).errors
    assert "pipeline (the stage unit, blocks.pattern): pattern 'layers.*' matched no module of LlamaForCausalLM " \
           "(top-level children: model, lm_head)" in str(e)
    report = meshplan.check(model, {**plan, "blocks": {"pattern": "model.layers.*"}})
    assert report.ok, report.errors
    assert "stage 1 (pp rank 1): model.layers.2-3, model.norm, lm_head" in render_table(report)


def test_check_traced_split():
    """``split: trace`` (a model that is not a block stack): checked as parallelize checks it, nothing traced;
    the stages are named by their split points."""
    from resnet import build as resnet, tiny_args as resnet_args
    model = resnet(resnet_args())
    trace = {"split": "trace", "split_points": ["layer2", "layer3", "avgpool"], "schedule": "interleaved_1f1b",
             "microbatches": 4}
    report = meshplan.check(model, {"layout": {"pp": 2, "vpp": 2}, "pipeline": trace})
    assert report.ok, report.errors
    lines = render_table(report).splitlines()
    assert lines[-6:] == ["pipeline: interleaved_1f1b, 4 microbatches, 4 stages (pp 2 x vpp 2)",
                          "stage 0 (pp rank 0): traced from the input to before layer2",
                          "stage 1 (pp rank 1): traced from layer2 to before layer3",
                          "stage 2 (pp rank 0): traced from layer3 to before avgpool",
                          "stage 3 (pp rank 1): traced from avgpool to the output", "ok"]
    (e,) = meshplan.check(model, {"layout": {"pp": 2}, "pipeline": {**trace, "split_points": ["layer9"],
                                                                     "schedule": "gpipe"}}).errors
    assert "pipeline.split_points.'layer9': matches no module of ResNet" in str(e)
    (e,) = meshplan.check(model, {"layout": {"pp": 2, "tp": 2}, "pipeline": {**trace, "split_points": ["layer3"],
                                                                              "schedule": "gpipe"}}).errors
    assert "pipeline.split: trace runs on pp ranks only; found world size 4" in str(e)
    (e,) = meshplan.check(model, {"layout": {"pp": 2}, "pipeline": {"microbatches": 4}}).errors
    assert "pattern 'layers.*' matched no module of ResNet" in str(e) and "pipeline.split: trace" in str(e)


def _cli(capsys, tmp_path, plan):
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(plan))
    code = main(["check", str(path), "--model", "examples.llama:build", "--config", json.dumps(LLAMA_CFG)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_check_pipeline(capsys, tmp_path):
    code, out, err = _cli(capsys, tmp_path, _plan())
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert "stage 0 (pp rank 0): tok_embeddings, layers.0" in out and lines[-1] == "ok"
    assert "world_size=4" in lines[0]


def test_cli_check_shipped_plan(capsys):
    code = main(["check", "plans/llama_pp.yaml", "--model", "examples.llama:build"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert "stage 1 (pp rank 1): layers.2-3, norm, output  (" in out and out.splitlines()[-1] == "ok"
    code = main(["check", "plans/llama_3d.yaml", "--model", "examples.llama:build", "--world-size", "8",
                 "--format", "json"])
    data = json.loads(capsys.readouterr()[0])
    assert code == 0 and data["ok"] and [r["pp_rank"] for r in data["pipeline"]["stages"]] == [0, 1]


def test_cli_check_bad_split_exit_2(capsys, tmp_path):
    code, out, err = _cli(capsys, tmp_path, _plan(split_points=["layers.5"]))
    assert code == 2 and err == ""
    lines = out.splitlines()
    assert lines[-2:] == ["1 error(s):", f"  1. {tmp_path / 'pp.yaml'}: pipeline.split_points[0]: 'layers.5' is not a "
                                         f"block; found none, expected 'layers.1' (where a stage begins)"]
