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

import json
from pathlib import Path
from typing import Any

from meshplan.errors import PlanError
from meshplan.hf.styles import resolve_alias, to_hf_style

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
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON: {e}") from None
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


def _rule(style: str) -> Any:
    data = resolve_alias(style)
    return data["style"] if len(data) == 1 else data


#: transformers' styles of an entry on a bare parameter, and the head_params list it joins
PARAM_STYLES = {"colwise": "sharded", "local_colwise": "sharded", "replicated_with_grad_allreduce": "summed"}


def _param_entries(model, hf: dict[str, Any]) -> dict[str, Any]:
    """transformers' entries on a bare parameter (``layers.*.self_attn.sinks: colwise`` beside
    ``layers.*.self_attn: local_params``) merged into one ``head_params`` rule on the module that owns it."""
    from meshplan.plan_file.patterns import wildcard
    modules = {wildcard(n) for n, _ in model.named_modules()}
    params = {wildcard(f"{m}.{n}" if m else n) for m, mod in model.named_modules()
              for n, _ in mod.named_parameters(recurse=False)}
    out: dict[str, Any] = {}
    merged: dict[str, dict[str, Any]] = {}
    for k, v in hf.items():
        if k in params and k not in modules and v in PARAM_STYLES:
            owner, _, name = k.rpartition(".")
            merged.setdefault(owner, {"style": "head_params"}).setdefault(PARAM_STYLES[v], []).append(name)
        else:
            out[k] = v
    return {**out, **merged}  # the merged rule replaces the owner's 'local_params'


def _own_inputs(model, rules: dict[str, Any]) -> dict[str, Any]:
    """Gathered colwise rules (``colwise_gather_output``) whose parent holds projections no rule covers get
    ``input_layouts: replicate``: each converts its own input, so the parent's input stays a plain tensor for
    those projections (lara_mini's ``linear_attn.out_proj``; see :func:`meshplan.checks.regions.region_errors`)."""
    from meshplan.plan_file.patterns import wildcard
    from meshplan.tensor_parallel.packed import features
    from meshplan.tensor_parallel.style_table import STYLES
    kids: dict[str, set[str]] = {}
    for path, mod in model.named_modules():
        if path and features(mod) is not None:
            kids.setdefault(wildcard(path.rpartition(".")[0]), set()).add(wildcard(path))
    out = dict(rules)
    for k, rule in rules.items():
        data = {"style": rule} if isinstance(rule, str) else rule
        spec = STYLES.get(data["style"])
        if spec is None or not spec.parent_converts_input(data) or spec.gives_local_heads(data):
            continue
        if any(c not in rules for c in kids.get(k.rpartition(".")[0], ())):
            out[k] = {**data, "input_layouts": "replicate"}
    return out


def _small_instance(cls, config):
    """A meta-device instance of ``cls`` from a shrunken copy of ``config`` that keeps every layer kind."""
    import torch

    from meshplan.hf.tiny_config import tiny_config
    with torch.device("meta"):
        return cls(tiny_config(config, tp=2))


def _structure(model, hf_rules: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Embedding, stream norms and lm_head rules read from a small meta-device instance (every layer kind of
    the model kept), and the instance's module paths (wildcarded) in model order."""
    from meshplan.checks.head_params import split_own_params, suggested_rule
    from meshplan.checks.regions import is_norm, summable_on_shards
    from meshplan.plan_file.patterns import wildcard
    from meshplan.tensor_parallel.style_table import STYLES
    names = {id(m): n for n, m in model.named_modules()}
    aliases = {k: resolve_alias(v) if isinstance(v, str) else v for k, v in hf_rules.items()}
    specs = {k: STYLES[a["style"]] for k, a in aliases.items() if a["style"] in STYLES}  # unknown: no meaning
    parents = {k.rpartition(".")[0] for k, spec in specs.items() if spec.column_parallel}
    out: dict[str, str] = {}
    emb = model.get_input_embeddings()
    if emb is not None and id(emb) in names:
        out[names[id(emb)]] = "embedding"
    local = {k.rpartition(".")[0] for k, spec in specs.items() if spec.gives_local_heads(aliases[k])}
    modules = dict(model.named_modules())
    for path, mod in modules.items():
        pattern = wildcard(path)
        parent = path.rpartition(".")[0]
        if path and is_norm(mod) and not any(pattern.startswith(p + ".") for p in parents if p):
            out[pattern] = "norm"
        elif path and wildcard(parent) in local and pattern not in hf_rules and \
                summable_on_shards(mod, modules[parent], model):
            out[pattern] = "head_norm"  # a per-head norm or a scalar-parameter activation on this rank's shards
        elif path and pattern in local and pattern not in hf_rules and \
                any(True for _ in mod.parameters(recurse=False)):
            out[pattern] = suggested_rule(*split_own_params(model, mod))  # sinks, differential lambdas
    head = model.get_output_embeddings()
    if head is not None and id(head) in names:
        out[names[id(head)]] = "lm_head"
    return out, [wildcard(p) for p in names.values()]


def from_hf(source: str | Path, *, sequence_parallel: bool = True, loss_parallel: bool = True,
            tp: int | None = 2, ep: int | None = None) -> dict:
    """A meshplan plan (plain data) from transformers' own tp_plan of a model.

    Args:
        source: a model type (``"llama"``), a ``config.json`` path or a directory holding one.
        sequence_parallel: write ``sequence_parallel`` (and the norm rules it needs).
        loss_parallel: keep the logits vocab-sharded.
        tp: the tensor-parallel degree written to ``layout`` (dp_shard is inferred from the world size at run
            time); None writes no layout (then every consumer must be given one).
        ep: the expert-parallel degree of a mixture-of-experts model (:mod:`meshplan.hf.moe`): its experts go to an
            ``expert_parallel`` section (from ``base_model_ep_plan``) with ``layout.etp: 1``.

    Returns:
        ``{"version": 1, "layout": {"tp": tp}, "tensor_parallel": {...}}``, ready for :meth:`Plan.from_data`
        or :func:`plan_yaml`.

    Raises:
        PlanError: unknown model type, no plan known for it, or an HF style meshplan cannot express.
    """
    import torch

    from meshplan.tensor_parallel.style_table import STYLES
    config, model_type, archs = _config(source)
    ep_rules: dict[str, Any] = {}
    cls = _model_class(config, model_type, archs)
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not base and model_type in BUILTIN:
        rules = dict(BUILTIN[model_type])
        origin = f"meshplan's built-in table (transformers ships no tp_plan for {model_type})"
    elif not base:
        raise PlanError(f"transformers ships no tp_plan for model type {model_type!r} and meshplan has no built-in "
                        f"one; write the rules by hand (see plans/hf_llama.yaml)")
    else:
        try:
            model = _small_instance(cls, config)
        except Exception as e:
            raise PlanError(f"{model_type}: cannot build a small {cls.__name__} to read its structure: "
                            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        # a task model holds the base model under base_model_prefix; the base model class itself does not
        p = cls.base_model_prefix
        prefix = f"{p}." if p and isinstance(getattr(model, p, None), torch.nn.Module) else ""
        hf = {prefix + k: v for k, v in base.items()}
        hf.update(getattr(cls, "_tp_plan", None) or {})
        from meshplan.hf.moe import MOE_STYLES, expert_rules, is_moe_plan
        moe, rules = is_moe_plan(hf), {}
        hf = _param_entries(model, hf)
        for k, v in hf.items():
            try:
                rules[k] = v if isinstance(v, dict) or (moe and v in MOE_STYLES) else _rule(v)
            except ValueError as e:
                raise PlanError(f"{model_type}: tp_plan rule {k!r} ({cls.__name__}): {e}") from None
        if moe:  # the experts go to the expert_parallel section
            rules, ep_rules = expert_rules(model, config, prefix, rules, model_type)
            hf = {k: v for k, v in hf.items() if k in rules}
        found, order = _structure(model, hf)
        for path, style in found.items():
            if isinstance(style, str) and STYLES[style].stream_module and not sequence_parallel:
                continue
            rules[path] = style  # lm_head: colwise_gather_output becomes meshplan's lm_head
        rules = _own_inputs(model, rules)
        rank = {p: i for i, p in enumerate(order)}
        rules = dict(sorted(rules.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        origin = f"transformers {_version()} {type(config).__name__}.base_model_tp_plan + {cls.__name__}._tp_plan"
    plan: dict[str, Any] = {"version": 1}
    moe = bool(base) and ep_rules
    if tp is not None or ep is not None:
        plan["layout"] = {k: v for k, v in (("tp", tp), ("ep", ep), ("etp", 1 if moe else None)) if v is not None}
    plan["tensor_parallel"] = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel, "rules": rules}
    if moe:
        plan["expert_parallel"] = {"rules": ep_rules}
    elif ep is not None:
        raise PlanError(f"{model_type}: ep={ep} given, but {cls.__name__} has no experts (its tp_plan shards none)")
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
    from meshplan.tensor_parallel.style_table import STYLES
    p = as_plan(plan)
    if p.tensor_parallel is None:
        return {}
    out = {}
    for pattern, rule in p.tensor_parallel.rules.items():
        try:
            out[pattern] = to_hf_style(rule)
        except ValueError as e:
            raise PlanError(f"{p.source or '<plan>'}: tensor_parallel.rules.{pattern!r}: {e}") from None
        if STYLES[rule.style].head_params:  # transformers shards a bare parameter by its own entry
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
