"""transformers' Multi-head Latent Attention (DeepSeek V2/V3's MLA) in a meshplan plan.

transformers' tp_plan names one module of the latent path, ``kv_a_proj_with_mqa: mla_kv_a_proj``, and marks the
per-head up-projections ``q_b_proj``/``kv_b_proj`` plain ``colwise``. meshplan keeps the latent's gradient partial
(:mod:`meshplan.tensor_parallel.latent`), so the whole path gets rules, read from the model: every other
parameterised child of the attention module that no rule (or ``head_norm``, which the latent's norm may look like)
covers (``q_a_proj``, ``q_a_layernorm``, ``kv_a_layernorm``) is ``latent`` too, and every colwise child is
``latent_colwise``, which takes a latent (a plain tensor) without a collective and the block input (the parent's
converted DTensor, ``q_proj`` when ``q_lora_rank`` is None) as ``colwise`` does. :func:`latent_misfits` is the
check of the same rule.
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["latent_rules", "latent_misfits"]


def _spec(rule: Any) -> Any:
    """The style table's entry of a rule (a style name, a mapping with ``style``, a rule model), or None."""
    from meshplan.plan_file.style_semantics import SEMANTICS
    name = rule if isinstance(rule, str) else rule.get("style") if isinstance(rule, dict) else getattr(
        rule, "style", None)
    return SEMANTICS.get(name) if isinstance(name, str) else None


def _is(rule: Any, flag: str) -> bool:
    spec = _spec(rule)
    return spec is not None and getattr(spec, flag)


def _blocks(model: Any, rules: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(parent path, parent module)`` of the first module each ``latent`` rule's pattern matches."""
    from meshplan.plan_file.patterns import wildcard
    seen = set()
    patterns = {k for k, v in rules.items() if _is(v, "latent")}
    for path, _ in model.named_modules():
        if wildcard(path) in patterns and wildcard(path.rpartition(".")[0]) not in seen:
            parent = path.rpartition(".")[0]
            seen.add(wildcard(parent))
            yield parent, model.get_submodule(parent)


def latent_rules(model: Any, rules: dict[str, Any]) -> dict[str, Any]:
    """``rules`` (transformers' converted, wildcard paths) with MLA's whole latent path ruled (see the module
    docstring). Unchanged when no rule is ``latent``."""
    from meshplan.plan_file.patterns import wildcard
    out = dict(rules)
    for parent, pmod in _blocks(model, rules):
        for name, child in pmod.named_children():
            key = wildcard(f"{parent}.{name}")
            if (key not in out or _is(out[key], "on_local_heads")) and any(True for _ in child.parameters()):
                out[key] = "latent"
            elif _is(out.get(key), "column_parallel") and not _is(out[key], "latent_input"):
                out[key] = "latent_colwise"
    return out


def latent_misfits(rules: dict[str, Any]) -> list[str]:
    """The colwise children (names) of a block with latent modules that are not ``latent_colwise``: a plain
    ``colwise`` would all-reduce a latent input's gradient, which the tp sum of the latent parameters' gradients
    would then count tp times.

    ``rules``: child name → rule (or style name), for the children rules cover."""
    if not any(_is(r, "latent") for r in rules.values()):
        return []
    return [name for name, rule in rules.items() if _is(rule, "column_parallel") and not _is(rule, "latent_input")]
