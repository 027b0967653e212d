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
