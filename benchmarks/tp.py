"""Tensor parallelism side by side: meshplan vs a hand-written torch plan vs transformers' own ``tp_plan``.

Run: ``python benchmarks/tp.py [--steps 10] [--quick] [--world 2]`` from the repo root (≈1.5 min on 2 cores;
``--quick``: tiny model, ≈1 min; ``--no-time``: counts only). One table; every contender runs the SAME
unmodified transformers ``LlamaForCausalLM`` (random weights, fp32, dropout 0):

* **meshplan** — ``meshplan.parallelize(model, "plans/hf_llama.yaml", mesh)`` (sequence parallel,
  loss_parallel) and ``meshplan.cross_entropy`` on the vocab-sharded logits.
* **hand-written torch** — the plan an expert writes with ``parallelize_module`` (torchtitan's Llama plan in
  transformers' module names: ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel``/``PrepareModuleInput``,
  the residual stream kept a ``Shard(1)`` DTensor because transformers derives positions from its shape) and
  torch's ``loss_parallel()`` context around the loss and its backward.
* **transformers tp_plan** — the model's own plan (``base_model_tp_plan`` + ``lm_head:
  colwise_gather_output``) expanded and applied as ``from_pretrained(tp_plan="auto")`` does it
  (``_expand_parallel_plan`` + ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``), on the
  existing mesh; no sequence parallelism, full logits gathered, plain ``F.cross_entropy``.
* **meshplan, examples/llama.py** (counts only) — the torchtitan-style example model, same shapes,
  ``plans/llama.yaml``.

Measured:

1. **Collectives and bytes per training step** (forward + backward + ``AdamW.step()``), one process on torch's
   ``fake`` process group with world = tp (every collective a no-op), counted by ``CommDebugMode`` and, for
   sizes, by a dispatch mode that records each c10d/functional collective. Bytes are what ONE rank sends in a
   ring: (t−1)/t of the full buffer for all-gather/reduce-scatter, 2·(t−1)/t for all-reduce.
2. **All-reduces issued by ``optimizer.step()``** and by gradient clipping (``meshplan.clip_grad_norm_`` for
   meshplan, ``torch.nn.utils.clip_grad_norm_`` for the others), separately.
3. **Parameter and gradient bytes per rank** after backward, over the ideal: every matrix (embedding, q/k/v/o,
   gate/up/down, lm_head) sharded 1/t, the norm weights whole. A full-vocabulary replicated embedding grad
   or a ``Partial`` grad counts at its local size.
4. **Loss at steps 0 and 1** on identical weights vs one device (real gloo ranks): a broken plan shows here.
5. **Step time** on real gloo processes (``torchrun``, CPU, world ``--world``): warm-up, then rounds
   interleaved A,B,C,A,B,C… so drift hits every contender alike; median over rounds, as a ratio to the
   hand-written plan.

Theoretical minimum per step (Megatron-SP; b batch, s sequence, h hidden, L layers, t tp, β = 4 bytes):

* per layer 2 all-gathers + 2 reduce-scatters forward; backward the same plus one all-gather per block input
  (2 per layer): Megatron-SP keeps only its sequence shard of each block input for the weight gradients and
  gathers it again in backward (Korthikanti et al. 2022, sec. 4.2.2), as meshplan's default
  ``save_gathered_inputs: false`` does; each over b·s·h. (A plan that keeps the gathered inputs, as the
  hand-written and transformers' plans do, sends 2L fewer all-gathers and keeps tp× the bytes of them);
* embedding: reduce-scatter forward, all-gather backward; lm_head: all-gather forward, reduce-scatter backward;
* vocab-parallel loss: 3 small all-reduces (row max and row Σexp over b·s fp32; [loss sum, token count]);
* norm-weight gradients: ONE coalesced all-reduce of (2L+1)·h elements;
* the optimizer step: none.

  collectives = 10L + 8;  bytes = (10L+4)·(t−1)/t·b·s·h·β + 2·(t−1)/t·(2·b·s·4 + 16 + (2L+1)·h·β).

A count below the minimum is possible (one all-reduce does the work of a reduce-scatter + all-gather); the
bytes column is the one to compare.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from _comm import CommLog  # noqa: E402
from _tp_contenders import (QUICK, Shape, batch, build_model, clip, forward_backward,  # noqa: E402
                             hand_written_plan, parallelize)

__all__ = ["Shape", "minimum", "hand_written_plan", "CONTENDERS", "count", "main"]

#: contender key → label in the table
CONTENDERS = {"meshplan": "meshplan (plans/hf_llama.yaml)", "hand": "hand-written torch plan",
              "hf": "transformers tp_plan", "titan": "meshplan, examples/llama.py (plans/llama.yaml)"}
TIMED = ("meshplan", "hand", "hf")  # the HF-model contenders; "hand" is the reference
BETA = 4  # fp32


def minimum(shape: Shape, t: int) -> tuple[int, float]:
    """(collectives, bytes one rank sends) per step for Megatron-SP; see the module docstring."""
    L, bsh = shape.layers, shape.batch * shape.seq * shape.hidden
    ring = (t - 1) / t
    big = (10 * L + 4) * ring * bsh * BETA
    small = 2 * ring * (2 * shape.batch * shape.seq * 4 + 16 + (2 * L + 1) * shape.hidden * BETA)
    return 10 * L + 8, big + small


class _Phase:
    """``CommDebugMode`` and :class:`CommLog` together; checks that they agree on the count."""

    def __enter__(self):
        from torch.distributed.tensor.debug import CommDebugMode
        self.debug, self.log = CommDebugMode(), CommLog()
        self.debug.__enter__()
        self.log.__enter__()
        return self.log

    def __exit__(self, *exc):
        self.log.__exit__(*exc)
        self.debug.__exit__(*exc)
        if exc[0] is None and self.debug.get_total_counts() != len(self.log.records):
            raise AssertionError(f"CommDebugMode counted {self.debug.get_total_counts()} collectives, "
                                 f"CommLog {len(self.log.records)}: {dict(self.debug.get_comm_counts())}")
        return False


# --------------------------------------------------------------------------------------------- memory
def _matrix(name: str) -> bool:
    return "norm" not in name.rsplit(".", 2)[-2]


def local_bytes(model: torch.nn.Module, t: int) -> dict[str, float]:
    """Local parameter and gradient bytes of this rank, and the ideal (matrices 1/t, norm weights whole)."""
    from torch.distributed.tensor import DTensor

    def local(x):
        return (x.to_local() if isinstance(x, DTensor) else x).numel() * x.element_size()

    params = dict(model.named_parameters())
    ideal = sum(p.numel() * p.element_size() / (t if _matrix(n) else 1) for n, p in params.items())
    return {"param": sum(local(p) for p in params.values()) / ideal,
            "grad": sum(local(p.grad) for p in params.values() if p.grad is not None) / ideal}


# --------------------------------------------------------------------------------------------- fake-group counting
def _fake_group(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def count(name: str, shape: Shape, t: int) -> dict:
    """One training step of contender ``name`` at tp = ``t`` on the fake group: collectives, bytes, memory."""
    from torch.distributed.device_mesh import init_device_mesh
    _fake_group(t)
    try:
        mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
        model = parallelize(name, build_model(name, shape), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, labels = batch(shape)
        with _Phase() as fb:
            forward_backward(name, model, tokens, labels)
        memory = local_bytes(model, t)
        with _Phase() as step:
            opt.step()
        with _Phase() as clipped:  # after the step: the grads are still there, still in their layouts
            try:
                clip(name, model)
                clip_ars = clipped.calls().get("all_reduce", 0)
            except Exception as e:  # noqa: BLE001 - shown in the table
                clip_ars = "fails: mixed Tensor/DTensor" if "mixed torch.Tensor and DTensor" in str(e) else \
                    f"fails: {type(e).__name__}"
        min_calls, min_bytes = minimum(shape, t)
        calls = {k: fb.calls().get(k, 0) + step.calls().get(k, 0) for k in ("all_gather", "reduce_scatter",
                                                                             "all_reduce")}
        moved = fb.ring_bytes() + step.ring_bytes()
        return {"name": name, "tp": t, "calls": calls, "min_calls": min_calls, "bytes": moved,
                "bytes_ratio": moved / min_bytes, "opt_ars": step.calls().get("all_reduce", 0),
                "clip_ars": clip_ars, **memory}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- gloo worker
def _worker(args) -> None:
    """Under torchrun: losses vs one device, then interleaved timed steps; rank 0 writes JSON."""
    from torch.distributed.device_mesh import init_device_mesh
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, shape = dist.get_world_size(), QUICK if args.quick else Shape()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tokens, labels = batch(shape)
    initial = build_model("hf", shape)
    ref = copy.deepcopy(initial)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for _ in range(2):
        ref_losses.append(forward_backward("ref", ref, tokens, labels))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    models, opts, losses, times = {}, {}, {}, {n: [] for n in TIMED}
    for name in TIMED:
        models[name] = parallelize(name, copy.deepcopy(initial), mesh)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
        losses[name] = []
    for r in range(2 + args.warmup + args.steps):
        for name in TIMED:  # interleaved: A, B, C, A, B, C, ...
            dist.barrier()
            start = time.perf_counter()
            loss = forward_backward(name, models[name], tokens, labels)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
            if r < 2:
                losses[name].append(loss)
            if r >= 2 + args.warmup:
                times[name].append(float(took))
    if dist.get_rank() == 0:
        out = {"world": world, "ref": ref_losses, "load": os.getloadavg()[0], "losses": losses,
               "median": {n: statistics.median(v) for n, v in times.items()}}
        with open(args.worker, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def run_gloo(world: int, steps: int, warmup: int, quick: bool, timeout: float = 900) -> dict:
    """Launch this script under torchrun (gloo, ``world`` CPU processes); returns rank 0's JSON."""
    fd, path = tempfile.mkstemp(prefix="meshplan-tp-bench-", suffix=".json")
    os.close(fd)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.abspath(__file__), "--worker", path, "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd + (["--quick"] if quick else []), env=env, capture_output=True, text=True,
                          timeout=timeout)
    try:
        if proc.returncode:
            raise RuntimeError(f"torchrun failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


# --------------------------------------------------------------------------------------------- table
def _fmt_calls(c: dict) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    return " ".join(f"{c[k]}{v}" for k, v in short.items() if c.get(k))


def table(rows: list[dict], gloo: dict | None) -> str:
    head = ("| contender | tp | collectives/step (min) | bytes/rank/step | × min | AR in opt.step | AR in clip "
            "| params × ideal | grads × ideal | loss step 0 / 1 (one device: {ref}) | step time × hand |")
    ref = " / ".join(f"{v:.6f}" for v in gloo["ref"]) if gloo else "—"
    lines = [head.format(ref=ref), "|" + "---|" * 11]
    for r in rows:
        timed = gloo is not None and r["tp"] == gloo["world"] and r["name"] in TIMED
        loss = " / ".join(f"{v:.6f}" for v in gloo["losses"][r["name"]]) if timed else "—"
        ratio = f"{gloo['median'][r['name']] / gloo['median']['hand']:.2f}" if timed else "—"
        calls = f"{sum(r['calls'].values())} = {_fmt_calls(r['calls'])} ({r['min_calls']})"
        lines.append(f"| {CONTENDERS[r['name']]} | {r['tp']} | {calls} | {r['bytes'] / 2**20:.2f} MiB "
                     f"| {r['bytes_ratio']:.2f} | {r['opt_ars']} | {r['clip_ars']} | {r['param']:.2f} "
                     f"| {r['grad']:.2f} | {loss} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per contender (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="gloo processes for the loss check and step time")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp degrees to count on the fake group")
    ap.add_argument("--quick", action="store_true", help="tiny model, 5 timed steps")
    ap.add_argument("--no-time", action="store_true", help="skip the gloo run (counts only)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.quick:
        args.steps = min(args.steps, 5)
        args.warmup = min(args.warmup, 1)
    if os.environ.get("RANK") is not None and args.worker:
        _worker(args)
        return ""
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    shape = QUICK if args.quick else Shape()
    rows = [count(name, shape, t) for t in args.tp for name in CONTENDERS]
    gloo = None if args.no_time else run_gloo(args.world, args.steps, args.warmup, args.quick)
    text = table(rows, gloo)
    s = shape
    print(f"Tensor parallelism per training step (forward + backward + AdamW.step), transformers LlamaForCausalLM "
          f"{s.layers} layers, hidden {s.hidden}, ffn {s.ffn}, {s.heads} heads / {s.kv_heads} KV, vocab {s.vocab}, "
          f"batch {s.batch} x seq {s.seq}, fp32")
    print(text)
    print(_footnotes(shape, args, gloo))
    print(f"({time.perf_counter() - started:.0f} s)")
    return text


def _footnotes(shape: Shape, args, gloo: dict | None) -> str:
    notes = [
        "collectives/step: counted by CommDebugMode on the fake group (world = tp), AG all-gather, RS "
        "reduce-scatter, AR all-reduce; (min) = Megatron-SP with its backward re-gather, 10L+8. bytes: ring "
        "bytes one rank sends; × min: over "
        "(10L+4)·(t-1)/t·bsh·4 + 2·(t-1)/t·(2bs·4 + 16 + (2L+1)·h·4).",
        "AR in opt.step: all-reduces AdamW issues itself (stock DTensor leaves the norm-weight grads Partial: 3 "
        "per weight). AR in clip: meshplan.clip_grad_norm_ (meshplan) / torch.nn.utils.clip_grad_norm_ (others).",
        "params/grads × ideal: local bytes after backward over (matrices / t + norm weights); a replicated "
        "full-vocabulary embedding grad counts whole.",
        "transformers tp_plan: its embedding is vocab-parallel with an all-reduce, each colwise input is its own "
        "Replicate DTensor (one backward all-reduce per q/k/v/gate/up), the lm_head gathers the full b·s·V "
        "logits, norms stay plain tensors; no sequence parallelism, no loss parallelism.",
        "meshplan, examples/llama.py: a different model class with the same shapes; counts only.",
    ]
    if gloo is not None:
        worst = max(abs(a - b) for v in gloo["losses"].values() for a, b in zip(v, gloo["ref"]))
        notes.append(f"loss: the contenders vs one device (plain model, same weights, AdamW between steps 0 and 1): "
                     f"max |difference| {worst:.1e}.")
        notes.append(f"step time: real gloo, world {gloo['world']}, same weights and batch; step time = "
                     f"median of {args.steps} interleaved steps after {args.warmup} warm-up, max over ranks, "
                     "as a ratio to the hand-written plan (median seconds: "
                     + ", ".join(f"{n} {v:.3f}" for n, v in gloo["median"].items())
                     + f"; load average {gloo['load']:.1f} on {os.cpu_count()} cores: a loaded machine makes the ratio "
                     "noisy, rerun with more --steps).")
    return "\n".join(f"{i}. {n}" for i, n in enumerate(notes, 1))


if __name__ == "__main__":
    main()
