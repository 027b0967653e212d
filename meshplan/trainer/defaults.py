"""The plan sections a transformers model gets when the plan leaves them out: ``meshplan train`` needs only a
layout. Each filled section is said in one line (rank 0), and ``meshplan convert --from hf`` writes the same rules
into a file to edit.

- ``tensor_parallel`` and ``blocks``: from transformers' own ``tp_plan`` (:func:`meshplan.hf.convert.from_hf`);
- ``pipeline`` (pp > 1): the ``1f1b`` schedule with ``max(2·pp, training.microbatches)`` microbatches;
- ``context_parallel`` (cp > 1): the blocks' ``self_attn`` modules, positions from ``position_ids``;
- ``layout`` (none given): data parallelism over every process.
"""

from __future__ import annotations

import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.plan_file.patterns import path_matches

__all__ = ["fill_plan"]


def _has(model: nn.Module, pattern: str) -> bool:
    return any(path_matches(pattern, name) for name, _ in model.named_modules())


def fill_plan(plan: Plan, model: nn.Module, config_dir: str | None) -> tuple[Plan, list[str]]:
    """``plan`` with the sections it lacks filled for ``model``, and one line per filled section.

    Args:
        plan: the plan (its layout decides which sections are needed).
        model: the meta-device model (its module paths).
        config_dir: the transformers folder or config.json the model came from, or None (not transformers: only
            ``pipeline`` is filled).

    Raises:
        PlanError: tp > 1 without rules for a model transformers has no plan for (naming what to write).
    """
    data = plan.model_dump(mode="json", exclude_unset=True)
    lay = plan.layout
    said: list[str] = []
    if lay is None:
        data["layout"] = {}
        said.append("plan: no layout: data parallelism over every process (dp_shard inferred)")
    tp, pp, cp = (getattr(lay, k, 1) if lay is not None else 1 for k in ("tp", "pp", "cp"))
    if config_dir is not None and "tensor_parallel" not in data and (tp > 1 or cp > 1 or pp > 1):
        from meshplan.hf.convert import from_hf
        hf = from_hf(config_dir, tp=None)
        data["tensor_parallel"] = hf["tensor_parallel"]
        said.append(f"plan: tensor_parallel rules from {hf['_origin']}")
        if "blocks" not in data and "blocks" in hf:
            data["blocks"] = hf["blocks"]
            said.append(f"plan: blocks {hf['blocks']['pattern']} (the model's repeated blocks)")
    if pp > 1 and "pipeline" not in data:
        micro = max(2 * pp, plan.training.microbatches if plan.training else 1)
        data["pipeline"] = {"schedule": "1f1b", "microbatches": micro}
        said.append(f"plan: pipeline 1f1b with {micro} microbatches")
    if cp > 1 and "context_parallel" not in data:
        blocks = (data.get("blocks") or {}).get("pattern")
        attention = f"{blocks}.self_attn" if blocks else None
        if attention is None or not _has(model, attention):
            raise PlanError(f"{plan.source or '<plan>'}: layout.cp is {cp} but the plan has no context_parallel "
                            f"section and the model has no {attention or '<blocks>.self_attn'} modules; write "
                            f"context_parallel.attention (see plans/hf_llama_cp.yaml)")
        data["context_parallel"] = {"attention": attention}
        said.append(f"plan: context_parallel over {attention} (positions from position_ids)")
    if not said:
        return plan, said
    return Plan.from_data(data, source=plan.source), said
