"""The house rules of ``meshplan/``, checked on its source (no torch needed).

* modules stay small (:data:`MAX_MODULE_LINES`) and so do functions (:data:`MAX_FUNCTION_LINES`, docstring not
  counted);
* the package imports without a cycle (module-level imports; lazy imports inside functions are allowed to
  break a dependency, not to form a cycle at import time); counting imports at any depth (``tests/_imports.py``),
  the cycles left are pinned in :data:`KNOWN_CYCLES` and may only shrink (issue 26);
* runtime state lives in ONE record on the model (``_meshplan_state``); no other ``_meshplan_*`` attribute;
* torch's private APIs are touched in ``meshplan/_torch.py`` only: no ``torch.*._module`` import elsewhere, and no
  ``obj._name`` access to a private name that meshplan does not define itself;
* a style's meaning lives in the style table (its torch-free semantics and its torch builds: two files): no
  comparison with a style name anywhere else;
* one divisors helper (:func:`meshplan.mesh.ranks.divisors`), one module-path pattern matcher
  (:mod:`meshplan.plan_file.patterns`);
* floors (issue 26, :data:`FLOORS`): the torch-free spec layer imports nothing above it and no torch, at any depth;
  model helpers on the ground floor; the rehearsals above apply; nothing imports upwards; no axis folder imports
  ``meshplan/state.py`` (but :data:`STATE_IMPORTERS_LEFT`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import _imports as _graph

pytestmark = pytest.mark.fast

PKG = Path(__file__).resolve().parents[1] / "meshplan"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
#: the style table, in two files: what a style name means (torch-free, the spec layer) and its torch builds
STYLE_TABLE = (PKG / "plan_file" / "style_semantics.py", PKG / "tensor_parallel" / "style_table.py")
PRIVATE_TORCH = PKG / "_torch.py"
#: Private names of other libraries (not torch) meshplan uses, each where and why; nothing else may use them.
OTHER_LIBRARY_PRIVATE = {
    ("meshplan/weights/materialize.py", "_initialize_weights"):
        "transformers' per-module initializer; its public initialize_weights() walks the whole model in one call, "
        "materialize calls it module by module (the same walk) to hold one module's full parameters at a time",
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()
TREES = {name: ast.parse(f.read_text(), str(f)) for name, f in MODULES.items()}


def _rel(name: str) -> str:
    return str(MODULES[name].relative_to(PKG.parent))


def test_modules_are_small():
    big = {_rel(n): len(f.read_text().splitlines()) for n, f in MODULES.items()}
    assert {k: v for k, v in big.items() if v > MAX_MODULE_LINES} == {}


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = fn.end_lineno - fn.lineno + 1
    doc = fn.body[0] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) and isinstance(fn.body[0].value.value, str) else None
    return lines - ((doc.end_lineno - doc.lineno + 1) if doc is not None else 0)


def test_functions_are_small():
    long = {}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_FUNCTION_LINES:
                long[f"{_rel(name)}:{node.lineno} {node.name}"] = _body_lines(node)
    assert long == {}


def _imports(name: str, tree: ast.Module, top_level_only: bool) -> set[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("meshplan"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("meshplan"))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{_rel(name)}:{node.lineno}: relative import; meshplan imports absolutely")
    # importing a.b.c imports the packages a and a.b first
    ancestors = set(_parents(name))  # a module's packages are imported before it: not a cycle
    return {m for imp in out for m in _parents(imp)} - ancestors


def _parents(mod: str) -> list[str]:
    """``mod`` and the packages importing it imports first (not the root: ``meshplan`` is always importing)."""
    parts = mod.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2 if len(parts) > 1 else 1, len(parts) + 1))
            if p in MODULES]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    graph = {n: _imports(n, t, top_level_only=True) for n, t in TREES.items()}
    assert _cycle(graph) is None


#: Issue 26 ("axis as a unit"): the import cycles left when imports at ANY depth count (a function-level import
#: only moves a dependency in time). Read by tests/_imports.py; 5 cycles over 32 modules before issue 26's first
#: step, 1 over 10 (the state cycle) before state.py stopped naming the axes' record classes, none now. This list
#: may only shrink: a new cycle, or a module joining one, fails; a cycle broken must leave it.
KNOWN_CYCLES: list[list[str]] = []


def test_import_cycles_at_any_depth_only_shrink():
    found = _graph.cycles(_graph.graph())
    new = [c for c in found if not any(set(c) <= set(k) for k in KNOWN_CYCLES)]
    assert new == [], f"import cycles (strongly connected components, function-level imports counted) that are " \
                      f"new or grew beyond KNOWN_CYCLES (issue 26): {new}"
    assert found == KNOWN_CYCLES, f"the cycles shrank: write KNOWN_CYCLES = {found}"


def test_import_reader_sees_every_import(tmp_path):
    pkg = tmp_path / "meshplan"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from meshplan.sub.b import thing\n    return thing\n")
    (pkg / "a.py").write_text("import os\nfrom meshplan import c\n")
    (pkg / "c.py").write_text("def f():\n    if True:\n        import meshplan.sub.b as b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from . import d\nfrom ..a import x\n")
    (pkg / "sub" / "d.py").write_text("from .b import y\n")
    known = _graph.modules(pkg)
    found = _graph.imports(known)
    assert {(i.source, i.target, i.in_function) for i in found} == {
        ("meshplan", "meshplan.sub.b", True), ("meshplan.a", "meshplan.c", False),
        ("meshplan.c", "meshplan.sub.b", True), ("meshplan.sub.b", "meshplan.sub.d", False),
        ("meshplan.sub.b", "meshplan.a", False), ("meshplan.sub.d", "meshplan.sub.b", False)}
    g = _graph.graph(found, known)
    assert g["meshplan.c"] == {"meshplan.sub", "meshplan.sub.b"}  # importing sub.b runs sub/__init__ first
    assert _graph.cycles(g) == [["meshplan.a", "meshplan.c", "meshplan.sub.b", "meshplan.sub.d"]]


def _code_tokens(path: Path) -> list[tokenize.TokenInfo]:
    return [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type not in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE)]


def test_one_state_record_on_the_model():
    found = {}
    for name, f in MODULES.items():
        for t in _code_tokens(f):
            if t.type == tokenize.NAME and t.string.startswith("_meshplan") and t.string != "_meshplan_state":
                found.setdefault(_rel(name), set()).add(t.string)
        for s in re.findall(r"[\"'](_meshplan_\w+)[\"']", f.read_text()):
            if s != "_meshplan_state":
                found.setdefault(_rel(name), set()).add(s)
    assert found == {}


def _own_private_names() -> set[str]:
    """Private names meshplan defines itself: functions, classes, attributes it assigns, parameters."""
    own = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {n for n in own if n.startswith("_")}


def test_private_torch_only_in_torch_module():
    own = _own_private_names()
    found = []
    for name, tree in TREES.items():
        if MODULES[name] == PRIVATE_TORCH:
            continue
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                if m.split(".")[0] == "torch" and any(p.startswith("_") for p in m.split(".")[1:]):
                    found.append(f"{_rel(name)}:{node.lineno} imports {m}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in own and (_rel(name), node.attr) not in OTHER_LIBRARY_PRIVATE:
                found.append(f"{_rel(name)}:{node.lineno} uses .{node.attr}")
    assert found == []


def _style_names() -> set[str]:
    from meshplan.plan_file.tensor_parallel import STYLE_NAMES
    return set(STYLE_NAMES)


def test_style_names_are_compared_only_in_the_style_table():
    styles = _style_names()
    found = []

    def is_style(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and node.value in styles:
            return True
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_style(e) for e in node.elts)
        return isinstance(node, ast.Attribute) and node.attr == "style"

    for name, tree in TREES.items():
        if MODULES[name] in STYLE_TABLE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(is_style(x) for x in [node.left, *node.comparators]):
                found.append(f"{_rel(name)}:{node.lineno}")
            elif isinstance(node, ast.MatchValue) and is_style(node.value):
                found.append(f"{_rel(name)}:{node.lineno}")
    assert found == []


def test_one_divisors_helper_and_one_pattern_matcher():
    divisors = re.compile(r"for \w+ in range\([^)]*\) if [^\n]*% ?\w+ == 0")
    matcher = re.compile(r"\[\^\\?\.\]|fnmatch")
    found = []
    for name, f in MODULES.items():
        text = f.read_text()
        if divisors.search(text) and name != "meshplan.mesh.ranks":
            found.append(f"{_rel(name)}: a divisors loop (use meshplan.mesh.ranks.divisors)")
        if matcher.search(text) and name != "meshplan.plan_file.patterns":
            found.append(f"{_rel(name)}: a module-path matcher (use meshplan.plan_file.patterns)")
    assert found == []


# ------------------------------------------------------------------ floors (issue 26): who may import whom

def _under(mod: str, names: tuple[str, ...]) -> bool:
    return any(mod == n or mod.startswith(n + ".") for n in names)


#: The spec layer (docs/house.md): the plan as data, rank math, what a style name means, transformers' aliases, the
#: solver, the errors and the version, the Axis shape and the axes' torch-free halves (the solver's terms). It never
#: imports the runtime: no module outside it and no torch, at any depth (function-level imports counted).
SPEC_LAYER = ("meshplan.plan_file", "meshplan.solver", "meshplan.mesh.ranks", "meshplan.errors", "meshplan.version",
              "meshplan.axis", "meshplan.context_parallel.costs", "meshplan.context_parallel.chunks",
              "meshplan.context_parallel.masks",
              "meshplan.expert_parallel.costs", "meshplan.pipeline.costs",
              "meshplan.data_parallel.costs", "meshplan.tensor_parallel.costs")
#: modules under SPEC_LAYER's names that are not in it, and why
NOT_SPEC = {"meshplan.solver.api": "meshplan.estimate/solve read a built model (checks/model_shape): the runtime's "
                                   "door to the solver, above it"}
#: other packages that are the runtime: never imported by the spec layer
RUNTIME_PACKAGES = {"torch", "transformers", "safetensors"}
#: The floors, lowest first. A module imports (at any depth) only modules on its own floor or below. The floors not
#: listed by name hold the rest: "runtime" (parallelize, the axes, training, checkpoints, faults, …) sits between the
#: ground floor and the rehearsals. A package whose __init__ imports nothing belongs to every floor.
FLOORS: dict[str, tuple[str, ...]] = {
    "spec": SPEC_LAYER,
    # model helpers below everything that handles a model: copies, default batches, model shape, factories, the
    # call order of a small copy, the check report, private torch
    "ground": ("meshplan._torch", "meshplan.model_copies", "meshplan.checks.model_shape",
               "meshplan.checks.model_factory", "meshplan.checks.call_order", "meshplan.checks.report",
               "meshplan.hf.tiny_config"),
    "runtime": (),
    # the rehearsals sit above what they rehearse (apply): dry run, shadow run, numerics, memory, meshplan.check
    "rehearsal": ("meshplan.checks.dry_run", "meshplan.checks.shadow", "meshplan.checks.numerics",
                  "meshplan.checks.memory", "meshplan.checks.offline"),
    # the command line, the trainer behind ``meshplan train`` (an application of the public API), and the root
    # package itself (``meshplan``: the public names, its lazy loaders)
    "entry": ("meshplan.cli", "meshplan.__main__", "meshplan.trainer"),
}
#: (importer, imported) pairs allowed against the floors, each with why (none today; the list may only shrink)
FLOOR_EXCEPTIONS: dict[tuple[str, str], str] = {}
#: the axis folders (the units' and those joining: their records are attached by parallelize alone)
AXIS_FOLDERS = ("meshplan.context_parallel", "meshplan.expert_parallel", "meshplan.tensor_parallel",
                "meshplan.pipeline", "meshplan.data_parallel")
#: axis modules still importing meshplan/state.py (issue 26: none left; may only shrink)
STATE_IMPORTERS_LEFT: dict[str, str] = {}


def _floor(mod: str, graph: dict[str, set[str]]) -> int:
    names = list(FLOORS)
    if mod == "meshplan":
        return names.index("entry")
    for i in reversed(range(len(names))):
        if _under(mod, FLOORS[names[i]]) and mod not in NOT_SPEC:
            return i
    if MODULES[mod].name == "__init__.py" and not graph[mod]:
        return 0  # an empty package
    return names.index("runtime")


def test_the_spec_layer_never_imports_the_runtime():
    """In-process, from the import graph (every import at any depth): what the spec layer reaches is the spec layer
    (or an empty package), and none of it imports torch, transformers or safetensors."""
    graph, external = _graph.graph(), _graph.external()
    spec = {m for m in MODULES if _floor(m, graph) == 0}
    assert {"meshplan.plan_file.style_semantics", "meshplan.plan_file.hf_aliases", "meshplan.solver.search",
            "meshplan.solver.units", "meshplan.mesh.ranks"} <= spec
    outside = {m: sorted(_graph.closure(graph, m) - spec) for m in sorted(spec)}
    assert {m: v for m, v in outside.items() if v} == {}
    runtime = {m: sorted(external[m] & RUNTIME_PACKAGES) for m in sorted(spec)}
    assert {m: v for m, v in runtime.items() if v} == {}


def test_floors_import_downwards():
    """Rehearsals above apply, model helpers on the ground floor, the spec layer below all: no import goes up."""
    graph = _graph.graph()
    names = list(FLOORS)
    up = {}
    for mod, targets in graph.items():
        for t in targets:
            if _floor(t, graph) > _floor(mod, graph) and (mod, t) not in FLOOR_EXCEPTIONS:
                up.setdefault(mod, []).append(f"{t} ({names[_floor(t, graph)]})")
    assert up == {}, "imports going up a floor (tests/test_house.py FLOORS)"
    assert {names[_floor(m, graph)] for m in MODULES} == set(names)  # every floor holds modules


def test_no_axis_folder_imports_the_state_module():
    """``parallelize`` alone attaches the records; the axes never import meshplan/state.py (but the ones left)."""
    found = {i.source for i in _graph.imports() if i.target == "meshplan.state" and _under(i.source, AXIS_FOLDERS)}
    assert found == set(STATE_IMPORTERS_LEFT), f"axis modules importing meshplan.state: {sorted(found)}"
