"""The ``expert_parallel`` section in ``meshplan check`` and in :func:`meshplan.parallelize`: checked against the
layout and the model by the same function (:func:`~meshplan.expert_parallel.apply.check_expert_parallel`), applied,
and summarised in one line::

    expert parallel: ep 2 × etp 1, edp 2 (expert gradients summed over edp, FSDP2 over edp); experts:
    layers.*.moe.experts (2 blocks, 8 experts, 4 per rank, interface sorted); router: layers.*.moe.router;
    per MoE block and step: 1 all_to_all of counts + 2 all_to_all of rows forward, 2 backward; tp 2: each tp rank
    routes its own tokens (router, shared expert summed over tp)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.expert_parallel.apply import EpApplied, MoeBlock, apply_expert_parallel, check_expert_parallel
from meshplan.plan_file.expert_parallel import ExpertParallel, ExpertsRule, RouterRule

__all__ = ["check_experts", "experts_lines", "prepare_experts", "apply_experts"]


def _needs_section(source: str | None, ep: int) -> PlanError:
    return PlanError(f"{source or '<plan>'}: layout.ep({ep}) > 1 needs an expert_parallel section (rules: experts, "
                     f"router)")


def check_experts(model: nn.Module, plan: Any, layout: Any, report: Any) -> None:
    """Validate ``plan``'s ``expert_parallel`` section for the resolved ``layout`` against ``model``; errors and the
    summary (``report.experts``) go into ``report``."""
    section = plan.expert_parallel
    where = f"{report.source}: expert_parallel"
    if section is None:
        if layout.ep > 1:
            report.errors.append(_needs_section(report.source, layout.ep))
        return
    try:
        tp_rules = plan.tensor_parallel.rules if plan.tensor_parallel is not None else None
        blocks = check_expert_parallel(model, section, layout, where, tp_rules)
        if layout.tp > 1 and plan.tensor_parallel is None:
            raise PlanError(f"{where}: layout.tp({layout.tp}) > 1 needs a tensor_parallel section (the dense "
                            f"layers' rules); without one every tp rank would compute the same tokens")
    except PlanError as e:
        report.errors.append(e)
        return
    experts = sorted({b.num_experts for b in blocks})
    report.experts = {
        "ep": layout.ep, "etp": layout.etp, "edp": layout.edp, "tp": layout.tp,
        "experts": list(section.patterns(ExpertsRule)), "router": list(section.patterns(RouterRule)),
        "blocks": len(blocks), "num_experts": experts, "per_rank": [e // layout.ep for e in experts],
        "interface": sorted({b.interface for b in blocks}),
    }


def experts_lines(experts: dict) -> list[str]:
    """The text report's line for ``report.experts`` (none without a section)."""
    if not experts:
        return []
    e = experts
    data = "summed over edp, FSDP2/DDP over edp" if e["edp"] > 1 else "edp 1: no data-parallel reduction"
    comm = ("1 all_to_all of counts + 2 all_to_all of rows (dispatch, combine) forward, 2 backward" if e["ep"] > 1
            else "no all_to_all (ep 1)")
    if e["etp"] > 1:
        tp = (f"; etp {e['etp']} = tp: each expert's FFN split over the tp group, which routes its whole token set "
              f"(1 all_reduce of the expert rows over etp forward, 1 of their gradient backward)")
    else:
        tp = (f"; tp {e['tp']}: each tp rank routes its own tokens (the block's other parameters summed over tp)"
              if e["tp"] > 1 else "")
    return [f"expert parallel: ep {e['ep']} × etp {e['etp']}, edp {e['edp']} (expert gradients {data}); experts: "
            f"{', '.join(e['experts'])} ({e['blocks']} blocks, {'/'.join(map(str, e['num_experts']))} experts, "
            f"{'/'.join(map(str, e['per_rank']))} per rank, interface {'/'.join(e['interface'])}); router: "
            f"{', '.join(e['router']) or 'none'}; per MoE block and step: {comm}{tp}"]


def prepare_experts(model: nn.Module, p: Any, topology: Any) -> tuple[ExpertParallel, tuple[MoeBlock, ...]] | None:
    """The ``expert_parallel`` section and its MoE blocks, checked on the whole model before
    :func:`meshplan.parallelize` changes anything (the pipeline split included: ``meshplan check`` checks the same
    whole model); None without a section.

    Raises:
        PlanError: ep > 1 without a section, a section on a bare ``DeviceMesh``, or what
            :func:`~meshplan.expert_parallel.apply.check_expert_parallel` refuses.
    """
    where = f"{p.source}: expert_parallel" if p.source else "expert_parallel"
    if topology is not None and topology.layout.ep > 1 and p.expert_parallel is None:
        raise _needs_section(p.source, topology.layout.ep)
    if p.expert_parallel is None:
        return None
    if topology is None:
        raise PlanError(f"{where} needs a meshplan Topology (meshplan.init or build_mesh), not a bare DeviceMesh")
    tp_rules = p.tensor_parallel.rules if p.tensor_parallel is not None else None
    return p.expert_parallel, check_expert_parallel(model, p.expert_parallel, topology.layout, where, tp_rules)


def apply_experts(model: nn.Module, p: Any, topology: Any, prepared: tuple, state: Any) -> EpApplied:
    """The experts of the prepared MoE blocks this rank still holds (a pipeline split pruned the others' layers)
    sharded over ep; ``state``: the model's record so far (its ``tensor_parallel``; its ``gradients``: the model's
    one gradient finaliser, where the tp token regions add their sums).
    """
    section, blocks = prepared
    modules = dict(model.named_modules())
    kept = tuple(b for b in blocks if b.experts in modules and not isinstance(modules[b.experts], nn.Identity))
    tensor_parallel = state.tensor_parallel if state is not None else None
    finalizer = state.gradients if state is not None else None
    return apply_expert_parallel(model, section, topology, kept, tensor_parallel, finalizer)
