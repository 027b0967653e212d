"""``meshplan estimate`` on pipelined plans against real gloo processes (tests/dist/solver_worker.py, world 4):
each rank's collectives of one step by kind and group size, and its parameter and optimizer bytes, exactly."""

from __future__ import annotations

import pytest

from _launch import case_result

pytestmark = pytest.mark.dist

SEQ, BATCH = 32, 8


@pytest.fixture(scope="module")
def world4(shared_launch):
    return shared_launch("solver_worker", 4)  # in world 4's shared launch (tests/_launch.py)


def _estimate(name: str, pp_rank: int):
    import llama
    from dist.solver_worker import PLANS
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.plan_file.document import Plan
    from meshplan.solver.collectives import step_collectives
    from meshplan.solver.memory import rank_memory
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    plan = Plan.from_data(PLANS[name], source=name)
    with __import__("torch").device("meta"):
        model = llama.build(llama.ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128,
                                            ffn_dim=128, max_seq_len=SEQ))
    shape, _ = shape_of_model(model)
    lay = plan.layout.resolve(4)
    cand, train = candidate_from_plan(plan, 4, SEQ, BATCH * lay.dp_replicate * lay.dp_shard)
    place = Placement(cand, shape.layers, 8)
    counts: dict[str, int] = {}
    for x in step_collectives(shape, cand, train, place, pp_rank):
        kind = "all_gather" if x.kind == "all_to_all" and "vocab-parallel" in x.what else x.kind  # DTensor on CPU
        counts[f"{kind}@{x.group.size}"] = counts.get(f"{kind}@{x.group.size}", 0) + x.count
    return counts, rank_memory(shape, cand, train, place, pp_rank)


@pytest.mark.parametrize("name", ["pp2_fsdp2", "pp2_ddp2", "pp2_tp2", "pp4", "pp2_interleaved_v2", "pp2_looped_bfs_tp2",
                                  "pp2_fsdp2_vocab_ends"])
def test_pipelined_estimate_matches_each_rank(world4, name):
    for rank, got in case_result(world4, name, 4).items():
        counts, mem = _estimate(name, got["pp_rank"])
        assert counts == got["counts"], (rank, counts, got["counts"])
        assert (mem.params, mem.optimizer) == (got["params"], got["optimizer"]), rank
