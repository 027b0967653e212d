"""The rules transformers' tp_plan leaves to the model's structure, read from a small meta-device instance.

:func:`structure_rules` adds what sequence and loss parallelism need (the input embedding, the norms on the residual
stream, the output embedding) and the per-head parts beside colwise projections (``head_norm``, ``head_params``);
:func:`param_entries` merges transformers' entries on bare parameters into one ``head_params`` rule;
:func:`present` keeps the rules that match a module; :func:`per_head_rowwise` makes a rowwise onto one value per
head (Doge's ``dt_proj``) hand each rank its own heads'; :func:`own_inputs` gives gathered colwise rules their own
input conversion where their parent holds projections without a rule.
"""

from __future__ import annotations

from typing import Any

from meshplan.hf.moe import MOE_STYLES
from meshplan.hf.styles import resolve_alias

__all__ = ["PARAM_STYLES", "param_entries", "own_inputs", "structure_rules", "present", "per_head_rowwise"]


#: transformers' styles of an entry on a bare parameter, and the head_params list it joins
PARAM_STYLES = {"colwise": "sharded", "local_colwise": "sharded", "replicated_with_grad_allreduce": "summed"}


def param_entries(model, hf: dict[str, Any]) -> dict[str, Any]:
    """transformers' entries on a bare parameter (``layers.*.self_attn.sinks: colwise`` beside
    ``layers.*.self_attn: local_params``) merged into one ``head_params`` rule on the module that owns it."""
    from meshplan.plan_file.patterns import wildcard
    modules = {wildcard(n) for n, _ in model.named_modules()}
    params = {wildcard(f"{m}.{n}" if m else n) for m, mod in model.named_modules()
              for n, _ in mod.named_parameters(recurse=False)}
    out: dict[str, Any] = {}
    merged: dict[str, dict[str, Any]] = {}
    for k, v in hf.items():
        owner, _, name = k.rpartition(".")
        experts = hf.get(owner) in MOE_STYLES  # Llama 4's experts.down_proj: colwise stays the experts rule's
        if k in params and k not in modules and v in PARAM_STYLES and not experts:
            merged.setdefault(owner, {"style": "head_params"}).setdefault(PARAM_STYLES[v], []).append(name)
        else:
            out[k] = v
    return {**out, **merged}  # the merged rule replaces the owner's 'local_params'


def own_inputs(model, rules: dict[str, Any]) -> dict[str, Any]:
    """Gathered colwise rules (``colwise_gather_output``) whose parent holds projections no rule covers get
    ``input_layouts: replicate``: each converts its own input, so the parent's input stays a plain tensor for
    those projections (lara_mini's ``linear_attn.out_proj``; see
    :func:`meshplan.tensor_parallel.check.regions.region_errors`)."""
    from meshplan.plan_file.patterns import wildcard
    from meshplan.tensor_parallel.packed import features
    from meshplan.plan_file.style_semantics import SEMANTICS
    kids: dict[str, set[str]] = {}
    for path, mod in model.named_modules():
        if path and features(mod) is not None:
            kids.setdefault(wildcard(path.rpartition(".")[0]), set()).add(wildcard(path))
    out = dict(rules)
    for k, rule in rules.items():
        data = {"style": rule} if isinstance(rule, str) else rule
        spec = SEMANTICS.get(data["style"])
        if spec is None or spec.latent or not spec.parent_converts_input(data) or spec.gives_local_heads(data):
            continue  # latent rules take no input_layouts: the latent path converts its own input
        if any(c not in rules for c in kids.get(k.rpartition(".")[0], ())):
            out[k] = {**data, "input_layouts": "replicate"}
    return out


def structure_rules(model, hf_rules: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Embedding, stream norms and lm_head rules read from a small meta-device instance (every layer kind of
    the model kept), and the instance's module paths (wildcarded) in model order."""
    from meshplan.tensor_parallel.check.head_params import split_own_params, suggested_rule
    from meshplan.tensor_parallel.check.regions import is_norm, summable_on_shards, whole_projection_norm
    from meshplan.plan_file.patterns import wildcard
    from meshplan.plan_file.style_semantics import SEMANTICS
    names = {id(m): n for n, m in model.named_modules()}
    aliases = {k: resolve_alias(v) if isinstance(v, str) else v for k, v in hf_rules.items()}
    specs = {k: SEMANTICS[a["style"]] for k, a in aliases.items() if a["style"] in SEMANTICS}  # unknown: no meaning
    parents = {k.rpartition(".")[0] for k, spec in specs.items() if spec.column_parallel}
    out: dict[str, str] = {}
    emb = model.get_input_embeddings()
    if emb is not None and id(emb) in names:
        out[names[id(emb)]] = "embedding"
    local = {k.rpartition(".")[0] for k, spec in specs.items() if spec.gives_local_heads(aliases[k])}
    kids: dict[str, set[str]] = {}  # a local parent's children whose colwise outputs stay local
    for k, spec in specs.items():
        if spec.gives_local_heads(aliases[k]):
            kids.setdefault(k.rpartition(".")[0], set()).add(k.rpartition(".")[2])
    modules = dict(model.named_modules())
    for path, mod in modules.items():
        pattern = wildcard(path)
        parent = path.rpartition(".")[0]
        if path and is_norm(mod) and not any(pattern.startswith(p + ".") for p in parents if p):
            out[pattern] = "norm"
        elif path and wildcard(parent) in local and pattern not in hf_rules and \
                summable_on_shards(mod, modules[parent], model):
            out[pattern] = "head_norm"  # a per-head norm or a scalar-parameter activation on this rank's shards
        elif path and wildcard(parent) in local and pattern not in hf_rules and \
                whole_projection_norm(mod, modules[parent], kids.get(wildcard(parent), set())):
            out[pattern] = "projection_norm"  # ESMC's q_norm over the whole q_proj output
        elif path and pattern in local and pattern not in hf_rules and \
                any(True for _ in mod.parameters(recurse=False)):
            out[pattern] = suggested_rule(*split_own_params(model, mod))  # sinks, differential lambdas
    head = model.get_output_embeddings()
    if head is not None and id(head) in names:
        out[names[id(head)]] = "lm_head"
    return out, [wildcard(p) for p in names.values()]


def present(model, rules: dict[str, Any]) -> dict[str, Any]:
    """The rules that match a module of this config's model: transformers' plans list alternatives (MLA's
    ``q_proj`` or ``q_b_proj``, by ``q_lora_rank``), and a rule that matches nothing is a plan error."""
    from meshplan.plan_file.patterns import match_rules
    return {k: v for k, v in rules.items() if match_rules(model, {k: k}, k, errors=[])}


def per_head_rowwise(model, rules: dict[str, Any]) -> dict[str, Any]:
    """Rowwise rules beside colwise ones with local outputs whose module outputs one value per head (Doge's
    ``dt_proj`` onto ``num_key_value_heads``, which transformers reduces whole) get ``output_layouts: shard(-1),
    use_local_output: true``: each rank gets its own heads' values (see
    :func:`meshplan.tensor_parallel.check.head_params.per_head_rowwise_errors`)."""
    from meshplan.tensor_parallel.check.head_params import PER_HEAD_ROWWISE, per_head_outputs
    from meshplan.plan_file.patterns import wildcard
    from meshplan.plan_file.style_semantics import SEMANTICS
    data = {k: {"style": r} if isinstance(r, str) else r for k, r in rules.items()}
    local = {k.rpartition(".")[0] for k, d in data.items() if d["style"] in SEMANTICS and
             SEMANTICS[d["style"]].gives_local_heads(d)}
    modules = dict(model.named_modules())
    out = dict(rules)
    for path, mod in modules.items():
        k, parent = wildcard(path), path.rpartition(".")[0]
        d = data.get(k)
        if d is None or d["style"] not in SEMANTICS or not SEMANTICS[d["style"]].row_parallel or \
                wildcard(parent) not in local or per_head_outputs(model, modules[parent], mod) is None:
            continue
        out[k] = {**d, **PER_HEAD_ROWWISE}
    return out
