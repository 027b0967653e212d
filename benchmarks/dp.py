"""FSDP2 traffic per step vs theory, and all-reduces per step for norm-weight grads, on torch's fake group.

Run: ``python benchmarks/dp.py`` (one process; the ``fake`` backend makes every collective a no-op, so
world sizes 2, 4 and 8 run on a laptop). Each collective is recorded by a dispatch mode with its size
and group; bytes are what ONE rank sends in a ring: (d−1)/d of the gathered/scattered buffer for
all-gather/reduce-scatter, 2·(d−1)/d for all-reduce. Theory (ZeRO-3): 3·(d−1)/d·Ψ per step with
resharding after forward (all-gather forward + all-gather backward + reduce-scatter), 2·(d−1)/d·Ψ without.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["CollectiveCounter", "fsdp_traffic", "norm_grad_all_reduces", "main"]

_KIND = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce"}


def _group_size(args) -> int:
    names = [a for a in args if isinstance(a, str)]
    if names:  # functional collectives: the group name is the last string (reduce ops are strings too)
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(names[-1]).size()
    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops: the first script object is the process group
            return dist.ProcessGroup.unbox(a).size()
    raise AssertionError(f"no process group among {[type(a).__name__ for a in args]}")


@dataclass
class CollectiveCounter(TorchDispatchMode):
    """Counts collectives (c10d and functional) and the bytes one rank sends for them.

    Attributes:
        calls: ``Counter`` of ``"<kind>@<group size>"``.
        bytes: ``Counter`` of ring bytes per kind.

    Example::

        >>> with CollectiveCounter() as c:
        ...     loss.backward()
        >>> c.calls["all_reduce@2"]
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        kind = _KIND.get(name) if ns in ("c10d", "_c10d_functional") else None
        if kind is not None:
            d = _group_size(args)
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if kind == "reduce_scatter" and ns == "c10d":
                tensors = [args[1]]  # (output shard, input): the scattered input is the full size
            n = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            if kind == "all_gather" and ns == "_c10d_functional":
                n *= d  # input is one shard
            self.calls[f"{kind}@{d}"] += 1
            self.bytes[kind] += n * (d - 1) / d * (2 if kind == "all_reduce" else 1)
        return func(*args, **(kwargs or {}))


def _fake(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def fsdp_traffic(world: int, reshard_after_forward: bool, root_reshards: bool = False) -> dict:
    """One forward+backward of the example Llama under FSDP2 over ``world`` ranks; bytes vs Ψ."""
    import meshplan
    from llama import build, tiny_args
    from meshplan.data_parallel import apply_data_parallel
    _fake(world)
    topo = meshplan.build_mesh({"dp_shard": world})
    model = build(tiny_args(dim=128, ffn_dim=256, n_layers=4))
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    apply_data_parallel(model, {"reshard_after_forward": reshard_after_forward}, topo)
    if root_reshards:
        model.set_reshard_after_forward(reshard_after_forward, recurse=False)
    x = torch.randint(0, 128, (2, 16))
    with CollectiveCounter() as c:
        model(x).float().sum().backward()
    dist.destroy_process_group()
    moved = c.bytes["all_gather"] + c.bytes["reduce_scatter"]
    ideal = (3 if reshard_after_forward else 2) * (world - 1) / world * psi
    return {"world": world, "reshard": reshard_after_forward, "root_reshards": root_reshards, "psi": psi,
            "bytes": moved, "ratio": moved / ideal, "calls": dict(c.calls)}


def norm_grad_all_reduces(mode: str) -> dict:
    """All-reduces per step for the norm-weight (Partial) grads: tp=2 × dp_shard=2, sequence parallel."""
    import meshplan
    import torch.nn.functional as F
    from llama import build, tiny_args
    from meshplan.train import train_step
    _fake(4 if mode != "tp_only" else 2)
    layout = {"tp": 2, "dp_shard": 2} if mode != "tp_only" else {"tp": 2}
    topo = meshplan.build_mesh(layout)
    model = build(tiny_args())
    rules = {"layers.*.attention_norm": "norm", "layers.*.ffn_norm": "norm", "norm": "norm",
             "tok_embeddings": "embedding", "output": "lm_head",
             **{f"layers.*.{m}": "colwise" for m in ("attention.wq", "attention.wk", "attention.wv",
                                                      "feed_forward.w1", "feed_forward.w3")},
             "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w2": "rowwise"}
    meshplan.parallelize(model, {"tensor_parallel": {"sequence_parallel": True, "loss_parallel": False,
                                                     "rules": rules}, "data_parallel": {}}, topo)
    x = torch.randint(0, 128, (2, 16))
    loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with CollectiveCounter() as c:
        if mode == "train_step":
            train_step(model, (x, x), loss_fn, opt, topology=topo)
        else:
            loss_fn(model(x), x).backward()
    dist.destroy_process_group()
    ar = {k: v for k, v in c.calls.items() if k.startswith("all_reduce")}
    return {"mode": mode, "all_reduces": ar, "norm_weights": 2 * 2 + 1}


def main() -> None:
    print("FSDP2 bytes per rank per step (forward+backward), example Llama dim 128, 4 layers, fp32")
    print(f"{'d':>2} {'reshard':>8} {'root':>5} {'Ψ bytes':>10} {'measured':>11} {'theory':>11} {'ratio':>6}  calls")
    for world in (2, 4, 8):
        for reshard, root in ((True, False), (True, True), (False, False)):
            r = fsdp_traffic(world, reshard, root)
            theory = (3 if reshard else 2) * (world - 1) / world * r["psi"]
            root_col = str(root) if reshard else "-"  # "root": the root module reshards too (torch: it does not)
            print(f"{world:>2} {str(reshard):>8} {root_col:>5} {r['psi']:>10} {r['bytes']:>11.0f} "
                  f"{theory:>11.0f} {r['ratio']:>6.3f}  {r['calls']}")
    print("\nall-reduces per step for norm-weight grads (5 norm weights: 2 per block + final), tp=2")
    for mode in ("tp_only", "eager", "train_step"):
        r = norm_grad_all_reduces(mode)
        print(f"{mode:>11}: {r['all_reduces']}")


if __name__ == "__main__":
    main()
