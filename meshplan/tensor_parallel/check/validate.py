"""Static validation of a plan against a model, before any collective: what ``meshplan.parallelize`` checks first
and ``meshplan.check`` (:mod:`meshplan.checks.offline`, above parallelize) reports.

Every problem is collected (not only the first) as a :class:`~meshplan.PlanError`
naming the plan file, the rule, the module path, what was found and what was
expected. Checks, in order: the layout resolves; every rule matches a module
(else the closest module paths); no module is claimed by two different rules;
each style fits its module type; every sharded size divides (features, heads,
KV heads, vocabulary; packed chunks; ``model.config``); the layouts chain (a
rowwise needs a colwise sibling, overridden input layouts must match the
residual stream, an ``lm_head`` takes the stream, a ``gather`` needs a partial
output, sequence parallelism needs every norm on the stream listed). The rehearsals that apply the plan
(the shadow run, the meta dry run, ``--numerics``) sit above ``parallelize`` and are run by ``meshplan.check``
only; this module imports none of them (issue 26).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.tensor_parallel.check.head_params import per_head_outputs
from meshplan.tensor_parallel.check.layer_kinds import layer_kinds_hint
from meshplan.tensor_parallel.check.regions import is_norm, local_head_regions, region_errors, unequal_packed_parts
from meshplan.checks.report import Report, fold_errors
from meshplan.errors import PlanError
from meshplan.mesh.ranks import divisors_text
from meshplan.plan_file.document import Plan
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.patterns import match_rules, wildcard
from meshplan.tensor_parallel.generate import rules_where
from meshplan.tensor_parallel.heads import head_count_errors, safe_attr, sees_heads
from meshplan.plan_file.layout_text import residual_stream
from meshplan.tensor_parallel.style_table import STYLES, StyleSpec

__all__ = ["Report", "validate_plan", "static_checks", "smallest_world"]


class _Checker:
    def __init__(self, model: nn.Module, plan: Plan, tp: int, report: Report, token_regions: Any = set):
        self.model, self.plan, self.tp, self.r = model, plan, tp, report
        self.token_regions = token_regions  # () -> the other axes' token regions (MoE blocks): meshplan.axes
        self.section = plan.tensor_parallel
        self.where = rules_where(plan.source)
        self.modules = dict(model.named_modules())
        self.stream = residual_stream(self.section.sequence_parallel)

    def err(self, msg: str) -> None:
        self.r.errors.append(PlanError(msg))

    def loc(self, pattern: str) -> str:
        return f"{self.where}.{pattern!r}"

    # -- matching -------------------------------------------------------------------------------------
    def match(self) -> dict[str, tuple[str, Any]]:
        self.conflicts: set[str] = set()
        return match_rules(self.model, self.section.rules, self.where, errors=self.r.errors, conflicts=self.conflicts)

    # -- per module -----------------------------------------------------------------------------------
    def divides(self, loc: str, path: str, what: str, n: int, by: int = 1) -> bool:
        if n % (self.tp * by):
            per = f"packed({by}) x " if by > 1 else ""
            self.err(f"{loc}: module {path!r}: {per}tp({self.tp}) does not divide {what}({n}); found {n}, "
                     f"expected a multiple of {self.tp * by}; valid tp: {divisors_text(n // by)}")
            return False
        return True

    def module(self, path: str, pattern: str, rule: Any) -> None:
        """The style fits the module, and tp (times ``packed``) divides the size it shards."""
        mod, spec, loc = self.modules[path], STYLES[rule.style], self.loc(pattern)
        packed = getattr(rule, "packed", None) or 1
        if spec.fits is not None and not spec.fits(mod, packed):
            self.err(f"{loc}: module {path!r} is {type(mod).__name__}{spec.misfit}; style {spec.name} expects "
                     f"{spec.expects}")
            return
        if spec.sharded_dim is None:
            return
        what, n = spec.sharded_dim(mod)
        parent = self.modules[path.rpartition(".")[0]] if "." in path else self.model
        why = unequal_packed_parts(parent, self.model, n, packed) if spec.column_parallel else None
        if why:
            self.err(f"{loc}: module {path!r}: packed({packed}) cannot shard out_features({n}): {why}")
        elif n % packed:
            self.err(f"{loc}: module {path!r}: packed({packed}) splits {what}({n}) into {packed} equal parts, but "
                     f"{n} is not a multiple of {packed}: the fused parts are unequal, and packed shards equal "
                     f"parts only; found {n}, expected a multiple of {packed} (or gather the output: "
                     f"output_layouts: replicate)")
        elif self.divides(loc, path, what, n, packed) and spec.gives_local_heads(rule.overrides()):
            self.heads(loc, path, n // packed)

    def heads(self, loc: str, path: str, out: int) -> None:
        parent = self.modules[path.rpartition(".")[0]] if "." in path else self.model
        hd = getattr(parent, "head_dim", None)
        if isinstance(hd, int) and hd > 0 and out % hd == 0 and (out // hd) % self.tp:
            self.err(f"{loc}: module {path!r}: tp({self.tp}) does not divide its {out // hd} heads "
                     f"(out_features {out} / head_dim {hd}); found {out // hd} heads, expected a multiple of {self.tp}")

    # -- model-wide -----------------------------------------------------------------------------------
    def config(self, matched: dict[str, tuple[str, Any]]) -> None:
        """Head counts of the model config must divide by tp where modules see local heads."""
        regions = local_head_regions(matched, self.modules)
        if not any(sees_heads(self.modules[p] if p else self.model) for p in regions) or \
                not self.section.adjust_head_counts:
            return
        cfg = getattr(self.model, "config", None)
        names = ("num_attention_heads", "num_key_value_heads") if safe_attr(cfg, "num_attention_heads") is not None else \
            ("n_head", "n_heads", "n_kv_heads")
        for name in names:
            n = safe_attr(cfg, name)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0 and n % self.tp:
                self.err(f"{self.where}: model config {type(cfg).__name__}.{name}: tp({self.tp}) does not divide "
                         f"{name}({n}); found {n}, expected a multiple of {self.tp}; valid tp: {divisors_text(n)}")

    def chain(self, matched: dict[str, tuple[str, Any]]) -> None:
        """The layouts chain: colwise siblings feed a rowwise, overridden inputs match the stream."""
        by_parent: dict[str, list[tuple[str, str, Any]]] = {}
        for path, (pattern, rule) in matched.items():
            by_parent.setdefault(path.rpartition(".")[0], []).append((path, pattern, rule))
        fanout = set()
        for parent, kids in by_parent.items():
            cols = [k for k in kids if STYLES[k[2].style].column_parallel]
            default_in = [k for k in cols if getattr(k[2], "input_layouts", None) is None]
            if default_in:
                fanout.add(parent)
            for path, pattern, rule in kids:
                spec, o = STYLES[rule.style], rule.overrides()
                if spec.needs_colwise_input(o):
                    self.rowwise_input(parent, path, pattern, cols, by_parent)
                if spec.column_parallel and not spec.parent_converts_input(o):
                    self.colwise_input(parent, path, pattern, o["input_layouts"], default_in, matched)
                self.stream_layouts(path, pattern, spec, o)
                if spec.reduces_output and rule.output_layouts == "partial":
                    self.reduced_output(path, pattern, matched)
        self.fanout = fanout

    def rowwise_input(self, parent: str, path: str, pattern: str, cols: list, kin: dict | None = None) -> None:
        """A rowwise taking ``shard(-1)`` needs colwise siblings that output it (``kin``: for the hint)."""
        bad = [c for c in cols if getattr(c[2], "output_layouts", None) not in (None, "shard(-1)")]
        if not cols:
            self.err(f"{self.loc(pattern)}: module {path!r} (rowwise) expects its input sharded on the "
                     f"last dim by a colwise sibling, but {parent or '(root)'!r} has no colwise child; found "
                     f"input layout {self.stream}, expected shard(-1); add colwise rules for the projections "
                     f"feeding it or set input_layouts{layer_kinds_hint(pattern, kin, self.modules)}")
        elif bad:
            self.err(f"{self.loc(pattern)}: module {path!r} (rowwise) expects shard(-1) input, but its "
                     f"colwise sibling(s) {', '.join(c[0] for c in bad)} output {bad[0][2].output_layouts}; "
                     f"found {bad[0][2].output_layouts}, expected shard(-1)")

    def colwise_input(self, parent: str, path: str, pattern: str, given: Any, default_in: list,
                      matched: dict[str, tuple[str, Any]]) -> None:
        """A colwise that overrides its input_layouts: alone in its block, and taking the stream."""
        if default_in:
            self.err(f"{self.loc(pattern)}: module {path!r} (colwise) overrides input_layouts ({given}) "
                     f"but its colwise siblings {', '.join(k[0] for k in default_in)} take {parent!r}'s "
                     f"converted input; found {given}, expected the same input_layouts on every colwise "
                     f"child of {parent or '(root)'!r}")
        elif given != self.stream and parent not in matched:
            self.err(f"{self.loc(pattern)}: module {path!r} (colwise) input_layouts {given} does not match "
                     f"the residual stream; found {given}, expected {self.stream}")

    def stream_layouts(self, path: str, pattern: str, spec: StyleSpec, o: dict) -> None:
        """What takes the residual stream must take its layout; what writes it had better write it."""
        given = o.get("input_layouts")
        if spec.takes_stream and given is not None and given != self.stream:
            self.err(f"{self.loc(pattern)}: module {path!r} ({spec.name}) input_layouts {given} does not match "
                     f"the residual stream (sequence_parallel: {self.section.sequence_parallel}); found "
                     f"{given}, expected {self.stream}")
        given, up = o.get("output_layouts"), self.modules.get(path.rpartition(".")[0], self.model)
        if spec.writes_stream and given not in (None, self.stream, "partial") and \
                per_head_outputs(self.model, up, self.modules[path]) is None:  # Doge's dt_proj: not the stream
            self.r.warnings.append(f"{self.loc(pattern)}: module {path!r} ({spec.name}) outputs {given} "
                                   f"but the residual stream is {self.stream}: an extra redistribute")

    def reduced_output(self, path: str, pattern: str, matched: dict[str, tuple[str, Any]]) -> None:
        """A module that reduces its partial output needs rowwise rules below it that leave theirs partial."""
        below = [p for p, (_, r) in matched.items() if p.startswith(path + ".") and STYLES[r.style].row_parallel
                 and r.output_layouts == "partial"]
        if not below:
            self.err(f"{self.loc(pattern)}: module {path!r} declares a partial output to reduce "
                     f"(gather/all_reduce), but no rowwise rule below it outputs partial; found "
                     f"{self.stream} outputs, expected partial (set output_layouts: partial on its "
                     f"rowwise children, or drop the rule)")

    def regions(self, matched: dict[str, tuple[str, Any]]) -> None:
        for msg in region_errors(self.model, self.modules, matched, self.section.sequence_parallel, self.where,
                                 self.conflicts, self.token_regions(), self.tp):
            self.err(msg)
        for parent in sorted(local_head_regions(matched, self.modules)):
            for msg in head_count_errors(self.modules[parent] if parent else self.model, parent, self.tp,
                                         self.where):
                self.err(msg)

    def stream_norms(self, matched: dict[str, tuple[str, Any]]) -> None:
        if self.section.sequence_parallel is False:
            return
        inside = tuple(p + "." for p in self.fanout if p)
        root_fanout = "" in self.fanout
        covering = [p + "." for p, (_, r) in matched.items() if STYLES[r.style].covers_submodules]
        for path, mod in self.modules.items():
            if not path or path in matched or not is_norm(mod) or path.startswith(inside) or root_fanout:
                continue
            if any(path.startswith(p) for p in covering):
                continue
            pattern = wildcard(path)
            self.err(f"{self.where}: module {path!r} ({type(mod).__name__}) runs on the sequence-sharded residual "
                     f"stream but no rule covers it; found no rule, expected {pattern!r}: norm")


def smallest_world(lay: Layout) -> int:
    """The fewest ranks ``lay`` runs on: tp·cp·pp times the data-parallel degrees it fixes (``dp_shard: -1``
    counts as 1), e.g. 8 for ``{tp: 2, pp: 2, dp_shard: 2}``."""
    return lay.smallest_world()


def static_checks(model: nn.Module, p: Plan, tp: int, report: Report,
                  token_regions: Any = set) -> tuple[dict, "_Checker | None"]:
    """Every tensor_parallel check that needs no dry run and no process group, into ``report.errors``
    (``token_regions``: ``() -> {module path}``, the modules other axes run on each tp rank's own tokens, handed by
    :mod:`meshplan.axes`: :attr:`meshplan.axis.Axis.token_regions`).

    Returns:
        ``(matched rules, checker)``; the checker (None without a tensor_parallel section) takes further errors
        (``checker.err``) and names the rules (``checker.where``): :func:`meshplan.check` adds the shadow run's.
    """
    if p.tensor_parallel is None:
        return {}, None
    checker = _Checker(model, p, tp, report, token_regions)
    matched = checker.match()
    for path, (pattern, rule) in matched.items():
        checker.module(path, pattern, rule)
    checker.config(matched)
    checker.chain(matched)
    checker.stream_norms(matched)
    checker.regions(matched)
    return matched, checker


def validate_plan(model: nn.Module, plan: Plan, tp: int, token_regions: Any = set) -> None:
    """The checks of :func:`check` that need no dry run and no process group of their own (all but the
    cross-shard shadow run); :func:`meshplan.parallelize` runs them first.

    Raises:
        PlanError: one error listing every problem (numbered), as :meth:`Report.raise_if_errors`.
    """
    report = Report(source=plan.source or "<plan>", model=type(model).__name__, tp=tp, world_size=tp)
    # the shadow run needs its own fake group: meshplan.check only
    static_checks(model, plan, tp, report, token_regions)
    report.errors = fold_errors(report.errors)
    report.raise_if_errors()
