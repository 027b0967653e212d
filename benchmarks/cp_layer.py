"""Context parallelism on ONE attention layer (CPU, gloo): saved bytes, ring traffic and time, ``allgather_kv`` vs
``ring``, up to 32k tokens. Run: ``python benchmarks/cp.py --layer [--seq 4096 32768] [--cp 2] [--steps 3]``.

The layer (not a model): ``x (1, S/cp, 128) → q, k, v projections (4 query heads, 2 kv heads, head_dim 32: GQA, K/V
passed unrepeated) → causal attention → output projection → (out · w).sum()``, float32, head-tail layout. cp = 1
is one process calling ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``; cp > 1 is one
``torchrun --nproc-per-node cp`` launch per length running both methods (meshplan's functions, as the plan's
runtime calls them), alternating, every process one thread.

Measured per rank (the table shows rank 0; every rank's figures are in ``--json``):

* **saved**: ``torch.autograd.graph.saved_tensors_hooks`` over the forward, every saved tensor by UNIQUE storage
  (its whole storage once), parameters excluded: what is alive for backward at the end of the forward. *attention*:
  the part saved inside the attention call; *rest*: projections' inputs. *× cp1*: saved / cp 1's saved; the target
  is ``1/cp`` (+ the layer's non-attention share, which is also 1/cp here: the projections' inputs are local).
* **ring sent**: bytes this rank passes to ``isend`` (meshplan's :class:`RingLinks`), forward and backward, per
  layer; theory: forward ``(cp−1)/cp`` of the sequence's K/V, backward that again plus ``cp/cp`` of dK/dV.
* **step**: forward + backward of the layer, from a barrier to the slowest rank's end, median of ``--steps``
  after one warm-up; *× allgather*: ring's step / allgather_kv's step at that length.
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

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DIM, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32
MiB = 2 ** 20


def _layer(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = lambda o, i: (torch.randn(o, i, generator=g) * i ** -0.5).requires_grad_()
    return {"q": w(HEADS * HEAD_DIM, DIM), "k": w(KV_HEADS * HEAD_DIM, DIM), "v": w(KV_HEADS * HEAD_DIM, DIM),
            "o": w(DIM, HEADS * HEAD_DIM)}


def _forward(p: dict, x: torch.Tensor, attend, track: dict) -> torch.Tensor:
    b, s, _ = x.shape
    q = (x @ p["q"].T).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
    k = (x @ p["k"].T).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = (x @ p["v"].T).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
    track["inside"] = True
    out = attend(q, k, v)
    track["inside"] = False
    return (out.transpose(1, 2).reshape(b, s, -1) @ p["o"].T * x).sum()


def _saved(p: dict, x: torch.Tensor, attend) -> tuple[torch.Tensor, dict]:
    """The loss and the bytes saved for backward by unique storage: total and inside attention."""
    params = {t.untyped_storage().data_ptr() for t in p.values()}
    track, seen = {"inside": False, "total": 0, "attention": 0}, set()

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in params and key not in seen and st.nbytes():
            seen.add(key)
            track["total"] += st.nbytes()
            track["attention"] += st.nbytes() if track["inside"] else 0
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _forward(p, x, attend, track)
    return loss, track


def _attend(method: str, cp: int, rank: int, group):
    from meshplan.context_parallel.attention import allgather_kv_attention
    from meshplan.context_parallel.ring import ring_attention
    if cp == 1:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    fn = ring_attention if method == "ring" else allgather_kv_attention
    kw = {"group": group, "cp": cp, "rank": rank, "load_balance": True}
    if method == "allgather_kv":
        kw["masks"] = {}
    return lambda q, k, v: fn(q, k, v, is_causal=True, enable_gqa=True, **kw)


def _count_sends(sent: dict):
    from meshplan.context_parallel import ring
    real = ring.RingLinks.post

    def post(self, sends, recvs, tags):
        sent[sent["phase"]] += sum(t.numel() * t.element_size() for t in sends)
        return real(self, sends, recvs, tags)
    ring.RingLinks.post = post


def measure(method: str, seq: int, cp: int, rank: int, group, steps: int, sent: dict | None = None) -> dict:
    """One rank's figures for ``method`` at ``seq`` tokens (see the module doc)."""
    import torch.distributed as dist
    from meshplan.context_parallel.chunks import rank_positions
    p = _layer()
    x = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(1))
    x = x[:, rank_positions(seq, cp, rank, cp > 1)] if cp > 1 else x
    attend = _attend(method, cp, rank, group)
    sent = sent if sent is not None else {}
    sent.update(phase="fwd", fwd=0, bwd=0, off=0)
    loss, saved = _saved(p, x, attend)
    sent["phase"] = "bwd"
    loss.backward()
    sent["phase"] = "off"
    times = []
    for _ in range(steps + 1):
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _forward(p, x, attend, {}).backward()
        t = torch.tensor([time.perf_counter() - t0])
        if cp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    kv = 2 * KV_HEADS * seq * HEAD_DIM * 4
    return {"method": method if cp > 1 else "one device", "seq": seq, "cp": cp, "rank": rank,
            "saved": saved["total"], "attention": saved["attention"], "sent_fwd": sent["fwd"],
            "sent_bwd": sent["bwd"], "kv": kv, "step_s": statistics.median(times[1:])}


def _worker(args) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    sent = {"phase": "off", "fwd": 0, "bwd": 0}
    _count_sends(sent)
    rows = []
    for method in ("allgather_kv", "ring"):
        r = measure(method, args.seq[0], cp, rank, dist.group.WORLD, args.steps, sent)
        rows.append(r)
    with open(os.path.join(args.worker, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def _launch(seq: int, cp: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get(
            "PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               os.path.join(ROOT, "benchmarks", "cp.py"), "--layer", "--worker", out, "--seq", str(seq),
               "--cp", str(cp), "--steps", str(steps)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
        return [r for k in range(cp) for r in json.load(open(os.path.join(out, f"rank{k}.json")))]


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def table(rows: list[dict]) -> str:
    """The rows of rank 0 as a text table (see the module doc for the columns)."""
    head = ("seq", "cp", "method", "saved MiB", "x cp1", "attention MiB", "rest MiB", "ring fwd MiB",
            "(cp-1)/cp KV", "ring bwd MiB", "step s", "x allgather")
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    ag = {(r["seq"], r["cp"]): r for r in rows if r["method"] == "allgather_kv" and r["rank"] == 0}
    out = []
    for r in rows:
        if r["rank"]:
            continue
        b, theory = base.get(r["seq"]), (r["cp"] - 1) / r["cp"] * r["kv"]
        ring = r["method"] == "ring"
        out.append((str(r["seq"]), str(r["cp"]), r["method"], _mib(r["saved"]),
                    f"{r['saved'] / b['saved']:.3f}" if b else "-", _mib(r["attention"]),
                    _mib(r["saved"] - r["attention"]), _mib(r["sent_fwd"]) if ring else "-",
                    _mib(theory) if r["cp"] > 1 else "-", _mib(r["sent_bwd"]) if ring else "-", f"{r['step_s']:.3f}",
                    f"{r['step_s'] / ag[(r['seq'], r['cp'])]['step_s']:.2f}" if ring else "-"))
    widths = [max(len(h), *(len(x[i]) for x in out)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head)] + [fmt(x) for x in out])


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write every rank's rows to this path")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return ""
    torch.set_num_threads(1)
    rows = []
    for seq in args.seq:
        rows.append(measure("one device", seq, 1, 0, None, args.steps))
        rows += _launch(seq, args.cp, args.steps)
    text = table(rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return text
