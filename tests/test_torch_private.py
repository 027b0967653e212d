"""Every private torch API in ``meshplan/_torch.py`` still imports and behaves as meshplan uses it (torch 2.13)."""

import pytest
import torch

pytestmark = pytest.mark.fast


def test_private_names_import():
    from meshplan import _torch
    for name in _torch.__all__:
        assert getattr(_torch, name) is not None, name


def test_simulated_ranks_compute_collectives_per_rank():
    from torch.distributed.tensor import Partial, Replicate

    from meshplan._torch import LocalTensor, simulated_ranks
    from meshplan.mesh.topology import build_mesh
    from torch.distributed.tensor import DTensor
    with simulated_ranks(2):
        mesh = build_mesh({"tp": 2})["tp"]
        x = DTensor.from_local(torch.ones(3), mesh, [Partial()]).redistribute(mesh, [Replicate()])
        local = x.to_local()
        assert isinstance(local, LocalTensor) and all(torch.equal(v, torch.full((3,), 2.0))
                                                      for v in local._local_tensors.values())
