"""transformers' mixture-of-experts models in a meshplan plan: the ``expert_parallel`` section from the config's
``base_model_ep_plan``, and the tensor-parallel rules that remain.

transformers shards experts two ways. Its ``base_model_tp_plan`` splits each expert over tp (``moe_tp_experts``,
``packed_colwise``/``rowwise`` on the experts' bare parameters); meshplan writes that as ``layout.etp`` = tp
(:mod:`meshplan.expert_parallel.etp`), so those entries are dropped. Its ``base_model_ep_plan`` dispatches tokens
to experts sharded over the ranks (``ep_dispatch_experts`` on the experts module, ``grouped_gemm`` on its
parameters): that is meshplan's ``experts`` style (``interface: topk``). transformers' plan names no router;
meshplan needs one per MoE block, read from the model: the one child of the experts' parent besides the experts
that holds a weight with a row per expert (itself or in a submodule: HunYuan's ``gate.wg``); among several, the
one named ``gate``/``router`` or of a ``*Router``/``*Gate`` class. A config whose ``base_model_ep_plan``
dispatches experts while its tp_plan shards none (gpt-oss) is an MoE model too. A config with no
``base_model_ep_plan`` (Llama 4, LongCat-Flash) gets an ``experts`` rule on each module its tp_plan rules
``moe_tp_experts``, the interface read from the module's forward. Torch-free apart from the model passed in.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import PlanError
from meshplan.hf.styles import HF_UNSUPPORTED, resolve_alias
from meshplan.plan_file.tensor_parallel import STYLE_NAMES

__all__ = ["expert_rules", "experts_present", "layer_blocks", "outside_blocks", "has_ep_plan", "is_moe_plan", "MOE_STYLES", "EP_STYLES"]

MOE_STYLES = {k for k, why in HF_UNSUPPORTED.items() if "expert" in why}


def is_moe_plan(hf_rules: dict[str, str]) -> bool:
    """Does a transformers tp_plan shard experts (an MoE model)?"""
    return any(v in MOE_STYLES for v in hf_rules.values())


def has_ep_plan(config: Any) -> bool:
    """Does the config's ``base_model_ep_plan`` dispatch experts (gpt-oss: its tp_plan shards only the embedding)?"""
    return "ep_dispatch_experts" in (getattr(config, "base_model_ep_plan", None) or {}).values()


def experts_present(model: Any, config: Any, prefix: str, hf_rules: dict[str, Any]) -> bool:
    """Does the model built from this config hold a module that the tp_plan's expert entries or the
    ``base_model_ep_plan``'s ``ep_dispatch_experts`` name? (Gemma 4 ships both plans, but its experts exist only
    with ``enable_moe_block``; without them the model is dense.)"""
    from meshplan.plan_file.patterns import match_rules
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    named = [prefix + k for k, v in ep_plan.items() if v == "ep_dispatch_experts"]
    named += [k for k, v in hf_rules.items() if v in MOE_STYLES]
    return any(match_rules(model, {k: k}, "", errors=[]) for k in named)


def _routes(child: Any, experts: int) -> bool:
    """Does ``child`` hold a weight with one row (or column) per expert, itself or in a submodule (HunYuan's
    ``gate.wg``)?"""
    return any(p.ndim == 2 and experts in p.shape for p in child.parameters())


def _wider_router(parent: Any, block: str, experts: str, count: int) -> list[str]:
    """The block's child named ``gate``/``router`` (or of a ``*Router``/``*Gate`` class) whose ``[n, dim]`` weight
    scores more than the ``count`` routed experts: Inkling's ``gate.weight`` also scores its shared experts
    (``[routed + shared, hidden]``)."""
    return [n for n, c in parent.named_children() if f"{block}.{n}" != experts
            and (n in ("gate", "router") or type(c).__name__.endswith(("Router", "Gate")))
            and any(p.ndim == 2 and p.shape[0] > count for p in c.parameters(recurse=False))]


def _router(model: Any, block: str, experts: str, count: int, model_type: str) -> str:
    """The block's one router, as :func:`meshplan.expert_parallel.apply.check_expert_parallel` accepts it: the
    block's one child besides the experts holding an ``[E, …]`` weight, or, among several, the one named
    ``gate``/``router`` or of a ``*Router``/``*Gate`` class."""
    from meshplan.plan_file.patterns import wildcard
    parent = model.get_submodule(block)
    found = [n for n, c in parent.named_children() if f"{block}.{n}" != experts and _routes(c, count)]
    if len(found) > 1:
        named = [n for n in found if n in ("gate", "router") or
                 type(parent.get_submodule(n)).__name__.endswith(("Router", "Gate"))]
        found = named if named else found
    found = found or _wider_router(parent, block, experts, count)
    if len(found) != 1:
        raise PlanError(f"{model_type}: MoE block {block} has {len(found)} router candidates {found}; expected one "
                        f"child besides {experts} holding a weight with {count} (the expert count) rows: write the "
                        f"expert_parallel rules by hand")
    return wildcard(f"{block}.{found[0]}")


def _derived_experts(model: Any, tp_rules: dict[str, Any], model_type: str) -> dict[str, str]:
    """The ``experts`` rules of a model whose config has no ``base_model_ep_plan`` (Llama 4, LongCat-Flash): the
    modules its tp_plan shards as ``moe_tp_experts``, each ruled ``experts`` with the interface read from its
    forward's signature (Llama 4's ``forward(x)``: ``dense``; LongCat's ``forward(hidden, top_k_index,
    top_k_weights)``: ``topk``).

    Raises:
        PlanError: the tp_plan names no experts module that this model holds.
    """
    from meshplan.plan_file.patterns import match_rules
    found = {k: "experts" for k, v in tp_rules.items()
             if v == "moe_tp_experts" and match_rules(model, {k: k}, "", errors=[])}
    if not found:
        raise PlanError(f"{model_type}: the tp_plan shards experts but names no experts module (moe_tp_experts) of "
                        f"this model, and the config has no base_model_ep_plan with ep_dispatch_experts; write the "
                        f"expert_parallel rules by hand (style: experts, router)")
    return found


#: transformers' ep styles meshplan's expert_parallel section holds (grouped_gemm: the experts' own parameters)
EP_STYLES = ("ep_dispatch_experts", "ep_router", "grouped_gemm")


def _ep_entries(model: Any, ep_plan: dict[str, str], prefix: str, tp_rules: dict[str, Any],
                model_type: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``(expert entries, tensor-parallel rules)`` of a ``base_model_ep_plan`` (full paths).

    transformers' ep plan may hold tp styles for the dense parts beside the experts (Gemma 4: ``mlp.gate_proj:
    colwise``, run over the same ranks); they mean what they mean in a tp_plan. Those the tp_plan already rules are
    left to it, those inside an experts module (MuseSpark's ``experts.post_expert_norm:
    replicated_with_grad_allreduce``: a weight shared by the experts, its gradient summed) to the experts rule,
    which keeps them whole; the rest become tensor-parallel rules.

    Raises:
        PlanError: a style that is neither an ep style nor a transformers tp style meshplan maps.
    """
    from meshplan.plan_file.patterns import match_rules
    ep = {prefix + k: v for k, v in ep_plan.items() if v in EP_STYLES and v != "grouped_gemm"}
    experts = tuple(k + "." for k, v in ep.items() if v == "ep_dispatch_experts")
    dense: dict[str, Any] = {}
    for key, style in ep_plan.items():
        path = prefix + key
        if style in EP_STYLES or path in tp_rules or path.startswith(experts):
            continue
        try:
            data = resolve_alias(style)
        except ValueError as e:
            raise PlanError(f"{model_type}: base_model_ep_plan rule {key!r}: {e} (meshplan maps "
                            f"{', '.join(EP_STYLES)} and transformers' tp styles)") from None
        if data["style"] not in STYLE_NAMES:
            raise PlanError(f"{model_type}: base_model_ep_plan rule {key!r}: transformers style {style!r} has no "
                            f"meshplan equivalent (meshplan maps {', '.join(EP_STYLES)} and transformers' tp styles)")
        if match_rules(model, {path: path}, "", errors=[]):
            dense[path] = data["style"] if len(data) == 1 else data
    return ep, dense


def layer_blocks(model: Any, ep_rules: dict[str, Any]) -> bool:
    """Are the MoE blocks whole layers (the experts' parent an element of a layer list: Gemma 4's decoder layer)?
    Such a block mixes tokens, so under tp its experts split over etp = tp (:mod:`meshplan.expert_parallel.region`)."""
    from meshplan.plan_file.patterns import match_rules
    experts = {k: k for k, v in ep_rules.items() if v in ("ep_dispatch_experts", "experts")}
    found = match_rules(model, experts, "base_model_ep_plan", errors=[]) if experts else {}
    return any(p.rpartition(".")[0].rpartition(".")[2].isdigit() for p in found)


def outside_blocks(model: Any, ep_rules: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
    """``rules`` without those inside an MoE block's token region (read from ``ep_rules``' experts): the
    structure's norm rules too (DiffusionGemma's MoE block is the whole decoder layer, its norms inside)."""
    from meshplan.plan_file.expert_parallel import token_region_of
    from meshplan.plan_file.patterns import match_rules
    experts = {k: k for k, v in ep_rules.items() if v in ("ep_dispatch_experts", "experts")}
    found = match_rules(model, experts, "base_model_ep_plan", errors=[]) if experts else {}
    inside = tuple(r + "." for r in set(token_region_of({p.rpartition(".")[0] for p in found}).values()))
    out = {}
    for key, rule in rules.items():
        hits = match_rules(model, {key: key}, "", errors=[])
        if not inside or not hits or not any(h.startswith(inside) or h + "." in inside for h in hits):
            out[key] = rule
    return out


def expert_rules(model: Any, config: Any, prefix: str, tp_rules: dict[str, Any],
                 model_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensor-parallel rules without the experts' entries, expert_parallel rules)`` for an MoE model.

    Args:
        model: a small meta-device instance (module paths). config: its transformers config.
        prefix: the base model's path prefix (``"model."``). tp_rules: the converted tp rules (full paths).

    Raises:
        PlanError: neither a ``base_model_ep_plan`` nor a ``moe_tp_experts`` module, an ep style meshplan does not
            know, or no single router per block.
    """
    from meshplan.plan_file.patterns import match_rules
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    rules, dense = _ep_entries(model, ep_plan, prefix, tp_rules, model_type)
    tp_rules = {**tp_rules, **dense}
    if not any(v == "ep_dispatch_experts" for v in rules.values()):
        rules = {**_derived_experts(model, tp_rules, model_type), **rules}
    experts = [k for k, v in rules.items() if v in ("ep_dispatch_experts", "experts")]
    blocks = set()
    for pattern in experts:
        for path in match_rules(model, {pattern: pattern}, "base_model_ep_plan", errors=[]):
            module = model.get_submodule(path)
            count = next(p.shape[0] for p in module.parameters())
            blocks.add((path.rpartition(".")[0], path, count))
    if not any(v == "ep_router" for v in rules.values()):
        rules.update({_router(model, b, e, n, model_type): "ep_router" for b, e, n in sorted(blocks)})
    from meshplan.plan_file.expert_parallel import token_region_of
    inside = tuple(r + "." for r in set(token_region_of({b for b, _, _ in blocks}).values()))
    kept = {}
    for key, rule in tp_rules.items():
        style = rule if isinstance(rule, str) else rule.get("style")
        hits = match_rules(model, {key: key}, "", errors=[]) if style not in MOE_STYLES else {}
        if hits and not any(h.startswith(inside) or h + "." in inside for h in hits):
            kept[key] = rule  # dense layers' rules; experts' entries and rules inside MoE blocks are dropped
    return kept, rules
