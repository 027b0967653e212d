"""``data_parallel.ends: vocab_parallel`` on the fake group: what it shards, and what ``meshplan check`` (the code
``parallelize`` runs) refuses, with a suggestion that, followed, checks ok. Numerics and collectives on real gloo
ranks: tests/test_dist_dp.py, tests/test_dist_pipeline.py (``*vocab_ends*``)."""

from pathlib import Path

import pytest
import torch
import yaml
import torch.nn as nn

import meshplan
from llama import build, tiny_args
from meshplan import PlanError
from meshplan.data_parallel.fsdp import apply_data_parallel

pytestmark = pytest.mark.fast

VOCAB = {"data_parallel": {"ends": "vocab_parallel"}}
TP = {"tensor_parallel": yaml.safe_load((Path(__file__).parents[1] / "plans" / "llama.yaml").read_text())["tensor_parallel"]}


def _errors(model, plan, world):
    return [str(e) for e in meshplan.check(model, plan, world_size=world, dry_run=False).errors]


def test_ends_are_row_shards_on_fsdps_mesh_and_outside_its_units(fake_pg):
    from torch.distributed.fsdp import FSDPModule
    with fake_pg(4):
        topo = meshplan.build_mesh({"dp_shard": 4})
        model = meshplan.parallelize(build(tiny_args()), VOCAB, topo)
        block = model.layers[0].attention.wq.weight
        for p in (model.tok_embeddings.weight, model.output.weight):
            assert p.placements[0].is_shard(0) and p.device_mesh is block.device_mesh
            assert p.to_local().shape == (128 // 4, 64)
        assert not isinstance(model.tok_embeddings, FSDPModule) and not isinstance(model.output, FSDPModule)
        assert isinstance(model, FSDPModule) and model.norm.weight.to_local().shape == (64 // 4,)  # the root's unit
        assert meshplan.parallel_state(model).data_parallel.ends == ()  # no FSDP2 end unit


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


class Blocksonly(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("make, plan, world, needle", [
    (lambda: build(tiny_args()), {"layout": {"tp": 2}, **TP, **VOCAB}, 4, r"ends: vocab_parallel is for tp 1, got tp\(2\)"),
    (lambda: build(tiny_args()), {"layout": {"dp_replicate": 2, "dp_shard": 2}, **VOCAB}, 4,
     r"needs mode fsdp; got mode hsdp with dp_replicate\(2\) dp_shard\(2\)"),
    (lambda: build(tiny_args()), {"layout": {"dp_shard": 3}, **VOCAB}, 3,
     r"tok_embeddings \(Embedding\): 3 data ranks do not divide its 128 rows; data ranks that do: 1, 2, 4, 8, 16, "
     r"32, 64"),
    (lambda: _with(build(tiny_args()), tok_embeddings=ScaledEmbedding(128, 64)), {"layout": {"dp_shard": 2}, **VOCAB},
     2, r"tok_embeddings \(ScaledEmbedding\) is not a plain dense nn.Embedding"),
    (Blocksonly, {"layout": {"dp_shard": 2}, **VOCAB}, 2, r"found no nn.Embedding or nn.Linear outside the blocks"),
])
def test_check_refuses_and_the_suggestion_checks_ok(make, plan, world, needle):
    errors = _errors(make(), plan, world)
    assert any(__import__("re").search(needle, e) for e in errors), errors
    assert all("use ends: fsdp" in e for e in errors if "ends" in e)
    fixed = {**plan, "data_parallel": {"ends": "fsdp"}}
    assert _errors(make(), fixed, world) == []


def _with(model, **children):
    for name, m in children.items():
        setattr(model, name, m)
    return model


def test_parallelize_and_apply_refuse_before_anything_changes(fake_pg):
    with fake_pg(3):
        topo = meshplan.build_mesh({"dp_shard": 3})
        model = build(tiny_args())
        before = {n: type(p) for n, p in model.named_parameters()}
        with pytest.raises(PlanError, match="3 data ranks do not divide its 128 rows"):
            meshplan.parallelize(model, VOCAB, topo)
        with pytest.raises(PlanError, match="3 data ranks do not divide its 128 rows"):
            apply_data_parallel(model, {"ends": "vocab_parallel"}, topo)
        assert {n: type(p) for n, p in model.named_parameters()} == before
        assert meshplan.parallel_state(model) is None


def test_tied_head_stays_one_parameter(fake_pg):
    with fake_pg(2):
        model = meshplan.parallelize(build(tiny_args(tie_embeddings=True)), VOCAB, meshplan.build_mesh({"dp_shard": 2}))
        assert model.output.weight is model.tok_embeddings.weight
        assert model.output.weight.to_local().shape == (64, 64)
        assert torch.is_tensor(model.output.weight)


def test_chunked_reduce_scatter_is_refused_off_the_cpu():
    from types import SimpleNamespace

    from meshplan.data_parallel.mode import check_data_parallel
    from meshplan.plan_file.data_parallel import DataParallel
    topo = SimpleNamespace(dense=SimpleNamespace(device_type="cuda"), layout=None)
    with pytest.raises(PlanError, match=r"reduce_scatter: chunked is for CPU \(gloo\) meshes, got mesh device "
                                        r"'cuda'.*use reduce_scatter: collective"):
        check_data_parallel(nn.Linear(2, 2), DataParallel(reduce_scatter="chunked"), topo)


def test_blocks_under_an_end_module_holding_a_parameter_are_not_ends(fake_pg):
    """HRM's ``HrmTextModel`` holds ``z_L_init`` itself, so the end module is the whole model: the blocks under it
    (already FSDP2 units) were sharded again as heads (the zoo's hrm_text crashed: mixed Tensor and DTensor)."""
    from torch.distributed.fsdp import FSDPModule

    from meshplan.model_copies import vocab_ends

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.init = nn.Parameter(torch.zeros(8))
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            h = self.embed(x) + self.init
            for layer in self.layers:
                h = layer(h)
            return h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = Body(), nn.Linear(8, 16, bias=False)

        def forward(self, x):
            return self.head(self.body(x))

    plan = {**VOCAB, "blocks": {"pattern": "body.layers.*"}}
    inside = lambda path, m: path.startswith("body.layers.")  # noqa: E731 - check's rule: the blocks' paths
    assert vocab_ends(Model(), inside) == [("body.embed", "embedding"), ("head", "head")]
    with fake_pg(2):
        model = meshplan.parallelize(Model(), plan, meshplan.build_mesh({"dp_shard": 2}))
        assert all(isinstance(b, FSDPModule) for b in model.body.layers)
        assert model.body.layers[0].weight.to_local().shape == (4, 8)  # FSDP2's shard of an 8 x 8 weight, once
        assert model.head.weight.to_local().shape == (8, 8)
