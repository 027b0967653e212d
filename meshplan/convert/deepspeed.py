"""DeepSpeed AutoTP configs: the ``tensor_parallel`` section of a DeepSpeed JSON config with custom
``partition_config.layer_specs`` (DeepSpeed's ``deepspeed/module_inject/autotp_config.py``: ``TPLayerSpec`` with
``patterns`` (regexes over parameter names, ``re.match``), ``partition_type`` ``column``/``row``/``skip``,
``gather_output``, ``shape`` and ``partition_dim`` for fused weights; ``AutoTPConfig.from_dict``), plus the ZeRO
stage and bf16/fp16:

.. code-block:: json

    {"tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": false, "layer_specs": [
        {"patterns": ["model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.q_proj\\\\.weight$"], "partition_type": "column"},
        {"patterns": ["lm_head\\\\.weight$"], "partition_type": "column", "gather_output": true}]}},
     "zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}

AutoTP is Megatron's tensor parallelism without sequence parallelism: the activations between blocks are
replicated, row layers all-reduce, the logits are gathered, embeddings are not in ``layer_specs``. Reading a
regex: the forms :func:`meshplan.plan_file.patterns.pattern_regex` writes (and ``[qkv]`` / ``(up|gate)``
alternatives) become patterns directly; any other regex (DeepSpeed's presets start with ``.*``) is matched
against the model's parameter names (``--model``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshplan.convert.common import HEAD_NAMES, Notes, is_replicate, layout_overrides, unheld_sections
from meshplan.errors import PlanError

__all__ = ["read_deepspeed", "write_deepspeed"]

#: meshplan style → DeepSpeed partition_type (with gather_output for the gathering column layers)
_PARTITION = {"colwise": "column", "rowwise": "row", "lm_head": "column", "replicate": "skip"}


def _spec(pattern: str, rule: Any, notes: Notes) -> dict | None:
    from meshplan.plan_file.patterns import pattern_regex
    from meshplan.plan_file.style_semantics import SEMANTICS
    kind, o = _PARTITION.get(rule.style), rule.overrides()
    spec = SEMANTICS[rule.style]
    if kind is None:
        notes.drop(f"rule {pattern!r} ({rule.style})", "AutoTP has no sequence parallelism" if spec.stream_module
                   else "DeepSpeed AutoTP's layer_specs shard Linear weights only; the module stays whole on every "
                   "rank")
        return None
    if spec.row_parallel and o.get("input_layouts") not in (None, "shard(-1)"):
        notes.drop(f"rule {pattern!r} (rowwise, input {o['input_layouts']})", "an AutoTP row layer takes its "
                   "input sharded")
        return None
    out: dict[str, Any] = {"patterns": [pattern_regex(pattern)], "partition_type": kind}
    if spec.takes_stream or (spec.column_parallel and is_replicate(o.get("output_layouts"))):
        out["gather_output"] = True
    packed = o.get("packed") or 1
    if packed > 1:
        out["shape"], out["partition_dim"] = ([packed, -1], 0) if spec.column_parallel else ([-1, packed], 1)
    return out


def write_deepspeed(plan: Any, notes: Notes) -> str:
    """The plan as a DeepSpeed config (see the module doc)."""
    unheld_sections(plan, {"tensor_parallel", "data_parallel"}, "DeepSpeed AutoTP", notes)
    layout_overrides(plan.layout, {"tp", "dp_shard"}, "a DeepSpeed AutoTP config", notes)
    section = plan.tensor_parallel
    tp = plan.layout.tp if plan.layout is not None else 1
    specs = []
    if section is not None:
        if section.sequence_parallel:
            notes.drop(f"tensor_parallel.sequence_parallel ({section.sequence_parallel})", "AutoTP replicates the "
                       "activations between blocks")
        if section.loss_parallel:
            notes.drop("tensor_parallel.loss_parallel", "AutoTP gathers the logits (gather_output)")
        specs = [s for s in (_spec(p, r, notes) for p, r in section.rules.items()) if s is not None]
    doc: dict[str, Any] = {"tensor_parallel": {"autotp_size": tp, "partition_config": {
        "use_default_specs": False, "layer_specs": specs}}}
    _write_zero(plan.data_parallel, doc, notes, tp)
    return json.dumps(doc, indent=2) + "\n"


def _write_zero(dp: Any, doc: dict, notes: Notes, tp: int) -> None:
    if dp is None:
        return
    mode, reshard = dp.mode, dp.reshard_after_forward
    if mode in ("hsdp", "none"):
        notes.drop(f"data_parallel.mode ({mode})", "no ZeRO stage matches it")
    elif mode == "ddp":
        doc["zero_optimization"] = {"stage": 0}
    elif mode == "fsdp" or reshard is not None:
        stage = 2 if reshard is False or tp > 1 else 3
        if reshard is not False and tp > 1:
            notes.drop("data_parallel.reshard_after_forward (ZeRO-3)", "DeepSpeed AutoTP runs ZeRO stages 0-2: "
                       "written as stage 2")
        doc["zero_optimization"] = {"stage": stage}
    if dp.param_dtype in ("bfloat16", "float16"):
        doc["bf16" if dp.param_dtype == "bfloat16" else "fp16"] = {"enabled": True}
    for key in ("reduce_dtype", "cpu_offload", "gradient_reduction", "accumulate_unsharded"):
        if key in dp.model_fields_set:
            notes.drop(f"data_parallel.{key} ({getattr(dp, key)})", "not mapped to a DeepSpeed setting")


def _patterns(regex: str, modules: dict[str, str] | None, where: str) -> list[str]:
    """The module patterns of a parameter-name regex: read from its text, else matched against the model."""
    from meshplan.plan_file.patterns import regex_patterns, wildcard
    found = regex_patterns(regex)
    if found is not None:
        return found
    if modules is None:
        raise PlanError(f"{where}: the regex {regex!r} is not one meshplan can read as module paths (a literal path "
                        f"with a one-segment wildcard per layer); pass --model MODULE:FACTORY to match it against the model's "
                        f"parameter names")
    try:
        rx = re.compile(regex)
    except re.error as e:
        raise PlanError(f"{where}: invalid regex {regex!r}: {e}") from None
    hits = [n.rpartition(".")[0] for n in modules.get("(parameters)", "").split(",") if n and rx.match(n)]
    if not hits:
        raise PlanError(f"{where}: the regex {regex!r} matches no parameter of the model")
    return list(dict.fromkeys(wildcard(h) for h in hits))


def _rule(spec: dict, heads: set[str], path: str, where: str, notes: Notes) -> Any:
    kind = str(spec.get("partition_type", "column")).lower()
    shape, dim = spec.get("shape"), spec.get("partition_dim")
    for key in sorted(set(spec) - {"patterns", "partition_type", "gather_output", "shape", "partition_dim"}):
        notes.drop(f"{where}.{key} ({spec[key]!r})", "meshplan rules apply to the model they are checked on")
    if kind == "skip":
        return "replicate"
    if kind not in ("column", "row"):
        raise PlanError(f"{where}.partition_type: {kind!r}; expected column, row or skip")
    rule: dict[str, Any] = {"style": "colwise" if kind == "column" else "rowwise"}
    if shape is not None:
        parts = shape[0] if kind == "column" else shape[-1]
        if isinstance(parts, (list, tuple)) and len(parts) > 1 and len(set(parts)) == 1:
            parts = len(parts)  # [[n, n, n], -1]: k equal parts, written out
        if not isinstance(parts, int) or parts < 2 or dim not in (None, 0 if kind == "column" else 1):
            notes.drop(f"{where}.shape ({shape}, partition_dim {dim})", "meshplan packs k equal parts only; the "
                       "layer is sharded as one block")
        else:
            rule["packed"] = parts
    if kind == "column" and spec.get("gather_output"):
        last = path.rpartition(".")[2]
        if path in heads or not heads and last in HEAD_NAMES:
            return "lm_head"
        rule["output_layouts"] = "replicate"
    return rule["style"] if len(rule) == 1 else rule


def read_deepspeed(source: str, notes: Notes, modules: dict[str, str] | None = None) -> dict:
    """Plan data from a DeepSpeed config file (JSON; see the module doc)."""
    from meshplan.plan_file.reading import read_json
    data = read_json(source, "DeepSpeed JSON config")  # bounded: a regular file of at most 4 MiB
    tp = (data.get("tensor_parallel") or {}) if isinstance(data, dict) else {}
    if not tp:
        raise PlanError(f"{source}: no tensor_parallel section; expected DeepSpeed AutoTP's {{\"tensor_parallel\": "
                        f"{{\"autotp_size\": N, \"partition_config\": {{\"layer_specs\": [...]}}}}}}")
    pc = tp.get("partition_config") or {}
    heads = set((modules or {}).get("(output)", "").split(",")) - {""}
    rules: dict[str, Any] = {}
    if pc.get("use_default_specs", True) and (tp.get("preset_model") or not pc.get("layer_specs")):
        rules = _builtin_specs(tp, modules, notes)
    for i, spec in enumerate(pc.get("layer_specs") or []):
        where = f"{source}: tensor_parallel.partition_config.layer_specs[{i}]"
        for regex in spec.get("patterns") or []:
            for path in _patterns(regex, modules, where):
                rules.setdefault(path, _rule(spec, heads, path, where, notes))  # the first match wins, as in DeepSpeed
    out: dict[str, Any] = {"version": 1, "layout": {"tp": int(tp.get("autotp_size") or tp.get("tp_size") or 1)},
                           "tensor_parallel": {"sequence_parallel": False, "loss_parallel": False, "rules": rules}}
    _read_zero(data, out, notes)
    return out


#: the transformers tp_plan styles AutoTP applies (docs/_tutorials/autotp-training.md); others fall back
_AUTOTP_HF = {"colwise", "rowwise", "colwise_gather_output", "colwise_rep"}


def _builtin_specs(tp: dict, modules: dict[str, str] | None, notes: Notes) -> dict:
    """The rules AutoTP takes without layer_specs: the model's transformers tp_plan (its second priority, with
    ``--model``), else a dropped rule set (the presets and heuristics are DeepSpeed's code, not this file)."""
    import json
    plan = json.loads((modules or {}).get("(tp_plan)") or "{}")
    if tp.get("preset_model") or not plan:
        which = f"preset_model {tp['preset_model']!r}" if tp.get("preset_model") else "no layer_specs"
        notes.lose(f"AutoTP's built-in specs ({which})",
                   "DeepSpeed shards by the model's transformers tp_plan or its own presets, which are not in "
                   "this file; meshplan reads only the layer_specs written in it, or with --model a transformers "
                   "model's tp_plan")
        return {}
    from meshplan.convert.hf_document import _rules
    for key in [k for k, v in plan.items() if v not in _AUTOTP_HF]:
        notes.drop(f"tp_plan {key!r} ({plan.pop(key)})", "AutoTP applies colwise, rowwise and "
                   "colwise_gather_output only; the module stays whole, as under DeepSpeed")
    notes.assume("the rules: the model's transformers tp_plan", "AutoTP uses it when the config has no layer_specs")
    return _rules(plan, modules, notes)[0]


def _read_zero(data: dict, out: dict, notes: Notes) -> None:
    stage = (data.get("zero_optimization") or {}).get("stage")
    dp: dict[str, Any] = {}
    if stage == 0:
        dp["mode"] = "ddp"
    elif stage in (1, 2, 3):
        dp["mode"] = "fsdp"
        if stage < 3:
            dp["reshard_after_forward"] = False
        if stage == 1:
            notes.drop("zero_optimization.stage 1 (optimizer states only)", "FSDP2 shards gradients too: written as "
                       "ZeRO-2 (reshard_after_forward: false)")
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if (data.get(key) or {}).get("enabled"):
            dp["param_dtype"] = dtype
    zero = data.get("zero_optimization") or {}
    for key in zero:
        if key == "offload_param" and (zero[key] or {}).get("device") == "cpu":
            dp["cpu_offload"] = True
            notes.assume("data_parallel.cpu_offload true (offload_param: cpu)", "FSDP2's CPU offload moves the "
                         "gradients and the optimizer state too")
        elif key != "stage":
            notes.drop(f"zero_optimization.{key} ({zero[key]!r})", "not a setting meshplan's data_parallel maps")
    tp = data.get("tensor_parallel") or {}
    for key in sorted(set(tp) - {"autotp_size", "tp_size", "partition_config", "preset_model"}):
        notes.drop(f"tensor_parallel.{key} ({tp[key]!r})", "not a setting meshplan's tensor_parallel maps")
    for key in sorted(set(data) - {"tensor_parallel", "zero_optimization", "bf16", "fp16"}):
        notes.drop(f"{key} ({data[key]!r})"[:120], "a DeepSpeed training setting, not part of a plan")
    if dp:
        out["data_parallel"] = dp
