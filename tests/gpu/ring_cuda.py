"""meshplan's ring attention on CUDA: one GPU, no network, no installs, under 2 minutes. Not collected by pytest.

Run (from the repository root)::

    torchrun --standalone --nproc-per-node 1 tests/gpu/ring_cuda.py     # or: python tests/gpu/ring_cuda.py

What one GPU can check, and why this way: cp needs cp processes, and NCCL refuses two ranks on one GPU ("duplicate
GPU"); gloo's point-to-point takes CPU tensors only, so a gloo ring "on CUDA" would test copies, not the GPU path.
So the cp ranks run as THREADS of this process on the one GPU, joined by ``QueueLinks`` (the ring's schedule code,
unchanged; only the transport is a queue instead of ``isend``/``irecv``): every block's math, the lse merge, the
backward with dK/dV travelling home, GQA, windows and soft-caps run as CUDA kernels. NCCL itself is exercised at
world 1 (the ring over a real NCCL group of one: ``RingLinks`` built, no hop needed) and by one
``batch_isend_irecv`` of a rank to itself. Prints one PASS/FAIL line per check and exits 1 on any FAIL.

Needs: torch with CUDA, and what ``import meshplan`` needs (pydantic, pyyaml): the lent GPU image (KINDS.md,
2026-11) has torch 2.11 and pyyaml but no pydantic — carry its wheels (pydantic, pydantic-core, annotated-types,
typing-inspection; /work/.library/device/README.md says how) or run where meshplan's environment is installed.
``RING_DEVICE=cpu python tests/gpu/ring_cuda.py`` smoke-runs checks 1-2 on CPU (43 s on 2 cores).

Checks:
1. float64, cp 2 and 4, both layouts, causal / full / window / soft-cap, GQA: out, dq, dk, dv vs dense attention
   on the GPU within 1e-9 (relative norm);
2. bfloat16, cp 2, causal, 4k tokens: out vs ``F.scaled_dot_product_attention`` (flash) within 2e-2 relative norm
   (bf16's own rounding; the ring accumulates in float32);
3. NCCL world 1: ``ring_attention`` over the default group (cp 1) equals SDPA, and a self send/recv moves a tensor;
4. time: ring cp 1 (one block, explicit math) vs SDPA at 8k tokens, forward + backward, for the record (no verdict).
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from meshplan.context_parallel.chunks import rank_positions  # noqa: E402
from meshplan.context_parallel.masks import AttentionMask  # noqa: E402
from meshplan.context_parallel.ring import QueueLinks, Ring, ring_attend, ring_attention, ring_backward, ring_forward  # noqa: E402

DEV = torch.device(os.environ.get("RING_DEVICE", "cuda"))  # RING_DEVICE=cpu: a smoke run of the script itself
FAILED = []


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def report(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def dense(q, k, v, mask, scale):
    pos = torch.arange(q.shape[-2], device=q.device)
    keep = mask.keep(pos, pos)
    g = q.shape[-3] // k.shape[-3]
    s = q @ k.repeat_interleave(g, -3).transpose(-1, -2) * scale
    if mask.softcap is not None:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, -3)


def ring_threads(cp, lb, mask, q, k, v, dout):
    """Every rank's output and gradients, placed at its positions (ranks as threads on the GPU). The threads call
    the ring's forward and backward functions directly: autograd runs every CUDA backward on ONE engine thread per
    device, so two ranks' backwards through autograd would wait on each other's messages forever (on CPU each
    backward runs in its caller's thread)."""
    queues, got, errors = {}, [torch.zeros_like(t) for t in (q, q, k, v)], []

    def rank(r):
        try:
            idx = torch.tensor(rank_positions(q.shape[-2], cp, r, lb), device=DEV)
            ql, kl, vl = (t[:, :, idx].contiguous() for t in (q, k, v))
            ring = Ring(QueueLinks(queues, cp, r), lb, mask, q.shape[-1] ** -0.5)
            with torch.no_grad():
                out, lse = ring_forward(ring, ql, kl, vl)
                dq, dk, dv = ring_backward(ring, ql, kl, vl, out, lse, dout[:, :, idx].contiguous())
            sync()
            for whole, part in zip(got, (out, dq, dk, dv)):
                whole[:, :, idx] = part
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise RuntimeError(errors[0])
    return got


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def check_float64():
    g = torch.Generator(device=DEV).manual_seed(0)
    masks = [AttentionMask(causal=True), AttentionMask(causal=False), AttentionMask(causal=True, window=50),
             AttentionMask(causal=True, softcap=5.0)]
    for cp in (2, 4):
        for lb in (True, False):
            for mask in masks:
                q, dout = (torch.randn(2, 8, 256, 64, device=DEV, dtype=torch.float64, generator=g) for _ in "ab")
                k, v = (torch.randn(2, 2, 256, 64, device=DEV, dtype=torch.float64, generator=g) for _ in "ab")
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                want = dense(qr, kr, vr, mask, 64 ** -0.5)
                want.backward(dout)
                got = ring_threads(cp, lb, mask, q, k, v, dout)
                worst = max(rel(a, b) for a, b in zip(got, (want.detach(), qr.grad, kr.grad, vr.grad)))
                report(f"float64 cp{cp} {'head-tail' if lb else 'contiguous'} {mask}", worst <= 1e-9,
                       f"worst rel {worst:.1e}")


def check_bf16():
    g = torch.Generator(device=DEV).manual_seed(1)
    q, dout = (torch.randn(1, 16, 4096, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in "ab")
    k, v = (torch.randn(1, 4, 4096, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in "ab")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = ring_threads(2, True, AttentionMask(causal=True), q, k, v, dout)[0]
    err = rel(got, want)
    report("bfloat16 cp2 causal 4k GQA vs SDPA", err <= 2e-2, f"rel {err:.1e}")


def check_nccl():
    if not dist.is_initialized():
        report("nccl world 1", True, "(skipped: not under torchrun)")
        return
    q, k, v = (torch.randn(1, 4, 512, 64, device=DEV) for _ in "abc")
    out = ring_attention(q, k, v, is_causal=True, group=dist.group.WORLD, cp=1, rank=0, load_balance=True)
    err = rel(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    report("nccl world 1: ring_attention over the default group", err <= 1e-4, f"rel {err:.1e}")
    src, dst = torch.arange(1024.0, device=DEV), torch.zeros(1024, device=DEV)
    try:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, src, 0), dist.P2POp(dist.irecv, dst, 0)]):
            w.wait()
        sync()
        report("nccl self isend/irecv", bool(torch.equal(src, dst)))
    except Exception as e:  # some NCCL builds refuse a self send; reported, not fatal to the ring's own checks
        report("nccl self isend/irecv", False, repr(e)[:200])


def check_time():
    q, k, v = (torch.randn(1, 16, 8192, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in "abc")
    ring = Ring(QueueLinks({}, 1, 0), True, AttentionMask(causal=True), 128 ** -0.5)
    for name, fn in (("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     ("ring cp1", lambda: ring_attend(q, k, v, ring))):
        fn().sum().backward()
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn().sum().backward()
        sync()
        print(f"TIME {name} 8k bf16 fwd+bwd: {(time.perf_counter() - t0) / 3 * 1e3:.1f} ms", flush=True)


def main():
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device")
        sys.exit(1)
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    start = time.perf_counter()
    for check in (check_float64, check_bf16, check_nccl, check_time) if DEV.type == "cuda" else (check_float64,
                                                                                                check_bf16):
        try:
            check()
        except Exception as e:
            report(check.__name__, False, repr(e)[:300])
    print(f"{'FAIL' if FAILED else 'PASS'} all ({len(FAILED)} failed) in {time.perf_counter() - start:.0f} s")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
