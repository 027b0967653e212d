"""The static subset of Python a torch plan file is written in, evaluated with ``ast`` (the file is never run):
literals, placements (``Replicate()``, ``Shard(n)``, ``Partial()``), style calls, names bound in the enclosing
function or at module level (``plan = RowwiseParallel(...)``, ``colwise = ColwiseParallel``, tuple unpacking,
``from torch.distributed.tensor.parallel import ColwiseParallel as CP``), dict spreads, and conditionals
(``a if cond else b``, assignments under ``if cond:``) whose condition is an option the user sets
(``--set loss_parallel=true``) or a parameter default (one assumed line)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping

from meshplan.errors import PlanError

__all__ = ["Evaluator", "StyleCall", "StyleClass", "STYLES", "call_name", "dotted"]

#: torch's ParallelStyle classes meshplan reads
STYLES = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"}
#: styles of other libraries whose arguments are read too (torchtitan's NoParallel: parameters replicated)
OTHER_STYLES = {"NoParallel"}


@dataclass(frozen=True)
class StyleClass:
    """A reference to a style class (``colwise_parallel = ColwiseParallel``): ``name`` is its class name."""

    name: str


@dataclass(frozen=True)
class StyleCall:
    """A style object: its class name, keyword arguments as plan layouts, and its source text."""

    cls: str
    kwargs: dict
    text: str


def call_name(node: ast.AST) -> str | None:
    """The last name of a call's function (``ColwiseParallel``, ``tp.ColwiseParallel``)."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def dotted(node: ast.AST) -> list[str] | None:
    """``model.layers`` → ``["model", "layers"]``; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _bind(stmts: list[ast.stmt], guards: tuple, out: dict) -> None:
    """Every name bound in ``stmts`` (not in nested functions) → [(guards, value node)], in source order."""
    for s in stmts:
        if isinstance(s, ast.Assign):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append((guards, s.value))
                elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):  # plan["k"] = style
                    entry = ast.copy_location(ast.Dict(keys=[t.slice], values=[s.value]), s)
                    out.setdefault(t.value.id + ".update()", []).append((guards, entry))
                elif isinstance(t, ast.Tuple) and isinstance(s.value, ast.Tuple) and \
                        len(t.elts) == len(s.value.elts):
                    for name, value in zip(t.elts, s.value.elts):
                        if isinstance(name, ast.Name):
                            out.setdefault(name.id, []).append((guards, value))
        elif _mutated(s):
            out.setdefault(_mutated(s) + ".unread", []).append((guards, s))
        elif isinstance(s, ast.ImportFrom):
            for a in s.names:
                out.setdefault(a.asname or a.name, []).append((guards, StyleClass(a.name)))
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and call_name(s.value.func) == "update" \
                and isinstance(s.value.func, ast.Attribute) and isinstance(s.value.func.value, ast.Name) \
                and len(s.value.args) == 1:
            out.setdefault(s.value.func.value.id + ".update()", []).append((guards, s.value.args[0]))
        elif isinstance(s, ast.If):
            _bind(s.body, guards + ((s.test, True),), out)
            _bind(s.orelse, guards + ((s.test, False),), out)
        elif isinstance(s, (ast.For, ast.While, ast.With, ast.Try)):
            for block in (s.body, getattr(s, "orelse", []), getattr(s, "finalbody", []),
                          *[h.body for h in getattr(s, "handlers", [])]):
                _bind(block, guards, out)


def _mutated(s: ast.stmt) -> str | None:
    """The name a statement changes in a way the reader does not follow (``plan.pop(k)``, ``del plan[k]``,
    ``plan |= {...}``), else None."""
    call = s.value if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) else None
    if call is not None and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and \
            call.func.attr in ("pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"):
        return call.func.value.id
    targets = s.targets if isinstance(s, ast.Delete) else [s.target] if isinstance(s, ast.AugAssign) else []
    for t in targets:
        t = t.value if isinstance(t, ast.Subscript) else t
        if isinstance(t, ast.Name):
            return t.id
    return None


def scope_of(tree: ast.Module, func: ast.FunctionDef | None) -> tuple[dict, dict]:
    """(bindings, parameter defaults) of a function, the module's bindings under them."""
    names: dict = {}
    _bind(tree.body, (), names)
    defaults: dict = {}
    if func is not None:
        local: dict = {}
        _bind(func.body, (), local)
        names = {**names, **local}
        args = func.args.posonlyargs + func.args.args
        for a, d in zip(args[len(args) - len(func.args.defaults):], func.args.defaults):
            defaults[a.arg] = d
        for a, d in zip(func.args.kwonlyargs, func.args.kw_defaults):
            if d is not None:
                defaults[a.arg] = d
        for a in args + func.args.kwonlyargs:
            if a.arg not in local:
                names.pop(a.arg, None)  # the parameter shadows a module-level name
    return names, defaults


class Evaluator:
    """Evaluates plan expressions in one scope. Conditions it cannot decide are collected in ``unresolved``
    (``{option: (line, text if true, text if false)}``) and taken as true, so one pass finds them all."""

    def __init__(self, text: str, where: str, names: dict, defaults: dict, settings: Mapping[str, Any]):
        self.text, self.where, self.names, self.defaults, self.settings = text, where, names, defaults, settings
        self.unresolved: dict[str, tuple[int, str, str]] = {}
        self.used: set[str] = set()
        self.assumed: dict[str, str] = {}
        self._depth = 0

    def src(self, node: Any, width: int = 0) -> str:
        text = (ast.get_source_segment(self.text, node) or type(node).__name__) if isinstance(node, ast.AST) \
            else getattr(node, "name", str(node))
        text = " ".join(text.split()).replace("( ", "(").replace(", )", ")")
        return text if not width or len(text) <= width else text[:width - 1] + "…"

    def fail(self, node: ast.AST) -> PlanError:
        return PlanError(f"{self.where}:{node.lineno}: cannot read {self.src(node)!r} without running the file "
                         f"(meshplan never runs it); expected a literal (Replicate(), Shard(n), Partial(), True/False,"
                         f" a number, None, a tuple), a style call, or a name bound to one")

    def option(self, node: ast.AST) -> tuple[str, Any] | None:
        """The value of an option named by ``node`` (``loss_parallel``, ``job_config.x.loss_parallel``)."""
        path = dotted(node)
        if path is None:
            return None
        for key in (".".join(path), path[-1]):
            if key in self.settings:
                self.used.add(key)
                return key, self.settings[key]
        if len(path) == 1 and isinstance(self.defaults.get(path[0]), ast.Constant):
            value = self.defaults[path[0]].value
            self.assumed[path[0]] = f"{value!r} (the parameter's default; pass --set {path[0]}=… to change it)"
            return path[0], value
        return ".".join(path), _UNSET

    def truth(self, test: ast.AST, yes: Any = None, no: Any = None) -> bool:
        """Is a condition true under the options? Unknown: recorded with both branches, taken as true."""
        if isinstance(test, ast.Constant):
            return bool(test.value)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return not self.truth(test.operand, no, yes)
        if isinstance(test, ast.BoolOp):  # short-circuit, as Python does
            stop = not isinstance(test.op, ast.And)
            return next((stop for v in test.values if self.truth(v, yes, no) == stop), not stop)
        found = self.option(test.left if isinstance(test, ast.Compare) else test)
        if found is not None and found[1] is not _UNSET:
            if not isinstance(test, ast.Compare):
                return bool(found[1])
            if len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant):
                other, op = test.comparators[0].value, type(test.ops[0])
                if op in _COMPARE:
                    return _COMPARE[op](found[1], other)
        key = found[0] if found is not None else self.src(test, 60)
        cond = self.src(test, 60)
        self.unresolved.setdefault(key, (test.lineno, ("" if cond == key else f"{cond}: ") +
                                         (self.src(yes, 70) if yes is not None else "…"),
                                         self.src(no, 70) if no is not None else "…"))
        return True

    def value(self, node: Any) -> Any:
        """The value of an expression: a literal, a placement text, a StyleCall, a StyleClass, a dict, a list."""
        if isinstance(node, StyleClass):
            return node
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, str))):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.truth(node.operand)
        if isinstance(node, (ast.Tuple, ast.List)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return self._dict(node)
        if isinstance(node, ast.IfExp):
            return self.value(node.body if self.truth(node.test, node.body, node.orelse) else node.orelse)
        if isinstance(node, ast.Name) and node.id in self.names:
            return self._name(node)
        if isinstance(node, (ast.Name, ast.Attribute)):
            found = self.option(node)
            if found is not None and found[1] is not _UNSET:
                return found[1]
            if call_name(node) in STYLES:  # ColwiseParallel, tp.ColwiseParallel
                return StyleClass(call_name(node))
        if isinstance(node, ast.Call):
            return self._call(node)
        raise self.fail(node)

    def _dict(self, node: ast.Dict) -> dict:
        out: dict = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                spread = self.value(v)
                if not isinstance(spread, dict):
                    raise self.fail(v)
                out.update(spread)
            elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                out[k.value] = self.value(v)
            else:
                raise self.fail(k)
        return out

    def _name(self, node: ast.Name) -> Any:
        bound = self.names[node.id]
        def branch(test: ast.AST, want: bool) -> Any:
            return next((v for g, v in bound if (test, want) in g), None)
        live = [v for guards, v in bound if all(self.truth(t, branch(t, True), branch(t, False)) == want
                                                for t, want in guards)]
        if not live:
            raise self.fail(node)
        self._depth += 1
        if self._depth > 50:
            raise self.fail(node)
        try:
            found = self.value(live[-1])
            if isinstance(found, dict) and node.id + ".unread" in self.names:
                stmt = self.names[node.id + ".unread"][0][1]
                raise PlanError(f"{self.where}:{stmt.lineno}: cannot follow {self.src(stmt, 80)!r} on the plan "
                                f"{node.id!r} without running the file (meshplan never runs it); meshplan follows "
                                f"assignments, .update({{...}}) and {node.id}[key] = style")
            if isinstance(found, dict):  # NAME.update({...}) calls, where their conditions hold
                for guards, arg in self.names.get(node.id + ".update()", []):
                    if all(self.truth(t, arg if want else None, None if want else arg) == want for t, want in guards):
                        found = {**found, **self.value(arg)}
            return found
        finally:
            self._depth -= 1

    def _call(self, node: ast.Call) -> Any:
        name = call_name(node.func)
        if name in ("Replicate", "Partial") and not node.args and not node.keywords:
            return name.lower()
        if name == "Shard" and len(node.args) == 1:
            return f"shard({self.value(node.args[0])})"
        cls = self.value(node.func) if isinstance(node.func, ast.Name) and node.func.id in self.names else \
            StyleClass(name) if name else None
        if not isinstance(cls, StyleClass):
            raise self.fail(node)
        if cls.name not in STYLES | OTHER_STYLES:
            for k in node.keywords:  # not read, but the conditions in them are reported with the others
                try:
                    self.value(k.value)
                except PlanError:
                    pass
            return StyleCall(cls.name, {}, self.src(node))
        if node.args:
            raise self.fail(node)
        return StyleCall(cls.name, {k.arg: self._argument(k.value) for k in node.keywords}, self.src(node))

    def _argument(self, node: ast.AST) -> Any:
        """A style's argument: a literal or placement (never a style or an unknown call)."""
        found = self.value(node)
        flat = found if isinstance(found, list) else list(found.values()) if isinstance(found, dict) else [found]
        if any(isinstance(x, (StyleCall, StyleClass)) for x in flat):
            raise self.fail(node)
        return found


_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Is: lambda a, b: a is b,
            ast.IsNot: lambda a, b: a is not b}


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset()
