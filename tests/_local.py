"""Shared helper for simulating N ranks in ONE process with torch's LocalTensorMode.

This is the only module in the test suite that imports the private
``torch.distributed._local_tensor`` package (tested with torch 2.13.0); every
other test goes through the names below, so a torch upgrade that moves that
API is fixed here once.

How it works: a ``fake`` process group (no real communication) is initialised
with ``world_size=N`` and ``LocalTensorMode(N)`` is entered.  Inside the mode
every tensor created by a factory (``torch.randn``, ``torch.zeros``, ...) is a
``LocalTensor`` holding one value per simulated rank; every op runs once per
rank; collectives (``c10d`` and ``_functional_collectives``, hence DTensor
redistribution) are computed exactly across the per-rank values.  The
``DeviceMesh`` rank/coordinate methods are patched to return per-rank
``SymInt`` values.

Usage::

    from _local import (   # tests/ is on sys.path (tests/conftest.py)
        local_ranks, make_mesh, distribute, on_rank, assert_ranks_agree,
        assert_close_rel,
    )

    def test_something():
        ref = torch.randn(8, 16)                 # plain tensor, made BEFORE the mode
        with local_ranks(4):                     # fake PG(world_size=4) + LocalTensorMode(4)
            mesh = make_mesh((2, 2), ("dp", "tp"))
            x = distribute(ref, mesh, [Shard(0), Shard(1)], requires_grad=True)
            y = some_op(x)                       # runs on all 4 simulated ranks
            assert_close_rel(y, some_op(ref))    # DTensor -> full_tensor(), every rank checked
            y0 = on_rank(x.to_local(), 0)        # rank 0's local shard, a plain tensor

Rules of thumb:

* Make reference (single-device) tensors *outside* ``local_ranks`` (or wrap
  their creation in ``plain()``): a factory call inside the mode returns a
  LocalTensor, not a plain tensor.
* A plain tensor in an op with a LocalTensor acts as the same value on every
  rank (fine, e.g. a plain target); ops on plain tensors only stay plain.  Use
  ``replicated(t)`` / ``distribute(...)`` / ``from_ranks(...)`` for inputs.
* Call the helpers that gather (``assert_close_rel`` on a DTensor,
  ``DTensor.full_tensor``) inside ``local_ranks``.

torch 2.13 quirks met under LocalTensorMode:

* ``mesh.get_local_rank(d)`` / ``get_coordinate()`` return per-rank ``SymInt``
  (``LocalIntNode``).  ``tensor >= symint`` and ``torch.tensor(symint)`` fail
  (``'LocalIntNode' object has no attribute 'guard_int'``);
  ``torch.full((), symint)`` gives the per-rank LocalTensor you want.
* Unevenly sharded DTensors: ``DTensor.to_local()``'s backward with a
  materialised per-rank gradient infers a SymInt global stride and fails with
  ``TypeError: unhashable type: non-nested SymInt``.  Wrap the gradient
  yourself with ``DTensor.from_local(..., shape=, stride=)`` (as
  ``meshplan.training.loss`` does), or use even shapes.
* ``CommDebugMode`` entered inside the mode counts each functional collective
  once, keyed ``torch.ops.c10d_functional.<op>``.
* The fake process group stays initialised between uses (cheap re-entry);
  asking for another world size destroys and re-initialises it.  A non-fake
  (real) default group is never touched: ``RuntimeError``.  Call ``shutdown()``
  to destroy the fake group explicitly (e.g. in a module-level teardown).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "LocalTensor",
    "LocalTensorMode",
    "assert_close_rel",
    "assert_ranks_agree",
    "distribute",
    "ensure_fake_pg",
    "from_ranks",
    "local_ranks",
    "make_mesh",
    "on_rank",
    "plain",
    "rank_values",
    "replicated",
    "shutdown",
]


def ensure_fake_pg(world_size: int) -> None:
    """Initialise the default ``fake`` process group with ``world_size`` ranks (idempotent)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(
                f"a real process group (backend {dist.get_backend()!r}) is initialised; "
                "tests/_local.py only manages the 'fake' one"
            )
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def shutdown() -> None:
    """Destroy the fake default process group if this helper's one is initialised."""
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[LocalTensorMode]:
    """Simulate ``world_size`` ranks: fake PG + ``LocalTensorMode(world_size)``.

    Yields the mode (``mode.ranks`` is ``frozenset(range(world_size))``).  On
    exit the mode is left and DTensor's RNG tracker (which may have been built
    from LocalTensors) is reset; the fake PG is kept for the next use.
    """
    ensure_fake_pg(world_size)
    from torch.distributed.tensor import _random

    try:
        with LocalTensorMode(world_size) as mode:
            yield mode
    finally:
        _random._rng_tracker = None


def plain() -> contextlib.AbstractContextManager:
    """Temporarily leave LocalTensorMode so factories return plain tensors."""
    return maybe_disable_local_tensor_mode()


def _ranks() -> frozenset[int]:
    mode = local_tensor_mode()
    if mode is None:
        raise RuntimeError("needs an active local_ranks(...) context")
    return mode.ranks


def make_mesh(shape: Sequence[int] | int, names: Sequence[str] | None = None) -> DeviceMesh:
    """``init_device_mesh("cpu", shape, mesh_dim_names=names)`` built outside the mode."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    with plain():
        return init_device_mesh("cpu", shape, mesh_dim_names=tuple(names) if names else None)


def replicated(t: torch.Tensor) -> LocalTensor:
    """A LocalTensor holding a copy of the plain tensor ``t`` on every simulated rank."""
    if isinstance(t, LocalTensor):
        return t
    return from_ranks(lambda r: t.detach().clone())


def from_ranks(
    values: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | Callable[[int], torch.Tensor],
) -> LocalTensor:
    """Build a LocalTensor from per-rank plain tensors (dict rank->tensor, list indexed by rank, or ``fn(rank)``)."""
    ranks = sorted(_ranks())
    if callable(values):
        with plain():
            per = {r: values(r) for r in ranks}
    elif isinstance(values, Mapping):
        per = dict(values)
    else:
        per = dict(enumerate(values))
    if set(per) != set(ranks):
        raise ValueError(f"need one tensor per rank {ranks}, got ranks {sorted(per)}")
    return LocalTensor({r: v.detach() for r, v in per.items()})


def distribute(
    t: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    requires_grad: bool = False,
) -> DTensor:
    """Shard the plain global tensor ``t`` as a leaf DTensor, with no communication."""
    d = distribute_tensor(replicated(t), mesh, list(placements), src_data_rank=None)
    return d.detach().requires_grad_(requires_grad)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per-rank plain tensors: a LocalTensor's values, a DTensor's *local* shards, or ``t`` on every rank."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    mode = local_tensor_mode()
    ranks = mode.ranks if mode is not None else frozenset({0})
    return {r: t for r in sorted(ranks)}


def on_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local value of ``t`` as a plain tensor (see ``rank_values``)."""
    return rank_values(t)[rank]


def assert_ranks_agree(t: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
    """Assert every rank holds the same value (exactly, NaN == NaN; or within ``tol`` relative); return it."""
    vals = rank_values(t)
    first_rank = min(vals)
    ref = vals[first_rank]
    for r, v in vals.items():
        if tol == 0.0:
            ok = v.shape == ref.shape and (
                torch.equal(v, ref)
                or (v.is_floating_point() and torch.allclose(v, ref, rtol=0, atol=0, equal_nan=True))
            )
        else:
            ok = v.shape == ref.shape and _rel_err(v, ref) <= tol
        if not ok:
            raise AssertionError(f"rank {r} differs from rank {first_rank}:\n{v}\nvs\n{ref}")
    return ref


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    a, b = a[~nan_a], b[~nan_b]
    diff = (a - b).norm().item()
    ref = b.norm().item()
    return diff / ref if ref > 0 else diff


def _materialize(t: torch.Tensor) -> dict[int, torch.Tensor]:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return rank_values(t)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Assert ``||actual - expected|| / ||expected|| <= tol`` (absolute when ``expected`` is 0).

    DTensors are compared via ``full_tensor()``; LocalTensors rank by rank
    (a plain side is broadcast to every rank).  NaNs must sit at the same
    positions.  Shapes must match exactly.
    """
    act, exp = _materialize(actual), _materialize(expected)
    if len(act) == 1 and len(exp) > 1:
        act = {r: next(iter(act.values())) for r in exp}
    if len(exp) == 1 and len(act) > 1:
        exp = {r: next(iter(exp.values())) for r in act}
    for r in sorted(act):
        a, e = act[r], exp[r]
        if a.shape != e.shape:
            raise AssertionError(f"rank {r}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
        err = _rel_err(a, e)
        if not err <= tol:
            raise AssertionError(f"rank {r}: relative error {err:.3e} > {tol:.1e}\nactual={a}\nexpected={e}")
