"""The explain table of ``meshplan check``: per module its style, the generated torch style, local
parameter shapes, collectives per forward and backward, and parameter bytes per rank.

Collectives follow the generated layouts (one conversion per block, see
:mod:`meshplan.tensor_parallel.generate`): converting a layout ``a → b`` costs ``S→R`` all_gather,
``P→R`` all_reduce, ``P→S`` reduce_scatter, ``S(i)→S(j)`` all_to_all, ``R→S``
nothing. A conversion feeding colwise layers gets partial gradients back, so
its backward is ``P → a``; the other conversions run backward in reverse. The
coalesced reduction of replicated parameters' partial gradients is one
all_reduce per backward. ``tests/test_check_cli.py`` pins these numbers to
``CommDebugMode`` counts. Each style's own collectives are part of its entry in
:data:`meshplan.tensor_parallel.style_table.STYLES`; the conversion arithmetic is
:mod:`meshplan.tensor_parallel.layouts`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch.nn as nn

from meshplan.axes import report_lines, tp_exempt
from meshplan.plan_file.patterns import wildcard
from meshplan.plan_file.layout_text import Stream, redistribute_collectives
from meshplan.tensor_parallel.style_table import STYLES

__all__ = ["explain", "render_table", "summary_lines"]


def _short(style: Any) -> str | None:
    if style is None:
        return None
    text = repr(style)
    text = re.sub(r"\((Replicate\(\)|Partial\(sum\)|Shard\(dim=-?\d+\)|_StridedShard\([^)]*\)),\)", r"\1", text)
    text = text.replace("input_layouts=", "in=").replace("output_layouts=", "out=").replace("input_layout=", "in=")
    text = text.replace("desired_layout=", "want=").replace("use_local_output=True", "local")
    text = text.replace("use_local_output=False", "dtensor").replace("sequence_dim=", "seq_dim=")
    text = re.sub(r"\(dim=(-?\d+)\)", r"(\1)", text)
    text = re.sub(r"_StridedShard\(dim=(-?\d+), sf=(\d+)\)", r"StridedShard(\1,sf=\2)", text)
    return re.sub(r"\bShard\(", "S(", text.replace("Replicate()", "R").replace("Partial(sum)", "P"))


def _placement(p: Any) -> str:
    pl = getattr(p, "placements", None)
    return "plain" if pl is None else ",".join(_short(x) or "" for x in pl)


#: the style column of a parent's one input conversion (the colwise fan-out)
_CONVERSION = "input conversion"


def _params(mod: nn.Module, applied: Any) -> tuple[dict[str, dict], int]:
    """A module's own parameters (global and local shapes, placements) and their bytes on one rank."""
    params, nbytes = {}, 0
    for name, prm in mod.named_parameters(recurse=False):
        local = prm.to_local() if hasattr(prm, "to_local") else prm
        params[name] = {"global": list(prm.shape), "local": list(local.shape) if applied else None,
                        "placement": _placement(prm) if applied else None}
        nbytes += local.numel() * local.element_size()
    return params, nbytes


def _rows(model: nn.Module, mods: dict[str, nn.Module], matched: dict, fanout: set, stream: Stream,
          applied: Any, regather: bool = False) -> list[dict]:
    """One row per ruled module and per converted parent, in model order (``regather``: a converted parent's
    gathered input is gathered again in backward, ``save_gathered_inputs: false``)."""
    torch_plan = applied[1].plan if applied else {}
    entries = [(p, pat, rule.style, rule.overrides()) for p, (pat, rule) in matched.items()]
    entries += [(p, "(colwise parent)", _CONVERSION, {}) for p in sorted(fanout)]
    order = {name: i for i, name in enumerate(mods)}
    rows = []
    for path, pattern, style, o in sorted(entries, key=lambda e: order.get(e[0], 0)):
        if style == _CONVERSION:
            fwd = redistribute_collectives(stream.layout, "replicate")
            bwd = redistribute_collectives("partial", stream.layout) + (fwd if regather else [])  # re-gather
            params, nbytes = {}, 0
        else:
            fwd, bwd = STYLES[style].collectives(o, stream)
            params, nbytes = _params(mods.get(path) or model, applied)
        rows.append({"module": path or "(root)", "rule": pattern, "style": style,
                     "torch_style": _short(torch_plan.get(path)), "params": params, "forward": fwd,
                     "backward": bwd, "bytes_per_rank": nbytes if applied else None})
    return rows


def _exempt_reason(exempt: list, path: str) -> str:
    """Why the parameters of the module at ``path`` stay whole: the first axis that shards it itself, else no rule."""
    return next((why for e in exempt if (why := e.reason(path)) is not None), "no rule")


def _parameter_totals(report, mods: dict[str, nn.Module], matched: dict, applied: Any,
                      exempt: list) -> dict[str, int]:
    """Parameter counts and bytes per rank; every parameter no tp rank shards goes to ``report.unsharded``
    (modules an axis shards itself, :func:`meshplan.axes.tp_exempt`, count 1/degree per rank and are not listed
    when the degree is above 1)."""
    seen, total, local_n, local_b, un_n, un_b = set(), 0, 0, 0, 0, 0
    covered = {p: (pat, r.style) for p, (pat, r) in matched.items()}
    for mod_path, mod in mods.items():
        for name, prm in mod.named_parameters(recurse=False):
            if id(prm) in seen:
                continue
            seen.add(id(prm))
            local = prm.to_local() if hasattr(prm, "to_local") else prm
            total += prm.numel()
            local_n += local.numel()
            local_b += local.numel() * local.element_size()
            rule = covered.get(mod_path)
            own = next((e for e in exempt if mod_path in e.modules), None)
            if own is not None:  # an axis shards it itself (whole over tp): 1/degree per rank
                local_n += local.numel() // own.degree - local.numel()
                local_b += (local.numel() // own.degree - local.numel()) * local.element_size()
                if own.degree > 1:
                    continue
            if applied:
                sharded = any(type(x).__name__ in ("Shard", "_StridedShard") for x in getattr(prm, "placements", ()))
            else:  # no dry run (errors): what the rule would do
                sharded = rule is not None and STYLES[rule[1]].shards_param(name)
            if not sharded:
                key = f"{mod_path}.{name}" if mod_path else name
                report.unsharded[key] = (f"replicated by rule {rule[0]!r} ({rule[1]})" if rule else
                                         _exempt_reason(exempt, mod_path))
                un_n += prm.numel()
                un_b += local.numel() * local.element_size()
    return {"parameters": total, "parameters_per_rank": local_n if applied else None,
            "bytes_per_rank": local_b if applied else None, "unsharded_parameters": un_n,
            "unsharded_bytes_per_rank": un_b if applied else None}


def explain(report, model: nn.Module, plan, tp: int, matched: dict, fanout: set, applied) -> None:
    """Fill ``report.modules``, ``report.unsharded`` and ``report.totals``.

    Args:
        report: the :class:`~meshplan.checks.report.Report` to fill.
        model: the model checked.
        plan: the plan.
        tp: the tensor-parallel degree.
        matched: path → ``(pattern, rule)`` of the rules that matched.
        fanout: the parents that convert their input once for their colwise children.
        applied: ``(meta copy, TpApplied)`` of the dry run, or None (no dry run: what the rules would do).
    """
    section = plan.tensor_parallel
    mods = dict((applied[0] if applied else model).named_modules())
    regather = section is not None and not section.save_gathered_inputs
    rows = _rows(model, mods, matched, fanout, Stream.of(section), applied, regather)
    if tp == 1:  # the rules are checked and shown as tp > 1 applies them; parallelize applies none at tp 1
        rows = [{**row, "forward": [], "backward": []} for row in rows]
    fwd_total, bwd_total = Counter(), Counter()
    for row in rows:
        fwd_total.update(row["forward"])
        bwd_total.update(row["backward"])
    sizes = _parameter_totals(report, mods, matched, applied, tp_exempt(model, plan, report))
    if tp > 1 and applied and applied[1].finalizer is not None and (section.sequence_parallel is not False or
                                                         any(STYLES[r.style].replicated for _, r in matched.values())):
        bwd_total.update(["all_reduce"])
    report.modules = rows
    report.totals = {"modules": len(rows), **sizes,
                     "forward": dict(sorted(fwd_total.items())), "backward": dict(sorted(bwd_total.items())),
                     "errors": len(report.errors)}


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _per_rank(t: dict) -> str:
    """Per-rank parameters, or why there is no number (no dry run: no tensor_parallel section, or errors)."""
    n = t.get("parameters_per_rank")
    if n is None:
        return f"per rank not computed ({t.get('per_rank_reason', 'no dry run')})"
    return (f"{n:,} per rank (rank {t.get('rank', 0)}: {_fmt_bytes(t.get('bytes_per_rank'))}; gradients "
            f"{_fmt_bytes(t.get('gradient_bytes_per_rank'))}, optimizer "
            f"{_fmt_bytes(t.get('optimizer_bytes_per_rank'))})")


def _counts(c: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in c.items()) or "none"


#: the columns a narrow terminal loses first (each is in --format json): torch's words for `style`, the shapes
_DROPPABLE = ("torch style", "local params")


def _cut(cell: str, width: int) -> str:
    return cell if len(cell) <= width else cell[:max(width - 1, 0)] + "…"


def _fit(head: tuple, body: list, width: int | None) -> tuple[tuple, list, list[int], list[str]]:
    """The table narrowed to ``width`` columns: droppable columns left out first, then the widest column cut
    (ending in "…"), never below 8 characters. Returns ``(head, body, widths, left out)``."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    left_out: list[str] = []
    total = lambda ws: sum(ws) + 2 * (len(ws) - 1)  # noqa: E731
    for name in _DROPPABLE:
        if width is None or total(widths) <= width:
            break
        i = head.index(name)
        head, body = head[:i] + head[i + 1:], [b[:i] + b[i + 1:] for b in body]
        widths, left_out = widths[:i] + widths[i + 1:], left_out + [name]
    while width is not None and total(widths) > width and max(widths) > 8:
        i = widths.index(max(widths))
        widths[i] -= min(widths[i] - 8, total(widths) - width)
    return head, body, widths, left_out


def render_table(report, rank_lines: bool = False, width: int | None = None) -> str:
    """Human-readable report: one row per rule (modules of one pattern folded), totals, unsharded, errors
    (``rank_lines``: the rank view's lines too, ``check --rank R``). ``width`` (a terminal's columns): a table
    wider than that leaves out its ``torch style`` then ``local params`` columns (``--format json`` has them), then
    cuts its widest column; the text lines wrap."""
    groups: dict[tuple, dict] = {}
    for r in report.modules:
        key = (r["rule"] if r["rule"] != "(colwise parent)" else wildcard(r["module"]), r["style"])
        g = groups.setdefault(key, {**r, "n": 0, "bytes": 0})
        g["n"] += 1
        g["bytes"] += r["bytes_per_rank"] or 0
    rank = report.totals.get("rank", 0)  # the rank view's (check --rank R; default rank 0)
    head = ("module (pattern)", "n", "style", "torch style", "local params", "fwd", "bwd", f"bytes on rank {rank}")
    body = []
    for (name, style), g in groups.items():
        shapes = " ".join(f"{k}[{'x'.join(map(str, v['local'] or v['global']))}]" for k, v in g["params"].items())
        body.append((name, str(g["n"]), style, g["torch_style"] or "-", shapes or "-", " ".join(g["forward"]) or "-",
                     " ".join(g["backward"]) or "-", _fmt_bytes(g["bytes"]) if report.totals.get("bytes_per_rank")
                     is not None else "-"))
    head, body, widths, left_out = _fit(head, body, width)
    line = lambda cells: "  ".join(_cut(c, w).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [f"meshplan check: {report.source}  model {report.model}  tp={report.tp}  world_size={report.world_size}",
           "", line(head), *(line(b) for b in body), ""]
    rest = summary_lines(report, rank_lines=rank_lines)
    if left_out:
        out.pop()
        rest = [f"(left out to fit {width} columns: {', '.join(left_out)}; --format json or a wider terminal shows "
                f"them)", "", *rest]
    if width is not None:  # the text lines wrap (the title too); the table's rows are cut to fit
        import textwrap
        wrap = lambda xs: [w for x in xs for w in (textwrap.wrap(x, width, subsequent_indent="  ",  # noqa: E731
                                                                 break_on_hyphens=False) if len(x) > width else [x])]
        out, rest = wrap(out[:1]) + out[1:], wrap(rest)
    return "\n".join(out + rest)


def summary_lines(report, unsharded: bool = True, rank_lines: bool = False) -> list[str]:
    """The report's lines after the table (the model picture shows them too): parameters, collectives per
    forward and backward, unsharded parameters, each axis unit's lines, the rank view (``rank_lines``), warnings,
    then ``ok`` or the numbered errors."""
    t = report.totals
    out = [f"parameters: {t.get('parameters', 0):,} global, {_per_rank(t)}; unsharded "
           f"{t.get('unsharded_parameters', 0):,}",
           f"collectives per forward: {_counts(t.get('forward', {}))}",
           f"collectives per backward: {_counts(t.get('backward', {}))}"]
    if report.tp == 1 and report.modules:
        out.append("tensor parallelism: tp 1 is none: the tensor_parallel rules are checked and shown as tp > 1 "
                   "applies them; parallelize applies no style at tp 1")
    if report.unsharded and unsharded:
        folded: dict[str, str] = {}
        for k, v in report.unsharded.items():
            folded.setdefault(re.sub(r"\.\d+(?=\.)", ".*", k), v)
        shown = "; ".join(f"{k} ({v})" for k, v in folded.items())
        out.append(f"unsharded parameters ({len(report.unsharded)}, every tp rank holds them whole): {shown}")
    out += report_lines(report)  # the axes that are units
    if rank_lines and report.rank_view is not None:
        from meshplan.checks.rank_view import view_lines
        out += view_lines(report.rank_view, _fmt_bytes)
    out += [f"warning: {w}" for w in report.warnings]
    out.append("ok" if report.ok else f"{len(report.errors)} error(s):")
    out += [f"  {i}. {e}" for i, e in enumerate(report.errors, 1)]
    return out
