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


def _view_init(m):
    """Writes through views of a column-sharded weight (the in-process test's initializer)."""
    if isinstance(m, torch.nn.Linear) and m.in_features == 16:
        torch.nn.init.zeros_(m.weight)
        torch.nn.init.ones_(m.weight[:, 5])
        torch.nn.init.constant_(m.weight.narrow(1, 3, 6), 2.0)
        torch.nn.init.normal_(m.weight[2])
        torch.nn.init.uniform_(m.weight[4:6, 7:10])
        torch.nn.init.constant_(m.weight[1:7][2:4, 1:15:3], 3.0)  # a slice of a slice, strided: rows 3-4, cols 1, 4, ..
        torch.nn.init.constant_(m.weight[:, 2:14][6, -1], 4.0)  # row 6, col 13


def views_on_real_ranks():
    """weight[:, j], narrow, weight[i], weight[a:b, c:d] of a rowwise weight at tp 4: each real rank holds the
    columns of the one-process tensor its coordinate names."""
    make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))  # noqa: E731
    with torch.device("meta"):
        one = make()
    want = meshplan.materialize(one, _view_init, seed=0, device="cpu", mode="sharded")[2].weight.detach()
    with torch.device("meta"):
        model = make()
    plan = {"tensor_parallel": {"sequence_parallel": False, "rules": {"0": "colwise", "2": "rowwise"}}}
    model = meshplan.parallelize(model, plan, meshplan.build_mesh({"tp": 4}))
    got = meshplan.materialize(model, _view_init, seed=0, mode="sharded")[2].weight
    rank = dist.get_rank()
    assert tuple(got.device_mesh.get_coordinate()) == (rank,), got.device_mesh.get_coordinate()
    mine = want[:, 4 * rank:4 * rank + 4]
    assert torch.equal(_local(got), mine), (rank, (_local(got) != mine).nonzero().tolist(), _local(got), mine)
    return {"columns": [4 * rank, 4 * rank + 4]}
