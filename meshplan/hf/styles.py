"""Hugging Face ``tp_plan`` style strings as aliases of meshplan styles, both ways.

The alias table (:data:`HF_ALIASES`, :data:`HF_UNSUPPORTED`) and :func:`resolve_alias` live in the plan layer
(:mod:`meshplan.plan_file.hf_aliases`, which plan loading reads; it says which transformers names map to what) and
are re-exported here; this module adds the way back (:func:`to_hf_style`, which reads the style table) and
transformers' loss on sharded logits. It imports no torch at module level.
"""

from __future__ import annotations

from typing import Any

from meshplan.plan_file.hf_aliases import HF_ALIASES, HF_UNSUPPORTED, resolve_alias  # the table, torch-free

__all__ = ["resolve_alias", "HF_ALIASES", "HF_UNSUPPORTED", "to_hf_style", "hf_rule_free", "install_hf_loss",
           "labels_shifted"]


def to_hf_style(rule: Any, pattern: str | None = None) -> str:
    """The transformers tp_plan string closest to a meshplan rule (``style`` plus overrides).

    Args:
        rule: a validated rule (``meshplan.plan_file.tensor_parallel`` model) or a mapping with a ``style`` key.
        pattern: the rule's module-path pattern. MLA's latent is ``mla_kv_a_proj`` on ``kv_a_proj_with_mqa`` only;
            transformers runs the other latent modules with no rule.

    Raises:
        ValueError: the rule has no transformers equivalent (e.g. ``embedding_tables``).
    """
    from meshplan.plan_file.style_semantics import SEMANTICS  # the spelling is part of a style's meaning
    data = rule if isinstance(rule, dict) else rule.model_dump(exclude_none=True)
    style, packed = data["style"], data.get("packed") or 1
    if packed > 2:
        raise ValueError(f"packed: {packed} has no transformers equivalent (its packed styles split 2 ways)")
    spec = SEMANTICS.get(style)
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
    from meshplan.plan_file.style_semantics import SEMANTICS
    style = rule.get("style") if isinstance(rule, dict) else rule.style
    spec = SEMANTICS.get(style)
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
