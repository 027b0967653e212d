"""Context parallelism (``allgather_kv``, load-balanced): K/V traffic, saved activations and tokens/s vs cp = 1.

``python benchmarks/cp.py --layer``: ONE attention layer up to 32k tokens, ``allgather_kv`` vs ``ring`` vs one
device (saved bytes, ring bytes sent, time): ``benchmarks/cp_layer.py`` says what it measures.
``python benchmarks/cp.py --documents``: packed documents of mixed lengths up to 32k tokens, the row's head-tail
layout (balanced by tokens) vs the per-document layout (by work), both methods: ``benchmarks/cp_documents.py``.
The rest of this docstring is the model benchmark.

Run: ``python benchmarks/cp.py [--quick] [--json [PATH]]`` from the repo root (≈2 min on 2 idle cores;
``--quick``: seq 512, one launch each, ≈25 s; ``--json``: the rows as JSON too, on stdout after the table or into
PATH). For each cp in ``--cp`` (default 1 2 4) the script launches itself under ``torchrun --standalone
--nproc-per-node cp`` (gloo, CPU; world = cp, so the layout is ``{cp: cp}`` and meshplan's default FSDP2 shards
the parameters over those ranks), builds the example Llama (``examples/llama.py``; default dim 128, 2 layers,
4 heads / 2 KV heads, ffn 256, vocab 512) from the same seed, applies::

    {"layout": {"cp": cp},
     "context_parallel": {"attention": "layers.*.attention", "positions": {"buffer": "freqs_cis"}}}

with ``meshplan.parallelize`` and trains with ``meshplan.train_step(model, (x, y), meshplan.cross_entropy, AdamW)``
on ONE fixed global batch of whole sequences (default batch 1 × seq 2048): the step gives each rank its two
head-tail chunks of every sequence. cp = 1 is the same script on one process (the section is a no-op there).
Every rank reports JSON; the table is built from all ranks.

Measured, per cp:

1. **K/V bytes per attention layer per forward** — one measured step (after warm-up) runs under a
   ``TorchDispatchMode`` that records every functional collective (``_c10d_functional.*``: what
   ``allgather_kv_attention`` issues through ``funcol``; FSDP2's ``c10d::`` parameter collectives are counted
   apart). *measured* = bytes this rank RECEIVES from the K/V all-gathers (input bytes × (cp−1): the output is
   cp inputs), over the forward, ÷ layers. *theory* = the full sequence's K and V as
   ``scaled_dot_product_attention`` gets them (2 · b · heads · S · head_dim · 4 bytes) × (cp−1)/cp. The example
   Llama repeats its K/V heads to n_heads BEFORE SDPA (GQA expanded), so what is gathered is n_heads/n_kv_heads ×
   the K/V its projections compute: column *× proj K/V*. *bwd RS*: the all-gather's backward, the reduce-scatter
   of dK/dV, received bytes ((cp−1)/cp of its input) ÷ layers, over the same theory.
2. **Saved activations per rank** — in the same step, ``torch.autograd.graph.saved_tensors_hooks`` count every
   tensor autograd saves, by UNIQUE storage (its whole ``untyped_storage().nbytes()``, once however many views
   of it are saved), parameters and buffers excluded (FSDP2's unsharded parameters included), released when
   autograd drops it; the peak of the live sum over the step (reached at the end of the forward + loss).
   *attention core*: what is saved while an attention module's ``scaled_dot_product_attention`` call runs (at cp
   > 1 that is meshplan's cross-shard attention: gathered and reordered K/V, the per-chunk SDPA); *rest*:
   everything else (embedding, norms, projections, RoPE, FFN, logits and loss). Ratios vs cp = 1; the rest
   should be ≈ 1/cp, the attention core cannot be (every rank holds the whole sequence's K/V). *(masks)*: the
   part of the attention core that is attention masks (the 2-D tensors saved there): meshplan passes each query
   chunk a bool chunk × keys causal mask, which SDPA turns into a float mask and saves for backward, O(S²/cp)
   bytes per layer, where cp = 1 passes ``is_causal`` and saves none.
3. **Training throughput** — ``--steps`` timed ``train_step`` calls (forward, backward, FSDP2 reduce-scatter,
   AdamW) after ``--warmup``, each timed from a barrier to the slowest rank's end. ``--rounds`` launches per
   configuration, in alternating order (A B C D, then D C B A); step time = the smallest of the launches'
   medians (the machine's other load only ever adds time). tokens/s = global tokens per step / step time;
   *× cp=1*: speed-up over cp = 1 with one thread; *per rank*: speed-up / cp. Every process runs with
   ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)``: a rank stands for one device, one core. So cp = 2 uses
   2 cores where cp = 1 uses 1: the row ``1 (2 thr)`` (cp = 1 with 2 intra-op threads, the same 2 cores) says
   whether splitting the sequence beats threading on this machine. cp = 4 on 2 cores runs 4 processes on 2 cores
   (oversubscribed): its time is NOT a scaling measurement; read its bytes and memory columns. *loss 0*: the
   first step's loss, equal across cp when attention is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["Shape", "run_config", "rows", "table", "main"]

MiB = 2 ** 20


@dataclass(frozen=True)
class Shape:
    """The example Llama and the batch: ``batch`` sequences of ``seq`` tokens per step (global)."""

    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    vocab: int = 512
    batch: int = 1
    seq: int = 2048

    def kv_bytes(self, heads: int) -> int:
        """The whole sequence's K and V (fp32) for ``heads`` heads: 2 · b · heads · S · head_dim · 4."""
        return 2 * self.batch * heads * self.seq * (self.dim // self.heads) * 4


# --------------------------------------------------------------------------------------------- worker side
def _plan(cp: int) -> dict:
    method = os.environ.get("MESHPLAN_CP_BENCH_METHOD", "allgather_kv")  # --method, handed to the workers
    return {"layout": {"cp": cp}, "context_parallel": {"method": method, "attention": "layers.*.attention",
                                                       "positions": {"buffer": "freqs_cis"}}}


def _comm_mode():
    """A dispatch mode recording each collective: (namespace, op, group size, input bytes, output bytes)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    import torch.distributed as dist

    def nbytes(x) -> int:
        if isinstance(x, (list, tuple)):
            return sum(nbytes(v) for v in x)
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    def group_size(args) -> int:
        names = [a for a in args if isinstance(a, str)]
        if names:
            return _resolve_process_group(names[-1]).size()
        for a in args:
            if isinstance(a, torch.ScriptObject):
                return dist.ProcessGroup.unbox(a).size()
        return 0

    class Comm(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[str, str, int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor decompose; its collectives come back here
            out = func(*args, **(kwargs or {}))
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            if ns == "_c10d_functional" and name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                self.records.append((ns, name, group_size(args), nbytes(args[0])))
            elif ns == "c10d" and name in ("_allgather_base_", "_reduce_scatter_base_", "allreduce_"):
                full = nbytes(args[0]) if name != "_reduce_scatter_base_" else nbytes(args[1])  # the full buffer
                self.records.append((ns, name, group_size(args), full))
            return out

    return Comm()


class _Saved:
    """Holder of one saved tensor: tells the tracker when autograd drops it (a detached reference, no cycle)."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int, tracker: "_Tracker") -> None:
        self.tensor, self.key, self.tracker = tensor.detach(), key, tracker

    def __del__(self) -> None:
        self.tracker.release(self.key)


class _Tracker:
    """Bytes of unique storages saved for backward and alive at once, per category.

    "attention": first saved inside an attention module's SDPA call, "mask": the 2-D ones among them (the only
    2-D tensors there: the masks SDPA saves, q/k/v/out are 4-D, logsumexp 3-D, indices 1-D), "rest": the others.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.in_attention = model, False
        self.refs: dict[int, int] = {}
        self.meta: dict[int, tuple[str, int]] = {}
        self.live = {"attention": 0, "mask": 0, "rest": 0}
        self.peak, self.at_peak = 0, dict(self.live)
        self.subclass = 0

    def _skip(self) -> set[int]:
        """Storages of the parameters (DTensor shards, or FSDP2's unsharded parameters) and buffers right now."""
        from meshplan._torch import local_tensor
        out = set()
        for t in (*self.model.parameters(), *self.model.buffers()):
            t = local_tensor(t)
            if t.untyped_storage().nbytes():
                out.add(t.untyped_storage().data_ptr())
        return out

    def pack(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            self.subclass += 1  # a tensor subclass (none expected here): not counted, reported
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self._skip():
            return t
        if self.refs.get(key, 0) == 0:
            kind = ("mask" if t.dim() == 2 else "attention") if self.in_attention else "rest"
            self.meta[key] = (kind, storage.nbytes())
            self.live[kind] += storage.nbytes()
            total = sum(self.live.values())
            if total > self.peak:
                self.peak, self.at_peak = total, dict(self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            kind, n = self.meta.pop(key)
            self.live[kind] -= n
            del self.refs[key]


def _flag_attention(model: torch.nn.Module, tracker: _Tracker) -> list:
    """While an attention module's ``scaled_dot_product_attention`` runs, ``tracker.in_attention`` is True.

    A torch function mode entered by each attention module's forward pre-hook (after meshplan's routing mode, so
    it sees the SDPA call first and hands it on) and left by a PREPENDED forward hook (before meshplan leaves
    its own mode: modes leave in LIFO order). Returns the hook handles.
    """
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    sdpa = F.scaled_dot_product_attention

    class Flag(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not sdpa:
                return func(*args, **(kwargs or {}))
            tracker.in_attention = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                tracker.in_attention = False

    modes, handles = [], []

    def enter(_m, _a):
        modes.append(Flag())
        modes[-1].__enter__()

    def leave(_m, _a, _o):
        modes.pop().__exit__(None, None, None)

    for path, module in model.named_modules():
        if path.endswith("attention") and path.startswith("layers."):
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, prepend=True, always_call=True))
    return handles


def _worker(args) -> None:
    """Under torchrun (world = cp): warm-up, one measured step, timed steps; rank 0 writes every rank's JSON."""
    import torch.distributed as dist
    import llama
    import meshplan
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    s = Shape(**json.loads(args.shape))
    cp = int(os.environ["WORLD_SIZE"])
    plan = _plan(cp)
    with meshplan.init(plan) as topo:
        cfg = llama.ModelArgs(dim=s.dim, n_layers=s.layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                              vocab_size=s.vocab, ffn_dim=s.ffn, max_seq_len=s.seq)
        torch.manual_seed(0)
        model = llama.build(cfg)
        meshplan.parallelize(model, plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
        y = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)

        def step():
            return meshplan.train_step(model, (x, y), meshplan.cross_entropy, opt, topology=topo)

        loss0 = step().loss  # the first step (also meshplan's first-forward audit)
        for _ in range(max(args.warmup - 1, 0)):
            step()
        # one measured step: collectives and saved activations
        comm, tracker = _comm_mode(), _Tracker(model)
        handles = _flag_attention(model, tracker)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), comm:
            step()
        for h in handles:
            h.remove()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
            times.append(float(took))
        mine = {"rank": topo.rank, "comm": comm.records, "saved_peak": tracker.peak, "saved_at_peak": tracker.at_peak,
                "uncounted_subclass": tracker.subclass,
                "times": times, "loss0": loss0, "fsdp": type(model).__name__.startswith("FSDP")}
        everyone = [None] * cp
        dist.all_gather_object(everyone, mine)
        if topo.rank == 0:
            with open(args.worker, "w") as f:
                json.dump({"cp": cp, "threads": args.threads, "ranks": everyone, "load": os.getloadavg()[0]}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 + gloo: a rare abort at interpreter exit (see tests/_launch.py); the results are written


# --------------------------------------------------------------------------------------------- launcher side
def run_config(cp: int, shape: Shape, threads: int, steps: int, warmup: int, timeout: float = 600) -> dict:
    """Launch this script under torchrun with ``cp`` gloo processes; returns rank 0's JSON (every rank's record)."""
    fd, path = tempfile.mkstemp(prefix="meshplan-cp-bench-", suffix=".json")
    os.close(fd)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
           os.path.abspath(__file__), "--worker", path, "--shape", json.dumps(asdict(shape)),
           "--threads", str(threads), "--steps", str(steps), "--warmup", str(warmup)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode or not os.path.getsize(path):
            raise RuntimeError(f"torchrun (cp={cp}) failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _pool(results: list[dict]) -> dict:
    """One configuration's launches as one: the first launch's counts (deterministic), each launch's median."""
    out = json.loads(json.dumps(results[0]))
    out["medians"] = [statistics.median(r["ranks"][0]["times"]) for r in results]
    out["load"] = max(r["load"] for r in results)
    out["launches"] = len(results)
    return out


def _row(res: dict, shape: Shape, base: dict | None) -> dict:
    """One row from a configuration's per-rank records; ``base``: the cp = 1 (one thread) row."""
    cp, ranks = res["cp"], res["ranks"]
    r0 = ranks[0]
    layers = shape.layers
    ag = [n for ns, op, d, n in r0["comm"] if ns == "_c10d_functional" and op == "all_gather_into_tensor"]
    rs = [n for ns, op, d, n in r0["comm"] if ns == "_c10d_functional" and op == "reduce_scatter_tensor"]
    fsdp = {}
    for ns, op, d, n in r0["comm"]:
        if ns == "c10d" and d > 1:
            fsdp[op] = fsdp.get(op, 0) + n * (d - 1) / d * (2 if op == "allreduce_" else 1)
    theory = shape.kv_bytes(shape.heads) * (cp - 1) / cp
    proj = shape.kv_bytes(shape.kv_heads) * (cp - 1) / cp
    ag_recv = sum(ag) * (cp - 1) / layers  # the output is cp inputs; cp−1 of them come from the other ranks
    rs_recv = sum(rs) * (cp - 1) / cp / layers
    step_s = min(res.get("medians") or [statistics.median(r0["times"])])  # other load only adds time
    tokens = shape.batch * shape.seq
    peak = [r["saved_peak"] for r in ranks]
    attn = [r["saved_at_peak"]["attention"] + r["saved_at_peak"]["mask"] for r in ranks]
    mask = [r["saved_at_peak"]["mask"] for r in ranks]
    rest = [r["saved_at_peak"]["rest"] for r in ranks]
    row = {"cp": cp, "threads": res["threads"], "processes": cp, "fsdp": r0["fsdp"],
           "kv_ag_calls_per_fwd": len(ag) / layers, "kv_rs_calls_per_bwd": len(rs) / layers,
           "kv_bytes_measured": ag_recv, "kv_bytes_theory": theory,
           "kv_ratio": ag_recv / theory if theory else None, "kv_vs_proj": ag_recv / proj if proj else None,
           "rs_bytes_measured": rs_recv, "rs_ratio": rs_recv / theory if theory else None,
           "fsdp_bytes_per_step": fsdp,
           "saved_max_rank": max(peak), "saved_per_rank": peak, "attention_max_rank": max(attn),
           "mask_max_rank": max(mask), "rest_max_rank": max(rest),
           "uncounted_subclass": sum(r["uncounted_subclass"] for r in ranks),
           "step_s": step_s, "step_s_launch_medians": res.get("medians"), "tokens_per_s": tokens / step_s,
           "loss0": r0["loss0"],
           "load": res["load"]}
    if base is not None:
        row["saved_ratio"] = row["saved_max_rank"] / base["saved_max_rank"]
        row["attention_ratio"] = row["attention_max_rank"] / base["attention_max_rank"]
        row["rest_ratio"] = row["rest_max_rank"] / base["rest_max_rank"]
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["per_rank_efficiency"] = row["speedup"] / cp
    return row


def rows(results: list[dict], shape: Shape) -> list[dict]:
    """Table rows from each configuration's result; ratios against the cp = 1, one-thread configuration."""
    base_res = next(r for r in results if r["cp"] == 1 and r["threads"] == 1)
    base = _row(base_res, shape, None)
    return [_row(r, shape, base) for r in results]


def _mib(n: float) -> str:
    return f"{n / MiB:.2f}"


def _r(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def table(all_rows: list[dict]) -> str:
    """The Markdown table: one row per (cp, threads)."""
    head = ("| cp | procs × thr | K/V AG recv/layer/fwd MiB | theory MiB | × theory | × proj K/V | bwd RS recv MiB "
            "| × theory | saved/rank MiB | × cp=1 | attn core MiB (masks) | × cp=1 | rest MiB | × cp=1 | 1/cp "
            "| step s | tokens/s | × cp=1 | per rank | loss 0 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in all_rows:
        cp = r["cp"]
        comm = cp > 1
        label = f"{cp}" + (f" ({r['threads']} thr)" if r["threads"] != 1 else "")
        lines.append(
            f"| {label} | {r['processes']} × {r['threads']} | {_mib(r['kv_bytes_measured'])} | "
            f"{_mib(r['kv_bytes_theory'])} | {_r(r['kv_ratio']) if comm else '—'} | "
            f"{_r(r['kv_vs_proj']) if comm else '—'} | {_mib(r['rs_bytes_measured'])} | "
            f"{_r(r['rs_ratio']) if comm else '—'} | {_mib(r['saved_max_rank'])} | {_r(r.get('saved_ratio'))} | "
            f"{_mib(r['attention_max_rank'])} ({_mib(r['mask_max_rank'])}) | {_r(r.get('attention_ratio'))} | "
            f"{_mib(r['rest_max_rank'])} | {_r(r.get('rest_ratio'))} | {1 / cp:.2f} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {_r(r.get('speedup'))} | {_r(r.get('per_rank_efficiency'))} | "
            f"{r['loss0']:.6f} |")
    return "\n".join(lines)


def _notes(shape: Shape, all_rows: list[dict], args) -> str:
    cores = os.cpu_count() or 1
    over = [r["cp"] for r in all_rows if r["processes"] * r["threads"] > cores]
    loss = [r["loss0"] for r in all_rows]
    uncounted = sum(r["uncounted_subclass"] for r in all_rows)
    notes = [
        "K/V AG recv: bytes one rank receives from the K/V all-gathers per attention layer per forward "
        "(_c10d_functional.all_gather_into_tensor input × (cp−1)); theory: full K+V at SDPA, "
        f"2·b·n_heads·S·hd·4 = {_mib(shape.kv_bytes(shape.heads))} MiB, × (cp−1)/cp. × proj K/V: over the K/V "
        f"the projections compute (n_kv_heads = {shape.kv_heads}): examples/llama.py repeats K/V to n_heads = "
        f"{shape.heads} before SDPA, so the gather moves {shape.heads // shape.kv_heads}× what GQA would need. "
        "bwd RS: the dK/dV reduce-scatter, "
        "(cp−1)/cp of its input, per layer. K/V collectives per layer per forward / backward: "
        + ", ".join(f"cp={r['cp']}: {r['kv_ag_calls_per_fwd']:g} / {r['kv_rs_calls_per_bwd']:g}"
                    for r in all_rows if r["cp"] > 1) + ".",
        "saved/rank: peak over the measured step of the unique storages autograd holds for backward (parameters, "
        "FSDP2's unsharded parameters and buffers excluded), the largest rank; attn core / rest: that peak split "
        "by where the tensor was first saved (inside an attention module's SDPA call, meshplan's cross-shard "
        "attention included, or elsewhere); (masks): the 2-D tensors saved there, the attention masks SDPA saves "
        "(meshplan's causal block masks: additive float, chunk × keys, 4 bytes an entry, built once per shape and "
        "shared by the layers, SDPA keeping them by reference; CUDA uses torch's lower-right causal bias and "
        "saves none; cp = 1 passes is_causal and saves none).",
        f"time: median of {args.steps} train_step calls (after {args.warmup} warm-up, max over ranks), the "
        f"smallest over {args.rounds} launch(es); tokens/s = {shape.batch}·{shape.seq} global tokens / step; "
        "× cp=1 against cp = 1 on one thread; per rank = × cp=1 / cp. One thread per process: a rank stands for "
        "a device.",
        f"loss 0: first step, same weights and batch for every cp (max spread {max(loss) - min(loss):.1e}).",
    ]
    fsdp = [f"cp={r['cp']}: " + ", ".join(f"{k} {_mib(v)}" for k, v in r["fsdp_bytes_per_step"].items())
            for r in all_rows if r["fsdp_bytes_per_step"]]
    if fsdp:
        notes.append("not in the K/V columns: FSDP2 (meshplan's default data parallelism over the cp ranks) moves "
                     "parameters and gradients, ring MiB sent per rank per step: " + "; ".join(fsdp) + ".")
    if uncounted:
        notes.append(f"WARNING: {uncounted} saved tensors were tensor subclasses and are not in the saved columns.")
    if over:
        notes.append(f"OVERSUBSCRIBED: cp = {', '.join(map(str, over))} runs more processes × threads than the "
                     f"{cores} cores here; its step time measures time-slicing, not context parallelism: read its "
                     "bytes and memory columns, not its tokens/s. Compare ratios, not absolute times.")
    load = max(r["load"] for r in all_rows)
    notes.append(f"{args.rounds} launch(es) per configuration; load average up to {load:.1f} on {cores} cores "
                 "during the runs (a loaded machine makes the time columns noisy; rerun with more --steps).")
    return "\n".join(f"{i}. {n}" for i, n in enumerate(notes, 1))


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:  # one attention layer, allgather_kv vs ring, up to 32k tokens (benchmarks/cp_layer.py)
        from cp_layer import main as layer_main
        return layer_main([a for a in argv if a != "--layer"])
    if "--documents" in argv:  # packed documents, token- vs work-balanced layout (benchmarks/cp_documents.py)
        from cp_documents import main as documents_main
        return documents_main([a for a in argv if a != "--documents"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp degrees (world = cp); 1 is added")
    ap.add_argument("--seq", type=int, help="global sequence length (default 2048; --quick 512)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, help="timed steps per configuration (default 8; --quick 4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, help="launches per configuration, in alternating order; step time = the "
                                               "smallest launch median (default 2; --quick 1)")
    ap.add_argument("--no-threads-row", action="store_true", help="skip cp = 1 with 2 threads")
    ap.add_argument("--quick", action="store_true", help="seq 512, 4 timed steps")
    ap.add_argument("--json", nargs="?", const="-", help="also write the rows as JSON to PATH (no PATH: stdout)")
    ap.add_argument("--method", default="allgather_kv", choices=("allgather_kv", "ring"),
                    help="the plan's context_parallel.method (ring: its K/V hops are point-to-point, not in the "
                         "K/V columns; benchmarks/cp_layer.py counts them)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return ""
    os.environ["MESHPLAN_CP_BENCH_METHOD"] = args.method
    args.seq = args.seq or (512 if args.quick else 2048)
    args.steps = args.steps or (4 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 2)
    shape = Shape(dim=args.dim, layers=args.layers, batch=args.batch, seq=args.seq)
    bad = [cp for cp in args.cp if cp < 1 or shape.seq % (2 * cp)]
    if bad:
        ap.error(f"--seq {shape.seq} must be a multiple of 2·cp (the head-tail chunks) for cp = {bad}")
    started = time.perf_counter()
    configs = [(1, 1)] + [(cp, 1) for cp in args.cp if cp != 1]
    if not args.no_threads_row and (os.cpu_count() or 1) >= 2:
        configs.insert(1, (1, 2))
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for i in range(args.rounds):  # A B C D, D C B A, …: drift of the machine hits every configuration alike
        for cp, threads in (configs if i % 2 == 0 else configs[::-1]):
            runs[(cp, threads)].append(run_config(cp, shape, threads, args.steps, args.warmup))
    results = [_pool(runs[c]) for c in configs]
    all_rows = rows(results, shape)
    text = table(all_rows)
    print(f"Context parallelism ({args.method}, load_balance: true), torch {torch.__version__}, gloo on CPU: "
          f"examples/llama.py dim {shape.dim}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, "
          f"ffn {shape.ffn}, vocab {shape.vocab}, fp32; global batch {shape.batch} × seq {shape.seq}; "
          "train_step + AdamW; world = cp.")
    print(text)
    print(_notes(shape, all_rows, args))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        data = json.dumps(all_rows, indent=1)
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w") as f:
                f.write(data)
    return text


if __name__ == "__main__":
    main()
