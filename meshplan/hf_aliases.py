"""Hugging Face ``tp_plan`` style strings as aliases of meshplan styles."""

from __future__ import annotations

from typing import Any

__all__ = ["resolve_alias", "HF_ALIASES"]

#: transformers' tp_plan strings (every generation) → a meshplan rule mapping
HF_ALIASES: dict[str, dict[str, Any]] = {
    "colwise": {"style": "colwise"},
    "rowwise": {"style": "rowwise"},
    "local_colwise": {"style": "colwise"},
    "local_rowwise": {"style": "rowwise"},
    "colwise_rep": {"style": "colwise", "output_layouts": "replicate"},
    "colwise_gather_output": {"style": "colwise", "output_layouts": "replicate"},
    "rowwise_rep": {"style": "rowwise", "input_layouts": "replicate"},
    "embedding_rowwise": {"style": "embedding"},
    "sequence_parallel": {"style": "norm"},
    "replicate": {"style": "replicate"},
    "gather": {"style": "prepare_output", "output_layouts": "partial", "desired_output_layouts": "replicate"},
}

_MESHPLAN = ("colwise", "rowwise", "norm", "embedding", "embedding_colwise", "embedding_tables", "lm_head",
             "replicate", "prepare_input", "prepare_output")


def resolve_alias(name: str) -> dict[str, Any]:
    """A style name (meshplan's or an HF alias) → a rule mapping; unknown names pass through for the
    discriminated union to reject with the list of valid styles."""
    key = name.strip()
    if key in _MESHPLAN:
        return {"style": key}
    if key in HF_ALIASES:
        return dict(HF_ALIASES[key])
    return {"style": key}
