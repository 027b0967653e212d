"""The explain table of ``meshplan check``: per module its style, the generated torch style, local
parameter shapes, collectives per forward and backward, and parameter bytes per rank.

Collectives follow the generated layouts (one conversion per block, see
:mod:`meshplan.tensor_parallel.generate`): converting a layout ``a → b`` costs ``S→R`` all_gather,
``P→R`` all_reduce, ``P→S`` reduce_scatter, ``S(i)→S(j)`` all_to_all, ``R→S``
nothing. A conversion feeding colwise layers gets partial gradients back, so
its backward is ``P → a``; the other conversions run backward in reverse. The
coalesced reduction of replicated parameters' partial gradients is one
all_reduce per backward. ``tests/test_check_cli.py`` pins these numbers to
``CommDebugMode`` counts.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.plan_file.patterns import wildcard

__all__ = ["explain", "render_table", "meta_dry_run"]


_SHARDING = ("colwise", "lm_head", "embedding", "embedding_colwise", "embedding_tables")


def _kind(layout: str | None) -> str:
    return "R" if layout in (None, "replicate") else "P" if layout == "partial" else "S"


def _redist(a: str | None, b: str | None) -> list[str]:
    """Collectives of converting layout ``a`` to ``b`` (as written in plans)."""
    a, b = a or "replicate", b or "replicate"
    ka, kb = _kind(a), _kind(b)
    if a == b or ka == "R":
        return []
    if ka == "S" and kb == "S":
        return ["all_to_all"]
    if ka == "S":
        return ["all_gather"]
    return ["all_reduce"] if kb == "R" else ["reduce_scatter"]


def _back(a: str | None, b: str | None) -> list[str]:
    """Backward of a forward ``a → b`` whose consumer is not a colwise (reverse conversion)."""
    ka, kb = _kind(a), _kind(b)
    if ka == "P":
        return [] if kb == "R" else ["all_gather"]
    if ka == "R" and kb == "S":
        return ["all_gather"]
    return _redist(b, a) if ka == kb == "S" and a != b else []


def _collectives(style: str, o: dict, stream: str, lp: bool) -> tuple[list[str], list[str]]:
    """(forward, backward) collectives of one rule's module (not counting its parent's conversion)."""
    fwd: list[str] = []
    bwd: list[str] = []
    if style == "colwise":
        if "input_layouts" in o:
            fwd += _redist(o["input_layouts"], "replicate")
            bwd += _redist("partial", o["input_layouts"])
        out = o.get("output_layouts") or "shard(-1)"
        fwd += _redist("shard(-1)", out)
    elif style == "rowwise":
        inp = o.get("input_layouts") or "shard(-1)"
        fwd += _redist(inp, "shard(-1)")
        bwd += _back(inp, "shard(-1)")
        out = o.get("output_layouts") or stream
        fwd += _redist("partial", out)
        bwd += _back("partial", out)
    elif style == "embedding":
        out = o.get("output_layouts") or stream
        fwd += _redist("partial", out)
        bwd += _back("partial", out)
    elif style == "embedding_colwise":
        out = o.get("output_layouts") or stream
        fwd += _redist("shard(-1)", out)
        bwd += _back("shard(-1)", out)
    elif style == "lm_head":
        inp = o.get("input_layouts") or stream
        fwd += _redist(inp, "replicate")
        bwd += _redist("partial", inp)
        out = o.get("output_layouts") or ("shard(-1)" if lp else stream if stream != "shard(1)" else "replicate")
        fwd += _redist("shard(-1)", out)
    elif style in ("prepare_input", "prepare_output"):
        src = o.get("input_layouts") if style == "prepare_input" else o.get("output_layouts")
        dst = o.get("desired_input_layouts") if style == "prepare_input" else o.get("desired_output_layouts")
        for a, b in zip(src if isinstance(src, list) else [src], dst if isinstance(dst, list) else [dst]):
            if a and b:
                fwd += _redist(a, b)
                bwd += _back(a, b)
    elif style == "embedding_tables":
        fwd, bwd = ["broadcast (per table)"], ["reduce (per table)"]
    return fwd, bwd


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


def explain(report, model: nn.Module, plan, tp: int, matched: dict, fanout: set, applied) -> None:
    """Fill ``report.modules``, ``report.unsharded`` and ``report.totals``."""
    section = plan.tensor_parallel
    stream = "replicate" if section is None or section.sequence_parallel is False else \
        "shard(0)" if section.sequence_parallel == "batch" else "shard(1)"
    lp = bool(section and section.loss_parallel)
    target = applied[0] if applied else model
    torch_plan = applied[1].plan if applied else {}
    mods = dict(target.named_modules())
    rows, fwd_total, bwd_total = [], Counter(), Counter()
    entries = [(p, pat, rule.style, rule.overrides()) for p, (pat, rule) in matched.items()]
    entries += [(p, "(colwise parent)", "input conversion", {}) for p in sorted(fanout)]
    order = {name: i for i, name in enumerate(mods)}
    for path, pattern, style, o in sorted(entries, key=lambda e: order.get(e[0], 0)):
        if style == "input conversion":
            fwd, bwd = _redist(stream, "replicate"), _redist("partial", stream)
        else:
            fwd, bwd = _collectives(style, o, stream, lp)
        mod = mods.get(path) or model
        params, nbytes = {}, 0
        for name, prm in mod.named_parameters(recurse=False) if style != "input conversion" else []:
            local = prm.to_local() if hasattr(prm, "to_local") else prm
            params[name] = {"global": list(prm.shape), "local": list(local.shape) if applied else None,
                            "placement": _placement(prm) if applied else None}
            nbytes += local.numel() * local.element_size()
        rows.append({"module": path or "(root)", "rule": pattern, "style": style,
                     "torch_style": _short(torch_plan.get(path)), "params": params, "forward": fwd,
                     "backward": bwd, "bytes_per_rank": nbytes if applied else None})
        fwd_total.update(fwd)
        bwd_total.update(bwd)
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
            if applied:
                sharded = any(type(x).__name__ in ("Shard", "_StridedShard") for x in getattr(prm, "placements", ()))
            else:  # no dry run (errors): what the rule would do
                sharded = rule is not None and (rule[1] in _SHARDING or (rule[1] == "rowwise" and name != "bias"))
            if not sharded:
                key = f"{mod_path}.{name}" if mod_path else name
                report.unsharded[key] = f"replicated by rule {rule[0]!r} ({rule[1]})" if rule else "no rule"
                un_n += prm.numel()
                un_b += local.numel() * local.element_size()
    if applied and applied[1].finalizer is not None and (section.sequence_parallel is not False or
                                                         any(r.style == "replicate" for _, r in matched.values())):
        bwd_total.update(["all_reduce"])
    report.modules = rows
    report.totals = {"modules": len(rows), "parameters": total, "parameters_per_rank": local_n if applied else None,
                     "bytes_per_rank": local_b if applied else None, "unsharded_parameters": un_n,
                     "unsharded_bytes_per_rank": un_b if applied else None,
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


def _counts(c: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in c.items()) or "none"


def render_table(report) -> str:
    """Human-readable report: one row per rule (modules of one pattern folded), totals, unsharded, errors."""
    groups: dict[tuple, dict] = {}
    for r in report.modules:
        key = (r["rule"] if r["rule"] != "(colwise parent)" else wildcard(r["module"]), r["style"])
        g = groups.setdefault(key, {**r, "n": 0, "bytes": 0})
        g["n"] += 1
        g["bytes"] += r["bytes_per_rank"] or 0
    head = ("module (pattern)", "n", "style", "torch style", "local params", "fwd", "bwd", "bytes/rank")
    body = []
    for (name, style), g in groups.items():
        shapes = " ".join(f"{k}[{'x'.join(map(str, v['local'] or v['global']))}]" for k, v in g["params"].items())
        body.append((name, str(g["n"]), style, g["torch_style"] or "-", shapes or "-", " ".join(g["forward"]) or "-",
                     " ".join(g["backward"]) or "-", _fmt_bytes(g["bytes"]) if report.totals.get("bytes_per_rank")
                     is not None else "-"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c[:w].ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    t = report.totals
    out = [f"meshplan check: {report.source}  model {report.model}  tp={report.tp}  world_size={report.world_size}",
           "", line(head), *(line(b) for b in body), "",
           f"parameters: {t.get('parameters', 0):,} global, {t.get('parameters_per_rank') or 0:,} per rank "
           f"({_fmt_bytes(t.get('bytes_per_rank'))}); unsharded {t.get('unsharded_parameters', 0):,}",
           f"collectives per forward: {_counts(t.get('forward', {}))}",
           f"collectives per backward: {_counts(t.get('backward', {}))}"]
    if report.unsharded:
        folded: dict[str, str] = {}
        for k, v in report.unsharded.items():
            folded.setdefault(re.sub(r"\.\d+(?=\.)", ".*", k), v)
        shown = "; ".join(f"{k} ({v})" for k, v in folded.items())
        out.append(f"unsharded parameters ({len(report.unsharded)}, every tp rank holds them whole): {shown}")
    out += [f"warning: {w}" for w in report.warnings]
    out.append("ok" if report.ok else f"{len(report.errors)} error(s):")
    out += [f"  {i}. {e}" for i, e in enumerate(report.errors, 1)]
    return "\n".join(out)


def _meta_copy(model: nn.Module) -> nn.Module:
    if all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return copy.deepcopy(model)
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _fake_group(world: int):
    import torch.distributed as dist
    from meshplan._torch import FakeStore
    prior = dist.get_world_size() if dist.is_initialized() else None
    prior_rank = dist.get_rank() if prior is not None else 0
    if prior is not None and dist.get_backend() != "fake":
        raise PlanError("a real process group is initialized; meshplan.check's dry run needs none (or a fake one)")
    if prior is not None and prior != world:
        dist.destroy_process_group()
    if prior != world:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        if prior != world:
            dist.destroy_process_group()
            if prior is not None:
                dist.init_process_group("fake", store=FakeStore(), rank=prior_rank, world_size=prior)


def meta_dry_run(model: nn.Module, plan, tp: int, report):
    """Apply ``plan`` to a meta-device copy under a ``fake`` group of ``tp`` ranks: ``(copy, TpApplied)``.

    Returns None (and records why in ``report.errors``) when torch rejects a style; skipped (None)
    under a real process group, where no fake one can be made.
    """
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() != "fake":
        return None
    from meshplan.mesh.topology import build_mesh
    from meshplan.tensor_parallel.generate import apply_tensor_parallel
    meta = _meta_copy(model)
    try:
        with _fake_group(tp):
            return meta, apply_tensor_parallel(meta, plan.tensor_parallel, build_mesh({"tp": tp})["tp"], plan.source)
    except PlanError as e:
        report.errors.append(e)
    except Exception as e:  # a style that torch rejects
        report.errors.append(PlanError(f"{report.source}: applying the plan to a meta copy failed: "
                                       f"{type(e).__name__}: {e}"))
    return None
