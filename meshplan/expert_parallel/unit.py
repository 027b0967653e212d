"""Expert parallelism as a unit: :data:`AXIS`, the one value the rest of meshplan reaches it through.

Torch-free (the solver imports it): each callable imports this folder's torch code when called.
"""

from __future__ import annotations

from typing import Any

from meshplan.axis import Axis, TpExempt
from meshplan.expert_parallel.costs import TERMS

__all__ = ["AXIS"]


def _check(model: Any, plan: Any, layout: Any, report: Any) -> None:
    from meshplan.expert_parallel.check import check_experts
    check_experts(model, plan, layout, report)


def _prepare(model: Any, plan: Any, topology: Any) -> Any:
    from meshplan.expert_parallel.check import prepare_experts
    return prepare_experts(model, plan, topology)


def _apply(model: Any, plan: Any, topology: Any, prepared: Any, state: Any) -> Any:
    from meshplan.expert_parallel.check import apply_experts
    return apply_experts(model, plan, topology, prepared, state)


def _shard_batch(state: Any, inputs: Any, targets: Any, shift: bool = False,
                 ignore_index: int = -100) -> tuple[Any, Any, bool]:
    """Every ep rank takes its own batch (ep ranks are data ranks of the dense layers): nothing to cut here."""
    return inputs, targets, shift


def _report_lines(summary: dict) -> list[str]:
    from meshplan.expert_parallel.check import experts_lines
    return experts_lines(summary)


def _data_parallel(layout: Any) -> bool:
    """Expert gradients are summed over ``edp`` (the data-parallel step runs for them)."""
    return layout.edp > 1


def _blocks_reason(plan: Any, layout: Any) -> str:
    """Expert gradients summed over ``edp`` by the data-parallel step, which wraps each block."""
    if layout is not None and plan.expert_parallel is not None and layout.edp > 1:
        return f"expert gradients are summed over edp({layout.edp}) by FSDP2/DDP, which wraps each block"
    return ""


def _opaque(model: Any, plan: Any) -> set:
    """The MoE blocks (token regions): routing is data-dependent, with all-to-alls of its own."""
    from meshplan.expert_parallel.apply import moe_blocks
    return moe_blocks(model, plan.expert_parallel)


def _data_shard(model: Any, state: Any, topology: Any, mode: str, policies: dict, reshard: Any) -> None:
    """The expert-sharded modules, data-parallel over ``edp`` on their own (before the dense blocks and roots, which
    then leave their parameters alone): :func:`~meshplan.expert_parallel.edp.shard_experts`."""
    from meshplan.expert_parallel.edp import shard_experts
    modules = [model.get_submodule(b.experts) for b in state.expert_parallel.blocks]
    shard_experts(modules, topology["edp"], mode, policies, reshard)


def _tp_exempt(model: Any, plan: Any, summary: dict) -> TpExempt | None:
    """The experts (sharded over ep, whole over tp) and the MoE blocks (run on each tp rank's own tokens)."""
    if plan.expert_parallel is None:
        return None
    from meshplan.expert_parallel.apply import expert_modules
    experts = expert_modules(model, plan.expert_parallel)
    return TpExempt(modules=frozenset(experts), degree=summary.get("ep", 1),
                    regions=tuple(p.rpartition(".")[0] + "." for p in experts),
                    module_reason="experts: whole on every tp rank (etp 1), ep 1",
                    region_reason="in an MoE block: each tp rank routes its own tokens; gradients summed over tp")


def _rank_share(plan: Any, coords: dict, sizes: dict, shape: Any, modules: list) -> dict | None:
    """The experts the rank holds: rank ``r`` of ``ep``, experts ``r·E/ep … (r+1)·E/ep − 1``, in ``modules``."""
    ep, r = sizes.get("ep", 1), coords.get("ep", 0)
    if ep <= 1 or shape is None or not shape.experts:
        return None
    k = shape.experts // ep
    return {"text": f"experts {r * k}-{(r + 1) * k - 1} of {shape.experts} (ep rank {r} of {ep}) in "
                    f"{len(modules)} modules", "label": "", "cells": [],
            "data": {"first": r * k, "last": (r + 1) * k - 1, "of": shape.experts, "rank": r, "degree": ep,
                     "modules": modules}}


#: expert parallelism: MoE experts split over ``ep`` (their FFN over ``etp``), tokens dispatched by all-to-all
AXIS = Axis(name="ep", section="expert_parallel", title="expert parallelism", mesh_dims=("ep", "etp"),
            state_field="expert_parallel", report_key="experts", check=_check, prepare=_prepare, apply=_apply,
            shard_batch=_shard_batch, report_lines=_report_lines,
            terms=TERMS, data_parallel=_data_parallel,
            opaque=_opaque, dtensor=True, blocks_reason=_blocks_reason, data_shard=_data_shard, rank_share=_rank_share,
            tp_exempt=_tp_exempt, token_regions=_opaque)
