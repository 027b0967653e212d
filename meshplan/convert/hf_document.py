"""transformers' plans and degrees as one JSON document, the fields of ``transformers.DistributedConfig`` plus the
pipeline plan:

.. code-block:: json

    {"tp_size": 2, "tp_plan": {"model.layers.*.self_attn.q_proj": "colwise", ...},
     "pp_size": 2, "pp_plan": {"model.embed_tokens": [["input_ids"], ["inputs_embeds"]],
                               "model.layers": [["hidden_states", "attention_mask"], ["hidden_states"]], ...},
     "fsdp_size": 2, "dp_replicate_size": 1, "ep_size": 1, "ep_plan": {}}

Paths are the full model's (``from_pretrained(tp_plan=...)`` and ``DistributedConfig(tp_plan=...)`` take them;
``base_model_tp_plan`` drops the ``model.`` prefix). Style strings map through :mod:`meshplan.hf.styles`' alias
table both ways. Reading also takes a flat ``tp_plan`` dict, or a model type / ``config.json``
(:func:`meshplan.hf.convert.from_hf`: transformers' own plans plus the norms and embeddings sequence parallelism
needs). transformers' pipeline runs one microbatch through ``pp_size`` stages that split the blocks with the
remainder on the first ranks, as meshplan's default split: read as ``schedule: gpipe, microbatches: 1``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshplan.convert.common import HEAD_NAMES, Notes, acts, is_replicate, layout_overrides, unheld_sections
from meshplan.errors import PlanError

__all__ = ["read_hf", "write_hf"]

_IO = {"first": [["input_ids"], ["inputs_embeds"]], "blocks": [["hidden_states", "attention_mask"], ["hidden_states"]],
       "last": [["hidden_states"], ["hidden_states"]], "head": [["hidden_states"], ["logits"]]}
_EP_STYLES = {"experts": "ep_dispatch_experts", "router": "ep_router"}
_SIZES = {"tp_size": "tp", "pp_size": "pp", "fsdp_size": "dp_shard", "dp_replicate_size": "dp_replicate",
          "ep_size": "ep"}


def _tp_plan(plan: Any, notes: Notes) -> dict[str, str]:
    from meshplan.hf.styles import hf_rule_free, to_hf_style
    section, out = plan.tensor_parallel, {}
    if section is None:
        return out
    for pattern, rule in section.rules.items():
        if hf_rule_free(rule, pattern):
            notes.drop(f"rule {pattern!r} ({rule.style})", "transformers runs it with no rule (MLA's latent)")
            continue
        try:
            out[pattern] = to_hf_style(rule, pattern)
        except ValueError as e:
            notes.drop(f"rule {pattern!r} ({rule.style})", str(e))
    if section.loss_parallel and any(v == "colwise_gather_output" for v in out.values()):
        notes.drop("tensor_parallel.loss_parallel", "transformers' lm_head style gathers the logits "
                   "(colwise_gather_output)")
    return out


def _pp_plan(plan: Any, notes: Notes) -> dict[str, list]:
    sec = plan.pipeline
    if sec is None:
        return {}
    if sec.split == "trace":
        notes.drop("pipeline (split: trace)", "transformers' pipeline splits the block container only")
        return {}
    container = (plan.blocks.pattern if plan.blocks else "layers.*").removesuffix(".*")
    first = list(sec.first_stage_modules or [])
    last = list(sec.last_stage_modules or [])
    if not first and not last:
        notes.assume("pp_plan lists the block container only", "the plan names no first/last stage modules "
                     "(meshplan finds them in the model)")
    notes.assume("pp_plan inputs and outputs", "transformers' decoder names (input_ids → inputs_embeds → "
                 "hidden_states → logits); meshplan passes tensors positionally")
    for key, value in (("schedule", sec.schedule), ("microbatches", sec.microbatches)):
        notes.drop(f"pipeline.{key} ({value})", "transformers' pipeline runs the whole batch through the stages "
                   "once, no schedule")
    for key in ("split_points", "first_stage_fewer_blocks", "last_stage_fewer_blocks"):
        if getattr(sec, key):
            notes.drop(f"pipeline.{key} ({getattr(sec, key)})", "transformers splits the blocks evenly")
    out = {m: _IO["first"] for m in first}
    out[container] = _IO["blocks"]
    out.update({m: _IO["head"] if i == len(last) - 1 and len(last) > 1 else _IO["last"] for i, m in enumerate(last)})
    return out


def write_hf(plan: Any, notes: Notes, opts: Any) -> str:
    """The plan as transformers' document (see the module doc)."""
    unheld_sections(plan, {"tensor_parallel", "pipeline", "expert_parallel", "blocks"}, "transformers", notes)
    if acts(plan.blocks):
        notes.drop("blocks.activation_checkpointing / compile", "not a transformers DistributedConfig field")
    lay = plan.layout
    layout_overrides(lay, {"tp", "pp", "dp_shard", "dp_replicate", "ep"}, "transformers' DistributedConfig", notes)
    doc: dict[str, Any] = {}
    for key, name in _SIZES.items():
        value = getattr(lay, name) if lay is not None else None
        if name == "dp_shard" and value == -1 and opts.world_size:
            value = lay.resolve(opts.world_size).dp_shard
        if value is not None and value != -1 and (value != 1 or name == "tp"):
            doc[key] = value
    if lay is not None and lay.dp_shard == -1 and not opts.world_size:
        notes.assume("fsdp_size left out", "the plan infers dp_shard from the world size, transformers takes 1 "
                     "without it: pass --world-size to write it")
    doc["tp_plan"] = _tp_plan(plan, notes)
    if plan.pipeline is not None:
        doc["pp_plan"] = _pp_plan(plan, notes)
    if plan.expert_parallel is not None:
        doc["ep_plan"] = {p: _EP_STYLES[r.style] for p, r in plan.expert_parallel.rules.items()}
    return json.dumps(doc, indent=2) + "\n"


def _flat(data: dict) -> bool:
    return bool(data) and all(isinstance(v, str) for v in data.values())


def _load(source: str) -> dict | None:
    """The JSON document at ``source``, or None when ``source`` is a model type / config.json / directory."""
    path = Path(source)
    if path.is_dir() or path.name == "config.json" or not path.is_file():
        return None
    from meshplan.plan_file.reading import read_json
    data = read_json(path, "JSON document")  # bounded: a regular file of at most 4 MiB
    if not isinstance(data, dict) or "model_type" in data or not set(data) & {"tp_plan", "pp_plan", "ep_plan",
                                                                               *_SIZES} and not _flat(data):
        return None  # a transformers config: from_hf reads it (and says what transformers thinks of it)
    return data


#: parameter names of per-head entries, when no model (--model) says which keys are modules
_HEAD_PARAM_NAMES = ("sinks", "sink", "attention_sinks", "s_aux")


def _param_entries(tp_plan: dict, modules: dict | None, notes: Notes) -> dict:
    """transformers' entries on a bare parameter of a ``local_params`` module (``self_attn.sinks: colwise`` beside
    ``self_attn: local_params``) as one ``head_params`` rule on the module (see :func:`meshplan.hf.convert.from_hf`);
    a key is a parameter when the model's modules (``modules``) do not hold it, else (no model) when its name is
    one of :data:`_HEAD_PARAM_NAMES`. A ``local_params`` entry with no parameter entry is dropped."""
    from meshplan.hf.structure import PARAM_STYLES
    owners = {k for k, v in tp_plan.items() if v == "local_params"}
    merged: dict[str, dict] = {k: {"style": "head_params"} for k in owners}
    out = {}
    for key, value in tp_plan.items():
        owner, _, name = key.rpartition(".")
        is_param = key not in modules if modules else name in _HEAD_PARAM_NAMES
        if owner in owners and value in PARAM_STYLES and is_param:
            merged[owner].setdefault(PARAM_STYLES[value], []).append(name)
        elif key not in owners:
            out[key] = value
    for owner, rule in merged.items():
        if len(rule) == 1:
            notes.drop(f"tp_plan {owner!r} (local_params)", "no entry of the plan shards a parameter of it")
        else:
            out[owner] = rule
    return out


def _rules(tp_plan: dict, modules: dict | None, notes: Notes) -> tuple[dict, bool]:
    """meshplan rules of a transformers tp_plan and whether it has norms on the stream (sequence parallelism)."""
    from meshplan.hf.styles import HF_UNSUPPORTED, resolve_alias
    from meshplan.plan_file.style_semantics import SEMANTICS
    rules, sp = {}, False
    heads = set((modules or {}).get("(output)", "").split(",")) - {""}
    tp_plan = _param_entries(tp_plan, modules, notes)
    for key, value in tp_plan.items():
        if isinstance(value, dict):
            rules[key] = value
            continue
        if value in HF_UNSUPPORTED:
            notes.drop(f"tp_plan {key!r} ({value})", HF_UNSUPPORTED[value])
            continue
        rule = resolve_alias(value)
        spec = SEMANTICS.get(rule["style"])
        if spec is None:
            raise PlanError(f"tp_plan {key!r}: {value!r} is not a transformers style meshplan knows")
        sp = sp or spec.stream_module
        last = key.rpartition(".")[2]
        if spec.column_parallel and is_replicate(rule.get("output_layouts")) and (key in heads or not heads and
                                                                                   last in HEAD_NAMES):
            rule = {"style": "lm_head"}  # transformers' gathered lm_head: loss_parallel false
        rules[key] = rule["style"] if len(rule) == 1 else rule
    return rules, sp


def _pipeline(pp_plan: dict, data: dict, notes: Notes) -> None:
    keys = list(pp_plan)
    blocks = [k for k, io in pp_plan.items() if list(io)[0][:1] == ["hidden_states"] and "attention_mask" in
              list(io)[0]] or keys[len(keys) // 2:len(keys) // 2 + 1]
    i = keys.index(blocks[0])
    data["blocks"] = {"pattern": f"{blocks[0]}.*"}
    sec = {"schedule": "gpipe", "microbatches": 1}
    if keys[:i]:
        sec["first_stage_modules"] = keys[:i]
    if keys[i + 1:]:
        sec["last_stage_modules"] = keys[i + 1:]
    data["pipeline"] = sec
    notes.assume("pipeline schedule gpipe, 1 microbatch", "transformers runs the whole batch through the stages once")


def read_hf(source: str, notes: Notes, opts: Any) -> dict:
    """Plan data from transformers' document (see the module doc), a flat tp_plan, or a model type/config."""
    data = _load(source)
    if data is None:
        from meshplan.hf.convert import from_hf
        tp = {} if opts.tp is None else {"tp": opts.tp}  # default: 2, or 1 with ep alone (from_hf)
        return from_hf(source, sequence_parallel=opts.sequence_parallel, loss_parallel=opts.loss_parallel,
                       ep=opts.ep, **tp)
    doc = {"tp_plan": data} if _flat(data) else data
    unknown = sorted(set(doc) - {"tp_plan", "pp_plan", "ep_plan", *_SIZES})
    for key in unknown:
        notes.drop(f"{key} ({doc[key]!r})", "not a field meshplan maps (tp_plan, pp_plan, ep_plan, the sizes)")
    rules, sp = _rules(doc.get("tp_plan") or {}, opts.modules, notes)
    out: dict[str, Any] = {"version": 1}
    layout = {_SIZES[k]: v for k, v in doc.items() if k in _SIZES and v not in (None, 1) or k == "tp_size"}
    if layout:
        out["layout"] = layout
    out["tensor_parallel"] = {"sequence_parallel": sp, "loss_parallel": False, "rules": rules}
    if doc.get("pp_plan"):
        _pipeline(doc["pp_plan"], out, notes)
    if doc.get("ep_plan"):
        from meshplan.plan_file.expert_parallel import HF_EP_ALIASES as EP_ALIASES
        out["expert_parallel"] = {"rules": {k: dict(EP_ALIASES[v]) for k, v in doc["ep_plan"].items()
                                            if v in EP_ALIASES}}
        for k, v in doc["ep_plan"].items():
            if v not in EP_ALIASES:
                notes.lose(f"ep_plan {k!r} ({v})", f"not an expert-parallel style meshplan maps "
                           f"({', '.join(sorted(EP_ALIASES))})")
    return out
