"""Convert transformers ``tp_plan``\\ s to meshplan plans, and back; offline.

``from_hf("llama")`` (a model type, a ``config.json`` path or a directory
holding one) reads the plan transformers ships with the model class, with no
download: the config class's ``base_model_tp_plan`` (paths relative to the base
model, so prefixed with the class's ``base_model_prefix``) plus the task
class's ``_tp_plan`` (``lm_head``). HF plans shard only the linear layers; the
meshplan plan adds what sequence and loss parallelism need, read from the model
structure (built on the meta device from a copy of the config shrunk by :mod:`meshplan.hf.tiny_config`, every layer kind kept): the
input embedding (``embedding``), every norm on the residual stream (``norm``),
the output embedding (``lm_head``) and, beside colwise projections, per-head norms and scalar-parameter
activations that transformers' plan leaves out (``head_norm``). Models transformers ships no plan for
use :data:`BUILTIN` (GPT-2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshplan.errors import PlanError
from meshplan.hf.structure import own_inputs, param_entries, per_head_rowwise, present, structure_rules
from meshplan.hf.styles import hf_rule_free, resolve_alias, to_hf_style

__all__ = ["from_hf", "to_hf", "plan_yaml", "BUILTIN"]

#: meshplan rules for causal-LM model types transformers ships no tp_plan for (full module paths)
BUILTIN: dict[str, dict[str, Any]] = {
    "gpt2": {
        "transformer.wte": "embedding",
        "transformer.wpe": "embedding",
        "transformer.drop": "norm",
        "transformer.h.*.ln_1": "norm",
        "transformer.h.*.attn.c_attn": {"style": "colwise", "packed": 3},
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.attn.resid_dropout": "norm",
        "transformer.h.*.ln_2": "norm",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.h.*.mlp.dropout": "norm",
        "transformer.ln_f": "norm",
        "lm_head": "lm_head",
    },
}


def _config(source: str | Path):
    import transformers
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise PlanError(f"{path}: no such config file")
        from meshplan.plan_file.reading import read_json
        data = read_json(path, "transformers config.json")  # bounded: a regular file of at most 4 MiB
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected a JSON object (a transformers config), got {type(data).__name__}")
        model_type = data.pop("model_type", None)
        if not model_type:
            raise PlanError(f"{path}: has no model_type")
        archs = data.get("architectures") or []
    else:
        model_type, data, archs = str(source), {}, []
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except ValueError:
        raise PlanError(f"unknown transformers model type {model_type!r} (from {source})") from None
    return config, model_type, archs


def _model_class(config, model_type: str, archs: list[str]):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = next((a for a in archs if hasattr(transformers, a)), None) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise PlanError(f"model type {model_type!r} has no causal-LM class in transformers; pass a config.json whose "
                        f"'architectures' names one")
    return getattr(transformers, name)


def _class_config(cls, config):
    """The config ``cls`` is built from: a composite config's text part where the causal-LM class takes that
    (``llama4``: Llama4ForCausalLM takes Llama4TextConfig, whose tp_plan is the language model's)."""
    want = getattr(cls, "config_class", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if isinstance(want, type) and not isinstance(config, want) and isinstance(text, want):
        return text
    return config


def _rule(style: str) -> Any:
    data = resolve_alias(style)
    return data["style"] if len(data) == 1 else data


def _small_instance(cls, config):
    """A meta-device instance of ``cls`` from a shrunken copy of ``config`` that keeps every layer kind."""
    import torch

    from meshplan.hf.tiny_config import tiny_config
    with torch.device("meta"):
        return cls(tiny_config(config, tp=2))


def _base_prefix(model, cls) -> str:
    """The base model's path prefix in a task model (``"model."``), ``""`` in the base model itself: the child named
    ``base_model_prefix``, or else the one child that is a transformers model (Llama4ForCausalLM's prefix is
    ``language_model``, its base model sits at ``model``)."""
    import torch
    from transformers import PreTrainedModel
    p = cls.base_model_prefix
    if p and isinstance(getattr(model, p, None), torch.nn.Module):
        return f"{p}."
    found = [n for n, c in model.named_children() if isinstance(c, PreTrainedModel)]
    return f"{found[0]}." if len(found) == 1 else ""


def _hf_rules(model, cls, config, base: dict, model_type: str, sequence_parallel: bool) -> tuple[dict, dict]:
    """``(tensor_parallel rules, expert_parallel rules)`` from transformers' plans and the model's structure."""
    import torch

    from meshplan.hf.moe import MOE_STYLES, expert_rules, experts_present, has_ep_plan, is_moe_plan, outside_blocks
    from meshplan.plan_file.style_semantics import SEMANTICS
    prefix = _base_prefix(model, cls)
    hf = {prefix + k: v for k, v in base.items()}
    hf.update(getattr(cls, "_tp_plan", None) or {})
    moe, rules, ep_rules = is_moe_plan(hf) or has_ep_plan(config), {}, {}
    if moe and not experts_present(model, config, prefix, hf):  # Gemma 4 without enable_moe_block: dense
        moe, hf = False, {k: v for k, v in hf.items() if v not in MOE_STYLES}
    hf = param_entries(model, hf)
    for k, v in hf.items():
        try:
            rules[k] = v if isinstance(v, dict) or (moe and v in MOE_STYLES) else _rule(v)
        except ValueError as e:
            raise PlanError(f"{model_type}: tp_plan rule {k!r} ({cls.__name__}): {e}") from None
    if moe:  # the experts go to the expert_parallel section
        rules, ep_rules = expert_rules(model, config, prefix, rules, model_type)
        hf = {k: v for k, v in hf.items() if k in rules}
    found, order = structure_rules(model, hf)
    for path, style in found.items():
        if isinstance(style, str) and SEMANTICS[style].stream_module and not sequence_parallel:
            continue
        rules[path] = style  # lm_head: colwise_gather_output becomes meshplan's lm_head
    rules = outside_blocks(model, ep_rules, rules) if ep_rules else rules  # no rule inside an MoE block
    from meshplan.hf.mla import latent_rules
    rules = latent_rules(model, rules)  # MLA: the latent path beside transformers' mla_kv_a_proj
    rules = per_head_rowwise(model, own_inputs(model, present(model, rules)))
    rank = {p: i for i, p in enumerate(order)}
    return dict(sorted(rules.items(), key=lambda kv: rank.get(kv[0], len(rank)))), ep_rules


def from_hf(source: str | Path, *, sequence_parallel: bool = True, loss_parallel: bool = True,
            tp: int | None = ..., ep: int | None = None) -> dict:  # type: ignore[assignment]
    """A meshplan plan (plain data) from transformers' own tp_plan of a model.

    Args:
        source: a model type (``"llama"``), a ``config.json`` path or a directory holding one.
        sequence_parallel: write ``sequence_parallel`` (and the norm rules it needs).
        loss_parallel: keep the logits vocab-sharded.
        tp: the tensor-parallel degree written to ``layout`` (dp_shard is inferred from the world size at run
            time); default 2, or 1 when ``ep`` is given (the layout asked for: ep alone); None writes no layout
            (then every consumer must be given one).
        ep: the expert-parallel degree of a mixture-of-experts model (:mod:`meshplan.hf.moe`): its experts go to an
            ``expert_parallel`` section (from ``base_model_ep_plan``) with ``layout.etp: 1``.

    Returns:
        ``{"version": 1, "layout": {"tp": tp}, "blocks": {"pattern": …}, "tensor_parallel": {...}}``, ready for
        :meth:`Plan.from_data` or :func:`plan_yaml`; ``blocks`` names the model's repeated blocks
        (:func:`meshplan.blocks.repeated_blocks`), which data parallelism shards one by one.

    Raises:
        PlanError: unknown model type, no plan known for it, or an HF style meshplan cannot express.
    """
    from meshplan.blocks import repeated_blocks
    config, model_type, archs = _config(source)
    if tp is ...:
        tp = 1 if ep is not None else 2
    ep_rules: dict[str, Any] = {}
    cls = _model_class(config, model_type, archs)
    config = _class_config(cls, config)
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not base and model_type not in BUILTIN:
        raise PlanError(f"transformers ships no tp_plan for model type {model_type!r} and meshplan has no built-in "
                        f"one; write the rules by hand (see plans/hf_llama.yaml)")
    try:
        model = _small_instance(cls, config)
    except Exception as e:
        raise PlanError(f"{model_type}: cannot build a small {cls.__name__} to read its structure: "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    from meshplan.hf.moe import layer_blocks
    if not base:
        rules = dict(BUILTIN[model_type])
        origin = f"meshplan's built-in table (transformers ships no tp_plan for {model_type})"
    else:
        rules, ep_rules = _hf_rules(model, cls, config, base, model_type, sequence_parallel)
        origin = f"transformers {_version()} {type(config).__name__}.base_model_tp_plan + {cls.__name__}._tp_plan"
    plan: dict[str, Any] = {"version": 1}
    moe = bool(base) and ep_rules
    if tp is not None or ep is not None:
        etp = ((tp or 1) if layer_blocks(model, ep_rules) else 1) if moe else None  # a layer sees all its tokens
        plan["layout"] = {k: v for k, v in (("tp", tp), ("ep", ep), ("etp", etp)) if v is not None}
    found = repeated_blocks(model)
    if found is not None:
        plan["blocks"] = {"pattern": found}
    plan["tensor_parallel"] = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel, "rules": rules}
    if moe:
        plan["expert_parallel"] = {"rules": ep_rules}
    elif ep is not None:
        raise PlanError(f"{model_type}: ep={ep} given, but {cls.__name__} has no experts (neither its tp_plan nor a "
                        f"base_model_ep_plan names any)")
    plan["_origin"] = f"{origin}; model class {cls.__name__}"
    return plan


def _version() -> str:
    import transformers
    return transformers.__version__


def to_hf(plan) -> dict[str, str]:
    """The transformers ``tp_plan`` (``{module path pattern: style string}``) of a meshplan plan.

    Raises:
        PlanError: a rule has no transformers equivalent.
    """
    from meshplan.plan_file.document import as_plan
    from meshplan.plan_file.style_semantics import SEMANTICS
    p = as_plan(plan)
    if p.tensor_parallel is None:
        return {}
    out = {}
    for pattern, rule in p.tensor_parallel.rules.items():
        if hf_rule_free(rule, pattern):
            continue  # transformers runs it with no rule (MLA's latent but kv_a_proj_with_mqa)
        try:
            out[pattern] = to_hf_style(rule, pattern)
        except ValueError as e:
            raise PlanError(f"{p.source or '<plan>'}: tensor_parallel.rules.{pattern!r}: {e}") from None
        if SEMANTICS[rule.style].head_params:  # transformers shards a bare parameter by its own entry
            if rule.summed:
                raise PlanError(f"{p.source or '<plan>'}: tensor_parallel.rules.{pattern!r}: head_params 'summed' "
                                f"({', '.join(rule.summed)}) has no transformers equivalent (its gradient sum hooks "
                                f"a module, not a parameter)")
            out.update({f"{pattern}.{n}": "colwise" for n in rule.sharded})
    return out


def plan_yaml(plan: dict) -> str:
    """YAML text of :func:`from_hf`'s result, with a header saying where the rules came from."""
    import yaml
    data = dict(plan)
    origin = data.pop("_origin", None)
    experts = data.pop("expert_parallel", None)
    tp = dict(data.pop("tensor_parallel", {}))
    rules = tp.pop("rules", {})
    lines = ["# Generated by `meshplan convert --from hf --to meshplan`"] + ([f"# from {origin}"] if origin else [])
    lines += yaml.safe_dump(data, sort_keys=False).splitlines() + ["tensor_parallel:"]
    lines += ["  " + x for x in yaml.safe_dump(tp, sort_keys=False).splitlines()] + ["  rules:"]
    for pattern, rule in rules.items():
        value = yaml.safe_dump(rule, default_flow_style=True, width=1000, sort_keys=False)
        value = value.strip().removesuffix("...").strip()
        lines.append(f"    {pattern}: {value}")
    if experts:
        lines += ["expert_parallel:", "  rules:"] + [f"    {k}: {v}" for k, v in experts["rules"].items()]
    return "\n".join(lines) + "\n"
