"""A 405B rehearsal without 405B: one rank of a 16,384-rank job, alone in this process.

Each rank runs in its own process (``--rank R`` runs one; without it the script starts one child per rank and
prints the table). The child makes a ``fake`` default process group of ``--world`` ranks in which it is rank R
(nothing is communicated, nothing waits for a peer), builds the example Llama (``examples/llama.py``) with the
shapes of ``--preset`` on the meta device, and runs ``meshplan.parallelize`` with ``plans/llama_3d.yaml``'s
sections at the given layout (``--preset mixtral-8x22b``: the example MoE, ``examples/moe.py``, with
``plans/moe.yaml`` pipelined and FSDP2-sharded the same way). Nothing is allocated: every parameter stays on the meta device, and what the rank
keeps is its local shards, with their exact shapes (its pipeline stage's blocks, its tp slice, its FSDP2 chunk).

Measured, from the rank's own local tensors (``DTensor.to_local()``): parameter bytes; gradient bytes (a meta
gradient ``zeros_like`` each parameter, as backward leaves them); optimizer bytes (``torch.optim.AdamW.step()`` on
the meta parameters creates its real state tensors: ``exp_avg``, ``exp_avg_sq``, ``step``); the time
``parallelize`` takes and the process's peak RSS (``ru_maxrss``; the baseline after the imports is printed too).

Compared: ``meshplan estimate``'s memory for the same rank (:func:`meshplan.solver.memory.rank_memory` given the
global rank: the exact FSDP2 chunk the rank holds). Must be equal, byte for byte.

Collectives: a pipeline's step cannot run on a fake group (the schedule infers shapes point to point), so the
step's collectives are the solver's (:func:`meshplan.solver.collectives.step_collectives`, which
``tests/test_solver_estimate.py`` and ``tests/test_dist_solver.py`` hold equal to one measured step op by op on
small shapes), listed by kind and group size; each group size is checked against the process groups this rank
really holds (its DeviceMesh dims and the FSDP2 mesh of its modules).

Usage::

    python benchmarks/rehearsal.py                       # llama3-405b, world 16384, first/middle/last stage
    python benchmarks/rehearsal.py --preset llama3-8b --world 512 --layout tp=8,pp=4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]

import torch  # noqa: E402
import yaml  # noqa: E402

PLANS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plans")
SEQ = 8192
#: MoE shapes (no solver preset has experts): examples/moe.py's ModelArgs. Mixtral 8x22B (its config.json)
MOE_SHAPES = {"mixtral-8x22b": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768,
                                    ffn_dim=16384, moe_hidden=16384, n_experts=8, top_k=2)}


@contextlib.contextmanager
def fake_rank(world: int, rank: int):
    """A ``fake`` default process group of ``world`` ranks in which this process is ``rank``."""
    import torch.distributed as dist
    from meshplan._torch import FakeStore
    assert not dist.is_initialized(), "a process group is already initialized"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_data(layout: dict, microbatches: int, schedule: str = "1f1b", moe: bool = False) -> dict:
    """``plans/llama_3d.yaml`` (``moe``: ``plans/moe.yaml`` pipelined and FSDP2-sharded like it) at ``layout``
    with ``microbatches`` (1f1b needs at least pp) and ``schedule``."""
    data = yaml.safe_load(open(os.path.join(PLANS, "llama_3d.yaml")))
    if moe:
        data = {**yaml.safe_load(open(os.path.join(PLANS, "moe.yaml"))),
                **{k: data[k] for k in ("blocks", "pipeline", "data_parallel")}}
    data["layout"] = dict(layout)
    data["pipeline"].update(microbatches=microbatches, schedule=schedule)
    return data


def meta_model(preset: str, layers: int | None = None):
    """The example Llama with the shapes of the solver's ``preset`` (or the example MoE with one of
    :data:`MOE_SHAPES`), on the meta device (``layers``: that many blocks instead of the preset's)."""
    import llama
    import moe
    from meshplan.solver.presets import model_preset
    if preset in MOE_SHAPES:
        shapes = {**MOE_SHAPES[preset], **({"n_layers": layers} if layers else {})}
        with torch.device("meta"):
            return moe.build(moe.ModelArgs(**shapes, max_seq_len=SEQ, capacity_factor=None))
    s = model_preset(preset)
    args = llama.ModelArgs(dim=s.hidden, n_layers=layers or s.layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                           vocab_size=s.vocab, ffn_dim=s.ffn, max_seq_len=SEQ, tie_embeddings=s.tied_embeddings)
    with torch.device("meta"):
        return llama.build(args)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def measured_bytes(model) -> dict:
    """Parameter, gradient and AdamW state bytes of this rank's local tensors (all on the meta device)."""
    params = list(model.parameters())
    assert all(_local(p).device.type == "meta" for p in params), "parallelize allocated a parameter"
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in params), "optimizer": _nbytes(states),
            "tensors": len(params)}


def estimated(preset: str, plan, world: int, rank: int, pp_rank: int, microbatches: int) -> tuple[dict, dict]:
    """``meshplan estimate``'s bytes for global ``rank``, its step's collectives ``{kind@group size: calls}`` and the
    number of FSDP2 units the solver counts on its pipeline rank (blocks, experts, the embedding and head units; a
    tied pair: the root)."""
    from meshplan.solver.collectives import step_collectives
    from meshplan.solver.memory import rank_memory
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.solver.presets import model_preset
    shape = shape_of_model(meta_model(preset))[0] if preset in MOE_SHAPES else model_preset(preset)
    lay = plan.layout.resolve(world)
    cand, train = candidate_from_plan(plan, world, SEQ, microbatches * lay.dp_replicate * lay.dp_shard,
                                      microbatches=microbatches)
    place = Placement(cand, shape.layers, 8)
    mem = rank_memory(shape, cand, train, place, pp_rank, rank=rank)
    counts: dict[str, int] = {}
    for x in step_collectives(shape, cand, train, place, pp_rank):
        if x.group.size > 1:
            counts[f"{x.kind}@{x.group.size}"] = counts.get(f"{x.kind}@{x.group.size}", 0) + x.count
    from meshplan.solver.collectives import fsdp_units as solver_units
    units = sum(n for _, _, _, n in solver_units(shape, cand, place, pp_rank, {})) if cand.mode in ("fsdp", "hsdp") else 0
    return {"params": int(mem.params), "grads": int(mem.grads), "optimizer": int(mem.optimizer)}, counts, units


def held_groups(model, topo) -> set[int]:
    """Sizes of the process groups this rank holds: its DeviceMesh dims and its modules' FSDP2 meshes."""
    import torch.distributed as dist
    sizes = {dist.get_world_size()} | {topo.dense.size(i) for i in range(topo.dense.ndim)} | {topo.expert.size(i) for i in range(topo.expert.ndim)}
    for p in model.parameters():
        if hasattr(p, "device_mesh"):
            sizes |= {p.device_mesh.size(i) for i in range(p.device_mesh.ndim)}
    return sizes


def _by_kind(rows) -> dict[str, list[int]]:
    """``{kind@group size: [calls, bytes]}`` of ``(kind, group size, bytes)`` rows (groups of one dropped)."""
    out: dict[str, list[int]] = {}
    for kind, d, n in rows:
        if d > 1:
            c = out.setdefault(f"{kind}@{d}", [0, 0])
            c[0], c[1] = c[0] + 1, c[1] + int(n)
    return out


def one_block(preset: str, data: dict, topo) -> dict | None:
    """One block's worth at the preset's shapes, measured: the plan's tensor_parallel section on a one-block model
    (embedding, the block, the head) over this rank's tp group, one forward and backward of one sequence of
    ``SEQ`` tokens on the meta device under :class:`benchmarks._comm.CommLog` (every DTensor and c10d collective,
    its group and buffer), the model's gradient finaliser run as ``train_step`` runs it; against the solver's tp
    terms (:func:`meshplan.solver.collectives.step_collectives`) for that one-block model. FSDP2 cannot run here
    (it refuses meta parameters), nor the pipeline's sends (its schedule infers shapes point to point) nor the
    experts' all-to-alls (the example MoE's experts stay whole, without ep, in this one-block model). On meta
    tensors the sequence-parallel re-gather of saved block inputs stands aside (it matches storages; meta has
    none): the run is ``save_gathered_inputs: true``'s, and so is the prediction. None for the MoE presets: an MoE
    block under sequence parallelism is a token region of expert parallelism, which needs the expert mesh (ep,
    edp) of the whole layout, not the tp group alone."""
    if preset in MOE_SHAPES:
        return None
    import dataclasses

    import meshplan
    from benchmarks._comm import CommLog
    from meshplan.checks.model_shape import shape_of_model
    from meshplan.solver.collectives import step_collectives
    from meshplan.solver.placement import Placement
    from meshplan.solver.plans import candidate_from_plan
    tp = data["layout"]["tp"]
    plan = meshplan.Plan.from_data({"version": data.get("version", 1), "layout": {"tp": tp},
                                    "tensor_parallel": data["tensor_parallel"]}, source="one block")
    model = meta_model(preset, layers=1)
    t0 = time.perf_counter()
    meshplan.parallelize(model, plan, topo["tp"])
    t1 = time.perf_counter()
    shape = dataclasses.replace(shape_of_model(meta_model(preset))[0], layers=1)
    x = torch.randint(0, shape.vocab, (1, SEQ), device="meta")
    sync = meshplan.parallel_state(model).grad_sync
    with CommLog() as log:
        with sync.deferred() if sync is not None else contextlib.nullcontext():
            meshplan.cross_entropy(model(x), x).backward()
        if sync is not None:
            sync.finish()
    t2 = time.perf_counter()
    cand, train = candidate_from_plan(plan, tp, SEQ, 1, microbatches=1)
    train = dataclasses.replace(train, save_gathered_inputs=True)  # on meta the re-gather stands aside (no storage)
    rows = [(x.kind, x.group.size, x.nbytes) for x in step_collectives(shape, cand, train, Placement(cand, 1, 8))
            for _ in range(x.count) if x.axis == "tp"]
    return {"measured": _by_kind(log.records), "solver": _by_kind(rows), "parallelize_s": t1 - t0,
            "forward_backward_s": t2 - t1}


def fsdp_units(model) -> int:
    """The modules FSDP2 wraps on this rank that gather parameters of their own (one all-gather group each: the
    experts, each block, the embedding unit, the [final norm, head] unit (one group however many modules it lists);
    a root whose parameters are all in its units gathers nothing)."""
    from torch.distributed.fsdp import FSDPModule

    import meshplan
    from meshplan.axes import roots
    mods = {id(m): m for r in [model, *roots(model, meshplan.parallel_state(model))] for m in r.modules()}
    units = [m for m in mods.values() if isinstance(m, FSDPModule)]

    def own(u) -> bool:  # a parameter outside every FSDP2 module below it
        inner = {id(p) for c in u.modules() if c is not u and isinstance(c, FSDPModule) for p in c.parameters()}
        return any(id(p) not in inner for p in u.parameters())
    record = meshplan.parallel_state(model).data_parallel
    shared = sum(len(mods) - 1 for mods, _ in record.ends) if record is not None else 0  # a list unit: one group
    return sum(own(u) for u in units) - shared


def rehearse_rank(preset: str, layout: dict, world: int, rank: int, microbatches: int,
                  schedule: str = "1f1b", block: bool = True) -> dict:
    """Rank ``rank`` of ``world`` on a fake group: parallelize the meta model, measure and estimate (see above);
    ``block``: also :func:`one_block`, which communicates on the fake group; run it once per process (a later
    fake group in the same process meets a group name torch's DeviceMesh kept from the first; each rank of the
    script runs in its own process)."""
    import meshplan
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    data = plan_data(layout, microbatches, schedule, moe=preset in MOE_SHAPES)
    plan = meshplan.Plan.from_data(data, source=f"llama_3d.yaml at {layout}")
    with fake_rank(world, rank):
        model = meta_model(preset)
        t0 = time.perf_counter()
        topo = meshplan.build_mesh(data["layout"])
        t1 = time.perf_counter()
        meshplan.parallelize(model, plan, topo)
        t2 = time.perf_counter()
        got = measured_bytes(model)
        info = plan.layout.resolve(world).rank_info(rank)
        est, counts, units = estimated(preset, plan, world, rank, info["pp"], microbatches)
        held = held_groups(model, topo)
        wrapped = fsdp_units(model)
        block = one_block(preset, data, topo) if block else None
    blocks = sorted({int(n.split(".")[1]) for n, _ in model.named_parameters() if n.startswith("layers.")})
    missing = sorted({k for k in counts if not k.startswith(("send", "recv")) and int(k.split("@")[1]) not in held})
    return {"rank": rank, "coords": {k: info[k] for k in ("pp", "dp", "tp", "cp", "ep", "edp")},
            "blocks": [len(blocks), blocks[0], blocks[-1]] if blocks else [0], "measured": got, "estimate": est,
            "collectives": counts, "groups_held": sorted(held), "groups_missing": missing,
            "fsdp_units": [wrapped, units], "block": block,
            "mesh_s": t1 - t0, "parallelize_s": t2 - t1, "rss_base": base,
            "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _ranks(world: int, pp: int) -> list[int]:
    """The last rank of the first stage, the first of a middle one, the last of the last stage (pp outermost,
    the default order; the last rank of an FSDP2 group holds the shortest chunks)."""
    per = world // pp
    return [per - 1, (pp // 2) * per, world - 1]


def _one(args) -> dict:
    """Run one rank in a child process (its own peak RSS); its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--world", str(args.world),
           "--layout", args.layout, "--microbatches", str(args.microbatches),
           "--schedule", args.schedule, "--rank", str(args.rank)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"rank {args.rank}: {out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _calls(counts: dict) -> str:
    """``kind@group: calls`` (``[calls, bytes]`` values: ``calls (MiB)``)."""
    return ", ".join(f"{k}: {v[0]} ({_mib(v[1])} MiB)" if isinstance(v, list) else f"{k}: {v}"
                     for k, v in sorted(counts.items()))


def table(results: list[dict]) -> str:
    """The markdown table of the ranks' results."""
    head = ("| rank | pp, dp, tp, ep, edp | blocks | params MiB | grads MiB | AdamW MiB | = estimate | collectives / step "
            "(solver; kind@group: calls) | one block measured (kind@group: calls (MiB)) | = solver | FSDP2 units (= solver) "
            "| parallelize s | peak RSS MiB (base) | process s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        m, c, b = r["measured"], r["coords"], r["block"] or {"measured": {}, "solver": {}}
        same = all(m[k] == r["estimate"][k] for k in ("params", "grads", "optimizer"))
        calls = {k: v[0] for k, v in b["measured"].items()} == {k: v[0] for k, v in b["solver"].items()}
        nbytes = [k for k in b["measured"] if b["measured"][k][1] != b["solver"].get(k, [0, 0])[1]]
        block = "not run (MoE)" if r["block"] is None else ("yes" if calls else "NO: " + _calls(b["solver"])) + (f" (bytes differ: {', '.join(nbytes)})"
                                                                       if nbytes else ", bytes too")
        units = f"{r['fsdp_units'][0]} ({'yes' if r['fsdp_units'][0] == r['fsdp_units'][1] else r['fsdp_units'][1]})"
        lines.append(f"| {r['rank']} | {c['pp']}, {c['dp']}, {c['tp']}, {c['ep']}, {c['edp']} | {r['blocks'][0]} ({'…'.join(map(str, r['blocks'][1:]))}) | "
                     f"{_mib(m['params'])} | {_mib(m['grads'])} | {_mib(m['optimizer'])} | "
                     f"{'yes' if same else 'NO: ' + str(r['estimate'])} | {_calls(r['collectives'])} | "
                     f"{_calls(b['measured']) or '-'} | {block} | {units} | {r['parallelize_s']:.2f} | "
                     f"{_mib(r['rss_peak'])} ({_mib(r['rss_base'])}) | {r.get('process_s', 0):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-405b")
    ap.add_argument("--world", type=int, default=16384)
    ap.add_argument("--layout", default="tp=8,pp=16", help="degrees; dp_shard is inferred")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--schedule", default="1f1b", help="the pipeline schedule (vpp > 1: interleaved_1f1b, …)")
    ap.add_argument("--ranks", help="comma-separated ranks, each in its own process (default: first, middle, last "
                    "stage)")
    ap.add_argument("--rank", type=int, help="run this rank here and print its JSON (else one child per rank)")
    args = ap.parse_args(argv)
    layout = {k: int(v) for k, v in (kv.split("=") for kv in args.layout.split(","))}
    if args.rank is not None:
        print(json.dumps(rehearse_rank(args.preset, layout, args.world, args.rank, args.microbatches,
                                       args.schedule)))
        return
    results, started = [], time.perf_counter()
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else _ranks(args.world, layout.get("pp", 1))
    for rank in ranks:
        args.rank = rank
        results.append(_one(args))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(f"{args.preset}, world {args.world}, layout {layout}, {args.schedule}, microbatches {args.microbatches}")
    print(table(results))
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
