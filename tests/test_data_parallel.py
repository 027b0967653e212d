"""The data_parallel section (validation, modes, errors) and train_step, on the fake group or one process."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ValidationError

import meshplan
from llama import build, tiny_args
from meshplan import Layout, PlanError
from meshplan.data_parallel.fsdp import apply_data_parallel, resolve_mode
from meshplan.plan_file.blocks import Blocks
from meshplan.plan_file.data_parallel import DataParallel
from meshplan.training.clip import _grad_norm_parts
from meshplan.training.step import StepResult, train_step

pytestmark = pytest.mark.fast


# ---------------------------------------------------------------- the section model
def _fields(model: type[BaseModel]):
    for name, f in model.model_fields.items():
        yield model, name, f
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann)


def test_every_field_has_a_description():
    missing = [f"{m.__name__}.{n}" for s in (DataParallel, Blocks) for m, n, f in _fields(s) if not f.description]
    assert not missing


def test_defaults_and_yaml_like_data():
    d, b = DataParallel(), Blocks()
    assert (d.mode, b.pattern, d.gradient_reduction, d.accumulate_unsharded) == (None, "layers.*", "sum", True)
    d = DataParallel.model_validate({"param_dtype": "bfloat16", "reshard_after_forward": 4})
    b = Blocks.model_validate({"activation_checkpointing": {"mode": "selective", "every": 2}})
    assert d.reshard_after_forward == 4 and b.activation_checkpointing.every == 2
    assert DataParallel.model_validate({"reshard_after_forward": True}).reshard_after_forward is True


@pytest.mark.parametrize("section, data, needle", [
    (DataParallel, {"modee": "fsdp"}, "modee"),
    (DataParallel, {"mode": "zero3"}, "mode"),
    (DataParallel, {"param_dtype": "fp16"}, "param_dtype"),
    (DataParallel, {"reshard_after_forward": 1}, "group size >= 2"),
    (Blocks, {"pattern": "layers..x"}, "empty path segment"),
    (Blocks, {"activation_checkpointing": {"mode": "full", "every": 2}}, "need mode: selective"),
    (Blocks, {"activation_checkpointing": {"mode": "selective"}}, "every > 1, a list of ops or policy: megatron"),
    (Blocks, {"activation_checkpointing": {"mode": "selective", "ops": ["mm"]}}, "ops[0]"),
])
def test_invalid_sections(section, data, needle):
    with pytest.raises(ValidationError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        section.model_validate(data)


def test_section_is_frozen_and_nestable():
    d = DataParallel()
    with pytest.raises(ValidationError):
        d.mode = "ddp"

    class P(meshplan.plan_file.strict.Strict):
        data_parallel: DataParallel | None = None

    assert P.model_validate({"data_parallel": {"mode": "ddp"}}).data_parallel.mode == "ddp"
    assert meshplan.Plan.from_data({"blocks": {"compile": True}}).blocks.compile
    with pytest.warns(FutureWarning, match="moved to the top-level blocks section"):  # the old spelling
        assert meshplan.Plan.from_data({"data_parallel": {"compile": True}}).blocks.compile


@pytest.mark.parametrize("module", ["meshplan.data_parallel.fsdp", "meshplan.blocks", "meshplan.state"])
def test_section_module_is_torch_free(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- modes
@pytest.mark.parametrize("layout, world, mode, shard, rep", [
    ({}, 1, "none", None, None),
    ({"tp": 2}, 2, "none", None, None),
    ({}, 4, "fsdp", ("dp_shard", "cp"), None),
    ({"cp": 2}, 2, "fsdp", ("dp_shard", "cp"), None),
    ({"dp_replicate": 2}, 2, "ddp", None, ("dp_replicate", "dp_shard", "cp")),
    ({"dp_replicate": 2, "tp": 2}, 8, "hsdp", ("dp_shard", "cp"), ("dp_replicate",)),
    ({"dp_replicate": 2, "cp": 2}, 8, "hsdp", ("dp_shard", "cp"), ("dp_replicate",)),
])
def test_mode_from_layout(layout, world, mode, shard, rep):
    assert resolve_mode(DataParallel(), Layout(**layout).resolve(world)) == (mode, shard, rep)


def test_explicit_modes():
    both = Layout(dp_replicate=2).resolve(8)
    assert resolve_mode(DataParallel(mode="fsdp"), both)[1] == ("dp_replicate", "dp_shard", "cp")
    assert resolve_mode(DataParallel(mode="ddp"), both)[2] == ("dp_replicate", "dp_shard", "cp")
    with pytest.raises(PlanError, match=r"mode: hsdp needs dp_replicate > 1 and dp_shard·cp > 1, got "
                                        r"dp_replicate\(1\) dp_shard\(4\) cp\(1\)"):
        resolve_mode(DataParallel(mode="hsdp"), Layout().resolve(4))
    with pytest.raises(PlanError, match=r"mode: none, but dp_replicate\(2\) dp_shard\(4\) cp\(1\): 8 ranks"):
        resolve_mode(DataParallel(mode="none"), both)


# ---------------------------------------------------------------- apply on the fake group
def _apply(fake_pg, world, layout, section=None, **kw):
    with fake_pg(world):
        topo = meshplan.build_mesh(layout)
        model = apply_data_parallel(build(tiny_args()), section, topo, **kw)
        return model, topo


def test_fsdp_per_block_and_root(fake_pg):
    from torch.distributed.fsdp import FSDPModule
    with fake_pg(4):
        topo = meshplan.build_mesh({})
        model = apply_data_parallel(build(tiny_args()), {"param_dtype": "bfloat16"}, topo)
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
        p = model.layers[0].attention.wq.weight
        assert p.placements[0].is_shard() and p.device_mesh.mesh_dim_names == ("dp_shard",)
        state = meshplan.parallel_state(model)
        assert state.data_parallel.mode == "fsdp" and state.blocks.paths == ["layers.0", "layers.1"]


@pytest.mark.parametrize("layout, world, dims, kind", [
    ({"dp_replicate": 2}, 8, ("dp_replicate", "dp_shard"), "FSDP"),
    ({"cp": 2}, 4, ("dp_shard_cp",), "FSDP"),
    ({"dp_replicate": 2}, 2, ("dp_replicate",), "Replicate"),
])
def test_meshes(fake_pg, layout, world, dims, kind):
    with fake_pg(world):
        model = apply_data_parallel(build(tiny_args()), None, meshplan.build_mesh(layout))
        assert model.output.weight.device_mesh.mesh_dim_names == dims
        assert type(model).__name__.startswith(kind)


def test_explicit_fsdp_shards_over_all_data_ranks(fake_pg):
    with fake_pg(8):
        model = apply_data_parallel(build(tiny_args()), {"mode": "fsdp"}, meshplan.build_mesh({"dp_replicate": 2}))
        assert model.output.weight.device_mesh.mesh_dim_names == ("dp",) and model.output.weight.device_mesh.size() == 8


def test_activation_checkpointing_every_second_block(fake_pg):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    with fake_pg(2):
        model = build(tiny_args(n_layers=4))
        ac = {"mode": "selective", "every": 2}
        apply_data_parallel(model, None, meshplan.build_mesh({}), blocks={"activation_checkpointing": ac})
        assert [isinstance(b, CheckpointWrapper) for b in model.layers] == [False, True, False, True]


def test_compile_applies(fake_pg):
    with fake_pg(2):
        model = build(tiny_args())
        apply_data_parallel(model, None, meshplan.build_mesh({}), blocks={"compile": True})
        assert all(b._compiled_call_impl is not None for b in model.layers)


@pytest.mark.parametrize("ac", [{"mode": "full"}, {"mode": "selective", "ops": ["aten.mm.default", "aten.bmm"]}])
def test_checkpointed_gradients_equal(fake_pg, ac):
    with fake_pg(1):
        torch.manual_seed(0)
        ref, model = build(tiny_args()), build(tiny_args())
        model.load_state_dict(ref.state_dict())
        apply_data_parallel(model, None, meshplan.build_mesh({}), blocks={"activation_checkpointing": ac})
        x = torch.randint(0, 128, (2, 8))
        ref(x).square().mean().backward()
        model(x).square().mean().backward()
        got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("section, layout, world, needle", [
    ({"blocks": {"pattern": "blocks.*"}}, {}, 2, r"blocks: pattern 'blocks.\*' matched no module of Transformer "
                                                 r"\(top-level children: tok_embeddings, layers, norm, output\)"),
    ({"blocks": {"activation_checkpointing": {"mode": "selective", "ops": ["aten.nosuchop"]}}}, {}, 2,
     r"activation_checkpointing.ops\[0\]: unknown op 'aten.nosuchop'"),
    ({"cpu_offload": True}, {}, 2, r"cpu_offload: true needs an accelerator \(mesh device 'cpu'\)"),
    ({"reshard_after_forward": 3}, {}, 8, r"reshard_after_forward: 3 must divide the shard size \(8\) and be "
                                          r"smaller; valid: 2, 4"),
    ({"reshard_after_forward": 2}, {}, 2, r"must divide the shard size \(2\).*valid: none"),
    ({"mode": "none"}, {}, 2, r"mode: none, but dp_replicate\(1\) dp_shard\(2\)"),
    ({"modee": 1}, {}, 2, r"data_parallel: modee: Extra inputs are not permitted"),
])
def test_apply_errors(fake_pg, section, layout, world, needle):
    section = dict(section)
    blocks = section.pop("blocks", None)
    with pytest.raises(PlanError, match=needle):
        _apply(fake_pg, world, layout, section, blocks=blocks)


def test_errors_leave_the_model_untouched(fake_pg):
    with fake_pg(8):
        model = build(tiny_args())
        section, blocks = {"reshard_after_forward": 3}, {"activation_checkpointing": {"mode": "full"}}
        with pytest.raises(PlanError, match="reshard_after_forward: 3"):
            apply_data_parallel(model, section, meshplan.build_mesh({}), blocks=blocks)
        assert type(model.layers[0]).__name__ == "TransformerBlock" and meshplan.parallel_state(model) is None


def test_reshard_int_with_tensor_parallel_is_rejected(fake_pg):
    with fake_pg(8):
        topo = meshplan.build_mesh({"tp": 2})
        model = build(tiny_args())
        plan = {"tensor_parallel": meshplan.load_plan("plans/llama.yaml").tensor_parallel.model_dump(exclude_unset=True),
                "data_parallel": {"reshard_after_forward": 2}}
        with pytest.raises(PlanError, match=r"reshard_after_forward: 2 \(an int\) does not work with tensor-parallel"):
            meshplan.parallelize(model, plan, topo)


def test_apply_twice_and_without_topology(fake_pg):
    model, topo = _apply(fake_pg, 2, {})
    with pytest.raises(PlanError, match="already applied"):
        apply_data_parallel(model, None, topo)
    with pytest.raises(PlanError, match="needs a Topology"):
        apply_data_parallel(build(tiny_args()))


def test_old_spelling_in_apply_data_parallel(fake_pg):
    """A section dict with blocks/activation_checkpointing/compile still works (FutureWarning), = blocks=."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    with fake_pg(2):
        model = build(tiny_args(n_layers=4))
        ac = {"mode": "selective", "every": 2}
        with pytest.warns(FutureWarning, match=r"apply_data_parallel: data_parallel.blocks, data_parallel."
                                               r"activation_checkpointing: deprecated.*pass blocks=\{'pattern': "
                                               r"'layers.\*', 'activation_checkpointing': \{'mode': 'selective', "
                                               r"'every': 2\}\} to apply_data_parallel"):
            apply_data_parallel(model, {"blocks": "layers.*", "activation_checkpointing": ac}, meshplan.build_mesh({}))
        assert [isinstance(b, CheckpointWrapper) for b in model.layers] == [False, True, False, True]
        state = meshplan.parallel_state(model)
        assert state.blocks.section == Blocks(activation_checkpointing=ac) and state.data_parallel.section == \
            DataParallel()
        with pytest.raises(PlanError, match=r"data_parallel.compile and the blocks section are both given"):
            apply_data_parallel(build(tiny_args()), {"compile": True}, meshplan.build_mesh({}), blocks={})


@pytest.mark.parametrize("layout, world, axes, key", [
    ({}, 1, ("dp_shard", "cp"), "dp_shard"),
    ({}, 4, ("dp_shard", "cp"), "dp_shard"),
    ({"dp_replicate": 2}, 2, ("dp_replicate", "dp_shard", "cp"), "dp_replicate"),
    ({"cp": 2}, 2, ("dp_shard", "cp"), "dp_shard_cp"),
    ({"cp": 2}, 4, ("dp_shard", "cp"), "dp_shard_cp"),
    ({"dp_replicate": 2}, 8, ("dp_replicate", "dp_shard", "cp"), "dp"),
    ({"dp_replicate": 2, "cp": 2}, 4, ("dp_replicate", "dp_shard", "cp"), "dp_cp"),
    ({"dp_replicate": 2, "cp": 2}, 8, ("dp_replicate", "dp_shard", "cp"), "dp_cp"),
    ({"tp": 2}, 4, ("dp_shard", "cp"), "dp_shard"),
])
def test_data_parallel_mesh_spans_the_axes(fake_pg, layout, world, axes, key):
    """Topology.span: the simplest mesh over the axes of size > 1 (the FSDP/replicate mesh of each mode)."""
    with fake_pg(world):
        topo = meshplan.build_mesh(layout)
        mesh = topo.span(axes)
        assert mesh == topo[key] and mesh.mesh_dim_names == (key,)


def test_parallelize_order_and_state(fake_pg):
    """TP → blocks (checkpointing) → FSDP (each checkpointed block, then the root), recorded in ONE state."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    with fake_pg(4):
        topo = meshplan.build_mesh({"dp_shard": 2, "tp": 2})
        plan = meshplan.Plan.from_data({
            "tensor_parallel": {"sequence_parallel": True, "loss_parallel": False, "rules": _TP_RULES},
            "blocks": {"activation_checkpointing": {"mode": "full"}}, "data_parallel": {}})
        model = meshplan.parallelize(build(tiny_args()), plan, topo)
        assert all(isinstance(b, CheckpointWrapper) and isinstance(b, FSDPModule) for b in model.layers)
        assert model.layers[0].attention.wq.weight.device_mesh.mesh_dim_names == ("dp_shard", "tp")
        state = meshplan.parallel_state(model)
        assert state.plan is plan and state.topology is topo and state.blocks.paths == ["layers.0", "layers.1"]
        assert state.data_parallel.mode == "fsdp" and state.data_parallel.grad_sync is None
        assert state.grad_sync is state.tensor_parallel.finalizer is not None
        assert state.sequence_parallel is True and state.data_axes == ("dp_replicate", "dp_shard", "cp")
        assert not [k for k in vars(model) if k.startswith("_meshplan") and k != "_meshplan_state"]


def test_blocks_section_without_data_parallel(fake_pg):
    """A blocks section applies on its own (tp only, no data ranks): checkpointing without FSDP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    with fake_pg(2):
        model = meshplan.parallelize(build(tiny_args()), {
            "tensor_parallel": {"loss_parallel": False, "rules": _TP_RULES},
            "blocks": {"activation_checkpointing": {"mode": "full"}}}, meshplan.build_mesh({"tp": 2}))
        assert all(isinstance(b, CheckpointWrapper) for b in model.layers) and not isinstance(model, FSDPModule)
        state = meshplan.parallel_state(model)
        assert state.data_parallel is None and state.blocks.paths == ["layers.0", "layers.1"]


# ---------------------------------------------------------------- train_step on one process
def _ce_sum(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _batch():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 128, (4, 12), generator=g), torch.randint(0, 128, (4, 12), generator=g)
    y[0, 2:] = -100  # microbatch 0 has 2 + 12 valid targets, microbatch 1 has 24
    return x, y


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_global_mean_and_clipping_match_torch(microbatches):
    torch.manual_seed(0)
    ref, model = build(tiny_args()), build(tiny_args())
    model.load_state_dict(ref.state_dict())
    x, y = _batch()
    loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)  # mean over ALL valid tokens
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    res = train_step(model, (x, y), _ce_sum, torch.optim.SGD(model.parameters(), lr=1.0),
                     microbatches=microbatches, max_grad_norm=0.1)
    assert isinstance(res, StepResult) and res.num_tokens == int((y != -100).sum()) == 38
    assert res.loss == pytest.approx(loss.item(), rel=1e-6) and res.grad_norm == pytest.approx(float(norm), rel=1e-5)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6)
        assert p.grad is None  # zero_grad(set_to_none=True)


def test_meshplan_cross_entropy_is_summed():
    torch.manual_seed(0)
    a, b = build(tiny_args()), build(tiny_args())
    b.load_state_dict(a.state_dict())
    x, y = _batch()
    r1 = train_step(a, (x, y), meshplan.cross_entropy, torch.optim.SGD(a.parameters(), lr=0.1), max_grad_norm=9.0)
    r2 = train_step(b, (x, y), _ce_sum, torch.optim.SGD(b.parameters(), lr=0.1), max_grad_norm=9.0)
    assert (r1.loss, r1.grad_norm) == pytest.approx((r2.loss, r2.grad_norm), rel=1e-6)


def test_train_step_inputs_as_dict_and_no_clipping():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 5)

        def forward(self, *, x):
            return self.lin(x)

    model = M()
    x, y = torch.randn(4, 3), torch.tensor([1, -100, 2, 3])
    res = train_step(model, ({"x": x}, y), lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                     torch.optim.SGD(model.parameters(), lr=0.1), microbatches=2)
    assert res.grad_norm is None and res.num_tokens == 3


def test_train_step_errors():
    model = build(tiny_args())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PlanError, match=r"microbatches\(3\) does not divide the inputs batch size \(4\); "
                                        r"valid: 1, 2, 4"):
        train_step(model, _batch(), _ce_sum, opt, microbatches=3)


def test_all_ignored_gives_nan_loss_and_zero_grads():
    model = build(tiny_args())
    x, y = _batch()
    res = train_step(model, (x, torch.full_like(y, -100)), _ce_sum, torch.optim.SGD(model.parameters(), lr=0.1),
                     max_grad_norm=1.0)
    assert res.num_tokens == 0 and res.loss != res.loss and res.grad_norm == 0.0


def test_norm_weights_never_double_count_replicate(fake_pg):
    """Each local ‖g‖² is weighted by (Shard mesh sizes)/world: replicas add up to exactly one copy."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    with fake_pg(8):
        mesh = meshplan.build_mesh({"tp": 2, "dp_replicate": 2}).dense["dp_replicate", "dp_shard", "tp"]
        cases = [((Replicate(), Shard(0), Shard(1)), 4 / 8), ((Replicate(), Shard(0), Replicate()), 2 / 8),
                 ((Replicate(), Replicate(), Replicate()), 1 / 8)]
        for placements, weight in cases:
            p = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, placements))
            p.grad = distribute_tensor(torch.ones(4, 4), mesh, placements)
            local = p.grad.to_local().numel()
            assert float(_grad_norm_parts([p], 8)) == pytest.approx(local * weight)


def test_float64_grads_can_be_clipped():
    """A float64 gradient's norm is computed in float64 (clipping float64 gradients raised: the norm was asked
    for in float32, and vector_norm refuses to narrow)."""
    g = torch.tensor([1.0, 1e-9, 1.0 / 3.0], dtype=torch.float64)
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = g.clone()
    assert float(_grad_norm_parts([p], 1)) == float(g.square().sum())


# ---------------------------------------------------------------- tp reductions of replicated grads (grads.py)
_TP_RULES = {"layers.*.attention_norm": "norm", "layers.*.ffn_norm": "norm", "norm": "norm",
             "tok_embeddings": "embedding", "output": "lm_head", "layers.*.attention.wo": "rowwise",
             "layers.*.feed_forward.w2": "rowwise",
             **{f"layers.*.{m}": "colwise" for m in ("attention.wq", "attention.wk", "attention.wv",
                                                      "feed_forward.w1", "feed_forward.w3")}}


def _assert_final_grads(model):
    from torch.distributed.tensor import DTensor
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if isinstance(p, DTensor):  # the parameter's placement and local shape: no Partial left
            assert p.grad.placements == p.placements, (name, p.grad.placements)
            assert p.grad.to_local().shape == p.to_local().shape, name


@pytest.mark.parametrize("no_sync", [False, True])
def test_hand_written_loop_one_tp_all_reduce_under_fsdp(fake_pg, no_sync):
    """FSDP×TP+SP, plain ``loss.backward()``: all 5 norm grads in ONE tp all-reduce (FSDP2 alone: 5)."""
    from benchmarks._comm import CommLog
    with fake_pg(4):
        topo = meshplan.build_mesh({"dp_shard": 2, "tp": 2})
        model = meshplan.parallelize(build(tiny_args()), {"tensor_parallel": {
            "sequence_parallel": True, "loss_parallel": False, "rules": _TP_RULES}, "data_parallel": {}}, topo)
        state = meshplan.parallel_state(model)
        sync = state.gradients  # the one finaliser parallelize made and handed to the axes
        assert sync is state.tensor_parallel.finalizer is state.grad_sync
        x = torch.randint(0, 128, (2, 16))
        per_backward = []
        for i in range(2):  # two microbatches; no_sync: FSDP2 reduces only the second
            if no_sync:
                model.set_requires_gradient_sync(i == 1)
            with CommLog() as c:
                _ce_sum(model(x), x).backward()
            per_backward.append(c.by_group()["all_reduce@2"])  # dp reduce-scatters; tp all-reduces are the @2 ones
        assert per_backward == ([0, 1] if no_sync else [1, 1])
        _assert_final_grads(model)
        assert not sync._pending and not sync._stash


def test_accumulated_backwards_match_one_device():
    """Two backwards (no zero_grad between) under TP+SP: each reduces only its own contribution, once."""
    import copy

    from _local import assert_close_rel, local_ranks
    torch.manual_seed(0)
    ref = build(tiny_args(n_kv_heads=4))
    x, y = _batch()
    _ce_sum(ref(x), y).backward()
    with local_ranks(2):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        meshplan.parallelize(model, {"tensor_parallel": {"sequence_parallel": True, "loss_parallel": False,
                                                         "rules": _TP_RULES}}, meshplan.build_mesh({"tp": 2}))
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            _ce_sum(model(xm), ym).backward()
        _assert_final_grads(model)
        refp = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert_close_rel(p.grad, refp[name].grad, 1e-5)


def test_batch_mode_plain_parameters_reduce_over_tp():
    """smp batch mode without a data_parallel section: plain parameters' grads are summed over tp."""
    from _local import assert_close_rel, from_ranks, local_ranks, on_rank

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm, self.out = nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16, bias=False)

        def forward(self, x):
            return self.out(self.norm(self.emb(x)))

    torch.manual_seed(0)
    ref, model = Toy(), Toy()
    model.load_state_dict(ref.state_dict())
    x = torch.randint(0, 16, (4, 6))
    _ce_sum(ref(x), x).backward()
    with local_ranks(2):  # emb: no rule, a plain parameter; each tp rank embeds its own two rows
        meshplan.parallelize(model, {"tensor_parallel": {"sequence_parallel": "batch", "loss_parallel": False,
                                                         "rules": {"norm": "norm", "out": "lm_head"}}},
                             meshplan.build_mesh({"tp": 2}))
        tp = meshplan.parallel_state(model).tensor_parallel
        assert tp.sequence_parallel == "batch" and tp.finalizer.plain == {"emb.weight"}
        xs = from_ranks({r: x[2 * r:2 * r + 2] for r in range(2)})
        _ce_sum(model(xs), xs).backward()
        _assert_final_grads(model)
        for r in range(2):
            torch.testing.assert_close(on_rank(model.emb.weight.grad, r), ref.emb.weight.grad, rtol=1e-5, atol=1e-6)
        assert_close_rel(model.norm.weight.grad, ref.norm.weight.grad, 1e-5)


def test_meta_init_keeps_the_tp_reduction(fake_pg):
    """materialize swaps the parameters' storage (and drops tensor hooks): the norm grads still end Replicate."""
    from torch.distributed.tensor import DTensor
    with fake_pg(2):
        with torch.device("meta"):
            model = build(tiny_args())
        meshplan.parallelize(model, {"tensor_parallel": {"sequence_parallel": True, "loss_parallel": False,
                                                         "rules": _TP_RULES}}, meshplan.build_mesh({"tp": 2}))
        meshplan.materialize(model, seed=0)
        x = torch.randint(0, 128, (2, 16))
        _ce_sum(model(x), x).backward()
        _assert_final_grads(model)
        assert meshplan.parallel_state(model).tensor_parallel.finalizer.collectives == 1
        assert all(p.grad.placements == p.placements for p in model.parameters() if isinstance(p, DTensor))


def test_clip_grad_norm_of_float64_gradients():
    """float64 training (the parity tests' precision) clips: the norm is taken in float64, not narrowed to float32
    (torch refuses the narrowing); bf16 gradients still accumulate in float32."""
    from meshplan.training.clip import clip_grad_norm_
    for dtype in (torch.float64, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype))
        p.grad = torch.full((3, 4), 0.5, dtype=dtype)
        assert clip_grad_norm_([p], 0.1, distributed=False, pp=1) == pytest.approx(0.5 * 12 ** 0.5, rel=1e-6)
        assert float(p.grad.double().norm()) == pytest.approx(0.1, rel=1e-2)


@pytest.mark.parametrize("plan,want", [
    ({"layout": {"dp_shard": 2}, "data_parallel": {"mode": "hsdp"}},
     "data_parallel.mode: hsdp needs dp_replicate > 1 and dp_shard·cp > 1, got dp_replicate(1) dp_shard(2) cp(1)"),
    ({"layout": {"dp_shard": 4}, "data_parallel": {"reshard_after_forward": 3}},
     "data_parallel.reshard_after_forward: 3 must divide the shard size (4) and be smaller; valid: 2"),
    ({"layout": {"dp_shard": 2}, "blocks": {"pattern": "blocks.*"}},
     "blocks: pattern 'blocks.*' matched no module of Transformer (top-level children: tok_embeddings, layers, norm, "
     "output) (the blocks section); expected the model's repeated blocks: write `blocks: {pattern: layers.*}`"),
])
def test_check_refuses_what_parallelize_refuses_before_changing_the_model(plan, want):
    """`meshplan check` and `meshplan.parallelize` run the same functions for the blocks and data_parallel sections
    (blocks_problem, data_parallel_problem), at dp > 1: check reports exactly the error parallelize raises first."""
    from meshplan.blocks import blocks_problem
    from meshplan.data_parallel.fsdp import data_parallel_problem
    with torch.device("meta"):
        model = build(tiny_args())
    world = plan["layout"]["dp_shard"]
    report = meshplan.check(model, plan, world_size=world)
    assert [str(e) for e in report.errors] == [f"<plan>: {want}" if want.startswith("blocks") else want]
    p = meshplan.Plan.from_data(plan)
    lay = p.layout.resolve(world)
    first = blocks_problem(model, p, lay) or data_parallel_problem(p, lay)  # what parallelize raises first
    assert str(first) == want


def test_expert_shard_placement_avoids_a_second_strided_shard(fake_pg):
    """FSDP2 over edp on a packed gate|up split over etp shards the model dim (torch cannot gather
    ``(_StridedShard(0), Shard(0), _StridedShard(1))``); other expert parameters keep FSDP2's dim 0."""
    from torch.distributed.tensor import DTensor, Shard

    from meshplan._torch import StridedShard
    from meshplan.expert_parallel.edp import expert_shard_placement
    with fake_pg(8):
        mesh = meshplan.build_mesh({"tp": 2, "ep": 2, "etp": 2, "dp_shard": 4}).expert["ep", "etp"]

        def param(local, placements, shape):
            return DTensor.from_local(torch.zeros(local), mesh, placements, run_check=False, shape=shape,
                                      stride=torch.empty(shape).stride())
        gate_up = param((2, 128, 64), [Shard(0), StridedShard(1, split_factor=2)], (4, 256, 64))
        assert expert_shard_placement(gate_up, 2) == Shard(2)
        assert expert_shard_placement(gate_up, 3) is None  # 64 % 3: no dim FSDP2 can shard evenly but 0
        down = param((2, 64, 64), [Shard(0), Shard(2)], (4, 64, 128))
        assert expert_shard_placement(down, 2) is None
        assert expert_shard_placement(torch.zeros(4, 8), 2) is None


def _cost_rows() -> list[list[str]]:
    """The ring-byte table of docs/data-parallel.md ("What a step costs"), its cells per row."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "data-parallel.md")).read()
    section = text[text.index("## What a step costs"):]
    rows = [line.strip("|").split("|") for line in section.splitlines() if re.match(r"\| [248] \| (yes|no) \|", line)]
    return [[c.strip() for c in row] for row in rows]


def test_docs_ring_byte_table_equals_the_estimate():
    """Every number of docs/data-parallel.md's ring-byte table is what ``meshplan estimate`` prints for that plan
    (its dp calls, its dp bytes per step, (d-1)/d of them per rank), and one row measured on the fake group
    (``benchmarks/dp.py``, d 4 with resharding) moves those bytes in those calls."""
    from benchmarks.dp import estimated_traffic, fsdp_traffic
    rows = _cost_rows()
    assert len(rows) == 6
    e, m = estimated_traffic(4, True), fsdp_traffic(4, True)
    assert (m["bytes"], m["calls"]) == (e["ring"], {"all_gather@4": e["calls"]["all_gather"],
                                                    "reduce_scatter@4": e["calls"]["reduce_scatter"]})
    assert f"Ψ = {m['psi']:,} B" in open(os.path.join(os.path.dirname(__file__), "..", "docs", "data-parallel.md")).read()
    for d, reshard, calls, printed, ring, ratio in rows:
        e = estimated_traffic(int(d), reshard == "yes")
        assert calls == f"{e['calls']['all_gather']} / {e['calls']['reduce_scatter']}", (d, reshard)
        assert (printed, ring) == (e["printed"], f"{round(e['ring']):,}"), (d, reshard)
        theory = (3 if reshard == "yes" else 2) * (int(d) - 1) / int(d) * m["psi"]
        assert ratio.split()[0] == f"{e['ring'] / theory:.4f}", (d, reshard)
