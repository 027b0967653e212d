"""Reading torch ``parallelize_module`` plans from Python source with ``ast`` (the file is never run); see
:mod:`meshplan.convert.torch_source` for what is found where."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Mapping

from meshplan.convert.common import Notes
from meshplan.errors import PlanError

__all__ = ["read_torch_plans"]



def _dotted(node: ast.AST) -> list[str] | None:
    from meshplan.convert.torch_eval import dotted
    return dotted(node)


def _name(node: ast.AST) -> str | None:
    from meshplan.convert.torch_eval import call_name
    return call_name(node)


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


def _functions(tree: ast.Module) -> dict[int, ast.FunctionDef]:
    """``id(node)`` → its innermost enclosing function."""
    out = {}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.update({id(n): f for n in ast.walk(f) if n is not f})
    return out


def _guards(stmts: list[ast.stmt], guards: tuple, out: dict) -> None:
    """``id(call)`` → the ``if`` conditions (test, branch) a call sits under."""
    for s in stmts:
        if isinstance(s, ast.If):
            _guards(s.body, guards + ((s.test, True),), out)
            _guards(s.orelse, guards + ((s.test, False),), out)
        elif isinstance(s, (ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef)):
            for block in (s.body, getattr(s, "orelse", []), getattr(s, "finalbody", []),
                          *[h.body for h in getattr(s, "handlers", [])]):
                _guards(block, guards if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) else (), out)
        else:
            out.update({id(n): guards for n in ast.walk(s) if isinstance(n, ast.Call)})


def _calls(tree: ast.Module) -> list[tuple[str, ast.AST, ast.FunctionDef | None, tuple]]:
    """``(key prefix, plan argument, enclosing function, its if-conditions)`` of every ``parallelize_module``
    call."""
    loops, funcs, out, guards = _loop_prefixes(tree), _functions(tree), [], {}
    _guards(tree.body, (), guards)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "parallelize_module":
            args = list(node.args) + [None] * 3
            kw = {k.arg: k.value for k in node.keywords}
            module, plan = kw.get("module", args[0]), kw.get("parallelize_plan", args[2])
            path = _dotted(module) if module is not None else None
            if plan is not None and path:
                base = loops.get(path[0])  # a loop variable: block → layers.*; block.moe → layers.*.moe
                prefix = ".".join([base, *path[1:]] if base else path[1:])
                out.append((prefix, plan, funcs.get(id(node)), guards.get(id(node), ())))
    return out


def _module_dicts(tree: ast.Module, name: str | None, where: str) -> list[tuple[str, ast.AST, None, tuple]]:
    """Without calls: the module-level dict literals of style calls (``name`` picks one)."""
    from meshplan.convert.torch_eval import STYLES
    dicts = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
             for t in node.targets if isinstance(t, ast.Name)}
    named = {k: d for k, d in dicts.items() if any(isinstance(v, ast.Call) and _name(v.func) in STYLES
                                                    for v in d.values) or k == "parallelize_plan" and not d.keys}
    if name is not None:
        if name not in named:
            raise PlanError(f"{where}: no dict of ParallelStyles named {name!r}; found {sorted(named) or 'none'}")
        return [("", named[name], None, ())]
    if len(named) > 1:
        raise PlanError(f"{where}: found {len(named)} dicts of ParallelStyles ({', '.join(sorted(named))}) and no "
                        f"parallelize_module call; expected one, or pass --name to pick one")
    return [("", d, None, ()) for d in named.values()]


def _nothing(tree: ast.Module, where: str) -> PlanError:
    """The refusal of a file with no plan, naming the parallelizing calls it found instead."""
    funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and "parallel" in f.name]
    calls = [f"{ast.unparse(c)} (line {c.lineno})" for f in funcs for c in ast.walk(f) if isinstance(c, ast.Call)
             and re.search(r"parallel|shard", _name(c.func) or "", re.I)]
    found = f"; found in {', '.join(f.name + '()' for f in funcs)}: {', '.join(dict.fromkeys(calls)) or 'no call'}" \
        if funcs else ""
    return PlanError(f"{where}: no parallelize_module call and no dict of ParallelStyles{found[:400]}: the layouts "
                     f"live where those calls read them (a model's own sharding config is not readable from this "
                     f"file); meshplan reads parallelize_module plans only; convert the file that holds them")


def _options_error(where: str, unresolved: dict) -> PlanError:
    parts = [f"{k} (line {line}: {yes} if true, {no} if false)" for k, (line, yes, no) in unresolved.items()]
    return PlanError(f"{where}: the plan depends on options meshplan cannot read without running the file: "
                     f"{'; '.join(parts)}; pass --set NAME=true|false for each (e.g. --set "
                     f"{next(iter(unresolved)).rpartition('.')[2]}=true)")


def _plans(tree: ast.Module, text: str, where: str, name: str | None, settings: Mapping[str, Any],
           notes: Notes) -> list[tuple[str, Any]]:
    """``(key prefix, evaluated plan)`` of every plan in the file, under the options ``settings``."""
    from meshplan.convert.torch_eval import Evaluator, scope_of
    found = _calls(tree) if name is None else []
    found = found or _module_dicts(tree, name, where)
    if not found:
        raise _nothing(tree, where)
    plans, unresolved, used, assumed = [], {}, set(), {}
    for prefix, node, func, guards in found:
        ev = Evaluator(text, where, *scope_of(tree, func), settings)
        if all(ev.truth(t, node if want else None, None if want else node) == want for t, want in guards):
            plans.append((prefix, ev.value(node)))  # a call under a false condition is not made
        unresolved = {**ev.unresolved, **unresolved}  # the first place each option was met
        used |= ev.used
        assumed.update(ev.assumed)
    if unresolved:
        raise _options_error(where, unresolved)
    for key in sorted(set(settings) - used):
        if not re.search(rf"\b{re.escape(key.rpartition('.')[2])}\b", text):  # read on no branch taken: fine
            notes.drop(f"--set {key}", "the file names no such option")
    for key, why in assumed.items():
        notes.assume(key, why)
    return plans


def read_torch_plans(source: str | Path, name: str | None, notes: Notes,
                     settings: Mapping[str, Any] = {}) -> dict[str, tuple[str, dict]]:
    """``{module pattern: (torch style class, its keyword arguments as plan layouts)}`` of a Python file.

    Raises:
        PlanError: unreadable file, no plan, a key that is not a string, an argument that is not a literal, a
        condition the options do not decide.
    """
    from meshplan.convert.torch_eval import STYLES, StyleCall
    where = str(source)
    from meshplan.plan_file.reading import read_text
    text = read_text(source, "Python source file")  # bounded: a regular file of at most 4 MiB
    try:
        tree = ast.parse(text, where)
    except (OSError, SyntaxError, ValueError) as e:
        raise PlanError(f"{where}: cannot read Python source: {getattr(e, 'strerror', None) or e}") from None
    out = {}
    for prefix, plan in _plans(tree, text, where, name, settings, notes):
        for k, style in (plan.items() if isinstance(plan, dict) else [("", plan)]):
            key = ".".join(x for x in (prefix, k) if x)
            if isinstance(style, StyleCall) and style.cls == "NoParallel" and not style.kwargs.get("output_layout"):
                notes.assume(f"{key!r} ({style.text})", "torchtitan's NoParallel read as replicate (parameters "
                             "replicated over tp)")
                style = StyleCall("NoParallel", {k.replace("input_layout", "input_layouts"): v for k, v in
                                                 style.kwargs.items()}, style.text)
            elif not isinstance(style, StyleCall) or style.cls not in STYLES:
                shown = repr(style) if not isinstance(style, StyleCall) else style.text if \
                    style.text.startswith(style.cls) else f"{style.cls}: {style.text}"
                notes.lose(f"{key!r} ({shown})", f"not one of torch's ParallelStyles ({', '.join(sorted(STYLES))});"
                           f" meshplan cannot tell what it does")
                continue
            out[re.sub(r"\.\d+(?=\.|$)", ".*", key)] = (style.cls, style.kwargs)
    return out
