"""FSDP2 over edp on the experts holds ``1/edp`` of each local expert on every edp rank, the bytes ``meshplan
estimate`` counts (issue 27): with fewer local experts than edp ranks (``ep · edp > num_experts``) FSDP2's default
shard of the experts dim left edp rank 0 every expert weight and the others nothing; such weights are sharded on
an inner dim instead (:func:`meshplan.expert_parallel.edp.expert_shard_placement`). Measured on a meta-device
model parallelized on each simulated rank of a fake process group (nothing allocated), compared with
:func:`meshplan.solver.memory.rank_memory` for that rank."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import meshplan
from meshplan.checks.model_shape import shape_of_model
from meshplan.solver.memory import rank_memory
from meshplan.solver.placement import Placement
from meshplan.solver.plans import candidate_from_plan

pytestmark = pytest.mark.fast

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=64, dropout=0.0)
RULES = {"layers.*.moe.experts": "experts", "layers.*.moe.router": "router"}


def meta_moe(experts):
    import moe
    with torch.device("meta"):
        return moe.build(moe.ModelArgs(**SMALL, moe_hidden=96, n_experts=experts, top_k=1, capacity_factor=None,
                                       aux_loss_coef=0.0))


def held(model, experts_only):
    """This rank's parameter elements (its local shards), the experts' only or all."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()
               if not experts_only or ".moe.experts." in n)


def estimated(model, plan, world, rank):
    """``meshplan estimate --rank``'s parameter bytes of ``rank``."""
    shape, warning = shape_of_model(model)
    assert warning is None, warning
    lay = plan.layout.resolve(world)
    cand, train = candidate_from_plan(plan, world, 64, lay.dp_replicate * lay.dp_shard)
    place = Placement(cand, shape.layers, 8)
    return rank_memory(shape, cand, train, place, place.pp_rank_of(rank), rank=rank).params


@pytest.mark.parametrize("experts,ep,world,inner", [(2, 2, 4, True), (4, 4, 8, True), (6, 2, 4, True),
                                                    (4, 2, 4, False)])
def test_every_edp_rank_holds_its_share_of_the_experts(fake_pg, experts, ep, world, inner):
    """1 local expert over edp 2 (and over edp 2 at ep 4), 3 over 2: each edp rank holds half of every local
    expert (an inner dim); 2 over 2: whole experts, as before. Each rank's bytes equal the estimate's."""
    plan = meshplan.Plan.from_data({"layout": {"ep": ep}, "expert_parallel": {"rules": RULES}})
    full = sum(p.numel() for n, p in meta_moe(experts).named_parameters() if ".moe.experts." in n)
    edp = world // ep
    for rank in range(world):
        with fake_pg(world, rank):
            model = meshplan.parallelize(meta_moe(experts), plan, meshplan.build_mesh(plan.layout))
            w1 = model.layers[0].moe.experts.w1
            assert w1.placements[0] == (Shard(1) if inner else w1.placements[0]), w1.placements
            assert held(model, experts_only=True) * ep * edp == full, (rank, held(model, True), full)
            assert 4 * held(model, experts_only=False) == estimated(meta_moe(experts), plan, world, rank), rank


@pytest.mark.parametrize("experts,ep,world", [(2, 2, 4), (6, 2, 4), (4, 2, 4)])
def test_check_rank_counts_the_same_expert_share(experts, ep, world):
    """``meshplan check --rank R`` (its rank view) counts each rank's expert share as estimate does."""
    import moe
    plan = meshplan.Plan.from_data({"layout": {"ep": ep}, "expert_parallel": {"rules": RULES}})
    model = moe.build(moe.ModelArgs(**SMALL, moe_hidden=96, n_experts=experts, top_k=1, capacity_factor=None,
                                    aux_loss_coef=0.0))
    for rank in range(world):
        view = meshplan.check(model, plan, world, rank=rank).rank_view
        assert view["parameter_bytes"] == estimated(meta_moe(experts), plan, world, rank), (rank, view)
