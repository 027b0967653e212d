"""Sharded initialization on real gloo ranks (a case of dp_worker's, pp_worker's and moe_worker's world-4 launches).

``sharded_then_train``: a model built on the meta device, parallelized and materialized with ``mode="sharded"``
(seed 0, the mode from the call or from the plan's ``init`` section): every rank's shards equal the slices of the
tensors ONE process draws in sharded mode (layout invariance, no communication), and every shard that several ranks
hold (dp replicas, tp-replicated norms) is bit-identical across them; then 3 SGD steps through
``meshplan.train_step``: every loss finite, the replicas still bit-identical.
"""

import hashlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import meshplan
from meshplan.weights.shards import local_slices, take_slices
from pp_meta import _train

WRAPPER = "_checkpoint_wrapped_module."


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _where(t):
    return str(local_slices(tuple(t.shape), t.placements, t.device_mesh)) if isinstance(t, DTensor) else "all"


def _replicas(model) -> int:
    """Every (name, slice) held by several ranks has one digest; returns how many such replicated pieces."""
    mine = {(k.replace(WRAPPER, ""), _where(t)): hashlib.sha256(_local(t).contiguous().numpy().tobytes()).hexdigest()
            for k, t in model.state_dict().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    digests: dict = {}
    for ranks in every:
        for k, h in ranks.items():
            digests.setdefault(k, []).append(h)
    differ = [k for k, hs in digests.items() if len(set(hs)) > 1]
    assert not differ, f"replicas differ: {differ[:4]}"
    return sum(len(hs) > 1 for hs in digests.values())


def sharded_then_train(make, plan, layout, vocab, mode="sharded"):
    """Meta → parallelize(plan) → materialize(seed=0, mode) → checks → 3 SGD steps → replicas equal."""
    with torch.device("meta"):
        one = make()
    full = meshplan.materialize(one, seed=0, device="cpu", mode="sharded").state_dict()
    with torch.device("meta"):
        meta = make()
    model = meshplan.parallelize(meta, plan, meshplan.build_mesh(layout))
    model = meshplan.materialize(model, seed=0, mode=mode)
    held = 0
    for k, t in model.state_dict().items():
        k = k.replace(WRAPPER, "")
        want = take_slices(lambda s: full[k][s], local_slices(tuple(t.shape), t.placements, t.device_mesh)) \
            if isinstance(t, DTensor) else full[k]
        assert torch.equal(_local(t), want), k
        held += _local(t).numel()
    replicated = _replicas(model)
    losses = _train(model, vocab)
    assert all(math.isfinite(x) for x in losses), losses
    assert _replicas(model) == replicated
    return {"worst": 0.0, "loss": losses, "held": held, "total": sum(t.numel() for t in full.values()),
            "replicated": replicated}
