"""``meshplan convert``: read a source in one format into a plan, write the plan in another.

Formats: ``meshplan`` (plan files), ``hf`` (:mod:`meshplan.convert.hf_document`), ``torch``
(:mod:`meshplan.convert.torch_source`), ``deepspeed`` (:mod:`meshplan.convert.deepspeed`), ``accelerate``
(:mod:`meshplan.convert.accelerate`). Every direction validates the plan in between, so a source that converts
is a plan meshplan accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.convert.common import HEAD_NAMES, Notes
from meshplan.errors import PlanError

__all__ = ["convert", "read", "write", "plan_text", "model_modules", "FORMATS", "Options"]

FORMATS = ("meshplan", "hf", "torch", "deepspeed", "accelerate")


@dataclass(frozen=True)
class Options:
    """What a direction may need beyond the source: the model (module types and paths resolve regexes and name
    embeddings), the world size (degrees a plan infers), the tp degree (sources without one), a dict's name."""

    modules: dict[str, str] | None = None
    world_size: int | None = None
    tp: int | None = None
    name: str | None = None
    sequence_parallel: bool = True
    loss_parallel: bool = True
    ep: int | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    read_back: bool = False  # reading a converter's own output: the sections a source lacks are not required


def model_modules(model: Any) -> dict[str, str]:
    """``{module path (and its wildcard pattern): class name}`` of a model, plus ``"(output)"``: its output head
    path(s), ``"(parameters)"``: every parameter name, comma-joined, ``"(tp_plan)"``: a transformers model's
    ``tp_plan`` as JSON, and ``"(blocks)"``: the pattern of its
    repeated blocks (:func:`meshplan.blocks.repeated_blocks`; the converters read only text)."""
    from meshplan.plan_file.patterns import wildcard
    out: dict[str, str] = {}
    for path, m in model.named_modules():
        if path:
            out[path] = out[wildcard(path)] = type(m).__name__
    names = {id(m): p for p, m in model.named_modules()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    heads = [names[id(head)]] if head is not None and id(head) in names else \
        [p for p, m in model.named_modules() if p.rpartition(".")[2] in HEAD_NAMES]
    out["(output)"] = ",".join(heads)
    out["(parameters)"] = ",".join(n for n, _ in model.named_parameters())
    import json
    out["(tp_plan)"] = json.dumps(getattr(model, "tp_plan", None) or {})  # a transformers model's full tp_plan
    from meshplan.blocks import repeated_blocks
    out["(blocks)"] = repeated_blocks(model) or ""
    return out


def read(fmt: str, source: str, opts: Options, notes: Notes) -> dict:
    """Plan data (a plan file's content) from ``source`` in format ``fmt``."""
    if fmt == "meshplan":
        from meshplan.plan_file.reading import read_plan_data
        return dict(read_plan_data(source))
    if fmt == "torch":
        from meshplan.convert.torch_source import read_torch
        data = read_torch(source, notes, opts.name, opts.modules, opts.settings)
    elif fmt == "hf":
        from meshplan.convert.hf_document import read_hf
        data = read_hf(source, notes, opts)
    elif fmt == "deepspeed":
        from meshplan.convert.deepspeed import read_deepspeed
        data = read_deepspeed(source, notes, opts.modules)
    else:
        from meshplan.convert.accelerate import read_accelerate
        data = read_accelerate(source, notes)
    if opts.tp is not None:
        data.setdefault("layout", {})["tp"] = opts.tp
    found = (opts.modules or {}).get("(blocks)")
    if found and "pattern" not in data.get("blocks", {}) and fmt != "meshplan":
        data["blocks"] = {**data.get("blocks", {}), "pattern": found}  # FSDP2 shards each block; layers.* may miss
        notes.assume(f"blocks: {{pattern: {found}}}", "the model's repeated blocks (the source names none)")
    elif fmt != "meshplan" and "pattern" not in data.get("blocks", {}):
        _blocks_from_rules(data, notes)
    from meshplan.convert.common import context_section
    if fmt != "meshplan" and not opts.read_back:
        context_section(data, opts.modules, notes, source)
    return data


def _blocks_from_rules(data: dict, notes: Notes) -> None:
    """Without a model: the blocks pattern every per-block rule starts with (``model.layers.*``), when it is
    not the default ``layers.*``."""
    rules = (data.get("tensor_parallel") or {}).get("rules") or {}
    heads = {k.split(".*.", 1)[0] + ".*" for k in rules if ".*." in k}
    if len(heads) == 1 and heads != {"layers.*"}:
        pattern = heads.pop()
        data["blocks"] = {**data.get("blocks", {}), "pattern": pattern}
        notes.assume(f"blocks: {{pattern: {pattern}}}", "the prefix of every per-block rule (the source names no "
                     "blocks)")


def write(fmt: str, plan: Any, opts: Options, notes: Notes) -> str:
    """The text of ``plan`` in format ``fmt``."""
    if fmt == "meshplan":
        return plan_text(plan)
    if fmt == "torch":
        from meshplan.convert.torch_source import write_torch
        return write_torch(plan, notes)
    if fmt == "hf":
        from meshplan.convert.hf_document import write_hf
        return write_hf(plan, notes, opts)
    if fmt == "deepspeed":
        from meshplan.convert.deepspeed import write_deepspeed
        return write_deepspeed(plan, notes)
    from meshplan.convert.accelerate import write_accelerate
    return write_accelerate(plan, notes, opts.world_size)


def convert(source: str, from_: str, to: str, opts: Options = Options()) -> tuple[str, Notes]:
    """``source`` (a path, or for ``hf`` a model type) in format ``from_`` as text in format ``to``.

    Returns:
        ``(text, notes)``: the notes list every item the target (or the source) could not hold, and every guess.

    Raises:
        PlanError: the source cannot be read, the plan does not validate, or a rule cannot be expressed at all.
    """
    from meshplan.plan_file.document import Plan
    for fmt, flag in ((from_, "--from"), (to, "--to")):
        if fmt not in FORMATS:
            raise PlanError(f"convert: {flag} {fmt!r} is not a format; expected one of {', '.join(FORMATS)}")
    notes = Notes()
    data = read(from_, source, opts, notes)
    origin = data.pop("_origin", None)
    plan = Plan.from_data(data, source=source if from_ == "meshplan" else None)
    text = write(to, plan, opts, notes)
    if to == "meshplan" and origin:
        text = text.replace("\n", f"\n# from {origin}\n", 1)
    if to == "meshplan":
        verify_plan_text(text, opts.world_size)
    else:
        _read_back(to, text, opts)
    return text, notes


_SUFFIX = {"hf": ".json", "torch": ".py", "deepspeed": ".json", "accelerate": ".yaml"}


def _read_back(fmt: str, text: str, opts: Options) -> None:
    """The written text read back by meshplan's own reader into a valid plan (nothing written otherwise)."""
    import os
    import tempfile
    from meshplan.plan_file.document import Plan
    fd, path = tempfile.mkstemp(suffix=_SUFFIX[fmt], prefix="meshplan-convert-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        Plan.from_data(read(fmt, path, Options(modules=opts.modules, tp=opts.tp, read_back=True), Notes()))
    except PlanError as e:
        raise PlanError(f"convert: the written {fmt} text does not read back as a plan meshplan accepts, nothing "
                        f"written: {e}") from None
    finally:
        os.unlink(path)


def verify_plan_text(text: str, world_size: int | None = None) -> None:
    """The checks a written plan passes before it is written: it reads back as a valid plan, its layout resolves
    (at ``world_size``, when given), and a ``cp`` degree has its ``context_parallel`` section.

    Raises:
        PlanError: the written plan would be refused (nothing is written).
    """
    import yaml
    from meshplan.plan_file.document import Plan
    try:
        plan = Plan.from_data(yaml.safe_load(text))
        if world_size is not None and plan.layout is not None:
            plan.layout.resolve(world_size)
    except PlanError as e:
        raise PlanError(f"convert: the converted plan would be refused, nothing written: {e}") from None
    cp = plan.layout.cp if plan.layout is not None else 1
    if isinstance(cp, int) and cp > 1 and plan.context_parallel is None:
        raise PlanError(f"convert: the converted plan has layout.cp {cp} and no context_parallel section; nothing "
                        f"written")


def plan_text(plan: Any) -> str:
    """A plan as a YAML plan file: every section as written (unset fields left out), one line per rule."""
    import yaml
    data = plan.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    data.pop("source", None)
    tp = dict(data.pop("tensor_parallel", None) or {})
    rules = tp.pop("rules", None) or {}
    ep = data.pop("expert_parallel", None)
    lines = ["# Generated by `meshplan convert`"] + yaml.safe_dump(data, sort_keys=False).splitlines()
    if plan.tensor_parallel is not None:
        lines += ["tensor_parallel:"] + ["  " + x for x in yaml.safe_dump(tp, sort_keys=False).splitlines()
                                          if tp] + ["  rules:"]
        for pattern, rule in rules.items():
            value = rule["style"] if list(rule) == ["style"] else rule
            text = yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False)
            lines.append(f"    {pattern}: {text.strip().removesuffix('...').strip()}")
        if not rules:
            lines[-1] = "  rules: {}"
    if ep:
        lines += ["expert_parallel:"] + ["  " + x for x in yaml.safe_dump(ep, sort_keys=False).splitlines()]
    return "\n".join(x for x in lines if x != "{}") + "\n"
