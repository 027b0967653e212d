"""Pipeline stages by tracing (``meshplan.pipeline.trace``) on the ResNet example, which is not a block stack.

Fast (one process): the traced stages chained give the full model's output and gradients; the stages keep the
model's parameter names and share its tensors; their state-dict parts together are the model's state dict;
tracing leaves the model as it was; and each way a split can fail gives one PlanError saying where, what was
found and what was expected.

Dist (real torchrun/gloo, 2 processes, one launch): pp=2 cut at ``layer3`` (the seeds' seq1 | seq2) with GPipe
and 1F1B, and vpp=2 (4 stages, cut at layer2, layer3, avgpool) with interleaved 1F1B; 4 microbatches, 3 SGD and
3 AdamW steps beside one device running the whole batch, in float64: the loss and every gradient at each step
and every parameter after each step within ``RTOL`` relative (1e-9, fixed: ``tests/_float64.py``); the ranks' state-dict keys together are the model's (see
``tests/dist/trace_worker.py``).


Through the plan (``pipeline: {split: trace}``, ``plans/resnet_pp.yaml``): fast, each refusal of
:func:`~meshplan.pipeline.traced.plan_traced` (other sections, other degrees, V-shaped schedules, bad split
points) and of the first step (inputs that are not tensors, another shape than the traced one), and the pruning
rule; dist (same launch), ``meshplan.parallelize`` + ``meshplan.train_step`` with gpipe, 1f1b, and vpp=2
interleaved_1f1b, looped_bfs and interleaved_zero_bubble, 3 AdamW steps with clipping: losses, pre-clip norms
and every parameter within ``RTOL`` of one device accumulating the same microbatches; the ranks' state-dict keys
disjoint and together the model's; the optimizer left with this rank's parameters only.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _float64 import RTOL
from _launch import case_result
import meshplan
from meshplan.errors import PlanError
from meshplan.pipeline.trace import check_split_points, stage_state_dict, traced_stages
from meshplan.pipeline.traced import TracedPipeline, _prune, _prune_optimizer, plan_traced, prepare_traced
from meshplan.plan_file.layout import Layout
from resnet import ResNet, build, tiny_args

SPLITS = {2: ["layer3"], 3: ["layer2", "layer3"]}


def _x(batch=2):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def traced():
    """``{num_stages: (model, reference copy, TracedStages of every stage)}``."""
    out = {}
    for n, split in SPLITS.items():
        model = build(tiny_args(), seed=0)
        ref = copy.deepcopy(model)
        out[n] = (model, ref, traced_stages(model, (_x(),), split, n, list(range(n))))
    return out


@pytest.mark.fast
@pytest.mark.parametrize("n", sorted(SPLITS))
def test_chained_stages_equal_the_model(traced, n):
    model, ref, stages = traced[n]
    x, y = _x(), torch.tensor([0, 3])
    h = x
    for m in stages.modules:
        h = m(h)
    F.cross_entropy(h, y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert torch.equal(h.detach(), ref(x).detach())
    got = {}
    for m in stages.modules:
        got.update({name: p.grad for name, p in m.named_parameters()})
    assert sorted(got) == sorted(n for n, _ in ref.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=0)
    model.zero_grad(set_to_none=True)


@pytest.mark.fast
@pytest.mark.parametrize("n", sorted(SPLITS))
def test_stage_keys_are_the_original_names_and_together_the_model(traced, n):
    model, _, stages = traced[n]
    full = model.state_dict(keep_vars=True)
    parts = [stage_state_dict(m, model) for m in stages.modules]
    # torch's traced stage modules keep the original FQNs (no renaming) and share the model's tensors
    for m in stages.modules:
        assert set(m.state_dict()) <= set(full)
        assert all(t is full[k] for k, t in m.state_dict(keep_vars=True).items())
    keys = [k for part in parts for k in part]
    assert len(keys) == len(set(keys)) and set(keys) == set(full)
    assert any(k.startswith("layer1.0.conv1.") for k in parts[0])
    assert all(k.startswith(("layer3.", "fc.")) for k in parts[-1])
    assert stages.stage_indices == list(range(n)) and stages.num_stages == n


@pytest.mark.fast
def test_tracing_leaves_the_model_as_it_was(traced):
    model, ref, _ = traced[3]
    assert "forward" not in vars(model.layer2) and "forward" not in vars(model.layer3)
    assert torch.equal(model(_x()), ref(_x()))


@pytest.mark.fast
def test_microbatches_compute_the_full_batch():
    """GroupNorm normalises per sample: a microbatch's rows equal the full batch's (BatchNorm's would not)."""
    model = build(tiny_args())
    x = _x(8)
    assert torch.equal(torch.cat([model(c) for c in x.chunk(4)]), model(x))


@pytest.mark.fast
@pytest.mark.parametrize("points, n, match", [
    (["layer9"], 2, r"'layer9'.*matches no module of ResNet.*closest module paths: layer\d"),
    (["layer2"], 3, r"1 split points \['layer2'\] for 3 stages; expected num_stages - 1 = 2"),
    (["layer*"], 2, r"split point 'layer\*' is not a module path"),
    ([""], 2, r"split point '' is not a module path"),
    (["layer2", "layer2"], 3, r"\['layer2'\] appear more than once"),
])
def test_bad_split_points_without_tracing(points, n, match):
    with pytest.raises(PlanError, match=match):
        check_split_points(ResNet(tiny_args()), points, n)


@pytest.mark.fast
def test_split_points_out_of_order_called_twice_or_cutting_an_empty_stage():
    model = build(tiny_args())
    with pytest.raises(PlanError, match=r"'layer3' in stage\(s\) \[2\].*expected 3 stages, split point k starting"):
        traced_stages(model, (_x(),), ["layer3", "layer2"], 3, [0])
    # a block calls its activation module twice: the split cuts more stages than asked
    with pytest.raises(PlanError, match=r"tracing cut 3 stages .*expected 2 stages"):
        traced_stages(model, (_x(),), ["layer1.0.act"], 2, [0])
    with pytest.raises(PlanError, match=r"split points \['conv1'\] leave a stage empty"):
        traced_stages(model, (_x(),), ["conv1"], 2, [0])  # nothing runs before the stem's conv
    with pytest.raises(PlanError, match=r"stage indices \[2\]; expected at least one, each in 0..1"):
        traced_stages(model, (_x(),), ["layer3"], 2, [2])


class _Strided(nn.Module):
    """Its second stage's input is a slice of a wider tensor (strides of the wide one), as EmbeddingGemma 2's
    hidden state at ``layers.1``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)[..., :4])


@pytest.mark.fast
def test_a_stage_receiving_a_non_contiguous_tensor_is_refused():
    """torch's stages receive into buffers of the traced strides and gloo/NCCL send and receive contiguous tensors
    only: such a split hung on real gloo (each rank failed its send or receive); refused when tracing."""
    with pytest.raises(PlanError, match=r"stage 1 \(from split point 'b'\) receives .* shape \(2, 4\) with strides "
                                        r"\(8, 1\), not contiguous.*move the split point"):
        traced_stages(_Strided(), (torch.randn(2, 4),), ["b"], 2, [0, 1])


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: torch.export cannot capture one graph
            return self.lin(x)
        return x


class _Net(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Sequential(inner), nn.Linear(4, 2)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.fast
def test_an_untraceable_model_names_the_module_and_why():
    with pytest.raises(PlanError) as info:
        traced_stages(_Net(_DataDependent()), (torch.randn(2, 4),), ["c"], 2, [0])
    msg = str(info.value)
    assert "torch.export cannot trace _Net at module b.0 (_DataDependent)" in msg, msg
    assert "test_pipeline_trace.py" in msg and "if x.sum() > 0:" in msg, msg
    assert "data-dependent" in msg and "expected a model torch.export captures as one graph" in msg, msg


@pytest.mark.fast
def test_a_parameter_on_two_stages_is_refused():
    tied = _Net(nn.Linear(4, 4))
    tied.c = nn.Linear(4, 4)
    tied.c.weight = tied.a.weight  # tied across the cut
    with pytest.raises(PlanError, match=r"parameters used by more than one traced stage \(stage 0: 'a.weight', "
                                        r"stage 1: '(a|c).weight'\)"):
        traced_stages(tied, (torch.randn(2, 4),), ["c"], 2, [0])


# ---------------------------------------------------------------- through the plan: split: trace

TRACE = {"split": "trace", "split_points": ["layer3"], "schedule": "gpipe", "microbatches": 4}
VPP_POINTS = ["layer2", "layer3", "avgpool"]


def _plan_traced(layout=None, world=2, **sections):
    plan = meshplan.Plan.from_data({"layout": layout or {"pp": 2}, **sections,
                                    "pipeline": {**TRACE, **sections.pop("pipeline", {})}})
    topo = SimpleNamespace(layout=Layout(**(layout or {"pp": 2})).resolve(world), pp_rank=1)
    return plan_traced(ResNet(tiny_args()), plan, topo, "p.yaml: pipeline")


@pytest.mark.fast
def test_the_resnet_plan_asks_for_the_traced_split():
    plan = meshplan.load_plan("plans/resnet_pp.yaml")
    assert plan.pipeline.split == "trace" and plan.pipeline.split_points == ("layer3",) and plan.layout.pp == 2
    assert meshplan.Plan.from_data({"pipeline": {"microbatches": 2}}).pipeline.split == "blocks"
    record = _plan_traced()
    assert isinstance(record, TracedPipeline) and record.stage_ids == [1] and record.num_stages == 2
    assert record.has_last and not record.has_first and record.shapes is None and record.stages == []
    assert _plan_traced({"pp": 2, "vpp": 2}, pipeline={"schedule": "interleaved_1f1b",
                                                       "split_points": VPP_POINTS}).stage_ids == [1, 3]


@pytest.mark.fast
@pytest.mark.parametrize("data, match", [
    ({"split": "trace", "microbatches": 4}, r"pipeline: split: trace needs split_points .*got none"),
    ({**TRACE, "first_stage_fewer_blocks": 1}, r"first_stage_fewer_blocks apply to split: blocks only; got "),
    ({**TRACE, "split": "traced"}, r"pipeline\.split: Input should be 'blocks' or 'trace' \(got 'traced'\)"),
])
def test_a_bad_trace_section_is_a_plan_error(data, match):
    with pytest.raises(PlanError, match=match):
        meshplan.Plan.from_data({"pipeline": data})


@pytest.mark.fast
@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel={"rules": {"fc": "colwise"}}),
     r"p\.yaml: pipeline\.split: trace with the tensor_parallel section\(s\): not supported yet.*expected split: "
     r"trace alone"),
    (dict(data_parallel={}), r"trace with the data_parallel section\(s\)"),
    (dict(blocks={"pattern": "layer*"}), r"trace with the blocks section\(s\)"),
    (dict(layout={"pp": 2, "tp": 2}, world=4), r"split: trace runs on pp ranks only; found world size 4 with pp=2 "
                                               r"and \{'tp': 2\}; expected world size = pp"),
    (dict(layout={"pp": 2}, world=4), r"found world size 4 with pp=2 and \{'dp': 2, 'dp_shard': 2\}"),
    (dict(layout={"pp": 2, "vpp": 2}, pipeline={"schedule": "zbv_zero_bubble", "split_points": VPP_POINTS}),
     r"pipeline\.schedule: zbv_zero_bubble with split: trace is not supported.*expected one of gpipe, 1f1b, "
     r"interleaved_1f1b, looped_bfs, interleaved_zero_bubble, or split: blocks"),
    (dict(pipeline={"schedule": "1f1b", "microbatches": 1}), r"pipeline\.microbatches: 1f1b needs at least pp\(2\)"),
    (dict(pipeline={"split_points": ["layer9"]}),
     r"p\.yaml: pipeline\.split_points\.'layer9': matches no module of ResNet"),
    (dict(pipeline={"split_points": ["layer2", "layer3"]}), r"2 split points .* for 2 stages"),
])
def test_what_the_traced_split_does_not_support_is_refused(kwargs, match):
    with pytest.raises(PlanError, match=match):
        _plan_traced(**kwargs)


@pytest.mark.fast
def test_the_first_step_needs_tensors_and_later_steps_the_traced_shape():
    record = _plan_traced()
    with pytest.raises(PlanError, match=r"traces the model on one microbatch .*got inputs of type\(s\) \['dict'\]; "
                                        r"expected a tensor or a tuple of tensors"):
        prepare_traced(ResNet(tiny_args()), record, {"x": _x(8)}, None, None)
    record.shapes = [(2, 3, 32, 32)]  # as if traced on batches of 8 in 4 microbatches
    prepare_traced(ResNet(tiny_args()), record, _x(8), None, None)  # same shape: nothing to do
    with pytest.raises(PlanError, match=r"traced the stages on microbatches of shape\(s\) \[\(2, 3, 32, 32\)\] .*got "
                                        r"\[\(1, 3, 32, 32\)\]; expected every step to bring batches of the first"):
        prepare_traced(ResNet(tiny_args()), record, _x(4), None, None)


@pytest.mark.fast
def test_pruning_keeps_this_ranks_entries_and_drops_the_rest_from_the_optimizer():
    model = ResNet(tiny_args())
    opt = torch.optim.AdamW(model.parameters())
    drop = {k for k in model.state_dict() if k.startswith(("layer3.", "fc.")) or k == "layer2.0.norm2.bias"}
    kept = set(model.state_dict()) - drop
    _prune_optimizer(opt, _prune(model, drop))
    assert isinstance(model.layer3, nn.Identity) and isinstance(model.fc, nn.Identity)
    assert model.layer2[0].norm2.bias is None and isinstance(model.layer2[0].norm2, nn.GroupNorm)
    assert set(model.state_dict()) == kept
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]


# ---------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def world2(shared_launch):
    return shared_launch("trace_worker", 2)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["gpipe_sgd", "gpipe_adamw", "1f1b_sgd", "1f1b_adamw", "interleaved_1f1b_sgd",
                                  "interleaved_1f1b_adamw"])
def test_pp2_resnet_trains_as_one_device(world2, case):
    values = case_result(world2, case, 2)
    for rank, v in values.items():
        assert v["param"] <= RTOL and v["grad"] <= RTOL, (rank, v)
    last = values[1]
    assert last["loss"] <= RTOL and len(last["losses"]) == 3, last
    keys = values[0]["keys"] + values[1]["keys"]
    assert len(keys) == len(set(keys)) and sorted(keys) == values[0]["model_keys"]


@pytest.mark.dist
@pytest.mark.parametrize("case", ["plan_gpipe", "plan_1f1b", "plan_interleaved_1f1b", "plan_looped_bfs",
                                  "plan_interleaved_zero_bubble"])
def test_resnet_plan_trains_as_one_device(world2, case):
    """``parallelize(build(), "plans/resnet_pp.yaml", topo)`` + ``train_step``: the ResNet traced and cut at
    layer3 (vpp=2: at layer2, layer3, avgpool) trains as one device accumulating the same microbatches."""
    values = case_result(world2, case, 2)
    for rank, v in values.items():
        assert v["param"] <= RTOL and v["loss"] <= RTOL and v["norm"] <= RTOL, (rank, v)
        assert v["num_tokens"] == [8, 8, 8] and v["optimizer_is_model"] and v["loaded"] == 0, (rank, v)
        assert min(v["ref_norms"]) > 0.5, v  # clipping (max_grad_norm 0.5) was active
    assert values[0]["losses"] == values[1]["losses"]  # every rank reports the step's loss
    keys = [k for ks in values[0]["keys"] for k in ks]
    assert len(keys) == len(set(keys)) and sorted(keys) == values[0]["model_keys"]
    assert all(ks for ks in values[0]["keys"])  # each rank holds part of the model
