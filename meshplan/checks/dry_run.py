"""The dry run of ``meshplan check``: the plan applied for real to a meta-device copy of the model under a
``fake`` process group (nothing allocated, nothing communicated), which gives the exact local parameter shapes
of the explain table (:mod:`meshplan.checks.explain`). The cross-shard shadow run (:mod:`meshplan.checks.shadow`)
uses the same copy and group."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.model_copies import meta_copy  # noqa: F401 (re-exported: meshplan.checks.dry_run.meta_copy)

__all__ = ["meta_copy", "fake_group", "meta_dry_run"]


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world`` ranks for the block (a fake one of another size is
    replaced, then restored).

    Raises:
        PlanError: a real process group is initialized.
    """
    import torch.distributed as dist
    from meshplan._torch import FakeStore
    prior = dist.get_world_size() if dist.is_initialized() else None
    prior_rank = dist.get_rank() if prior is not None else 0
    if prior is not None and dist.get_backend() != "fake":
        raise PlanError("a real process group is initialized; meshplan.check's dry run needs none (or a fake one)")
    if prior is not None and prior != world:
        dist.destroy_process_group()
    if prior != world:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        if prior != world:
            dist.destroy_process_group()
            if prior is not None:
                dist.init_process_group("fake", store=FakeStore(), rank=prior_rank, world_size=prior)


def meta_dry_run(model: nn.Module, plan, tp: int, report):
    """Apply ``plan`` to a meta-device copy under a ``fake`` group of ``tp`` ranks: ``(copy, TpApplied)``.

    Returns None (and records why in ``report.errors``) when torch rejects a style; skipped (None)
    under a real process group, where no fake one can be made.
    """
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() != "fake":
        return None
    from meshplan.mesh.topology import build_mesh
    from meshplan.tensor_parallel.apply import apply_tensor_parallel
    meta = meta_copy(model)
    try:
        with fake_group(tp):
            return meta, apply_tensor_parallel(meta, plan.tensor_parallel, build_mesh({"tp": tp})["tp"], plan.source)
    except PlanError as e:
        report.errors.append(e)
    except Exception as e:  # a style that torch rejects
        report.errors.append(PlanError(f"{report.source}: applying the plan to a meta copy failed: "
                                       f"{type(e).__name__}: {e}"))
    return None
