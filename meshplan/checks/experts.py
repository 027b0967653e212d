"""The ``expert_parallel`` section in ``meshplan check``: checked against the layout and the model as
:func:`meshplan.parallelize` checks it, and summarised in one line::

    expert parallel: ep 2 × etp 1, edp 2 (expert gradients summed over edp, FSDP2 over edp); experts:
    layers.*.moe.experts (2 blocks, 8 experts, 4 per rank, interface sorted); router: layers.*.moe.router;
    per MoE block and step: 1 all_to_all of counts + 2 all_to_all of rows forward, 2 backward; tp 2: each tp rank
    routes its own tokens (router, shared expert summed over tp)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.expert_parallel.apply import check_expert_parallel
from meshplan.plan_file.expert_parallel import ExpertsRule, RouterRule

__all__ = ["check_experts", "experts_lines"]


def check_experts(model: nn.Module, plan: Any, layout: Any, report: Any) -> None:
    """Validate ``plan``'s ``expert_parallel`` section for the resolved ``layout`` against ``model``; errors and the
    summary (``report.experts``) go into ``report``."""
    section = plan.expert_parallel
    where = f"{report.source}: expert_parallel"
    if section is None:
        if layout.ep > 1:
            report.errors.append(PlanError(f"{report.source}: layout.ep({layout.ep}) > 1 needs an expert_parallel "
                                           f"section (rules: experts, router)"))
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
