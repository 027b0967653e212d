"""transformers' ``tp_plan`` style strings as aliases of meshplan styles: the torch-free table plan loading reads.

transformers has renamed its tensor-parallel styles three times (4.50's
``local_colwise``/``gather``/``local_packed_rowwise``, 4.54's
``colwise_gather_output``/``packed_colwise``/``embedding_rowwise``, 5.x's
``rowwise_split_input``/``replicated_with_grad_allreduce`` and the proposed
``{kind}_{comm}`` names such as ``rowwise_reduce_scatter``). A plan file may
use any of them wherever a meshplan style name is expected; :data:`HF_ALIASES`
says what each becomes. Strings that name parameter-level or MoE styles, which
meshplan does not express, are in :data:`HF_UNSUPPORTED` with the reason: they
are rejected with that reason instead of "unknown style".

The plan layer (:mod:`meshplan.plan_file.tensor_parallel`) reads this table; the way back (a meshplan rule →
a transformers string, which needs the style table) lives in :mod:`meshplan.hf.styles`, above it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["resolve_alias", "HF_ALIASES", "HF_UNSUPPORTED"]

_REP = "replicate"

#: transformers' tp_plan strings (every generation) → a meshplan rule mapping
HF_ALIASES: dict[str, dict[str, Any]] = {
    # column-parallel (the "local_" variants of 4.50 only differed in returning plain tensors,
    # which meshplan's colwise does by default)
    "colwise": {"style": "colwise"},
    "local_colwise": {"style": "colwise"},
    "colwise_rep": {"style": "colwise", "output_layouts": _REP},
    "colwise_gather_output": {"style": "colwise", "output_layouts": _REP},
    "colwise_allgather": {"style": "colwise", "output_layouts": _REP},
    "colwise_loss_parallel": {"style": "lm_head"},
    # row-parallel
    "rowwise": {"style": "rowwise"},
    "local_rowwise": {"style": "rowwise"},
    "rowwise_output_dtensor": {"style": "rowwise"},
    "rowwise_allreduce": {"style": "rowwise"},
    "rowwise_reduce_scatter": {"style": "rowwise"},
    "rowwise_rep": {"style": "rowwise", "input_layouts": _REP},
    "rowwise_split_input": {"style": "rowwise", "input_layouts": _REP},
    # fused (packed) weights: HF's packed styles split 2 ways (gate_up); set `packed: k` for others
    "packed_colwise": {"style": "colwise", "packed": 2},
    "local_packed_colwise": {"style": "colwise", "packed": 2},
    "packed_rowwise": {"style": "rowwise", "packed": 2},
    "local_packed_rowwise": {"style": "rowwise", "packed": 2},
    # embeddings
    "embedding_rowwise": {"style": "embedding"},
    "vocab_allreduce": {"style": "embedding"},
    "vocab_reduce_scatter": {"style": "embedding"},
    # sequence-parallel norms / dropouts
    "sequence_parallel": {"style": "norm"},
    "activation": {"style": "norm"},
    # whole-module replicas: HF's `local`/`isolated` run the module on every rank
    "replicate": {"style": "replicate"},
    "local": {"style": "replicate"},
    "isolated": {"style": "replicate"},
    # a replicated module fed by local head shards (Qwen3/Gemma3 q_norm, k_norm): grads summed over tp
    "replicated_with_grad_allreduce": {"style": "head_norm"},
    # DeepSeek MLA's latent kv_a_proj_with_mqa (from_hf adds its latent siblings and latent_colwise up-projections)
    "mla_kv_a_proj": {"style": "latent"},
    # a module whose own parameters belong to its local heads (attention sinks): the parameter entries
    # ('self_attn.sinks: colwise') are merged into it by meshplan.hf.convert.from_hf as `sharded: [sinks]`
    "local_params": {"style": "head_params"},
    # all-reduce a module's partial output
    "gather": {"style": "prepare_output", "output_layouts": "partial", "desired_output_layouts": _REP},
    "all_reduce": {"style": "prepare_output", "output_layouts": "partial", "desired_output_layouts": _REP},
    "all_reduce_output": {"style": "prepare_output", "output_layouts": "partial", "desired_output_layouts": _REP},
}

_MOE = ("it shards experts, which meshplan writes in the expert_parallel section (meshplan.hf.from_hf(model_type, "
        "ep=N) converts a model's base_model_ep_plan), not as a tensor_parallel rule")
#: transformers strings meshplan rejects, with the reason
HF_UNSUPPORTED: dict[str, str] = {
    "grouped_gemm": _MOE, "ep_router": _MOE, "moe_tp_experts": _MOE, "megamoe_router": _MOE,
    "megamoe_experts": _MOE, "moe_identity_expert": _MOE, "ep_dispatch_experts": _MOE,
    "moe_tp_gate_up_colwise": _MOE, "moe_tp_down_rowwise": _MOE,
    "activation_seq_dim_2": "meshplan's sequence-parallel stream shards dim 1",
    "keep_full_weight": "it is an FSDP plan string, not a tensor-parallel style",
    "free_full_weight": "it is an FSDP plan string, not a tensor-parallel style",
}


def resolve_alias(name: str) -> dict[str, Any]:
    """A style name (meshplan's or an HF alias) → a rule mapping.

    Unknown names pass through for the plan's discriminated union to reject with
    the list of valid styles.

    Raises:
        ValueError: ``name`` is an HF style meshplan cannot express (the message says why).
    """
    key = name.strip()  # a meshplan name that is also a transformers string (colwise, …) maps to itself
    if key in HF_ALIASES:
        return dict(HF_ALIASES[key])
    if key in HF_UNSUPPORTED:
        raise ValueError(f"transformers style {key!r} is not supported: {HF_UNSUPPORTED[key]}")
    return {"style": key}
