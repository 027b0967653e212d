"""Private torch APIs meshplan relies on, imported here and nowhere else (tested with torch 2.13.0).

Each name says why meshplan needs it. ``tests/test_torch_private.py`` imports every one, so a torch
upgrade that moves one fails in one obvious place.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["FakeStore", "LocalTensor", "LocalTensorMode", "local_tensor_mode", "no_local_tensor_mode",
           "simulated_ranks"]

# a process group that communicates nothing: meshes and shapes at any world size in one process
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

# N ranks simulated in one process (each op runs per rank; collectives computed exactly): numerics checks
from torch.distributed._local_tensor import (  # noqa: E402
    LocalTensor,
    LocalTensorMode,
    local_tensor_mode,
    maybe_disable_local_tensor_mode as no_local_tensor_mode,
)


@contextlib.contextmanager
def simulated_ranks(world_size: int) -> Iterator[LocalTensorMode]:
    """``world_size`` ranks in this process: a ``fake`` default group and ``LocalTensorMode``.

    A fake group of another size is replaced (and the earlier one restored on exit); a real
    (non-fake) default group is an error, since collectives would reach other processes.

    Raises:
        RuntimeError: a real process group is initialized.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import _random
    prior = dist.get_world_size() if dist.is_initialized() else None
    if prior is not None and dist.get_backend() != "fake":
        raise RuntimeError(f"a real process group (backend {dist.get_backend()!r}) is initialized; a simulated run "
                           f"needs none")
    if prior is not None and prior != world_size:
        dist.destroy_process_group()
    if prior != world_size:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with LocalTensorMode(world_size) as mode:
            yield mode
    finally:
        _random._rng_tracker = None  # may hold LocalTensors
        if prior != world_size:
            dist.destroy_process_group()
            if prior is not None:
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=prior)
