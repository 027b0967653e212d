"""Shared fixtures: a `fake` process group of any world size (mesh and shape checks, no real ranks)."""

import contextlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Initialise torch's `fake` backend as rank `rank` of `world_size`; destroy it afterwards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def drop_fake_process_group() -> None:
    """Destroy a ``fake`` process group left by an earlier test (``tests/_local.py`` keeps one for the next use):
    a single-process save under it would plan for ranks that never write (an incomplete checkpoint)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


@pytest.fixture
def fake_pg():
    """``with fake_pg(world, rank):`` inside a test."""
    return fake_process_group


@pytest.fixture(scope="session")
def shared_launch(request):
    """``shared_launch(worker, n)``: the worker's results at world ``n`` from one launch per world size shared by
    every test file of the session (``tests/_launch.py``: ``SharedLaunches``)."""
    from _launch import SharedLaunches
    return SharedLaunches({item.path.name for item in request.session.items})
