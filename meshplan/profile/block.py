"""A reference eager transformer block, timed by the ``meshplan profile`` job (every rank at once): what a block's
element-wise operators and launches cost on this machine beyond its matmuls and attention
(:func:`meshplan.profile.run.block_costs` turns the times into the cluster's ``touch_rate`` and
``block_op_overhead``; :func:`meshplan.solver.compute.block_time` prices them), and what the whole block takes
against its price from every measured rate (:func:`meshplan.profile.run.block_scale`).

The block is a Llama decoder layer written plainly here (pre-norm RMSNorm computed in float32, q/k/v/o
projections, RoPE, the GQA repeat, causal ``scaled_dot_product_attention``, SwiGLU, two residual adds), run
forward and backward at two batch sizes, beside the same matmuls and attention alone. Why measured and not
counted: on a CPU the element-wise ops of an eager block run ~4× slower than a cache-warm ``torch.add`` of the
same bytes (autograd's saved tensors, broadcast multiplies whose backward reduces a weight gradient, float32
up-casts, ``stack``/``repeat_interleave`` copies), and their time grows when ranks share cores; a whole block
timed on every rank at once sees both. (The GPU shape is not yet checked on a GPU.)

Why the whole block's time too: its matmuls run slower inside the block than the profile's matmuls alone (operands
fresh from the element-wise ops, weight-gradient and transposed shapes), and a window ends with the slowest rank's,
as a synchronous step does. On the 2026-11-27 host the block priced from the rates read 36.8-37.4 ms per sequence
at world 2 while the whole block took 41.7-51.9 ms; a step of the example Llama ran 1.19× its price at world 2 and
1.34× at world 4 (benchmarks/calibrate.py), the same gap.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["measure_block", "whole_block_time", "REFERENCE", "BATCHES"]

#: the reference block's shape by device: hidden, heads, kv heads, FFN width, sequence (calibrate.py's Llama on a
#: CPU; on a GPU one large enough that its kernels are not launch-bound)
REFERENCE = {"cpu": {"hidden": 256, "heads": 8, "kv_heads": 4, "ffn": 1024, "seq": 256},
             "cuda": {"hidden": 2048, "heads": 16, "kv_heads": 8, "ffn": 8192, "seq": 2048}}
#: sequences per timed call: two token counts separate the per-token work from the per-call launches
BATCHES = (1, 4)


class _Block(nn.Module):
    """One pre-norm Llama layer (``h = x + attn(norm(x)); h + ffn(norm(h))``), eager."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norms = nn.ParameterList([nn.Parameter(torch.ones(hidden)) for _ in range(2)])
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                             1e4 ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        cos, sin = self.cos.to(x.device), self.sin.to(x.device)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = self._norm(x, self.norms[0])
        q = self._rope(self.wq(a).view(b, s, self.heads, self.head_dim))
        k = self._rope(self.wk(a).view(b, s, self.kv_heads, self.head_dim))
        v = self.wv(a).view(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        f = self._norm(h, self.norms[1])
        return h + self.w2(F.silu(self.w1(f)) * self.w3(f))

    def bare(self, x: torch.Tensor) -> torch.Tensor:
        """The same matmuls and attention on the same shapes, without the element-wise ops between them (GQA
        inside the attention kernel instead of a repeat; the up projection's output summed instead of gated)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = self.wo(out.transpose(1, 2).reshape(b, s, -1))
        return y + self.w2(self.w1(x)) + self.w3(x).sum(-1, keepdim=True)


def measure_block(timed: Callable, mean: Callable, device: torch.device, dtype: torch.dtype) -> dict:
    """``{"block_reference": shape, "block_rest_times": [[sequences, seconds per forward and backward of the
    block beyond its matmuls and attention], ...], "block_whole_times": [[sequences, seconds of the whole block],
    ...]}`` (means over the ranks; ``timed``, ``mean``: the worker's helpers).

    The matmuls and attention are timed alone on the same shapes in alternating windows (:meth:`_Block.bare`) and
    subtracted: a difference of two times taken at the same moment, not of a time and a price from rates measured
    earlier (that residual, a few percent of the block, changed sign with the host's drift between the two)."""
    shape, block = _reference(device, dtype)
    times, wholes = [], []
    for batch, x, grad in _inputs(shape, device, dtype):
        whole, bare = [], []
        for _ in range(3):  # alternating, so that drift lands on both
            whole.append(timed(lambda: block(x).backward(grad), reps=1, window=0.4))
            bare.append(timed(lambda: block.bare(x).backward(grad), reps=1, window=0.4))
        times.append([batch, mean(statistics.median(whole) - statistics.median(bare))])
        wholes.append([batch, mean(statistics.median(whole))])
    return {"block_reference": dict(shape), "block_rest_times": times, "block_whole_times": wholes}


def whole_block_time(timed: Callable, mean: Callable, device: torch.device, dtype: torch.dtype,
                     window: float = 0.25) -> float:
    """Seconds of the reference block whole, forward and backward, summed over :data:`BATCHES` (means over the
    ranks, every rank at once): the sum the profile's ``block_whole_times`` hold, timed again at another moment.
    ``benchmarks/calibrate.py``'s worker times it before each layout's steps, so that the host's drift between the
    profile and a run is measured, not guessed (:func:`meshplan.profile.run.reference_block_price`: the
    profile's own)."""
    shape, block = _reference(device, dtype)
    return sum(mean(timed(lambda: block(x).backward(grad), reps=2, window=window))
               for _, x, grad in _inputs(shape, device, dtype))


def _reference(device: torch.device, dtype: torch.dtype) -> tuple[dict, _Block]:
    """The device's reference shape and its block, seeded."""
    shape = REFERENCE["cuda" if device.type == "cuda" else "cpu"]
    torch.manual_seed(0)
    return shape, _Block(**shape).to(device=device, dtype=dtype)


def _inputs(shape: dict, device: torch.device, dtype: torch.dtype):
    """``(sequences, input, output gradient)`` for each batch of :data:`BATCHES`."""
    for batch in BATCHES:
        x = torch.randn(batch, shape["seq"], shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        yield batch, x, torch.randn_like(x)
