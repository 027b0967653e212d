"""torch ``parallelize_module`` plans as Python source: written from a meshplan plan, read back with ``ast``.

Writing: one ``parallelize_plan`` dict, ``{module pattern: ParallelStyle(...)}`` (torch's ``parallelize_module``
matches ``*`` per path segment as meshplan does), with the layouts meshplan generates spelled out. A colwise
layer's parent input conversion (meshplan gathers a block input once for all its colwise layers) has no
arity-free torch spelling, so each colwise gathers its own input (``input_layouts=Shard(1)``): the same values,
more all-gathers (one dropped line).

Reading: the file is parsed, never run. Plans are the dict literals passed to ``parallelize_module(module, mesh,
plan)`` calls (by value or by a name assigned a dict literal): the module argument gives the key prefix
(``model`` → none, ``model.layers`` → ``layers``, a loop variable of ``for _, block in model.layers.items()`` →
``layers.*``); without calls, the dict literals of style calls assigned at module level (``name=`` picks one).
Style arguments must be literals (``Replicate()``, ``Shard(1)``, ``True``, tuples); anything else is an error
naming the line.
"""

from __future__ import annotations

from typing import Any

from meshplan.convert.common import HEAD_NAMES, Notes, is_replicate, layout_overrides, unheld_sections
from meshplan.errors import PlanError

__all__ = ["write_torch", "TORCH_STYLES"]

#: meshplan style → the torch ParallelStyle class that builds it (the others have no torch class)
TORCH_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel", "norm": "SequenceParallel",
                "embedding": "RowwiseParallel", "embedding_colwise": "ColwiseParallel", "lm_head": "ColwiseParallel",
                "prepare_input": "PrepareModuleInput", "prepare_output": "PrepareModuleOutput"}
_DEFAULTS = {"ColwiseParallel": {"input_layouts": "replicate", "output_layouts": "shard(-1)", "use_local_output": True},
             "RowwiseParallel": {"input_layouts": "shard(-1)", "output_layouts": "replicate", "use_local_output": True},
             "SequenceParallel": {"sequence_dim": 1, "use_local_output": False},
             "PrepareModuleInput": {"use_local_output": False}, "PrepareModuleOutput": {"use_local_output": True}}


def _placement(text: Any) -> str:
    if isinstance(text, list):
        return "(" + ", ".join(_placement(t) for t in text) + ("," if len(text) == 1 else "") + ")"
    if text is None:
        return "None"
    if not text.startswith("shard("):
        return "Replicate()" if is_replicate(text) else "Partial()"
    return f"Shard({text[len('shard('):-1]})"


def _call(cls: str, kwargs: dict) -> str:
    shown = {k: v for k, v in kwargs.items() if _DEFAULTS.get(cls, {}).get(k, object()) != v}
    def text(k: str, v: Any) -> str:
        if k.endswith("kwarg_layouts"):
            return "{" + ", ".join(f"{n!r}: {_placement(x)}" for n, x in (v or {}).items()) + "}"
        return _placement(v) if k.endswith("layouts") else repr(v)
    args = ", ".join(f"{k}={text(k, v)}" for k, v in shown.items())
    return f"{cls}({args})"


def _torch_rule(pattern: str, rule: Any, stream: Any, notes: Notes) -> str | None:
    from meshplan.plan_file.style_semantics import SEMANTICS
    spec, o = SEMANTICS[rule.style], rule.overrides()
    cls = TORCH_STYLES.get(rule.style)
    if (o.get("packed") or 1) > 1:
        raise PlanError(f"tensor_parallel.rules.{pattern!r}: packed: {o['packed']} has no torch style (torch's "
                        f"ColwiseParallel splits a fused weight as one block, which mixes its parts); convert a plan "
                        f"without packed rules")
    if cls is None:
        notes.drop(f"rule {pattern!r} ({rule.style})", "torch has no ParallelStyle for it (meshplan builds its own); "
                   "the module is left out of the torch plan")
        return None
    if spec.stream_module:
        if stream.local:
            notes.drop(f"rule {pattern!r} ({rule.style})", "without sequence parallelism it does nothing")
            return None
        return _call(cls, {"sequence_dim": int(stream.layout[len("shard("):-1])})
    lay = spec.layouts(o, stream)
    if spec.parent_converts_input(o) and not is_replicate(stream.layout):
        lay["input_layouts"] = stream.layout  # each colwise gathers its own input (see the module doc)
    return _call(cls, lay)


def write_torch(plan: Any, notes: Notes) -> str:
    """The plan's tensor_parallel section as a Python module defining ``parallelize_plan``."""
    from meshplan.plan_file.layout_text import Stream
    unheld_sections(plan, {"tensor_parallel"}, "a torch parallelize_module plan", notes)
    layout_overrides(plan.layout, set(), "a torch parallelize_module plan (the DeviceMesh you pass holds the "
                     "degrees)", notes)
    section = plan.tensor_parallel
    stream = Stream.of(section)
    entries = []
    for pattern, rule in (section.rules.items() if section else ()):
        text = _torch_rule(pattern, rule, stream, notes)
        if text is not None:
            entries.append(f"    {pattern!r}: {text},")
    from meshplan.plan_file.style_semantics import SEMANTICS
    if section is not None and not stream.local and any(SEMANTICS[r.style].parent_converts_input(r.overrides())
                                                        for r in section.rules.values()):
        notes.drop("the one input conversion per block (colwise parents)", "torch's PrepareModuleInput needs the "
                   "parent's argument layout; each colwise layer all-gathers its own input instead (same values)")
    if section is not None and section.loss_parallel:
        entries.append("    # logits stay vocab-sharded: compute the loss under torch.distributed.tensor.parallel."
                       "loss_parallel()")
    head = (f'"""Generated by `meshplan convert --to torch`{" from " + plan.source if plan.source else ""}.\n\n'
            f"    parallelize_module(model, tp_mesh, parallelize_plan)\n\"\"\"\n\n"
            "from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: F401\n"
            "from torch.distributed.tensor.parallel import (  # noqa: F401\n"
            "    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,\n)\n\n")
    return head + "parallelize_plan = {\n" + "\n".join(entries) + ("\n" if entries else "") + "}\n"


_EMBEDDING_NAME = ("embed", "wte", "wpe", "tok")
_HEAD_NAME = HEAD_NAMES


def _kind(key: str, modules: dict[str, str] | None, names: tuple[str, ...], cls: str, notes: Notes) -> bool:
    """Is module ``key`` an embedding (``names``: _EMBEDDING_NAME) or the output head: by its class when the model
    is known, else by its name (an assumed line)."""
    if modules is not None:
        found = modules.get(key, "")
        return ("Embedding" in found) if names is _EMBEDDING_NAME else key in modules.get("(output)", "").split(",")
    last = key.rpartition(".")[2]
    hit = any(n in last for n in names) if names is _EMBEDDING_NAME else last in names
    if hit:
        notes.assume(f"{key!r} ({cls}) is the {'input embedding' if names is _EMBEDDING_NAME else 'output head'}",
                     "by its name (pass --model to read the module types)")
    return hit


def _stream(styles: dict[str, tuple[str, dict]]) -> Any:
    from meshplan.plan_file.layout_text import Stream
    dims = {kw.get("sequence_dim", 1) for cls, kw in styles.values() if cls == "SequenceParallel"}
    sp = "batch" if dims == {0} else bool(dims)
    heads = [kw for cls, kw in styles.values() if cls == "ColwiseParallel" and kw.get("use_local_output") is False
             and kw.get("output_layouts", "shard(-1)") == "shard(-1)"]
    return Stream(sp, bool(heads))


def _rule(key: str, cls: str, kw: dict, stream: Any, modules: dict | None, notes: Notes) -> Any:
    from meshplan.convert.common import rule_data
    lay = {**_DEFAULTS.get(cls, {}), **kw}
    lay.pop("sequence_dim", None)
    if cls == "SequenceParallel":
        return "norm"
    if cls == "NoParallel":
        return {"style": "replicate", **kw}
    if cls in ("PrepareModuleInput", "PrepareModuleOutput"):
        return {"style": "prepare_input" if cls == "PrepareModuleInput" else "prepare_output", **kw}
    if cls == "RowwiseParallel" and is_replicate(lay["input_layouts"]) and \
            _kind(key, modules, _EMBEDDING_NAME, cls, notes):
        return rule_data("embedding", {"output_layouts": lay["output_layouts"]}, stream)
    if cls == "RowwiseParallel":
        lay.pop("use_local_output")  # the stream's local/DTensor form: meshplan's choice, same values
        return rule_data("rowwise", lay, stream)
    if _kind(key, modules, _EMBEDDING_NAME, cls, notes):
        return rule_data("embedding_colwise", {"output_layouts": lay["output_layouts"]}, stream)
    gathers_stream = lay["input_layouts"] == stream.layout and not is_replicate(stream.layout)
    if "*" not in key and gathers_stream or \
            _kind(key, modules, _HEAD_NAME, cls, notes):
        return rule_data("lm_head", lay, stream)
    if gathers_stream:
        lay.pop("input_layouts")  # each colwise gathered the stream itself: meshplan gathers once per parent
    return rule_data("colwise", lay, stream)


def _gathers(kw: dict) -> bool:
    """A PrepareModuleInput that turns its one tensor input Replicate (the colwise fan-out)."""
    want = [x for x in kw.get("desired_input_layouts") or [] if x]
    return len(want) == 1 and is_replicate(want[0])


def read_torch(source: Any, notes: Notes, name: str | None = None, modules: dict[str, str] | None = None,
               settings: Any = ()) -> dict:
    """Plan data from a Python file holding a ``parallelize_module`` plan (see the module doc).

    Args:
        source: the file. notes: gets what was assumed or dropped. name: the dict to read when the file has
        several. modules: ``{module pattern: class name}`` of the model (``"(output)"``: its output head), if known.
        settings: ``(name, value)`` pairs deciding the file's conditions (``--set loss_parallel=true``).
    """
    from meshplan.convert.torch_read import read_torch_plans
    styles = read_torch_plans(source, name, notes, dict(settings))
    stream = _stream(styles)
    parents = {k.rpartition(".")[0] for k, (cls, _) in styles.items() if cls == "ColwiseParallel"}
    rules = {}
    for key, (cls, kw) in styles.items():
        if cls == "PrepareModuleInput" and key in parents and _gathers(kw):
            continue  # the parent's one input conversion for its colwise layers: meshplan generates it
        rules[key] = _rule(key, cls, kw, stream, modules, notes)
    tp = {"sequence_parallel": stream.sequence_parallel, "loss_parallel": stream.loss_parallel, "rules": rules}
    return {"version": 1, "tensor_parallel": tp}
