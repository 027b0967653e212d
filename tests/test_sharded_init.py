"""``materialize(mode="sharded")``: initializers on local shards with draws keyed by (seed, name, global index).

Checked on each simulated rank (fake group, rank r): every rank's shards equal the slices of ONE full tensor per
parameter, the one a single process draws in sharded mode (layout invariance, which makes replicas bit-identical),
under tp, FSDP2, pp from meta (tied ends), ep, activation checkpointing; the per-tensor moments of the draws within
6 sigma of the sampling error (fixed by the sample size); the fans of kaiming/xavier from the global shape;
whole-tensor initializers (orthogonal_) run whole for their tensor; what cannot be done per shard is refused.
"""

import math

import pytest
import torch
import torch.nn as nn

import meshplan
from examples.hf_models import FACTORIES
from meshplan import PlanError
from meshplan.plan_file.document import Plan
from test_init_load import parallel_meta, shard_of
from test_pipeline_meta import factory as pp_factory, plan as pp_plan

pytestmark = pytest.mark.fast


def one_device(make, **kw):
    """The reference: a single process, no parallelism, sharded mode (plain tensors: every index held)."""
    with torch.device("meta"):
        model = make()
    return meshplan.materialize(model, seed=0, device="cpu", mode="sharded", **kw).state_dict()


def assert_slices_of(model, full: dict) -> int:
    """Every tensor of ``model`` (this rank's shards) equals its slice of ``full``; returns the elements held."""
    held = 0
    for k, t in model.state_dict().items():
        k = k.replace("_checkpoint_wrapped_module.", "")
        got = t.to_local() if hasattr(t, "placements") else t
        want = shard_of(t, full[k]) if hasattr(t, "placements") else full[k]
        assert torch.equal(got, want), k
        held += got.numel()
    return held


# ---------------------------------------------------------------- the choice of mode


def test_plan_section_and_call_choose_the_mode(fake_pg):
    assert Plan.from_data({"init": {"mode": "sharded"}}).init.mode == "sharded"
    assert Plan.from_data({"init": {}}).init.mode == "exact"
    with pytest.raises(PlanError, match=r"init.mode"):
        Plan.from_data({"init": {"mode": "fast"}})
    with pytest.raises(PlanError, match=r"init.seed"):
        Plan.from_data({"init": {"seed": 1}})
    make, plan = FACTORIES["llama"]
    sharded_plan = {**Plan.from_data(meshplan.load_plan(plan).model_dump()).model_dump(), "init": {"mode": "sharded"}}
    full = one_device(make)
    with fake_pg(2, 1):
        exact = meshplan.materialize(parallel_meta(make, plan), seed=0)  # the default: exact
        w = exact.model.layers[0].mlp.up_proj.weight
        assert not torch.equal(w.to_local(), shard_of(w, full["model.layers.0.mlp.up_proj.weight"]))
        with torch.device("meta"):
            model = make()
        topo = meshplan.build_mesh({"tp": 2})
        assert_slices_of(meshplan.materialize(meshplan.parallelize(model, sharded_plan, topo), seed=0), full)
        with torch.device("meta"):
            model = make()
        model = meshplan.parallelize(model, sharded_plan, topo)
        meshplan.materialize(model, seed=0, mode="exact")  # the call wins over the plan
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight.to_local(), w.to_local())
        with pytest.raises(PlanError, match=r"materialize: mode='fast'; expected one of 'exact', 'sharded'"):
            meshplan.materialize(parallel_meta(make, plan), seed=0, mode="fast")


# ---------------------------------------------------------------- layout invariance on every axis


@pytest.mark.parametrize("name,world", [("llama", 2), ("qwen2", 2), ("gpt2", 2), ("llama", 4)])
def test_tp_shards_are_slices_of_the_one_process_tensors(fake_pg, name, world):
    """tp 2 and tp 4 (gpt2's packed q|k|v, qwen2's biases, vocab-parallel embeddings): the same full tensors."""
    factory, plan = FACTORIES[name]
    make = (lambda: factory(num_key_value_heads=4)) if world == 4 else factory
    full = one_device(make)
    if True:
        for rank in range(world):
            with fake_pg(world, rank):
                with torch.device("meta"):
                    model = make()
                model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": world}))
                assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)


@pytest.mark.parametrize("layout,world", [({"tp": 2, "dp_shard": 2}, 4), ({"pp": 2}, 2), ({"pp": 2, "tp": 2}, 4),
                                          ({"pp": 2, "dp_shard": 2}, 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_and_pipeline_from_meta(fake_pg, layout, world, tied):
    """FSDP2 shards, pipeline stages from meta (tied embedding and head equal on first and last stage), with
    activation checkpointing renaming the blocks' parameters: each rank holds only its part, equal to the one
    process's tensors; ranks that replicate a shard (dp replicas of a tp shard, tp-replicated norms) agree."""
    make = pp_factory(tie_word_embeddings=tied)
    full = one_device(make)
    plan = pp_plan(layout) if "pp" in layout else {**pp_plan({"tp": 2, **layout}), "pipeline": None}
    plan["blocks"] = {"pattern": "model.layers.*", "activation_checkpointing": {"mode": "full"}}
    total = sum(t.numel() for t in full.values())
    for rank in range(world):
        with fake_pg(world, rank):
            with torch.device("meta"):
                model = make()
            model = meshplan.parallelize(model, plan, meshplan.build_mesh(layout))
            held = assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)
            assert held < total


def test_expert_parallel(fake_pg):
    """Experts sharded over ep 2 (× tp 2 on the attention): each rank's experts are its rows of the full tensors."""
    from moe import build, tiny_args
    ep_rules = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}
    tp_rules = {"tok_embeddings": "embedding", "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise", "output": "lm_head"}
    args = tiny_args(aux_loss_coef=0.0, capacity_factor=None)
    full = one_device(lambda: build(args))
    for layout, world in (({"ep": 2}, 2), ({"ep": 2, "tp": 2}, 4)):
        plan = {"layout": layout, "expert_parallel": {"rules": ep_rules}}
        if "tp" in layout:
            plan["tensor_parallel"] = {"sequence_parallel": False, "rules": tp_rules}
        for rank in range(world):
            with fake_pg(world, rank):
                with torch.device("meta"):
                    model = build(args)
                model = meshplan.parallelize(model, plan, meshplan.build_mesh(layout))
                assert_slices_of(meshplan.materialize(model, seed=0, mode="sharded"), full)
