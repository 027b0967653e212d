"""The ``context_parallel`` section checked: in ``meshplan check`` (:func:`check_context`) against the layout and
the model as :func:`meshplan.parallelize` checks it (:func:`prepare_context`), and summarised in one line::

    context parallel: cp 2, allgather_kv (per attention module and step: 1 all_gather of K and V over cp,
    1 reduce_scatter of dK and dV), head-tail chunks (rank r holds chunks r and 2·cp−1−r of 2·cp);
    attention: layers.*.attention (4 modules); positions: buffer freqs_cis (dim 0)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.context_parallel.apply import CpApplied, apply_context_parallel, check_context_parallel, \
    check_plan_context
from meshplan.errors import PlanError

__all__ = ["check_context", "context_lines", "prepare_context", "apply_context"]


def check_context(model: nn.Module, plan: Any, layout: Any, report: Any, graphs: str = "") -> None:
    """Validate ``plan``'s ``context_parallel`` section for ``layout`` (resolved) against ``model``; errors and the
    summary (``report.context``) go into ``report`` (``graphs``: as :func:`check_plan_context` takes it)."""
    try:
        check_plan_context(model, plan, layout.cp, layout.pp, None, graphs)
        section = plan.context_parallel
        if section is None:
            return
        resolved = check_context_parallel(model, section, None)
    except PlanError as e:
        report.errors.append(e)
        return
    if layout.cp > 1:  # the runtime's first-forward audit, on a small copy (checks/cp_audit.py)
        from meshplan.context_parallel.audit import attention_audit_errors
        where = f"{plan.source}: context_parallel" if plan.source else "context_parallel"
        report.errors += [PlanError(m) for m in attention_audit_errors(model, section.attention, layout.cp, where,
                                                                          report.warnings)]
    positions = (f"kwarg {resolved.kwarg}" if resolved.kwarg else
                 f"buffer {resolved.buffer} (dim {resolved.buffer_dim})" if resolved.buffer else "none")
    report.context = {"cp": layout.cp, "method": section.method, "load_balance": section.load_balance,
                      "attention": list(section.attention), "attention_modules": len(resolved.paths),
                      "positions": positions, **_windows(model, resolved.paths)}
    if section.method == "torch_ring":
        report.warnings.append(f"{report.source}: context_parallel.method: torch_ring runs on CUDA only (torch "
                               f"2.13); meshplan.parallelize refuses it on a CPU mesh (method: ring runs anywhere)")


def _windows(model: nn.Module, paths: tuple[str, ...]) -> dict:
    """``{"windows": {"8": 2}}`` (window in tokens → attention modules) for a model whose layers slide, else {}."""
    from meshplan.context_parallel.hf_check import layer_masks
    counts: dict[str, int] = {}
    for mask in layer_masks(model, paths).values():
        counts[str(mask.window)] = counts.get(str(mask.window), 0) + 1
    return {"windows": counts} if counts else {}


def context_lines(context: dict) -> list[str]:
    """The text report's line for ``report.context`` (none without a section)."""
    if not context:
        return []
    method = context["method"]
    cp = context["cp"]
    if method == "allgather_kv":
        method += (" (per attention module and step: 1 all_gather of K and V over cp, 1 reduce_scatter of dK, dV; "
                   "saves the whole sequence's K/V)")
    else:
        method += (f" (per attention module and step: {cp - 1} K/V hops forward, {cp - 1} K/V and {cp} dK/dV hops "
                   f"backward, each 1/{cp} of the sequence's K/V, overlapped with attention; saves 1/{cp} of K/V)")
    chunks = ("head-tail chunks (rank r holds chunks r and 2·cp−1−r of 2·cp)" if context["load_balance"]
              else "contiguous chunks (rank r holds the r-th 1/cp)")
    return [f"context parallel: cp {context['cp']}, {method}, {chunks}; attention: "
            f"{', '.join(context['attention'])} ({context['attention_modules']} modules); positions: "
            f"{context['positions']}" + "".join(f"; sliding window {w} tokens ({n} of them: each rank reads the "
                                                f"key chunks it reaches)" for w, n in context.get("windows", {}).items())]


def prepare_context(model: nn.Module, p: Any, topology: Any, graphs: str = "") -> str | None:
    """The ``context_parallel`` section checked before :func:`meshplan.parallelize` changes anything; its error
    prefix when cp > 1 (what :func:`apply_context` takes), else None (``graphs``: as :func:`check_plan_context`
    takes it)."""
    if p.context_parallel is not None and topology is None:
        raise PlanError(f"{p.source or '<plan>'}: context_parallel needs a meshplan Topology (meshplan.init or "
                        f"build_mesh), not a bare DeviceMesh")
    if topology is None:
        return None
    lay = topology.layout
    return check_plan_context(model, p, lay.cp, lay.pp, topology.dense.device_type, graphs)


def apply_context(model: nn.Module, p: Any, topology: Any, where: str) -> CpApplied:
    """The runtime installed for the plan's section (``where``: :func:`prepare_context`'s prefix)."""
    return apply_context_parallel(model, p.context_parallel, topology, where)
