"""Hugging Face ``tp_plan`` style strings as aliases of meshplan styles.

transformers has renamed its tensor-parallel styles three times (4.50's
``local_colwise``/``gather``/``local_packed_rowwise``, 4.54's
``colwise_gather_output``/``packed_colwise``/``embedding_rowwise``, 5.x's
``rowwise_split_input``/``replicated_with_grad_allreduce`` and the proposed
``{kind}_{comm}`` names such as ``rowwise_reduce_scatter``). A plan file may
use any of them wherever a meshplan style name is expected; :data:`HF_ALIASES`
says what each becomes. Strings that name parameter-level or MoE styles, which
meshplan does not express, are in :data:`HF_UNSUPPORTED` with the reason: they
are rejected with that reason instead of "unknown style".

This module is torch-free (plan loading imports it).
"""

from __future__ import annotations

from typing import Any

from meshplan.plan_file.tensor_parallel import STYLE_NAMES

__all__ = ["resolve_alias", "HF_ALIASES", "HF_UNSUPPORTED", "to_hf_style", "hf_rule_free", "install_hf_loss",
           "labels_shifted"]

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
    key = name.strip()
    if key in STYLE_NAMES:
        return {"style": key}
    if key in HF_ALIASES:
        return dict(HF_ALIASES[key])
    if key in HF_UNSUPPORTED:
        raise ValueError(f"transformers style {key!r} is not supported: {HF_UNSUPPORTED[key]}")
    return {"style": key}


def to_hf_style(rule: Any, pattern: str | None = None) -> str:
    """The transformers tp_plan string closest to a meshplan rule (``style`` plus overrides).

    Args:
        rule: a validated rule (``meshplan.plan_file.tensor_parallel`` model) or a mapping with a ``style`` key.
        pattern: the rule's module-path pattern. MLA's latent is ``mla_kv_a_proj`` on ``kv_a_proj_with_mqa`` only;
            transformers runs the other latent modules with no rule.

    Raises:
        ValueError: the rule has no transformers equivalent (e.g. ``embedding_tables``).
    """
    from meshplan.tensor_parallel.style_table import STYLES  # the spelling is part of a style's meaning
    data = rule if isinstance(rule, dict) else rule.model_dump(exclude_none=True)
    style, packed = data["style"], data.get("packed") or 1
    if packed > 2:
        raise ValueError(f"packed: {packed} has no transformers equivalent (its packed styles split 2 ways)")
    spec = STYLES.get(style)
    name = spec.hf_style(data) if spec is not None else None
    if name is None:
        raise ValueError(f"meshplan style {style!r} has no transformers tp_plan equivalent")
    if hf_rule_free(rule, pattern):
        raise ValueError(f"transformers runs MLA's latent modules other than kv_a_proj_with_mqa ({name}) with no "
                         f"rule (its colwise up-projections all-reduce their input gradients)")
    return name


def hf_rule_free(rule: Any, pattern: str | None) -> bool:
    """Does transformers run the module of this rule with no tp_plan entry? MLA's latent modules but
    ``kv_a_proj_with_mqa`` (``q_a_proj``, the norms): :func:`to_hf_style` has no string for them."""
    from meshplan.tensor_parallel.style_table import STYLES
    style = rule.get("style") if isinstance(rule, dict) else rule.style
    spec = STYLES.get(style)
    return spec is not None and spec.latent and (pattern or "").rpartition(".")[2] != "kv_a_proj_with_mqa"


def install_hf_loss(model: Any, section: Any) -> bool:
    """Make a transformers model's own loss (``model(input_ids, labels=…)``) work on vocab-sharded logits.

    With ``loss_parallel`` the lm_head returns a vocab-sharded DTensor, which
    transformers' ``F.cross_entropy`` cannot take. The model's ``loss_function``
    is wrapped: the causal-LM loss (``ForCausalLMLoss``: shift, ``ignore_index``,
    ``num_items_in_batch``) runs :func:`meshplan.cross_entropy` on the shards;
    any other loss on sharded logits raises a :class:`~meshplan.PlanError`
    naming ``meshplan.cross_entropy``. Plain logits go to the original loss.

    Returns:
        Whether a wrapper was installed (transformers model with ``loss_parallel``).
    """
    if section is None or not section.loss_parallel or not isinstance(
            getattr(type(model), "loss_function", None), property):
        return False
    original = model.loss_function
    causal = getattr(original, "__name__", "") == "ForCausalLMLoss"

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        import torch
        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor

        from meshplan.errors import PlanError
        from meshplan.training.loss import cross_entropy
        if not isinstance(logits, DTensor):
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if not causal:
            raise PlanError(f"{type(model).__name__}: its loss {getattr(original, '__name__', original)!r} got "
                            f"vocab-sharded logits (tensor_parallel.loss_parallel: true); compute the loss with "
                            f"meshplan.cross_entropy(logits, labels) or set loss_parallel: false")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        # transformers' .float(): half precisions up to float32 (a float32 loss), float64 kept (not cast down)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = cross_entropy(logits, shift_labels.to(logits.device), ignore_index=ignore_index,
                             reduction=reduction)
        return loss / num_items_in_batch if reduction == "sum" else loss

    loss_function.causal = causal  # type: ignore[attr-defined]  (read by labels_shifted)
    model.loss_function = loss_function
    return True


def labels_shifted(model: Any) -> bool:
    """Does ``model``'s own loss shift its labels (transformers' causal-LM loss: the first label of each row is
    no target)? :func:`meshplan.train_step` counts the tokens the same way."""
    if "loss_function" not in getattr(model, "__dict__", {}) and not isinstance(
            getattr(type(model), "loss_function", None), property):
        return False
    fn = model.loss_function
    return bool(getattr(fn, "causal", False)) or getattr(fn, "__name__", "") == "ForCausalLMLoss"
