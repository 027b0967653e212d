"""Random numbers keyed by (seed, tensor name, global element index): ``materialize(mode="sharded")``'s stream.

Element ``i`` (row-major index in the FULL tensor) of the tensor named ``name`` draws from
``splitmix64(key(seed, name) + (i + 1) * golden)``: a counter-based generator, so a rank computes the values of
its own shard only, and every rank that holds element ``i`` (a replica, another layout, another rank order)
computes the same bits. A float64 tensor: uniforms from the top 53 bits, normals by Box-Muller on two 32-bit parts
(tails cut at 6.7 standard deviations); other dtypes: computed in float32 from 24-bit parts (tails cut at 5.9
standard deviations, a probability of 4e-9 per element), then cast. The arithmetic is int64 with wrap-around
(torch's CPU and CUDA integer ops).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

__all__ = ["Keyed", "tensor_key", "fill_keyed", "module_seed"]

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK = 1 << 20  # elements per transient block: the int64/float64 temporaries stay O(1 MiB) whatever the shard


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> k).bitwise_and_((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, in place on int64 ``z``."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_i64(_M1))
    z.bitwise_xor_(_shr(z, 27)).mul_(_i64(_M2))
    return z.bitwise_xor_(_shr(z, 31))


def tensor_key(seed: int, name: str) -> int:
    """The 64-bit key of tensor ``name`` under ``seed`` (an int64)."""
    digest = hashlib.blake2b(f"{int(seed)}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def module_seed(seed: int, name: str) -> int:
    """A ``torch.manual_seed`` value for the temporaries of module ``name``'s initializer (non-negative, < 2^63)."""
    return tensor_key(seed, "module:" + name) & ((1 << 63) - 1)


@dataclass(frozen=True)
class Keyed:
    """Where a local tensor's elements sit in the full tensor named ``name``.

    Attributes:
        name: the parameter's name in the one-device model (the first name of a tied parameter).
        key: :func:`tensor_key` of (seed, name).
        base: the flat offset fixed by dims a view selected away (0 for a parameter).
        idx: per local dim, the global indices it holds (int64, as long as that dim).
        strides: per local dim, the full tensor's row-major stride.
        lattice: per local dim, ``(origin, step, size)``: the view's index ``j`` along that dim is the full
            tensor's index ``origin + step * j``, for ``j < size`` (``(0, 1, n)`` for a parameter).
        whole: True for the parameter itself (not a view of it).
    """

    name: str
    key: int
    base: int
    idx: tuple[torch.Tensor, ...]
    strides: tuple[int, ...]
    lattice: tuple[tuple[int, int, int], ...]
    whole: bool = True

    def select(self, dim: int, j: int) -> tuple[int | None, "Keyed"]:
        """``view[j]`` along ``dim`` (negative ``j`` from the end): the local position holding it (None: this
        rank holds none of it) and the view's record."""
        origin, step, size = self.lattice[dim]
        full = origin + step * (j % size)
        pos = torch.nonzero(self.idx[dim] == full).flatten()
        drop = lambda t: t[:dim] + t[dim + 1:]  # noqa: E731
        return (int(pos[0]) if pos.numel() else None,
                Keyed(self.name, self.key, self.base + full * self.strides[dim], drop(self.idx), drop(self.strides),
                      drop(self.lattice), False))

    def slice(self, dim: int, start, stop, step) -> tuple[list[int], "Keyed"]:
        """``view[start:stop:step]`` along ``dim``: the local positions it keeps and the view's record."""
        origin, st, size = self.lattice[dim]
        start, stop, step = slice(start, stop, step).indices(size)
        j = (self.idx[dim] - origin) // st
        mask = (j >= start) & (j < stop) & ((j - start) % step == 0)
        lattice = (origin + st * start, st * step, len(range(start, stop, step)))
        put = lambda t, v: t[:dim] + (v,) + t[dim + 1:]  # noqa: E731
        return (torch.nonzero(mask).flatten().tolist(),
                Keyed(self.name, self.key, self.base, put(self.idx, self.idx[dim][mask]), self.strides,
                      put(self.lattice, lattice), False))


def _flat(target: Keyed, rows: slice) -> torch.Tensor:
    """The full tensor's flat indices of local rows ``rows`` (dim 0), broadcast to the block's shape."""
    n = len(target.idx)
    flat = torch.tensor(target.base, dtype=torch.int64)
    for d, (idx, stride) in enumerate(zip(target.idx, target.strides)):
        part = idx[rows] if d == 0 else idx
        flat = flat + (part * stride).view([-1 if e == d else 1 for e in range(n)])
    return flat


def _values(bits: torch.Tensor, kind: str, a: float, b: float, dtype: torch.dtype) -> torch.Tensor:
    """Draws from int64 bits: ``uniform`` on [a, b), ``normal`` with mean a and std b; computed in float64 for a
    float64 tensor (53-bit uniforms, 32-bit Box-Muller halves), else in float32 (24-bit uniforms and halves)."""
    wide = dtype == torch.float64
    ftype, width = (torch.float64, 53) if wide else (torch.float32, 24)
    if kind == "uniform":
        u = _shr(bits, 64 - width).to(ftype).add_(0.5).mul_(2.0 ** -width)
        return u.mul_(b - a).add_(a)
    half = 32 if wide else 24
    u1 = _shr(bits, 64 - half).to(ftype).add_(0.5).mul_(2.0 ** -half)
    u2 = bits.bitwise_and_((1 << half) - 1).to(ftype).add_(0.5).mul_(2 * math.pi * 2.0 ** -half)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).mul_(b).add_(a)


def fill_keyed(out: torch.Tensor, target: Keyed, kind: str, a: float, b: float) -> None:
    """Write the keyed draws of ``target``'s elements into ``out`` (its local tensor), block by block of dim 0."""
    if out.numel() == 0:
        return
    if out.dim() == 0:
        out.copy_(_values(_bits(_flat(target, slice(None)), target.key), kind, a, b, out.dtype))
        return
    step = max(1, _CHUNK // max(1, out[0].numel()))
    for r0 in range(0, out.shape[0], step):
        rows = slice(r0, min(r0 + step, out.shape[0]))
        out[rows].copy_(_values(_bits(_flat(target, rows).to(out.device), target.key), kind, a, b, out.dtype))


def _bits(flat: torch.Tensor, key: int) -> torch.Tensor:
    """64 random bits per flat index (int64): splitmix64 of the key's stream at position ``flat + 1``."""
    return _mix(flat.add(1).mul_(_i64(_GOLDEN)).add_(key))
