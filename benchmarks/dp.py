"""FSDP2 traffic per step vs theory, and tp all-reduces per step for norm-weight grads, on torch's fake group.

Run: ``python benchmarks/dp.py`` (one process; the ``fake`` backend makes every collective a no-op, so
world sizes 2, 4 and 8 run on a laptop). Each collective is recorded by a dispatch mode with its size
and group; bytes are what ONE rank sends in a ring: (d−1)/d of the gathered/scattered buffer for
all-gather/reduce-scatter, 2·(d−1)/d for all-reduce. Theory (ZeRO-3): 3·(d−1)/d·Ψ per step with
resharding after forward (all-gather forward + all-gather backward + reduce-scatter), 2·(d−1)/d·Ψ without.
The first table sets each row beside ``meshplan estimate``'s dp collectives for the same model and plan (its
calls and its "bytes per step by axis: dp", the sum of the calls' buffers; ring bytes = (d−1)/d of that): the
units are the blocks, the embedding and the [final norm, head] unit, which stays gathered after forward
(``meshplan/data_parallel/ends.py``), so the step moves 3·(d−1)/d·Ψ less (d−1)/d of the head unit once.
"""

from __future__ import annotations

import os
import sys
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from _comm import CommLog  # noqa: E402

__all__ = ["fsdp_traffic", "estimated_traffic", "norm_grad_all_reduces", "main"]

#: the example Llama the traffic table measures (examples/llama.py's ModelArgs keys)
SIZES = dict(dim=128, ffn_dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128)


def _fake(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def estimated_traffic(world: int, reshard_after_forward: bool) -> dict:
    """``meshplan estimate``'s dp collectives of the same model and plan (FSDP2 over ``world``): calls per kind, the
    buffers' bytes per step (what estimate prints as "bytes per step by axis: dp") and this rank's ring bytes."""
    import meshplan
    from meshplan.solver.report import fmt_bytes
    plan = {"version": 1, "layout": {}, "blocks": {"pattern": "layers.*"},
            "data_parallel": {"mode": "fsdp", "reshard_after_forward": reshard_after_forward}}
    e = meshplan.estimate(plan, SIZES, world, seq=16, global_batch=2 * world)
    dp = [x for x in e.collectives if x.axis == "dp"]
    calls = {k: sum(x.count for x in dp if x.kind == k) for k in ("all_gather", "reduce_scatter")}
    buffers = sum(x.count * x.nbytes for x in dp)
    return {"calls": calls, "buffers": buffers, "printed": fmt_bytes(buffers), "ring": (world - 1) / world * buffers}


def fsdp_traffic(world: int, reshard_after_forward: bool, root_reshards: bool = False) -> dict:
    """One forward+backward of the example Llama under FSDP2 over ``world`` ranks; bytes vs Ψ. ``root_reshards``:
    every unit reshards after forward, the head unit and the root too (meshplan keeps the head gathered)."""
    import meshplan
    from llama import build, tiny_args
    from meshplan.data_parallel.fsdp import apply_data_parallel
    _fake(world)
    topo = meshplan.build_mesh({"dp_shard": world})
    model = build(tiny_args(**SIZES))
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    apply_data_parallel(model, {"reshard_after_forward": reshard_after_forward}, topo)
    if root_reshards:
        model.set_reshard_after_forward(reshard_after_forward, recurse=True)
    x = torch.randint(0, 128, (2, 16))
    with CommLog() as c:
        model(x).float().sum().backward()
    dist.destroy_process_group()
    ring = c.ring_bytes_by_kind()
    moved = ring["all_gather"] + ring["reduce_scatter"]
    ideal = (3 if reshard_after_forward else 2) * (world - 1) / world * psi
    return {"world": world, "reshard": reshard_after_forward, "root_reshards": root_reshards, "psi": psi,
            "bytes": moved, "ratio": moved / ideal, "calls": dict(c.by_group())}


def norm_grad_all_reduces(mode: str, microbatches: int = 1, no_sync: bool = False) -> dict:
    """tp all-reduces per step for the norm-weight (``Partial``) grads, sequence parallel, tp=2.

    ``mode``: ``tp_only`` (a hand-written loop, tp=2), ``loop`` (a hand-written loop: ``loss.backward()`` per
    microbatch, tp=2 × dp_shard=2) or ``train_step`` (tp=2 × dp_shard=2). ``no_sync``: FSDP2 reduces only the
    last microbatch. The tp all-reduces are the ``all_reduce@2`` ones (dp reduces with reduce-scatters;
    train_step's token count and clipping all-reduce over all 4 ranks).
    """
    import meshplan
    import torch.nn.functional as F
    from llama import build, tiny_args
    from meshplan.training.step import train_step
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
    x = torch.randint(0, 128, (2 * microbatches, 16))
    loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with CommLog() as c:
        if mode == "train_step":
            train_step(model, (x, x), loss_fn, opt, topology=topo, microbatches=microbatches)
        else:
            for i, xm in enumerate(x.chunk(microbatches)):
                if no_sync:
                    model.set_requires_gradient_sync(i == microbatches - 1)
                loss_fn(model(xm), xm).backward()
    dist.destroy_process_group()
    ar = {k: v for k, v in c.by_group().items() if k.startswith("all_reduce")}
    return {"mode": mode, "microbatches": microbatches, "no_sync": no_sync, "tp_all_reduces": ar.get("all_reduce@2", 0),
            "all_reduces": ar, "norm_weights": 2 * 2 + 1}


def main() -> None:
    print("FSDP2 bytes per rank per step (forward+backward), example Llama dim 128, 4 layers, fp32, vs meshplan "
          "estimate's dp collectives")
    print(f"{'d':>2} {'reshard':>8} {'Ψ bytes':>10} {'est AG/RS':>9} {'est dp':>10} {'est ring':>10} "
          f"{'measured':>10} {'meas/est':>8} {'/theory':>8}  calls")
    for world in (2, 4, 8):
        for reshard in (True, False):
            r, e = fsdp_traffic(world, reshard), estimated_traffic(world, reshard)
            theory = (3 if reshard else 2) * (world - 1) / world * r["psi"]
            calls = f"{e['calls']['all_gather']}/{e['calls']['reduce_scatter']}"
            print(f"{world:>2} {str(reshard):>8} {r['psi']:>10} {calls:>9} {e['printed']:>10} {e['ring']:>10.0f} "
                  f"{r['bytes']:>10.0f} {r['bytes'] / e['ring']:>8.4f} {r['bytes'] / theory:>8.4f}  {r['calls']}")
    print("every unit resharded after forward (the head unit and the root too; not meshplan's: measured only)")
    for world in (2, 4, 8):
        r = fsdp_traffic(world, True, root_reshards=True)
        print(f"{world:>2} {'all':>8} {r['psi']:>10} {r['bytes']:>10.0f} {r['ratio']:>8.4f}  {r['calls']}")
    print("\ntp all-reduces per step for norm-weight grads (5 norm weights: 2 per block + final), SP, tp=2"
          "\n(before meshplan's gradient finaliser (GradFinalizer) covered FSDP2, a hand-written loop got FSDP2's own path: 5 per backward)")
    print(f"{'loop':>10} {'layout':>15} {'microbatches':>12} {'tp all-reduces':>14}  all all-reduces")
    for mode, mb, no_sync, layout in (("tp_only", 1, False, "tp2"), ("loop", 1, False, "tp2 x dp_shard2"),
                                      ("loop", 2, False, "tp2 x dp_shard2"), ("loop", 2, True, "tp2 x dp_shard2"),
                                      ("train_step", 1, False, "tp2 x dp_shard2"),
                                      ("train_step", 2, False, "tp2 x dp_shard2")):
        r = norm_grad_all_reduces(mode, mb, no_sync)
        label = {"tp_only": "hand", "loop": "hand", "train_step": "train_step"}[mode]
        mbs = f"{mb}{' no-sync' if no_sync else ''}"
        print(f"{label:>10} {layout:>15} {mbs:>12} {r['tp_all_reduces']:>14}  {r['all_reduces']}")


if __name__ == "__main__":
    main()
