"""Reading torch ``parallelize_module`` plans from Python source with ``ast`` (the file is never run); see
:mod:`meshplan.convert.torch_source` for what is found where."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from meshplan.convert.common import Notes
from meshplan.errors import PlanError

__all__ = ["read_torch_plans"]

_STYLES = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"}


class _Literal:
    """Evaluates the literal subset of Python a plan's style arguments are written in."""

    def __init__(self, source: str, where: str):
        self.source, self.where = source, where

    def fail(self, node: ast.AST) -> PlanError:
        text = ast.get_source_segment(self.source, node) or type(node).__name__
        return PlanError(f"{self.where}:{node.lineno}: cannot read {text!r} without running the file (meshplan "
                         f"never runs it); expected a literal: Replicate(), Shard(n), Partial(), True/False, a "
                         f"number, None, or a tuple of them")

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, str))):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        name = _name(node.func) if isinstance(node, ast.Call) else None
        if name in ("Replicate", "Partial") and not node.args:
            return name.lower()
        if name == "Shard" and len(node.args) == 1:
            return f"shard({self.value(node.args[0])})"
        raise self.fail(node)

    def style(self, node: ast.AST) -> tuple[str, dict] | None:
        name = _name(node.func) if isinstance(node, ast.Call) else None
        if name not in _STYLES:
            return None
        if node.args:
            raise self.fail(node)
        return name, {k.arg: self.value(k.value) for k in node.keywords}


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _loop_prefixes(tree: ast.AST) -> dict[str, str]:
    """Loop variables bound to the children of a module attribute: ``block`` → ``layers.*``."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.For):
            continue
        it = node.iter.args[0] if isinstance(node.iter, ast.Call) and _name(node.iter.func) == "enumerate" \
            and node.iter.args else node.iter
        if isinstance(it, ast.Call) and _name(it.func) in ("items", "named_children", "values", "children"):
            it = it.func.value
        path = _dotted(it)
        target = node.target.elts[-1] if isinstance(node.target, ast.Tuple) else node.target
        if path and len(path) > 1 and isinstance(target, ast.Name):
            out[target.id] = ".".join(path[1:]) + ".*"
    return out


def _dicts(tree: ast.AST) -> dict[str, ast.Dict]:
    """Dict literals assigned to a name (the last assignment of each name)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value
    return out


def _found(tree: ast.AST, name: str | None, where: str) -> list[tuple[str, ast.Dict]]:
    """``(key prefix, dict)`` of every plan in the file (see the module doc)."""
    dicts, loops, plans = _dicts(tree), _loop_prefixes(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "parallelize_module":
            args = list(node.args) + [None] * 3
            kw = {k.arg: k.value for k in node.keywords}
            module, plan = kw.get("module", args[0]), kw.get("parallelize_plan", args[2])
            plan = dicts.get(plan.id) if isinstance(plan, ast.Name) else plan
            path = _dotted(module) if module is not None else None
            if isinstance(plan, ast.Dict) and path:
                prefix = loops.get(path[0], "") if len(path) == 1 else ".".join(path[1:])
                plans.append((prefix, plan))
    if plans and name is None:
        return plans
    named = {k: d for k, d in dicts.items() if any(isinstance(v, ast.Call) and _name(v.func) in _STYLES
                                                    for v in d.values) or k == "parallelize_plan" and not d.keys}
    if name is not None:
        if name not in named:
            raise PlanError(f"{where}: no dict of ParallelStyles named {name!r}; found {sorted(named) or 'none'}")
        return [("", named[name])]
    if len(named) != 1:
        raise PlanError(f"{where}: found {len(named)} dicts of ParallelStyles ({', '.join(sorted(named)) or 'none'}) "
                        f"and no parallelize_module call; expected one, or pass --name to pick one")
    return [("", next(iter(named.values())))]


def read_torch_plans(source: str | Path, name: str | None, notes: Notes) -> dict[str, tuple[str, dict]]:
    """``{module pattern: (torch style class, its keyword arguments as plan layouts)}`` of a Python file.

    Raises:
        PlanError: unreadable file, no plan, a key that is not a string, an argument that is not a literal.
    """
    where = str(source)
    from meshplan.plan_file.reading import read_text
    text = read_text(source, "Python source file")  # bounded: a regular file of at most 4 MiB
    try:
        tree = ast.parse(text, where)
    except (OSError, SyntaxError, ValueError) as e:
        raise PlanError(f"{where}: cannot read Python source: {getattr(e, 'strerror', None) or e}") from None
    lit, out = _Literal(text, where), {}
    for prefix, d in _found(tree, name, where):
        for k, v in zip(d.keys, d.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise lit.fail(k if k is not None else d)
            style = lit.style(v)
            key = f"{prefix}.{k.value}" if prefix else k.value
            if style is None:
                notes.drop(f"{key!r} ({ast.get_source_segment(text, v)})", "not one of torch's ParallelStyles "
                           f"({', '.join(sorted(_STYLES))}); meshplan cannot tell what it does")
                continue
            out[re.sub(r"\.\d+(?=\.|$)", ".*", key)] = style
    return out
