"""``activation_checkpointing: {mode: selective, policy: megatron}`` (:mod:`meshplan.recompute`): what it keeps,
and that a float64 step under it equals the same tp step without checkpointing bit for bit (simulated ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import meshplan
from meshplan.plan_file.blocks import ActivationCheckpointing

pytestmark = pytest.mark.fast

TP = yaml.safe_load(open("plans/llama.yaml"))["tensor_parallel"]
MEGATRON = {"mode": "selective", "policy": "megatron"}


def _llama():
    import llama
    torch.manual_seed(0)
    return llama.build(llama.tiny_args(dropout=0.0)).to(torch.float64)


def _grads(model, blocks, x):
    from meshplan._torch import simulated_ranks
    from meshplan.mesh.topology import build_mesh
    plan = {"layout": {"tp": 2}, "tensor_parallel": TP, **({"blocks": blocks} if blocks else {})}
    with simulated_ranks(2):
        meshplan.parallelize(model, plan, build_mesh({"tp": 2}))
        loss = meshplan.cross_entropy(model(x), x)
        loss.backward()
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        return full(loss).detach().clone(), {k.replace("_checkpoint_wrapped_module.", ""): full(p.grad).clone()
                                             for k, p in model.named_parameters()}


def test_megatron_policy_step_equals_no_checkpointing_exactly():
    ref = _llama()
    x = torch.randint(0, 128, (2, 16))
    loss, grads = _grads(copy.deepcopy(ref), None, x)
    got_loss, got = _grads(copy.deepcopy(ref), {"activation_checkpointing": MEGATRON}, x)
    assert torch.equal(got_loss, loss)
    assert got.keys() == grads.keys()
    for k in grads:
        assert torch.equal(got[k], grads[k]), k


@pytest.mark.parametrize("data, msg", [
    ({"mode": "selective", "policy": "megatron", "ops": ["aten.mm.default"]}, "both given"),
    ({"mode": "full", "policy": "megatron"}, "need mode: selective"),
    ({"mode": "selective", "policy": "titan"}, "megatron"),
])
def test_policy_is_refused_where_it_cannot_apply(data, msg):
    with pytest.raises(ValueError, match=msg):
        ActivationCheckpointing.model_validate(data)


def test_solver_prices_the_policy_recompute_and_round_trips_it():
    """compute: the attention, the two row-parallel matmuls once more (forward FLOPs), nothing else;
    a plan written from the candidate reads back to it."""
    from meshplan.plan_file.document import Plan
    from meshplan.solver.candidate import Candidate, Training
    from meshplan.solver.presets import cluster_preset
    from meshplan.solver.compute import block_time
    from meshplan.solver.plans import candidate_from_plan, plan_from_candidate
    from meshplan.solver.shape import ModelShape
    s = ModelShape(layers=2, hidden=256, heads=8, kv_heads=8, ffn=1024, vocab=512, mlp="gelu")
    tr, cl, t, tokens = Training(seq=512, global_batch=2), cluster_preset("h100-80g"), 4, 2 * 512
    plain = block_time(s, Candidate(tp=t, micro_batch=2), tr, cl, False, False)[1]
    cand = Candidate(tp=t, micro_batch=2, ac="selective", ac_policy="megatron")
    rowwise = 2 * tokens * (s.hidden * s.q_width + s.ffn * s.hidden) / t
    attention = 2 * tokens * tr.seq * s.q_width / t
    assert block_time(s, cand, tr, cl, False, False)[1] == plain + rowwise + attention
    data = plan_from_candidate(cand, tr, {"tensor_parallel": TP})
    assert data["blocks"]["activation_checkpointing"] == MEGATRON
    back, _ = candidate_from_plan(Plan.from_data(data), 4, 512, 2)
    assert (back.ac, back.ac_policy, back.megatron, back.op_level) == ("selective", "megatron", True, True)


def test_search_space_takes_the_policy():
    from meshplan.errors import PlanError
    from meshplan.solver.search import Space
    assert Space(ac_policy="megatron").ac_policy == "megatron"
    with pytest.raises(PlanError, match="valid: megatron"):
        Space(ac_policy="titan")
