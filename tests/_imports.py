"""The import graph of ``meshplan/``, read from the source with :mod:`ast` (nothing is imported).

Every ``import`` and ``from … import`` counts, at any depth: module level, inside functions and methods (lazy
imports), under ``if TYPE_CHECKING:`` or ``try:``, relative ones resolved against the importing module, and the lazy
``__getattr__`` loaders of a package's ``__init__`` (they are function-level imports of the package). A lazy import
only moves a dependency in time; two modules that need each other are one unit however late one of them imports
the other (issue 26), so :func:`cycles` reads them all.

Edges: ``from a.b import c`` reaches ``a.b.c`` when that is a module, else ``a.b``; importing ``a.b.c`` also runs
the packages ``a.b`` above it (their ``__init__``), except the root ``meshplan`` (every module sits under it and
its loaders are lazy). A module's own packages are not edges: they run before it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "meshplan"
ROOT = "meshplan"


@dataclass(frozen=True)
class Import:
    """One internal import statement's target.

    Args:
        source: the importing module (dotted).
        target: the imported module (dotted; a name imported from a module resolves to the module).
        line: the statement's line in ``source``.
        in_function: the statement sits inside a function or method (a lazy import).
    """

    source: str
    target: str
    line: int
    in_function: bool


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """Every module of the package, dotted name → file (a package is its ``__init__.py``)."""
    out = {}
    for f in sorted(pkg.rglob("*.py")):
        parts = f.relative_to(pkg.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _resolve(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, is_package: bool, node: ast.AST, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == ROOT or a.name.startswith(ROOT + ".")]
    if not isinstance(node, ast.ImportFrom):
        return []
    mod = _resolve(name, is_package, node)
    if mod != ROOT and not mod.startswith(ROOT + "."):
        return []
    subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
    plain = [a for a in node.names if f"{mod}.{a.name}" not in known]
    return subs + ([mod] if plain or not subs else [])


def _walk(tree: ast.AST, in_function: bool = False):
    """Yield ``(node, in_function)`` for every node below ``tree``."""
    for child in ast.iter_child_nodes(tree):
        yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def imports(known: dict[str, Path] | None = None) -> list[Import]:
    """Every internal import of the package, one :class:`Import` per imported module per statement."""
    known = modules() if known is None else known
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, in_function in _walk(tree):
            out.extend(Import(name, t, node.lineno, in_function) for t in _targets(name, is_package, node, known))
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines of the statements under ``if TYPE_CHECKING:`` (never run: annotations only)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for stmt in node.body:
                out.update(range(stmt.lineno, stmt.end_lineno + 1))
    return out


def external(known: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module → the top-level names of the other packages it imports (``torch``, ``yaml``, …), at any depth
    (inside functions too), but not under ``if TYPE_CHECKING:``, which never runs."""
    known = modules() if known is None else known
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        found = set()
        for node, _ in _walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        out[name] = found - {ROOT}
    return out


def closure(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or not (not ``start`` itself unless in a cycle)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _packages(mod: str, known: dict[str, Path]) -> list[str]:
    """``mod`` and the packages above it that importing it runs (not the root)."""
    parts = mod.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts) + 1)) if p in known] or (
        [mod] if mod in known else [])


def graph(found: list[Import] | None = None, known: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module → the modules it imports (at any depth), with the packages those run first."""
    known = modules() if known is None else known
    found = imports(known) if found is None else found
    out: dict[str, set[str]] = {name: set() for name in known}
    for imp in found:
        own = set(_packages(imp.source, known))
        out[imp.source].update(m for m in _packages(imp.target, known) if m not in own and m != imp.source)
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, smallest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: no recursion limit on a long chain
        work = [(start, iter(sorted(g.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(g.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for n in sorted(g):
        if n not in index:
            visit(n)
    return sorted(out, key=lambda c: (len(c), c))


def summary() -> dict[str, int]:
    """The numbers issue 26 tracks: cycles, modules in them, internal imports in all and inside functions."""
    found = imports()
    comps = cycles(graph(found))
    return {"cycles": len(comps), "modules_in_cycles": sum(map(len, comps)), "imports": len(found),
            "function_level": sum(i.in_function for i in found)}


if __name__ == "__main__":
    print(summary())
    for c in cycles(graph()):
        print(len(c), " ".join(m.removeprefix("meshplan.") for m in c))
