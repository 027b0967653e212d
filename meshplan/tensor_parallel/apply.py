"""Apply the ``tensor_parallel`` section to a model: the generated plan (:mod:`meshplan.tensor_parallel.generate`),
stored head counts divided by tp, tied parameters tied again, the post-backward gradient finaliser and dropout
randomness."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from meshplan.errors import PlanError
from meshplan.gradients import GradFinalizer, finalizer_for
from meshplan.plan_file.tensor_parallel import TensorParallel
from meshplan.tensor_parallel.dropout.attach import attach_rng
from meshplan.tensor_parallel.dropout.per_shard import TpRng
from meshplan.tensor_parallel.dropout.single_device import SingleDeviceDropout
from meshplan.tensor_parallel.generate import generate_tp_plan, rules_where
from meshplan.tensor_parallel.heads import adjust_heads
from meshplan.tensor_parallel.style_table import STYLES

__all__ = ["apply_tensor_parallel", "TpApplied", "tied_parameters", "retie"]


@dataclass(frozen=True)
class TpApplied:
    """What :func:`apply_tensor_parallel` did: the torch plan, adjusted head counts, the grad finaliser.

    ``finalizer`` is the model's live :class:`~meshplan.gradients.GradFinalizer` (coalesced tp reduction of
    replicated grads) when tensor parallelism tracked parameters in it, else None; ``sequence_parallel`` the
    section's mode (``"batch"``: tp ranks hold different samples).
    """

    plan: dict[str, Any]
    head_counts: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    finalizer: GradFinalizer | None = None
    rng: TpRng | SingleDeviceDropout | None = None
    sequence_parallel: bool | str = False


def tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of ``(module path, parameter name)`` that hold one parameter object (tied weights)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    return [v for v in owners.values() if len(v) > 1]


def retie(model: nn.Module, tied: list[list[tuple[str, str]]], where: str) -> None:
    """Parallel styles replace parameters module by module; tie them again (same placement required).

    Raises:
        PlanError: tied parameters got different placements.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    for group in tied:
        params = [getattr(modules[m], n) for m, n in group]
        first = params[0]
        place = [getattr(p, "placements", None) for p in params]
        if any(pl != place[0] for pl in place):
            names = ", ".join(f"{m}.{n} ({pl})" for (m, n), pl in zip(group, place))
            raise PlanError(f"{where}: tied parameters get different placements: {names}; tie an 'embedding' "
                            f"(vocab-parallel, shard(0)) with an 'lm_head' (shard(0)), or untie them")
        for (m, n) in group[1:]:
            setattr(modules[m], n, first)


def apply_tensor_parallel(model: nn.Module, section: TensorParallel, tp_mesh: DeviceMesh,
                          source: str | None = None, finalizer: GradFinalizer | None = None) -> TpApplied:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` as ``section`` says.

    Beyond ``parallelize_module``: stored head counts divided by tp, one
    coalesced post-backward reduction of ``Partial`` gradients (norm weights
    under SP, ``replicate`` modules), and per-shard dropout streams.

    Args:
        model: the model, changed in place.
        section: the plan's ``tensor_parallel`` section.
        tp_mesh: the 1-D tensor-parallel mesh.
        source: the plan file, for error messages.
        finalizer: the model's gradient finaliser, handed by :func:`meshplan.parallelize` (default: a new one
            when there is anything to sum: the rehearsals' throwaway copies).

    Returns:
        A :class:`TpApplied` (keep it alive with the model: it holds the hooks' state).

    Raises:
        PlanError: what :func:`~meshplan.tensor_parallel.generate.generate_tp_plan` raises, head counts tp
            does not divide, or tied parameters with different placements.
    """
    tp = tp_mesh.size()
    where = rules_where(source)
    plan, meta = generate_tp_plan(model, section, tp, source)
    modules = meta["modules"]  # styles change modules in place: one traversal serves every step
    heads = adjust_heads(model, meta["local_heads"], tp, where, section.adjust_head_counts, modules)
    tied = tied_parameters(model)
    if tp_mesh.device_type == "cpu" and any(STYLES[r.style].gives_dtensor_output(r.overrides())
                                            for _, r in meta["matched"].values()):
        from meshplan.tensor_parallel.cpu_attention import register_cpu_attention_rule
        register_cpu_attention_rule()  # DTensor q/k/v reach SDPA: torch 2.13 has no CPU rule for it
    if tp > 1 or plan:
        # the plan's keys are exact paths: apply each style to its module directly (handing torch the dict
        # makes parallelize_module match every key's pattern against every child of every level: O(keys x children))
        # meta parameters hold no data: skip scattering them from rank 0 (18x cheaper per parameter)
        src = None if any(p.is_meta for p in model.parameters()) else 0
        for path, style in plan.items():
            parallelize_module(modules[path] if path else model, tp_mesh, style, src_data_rank=src)
    retie(model, tied, where)
    summed = [f"{p}.{n}" if p else n for p in meta["head_norms"] for n, _ in modules[p].named_parameters()]
    summed += meta["summed_params"]  # head_params' shared parameters: each rank's heads' part of the gradient
    finalizer = finalizer_for(model, tp_mesh, section.sequence_parallel, summed, into=finalizer)
    tracked = finalizer is not None and finalizer.active
    if tracked:
        finalizer.install(model)
    return TpApplied(plan=plan, head_counts=heads, finalizer=finalizer if tracked else None,
                     rng=attach_rng(model, modules, meta, section, tp_mesh, where),
                     sequence_parallel=section.sequence_parallel)
