"""Checks of what runs where: modules inside tensor-parallel regions, embeddings on the sequence-parallel
stream, fused projections with unequal parts.

A *local-heads region* is a module whose colwise children hand it their local shards (plain tensors: this
rank's heads or features). Any other parameterised module in it runs on those shards: a per-head norm
(``q_norm``/``k_norm`` over ``head_dim``) is right only with ``head_norm`` (its gradient, each rank's heads'
part, summed over tp); with no rule or ``replicate`` each rank's copy would train on its own heads' gradient
and drift. Under sequence parallelism every embedding outside the regions writes to the sequence-sharded
stream and must produce it (``embedding``/``embedding_colwise``).
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn as nn

from meshplan.tensor_parallel.check.head_params import head_norm_size_errors, head_params_errors, own_param_errors, \
    per_head_rowwise_errors, projection_norm_errors
from meshplan.plan_file.patterns import wildcard
from meshplan.tensor_parallel.heads import safe_attr
from meshplan.tensor_parallel.packed import features
from meshplan.tensor_parallel.style_table import STYLES

__all__ = ["is_norm", "local_head_regions", "region_errors", "summable_on_shards", "unequal_packed_parts",
           "whole_projection_norm"]

_NORM_RE = re.compile(r"(LayerNorm|RMSNorm|GroupNorm|BatchNorm)", re.I)


def is_norm(mod: nn.Module) -> bool:
    """Is ``mod`` a normalization layer (torch's, or a model's own ``*Norm`` class by name)?"""
    return isinstance(mod, (nn.LayerNorm, nn.GroupNorm)) or bool(_NORM_RE.search(type(mod).__name__))


def local_head_regions(matched: dict[str, tuple[str, Any]], modules: dict[str, nn.Module] | None = None) -> set[str]:
    """Parents of colwise rules whose local outputs they see (see
    :func:`meshplan.plan_file.style_semantics.gives_local_shards`)."""
    return {path.rpartition(".")[0] for path, (_, rule) in matched.items()
            if STYLES[rule.style].gives_local_heads(rule.overrides())
            and (modules is None or features(modules[path]) is not None or isinstance(modules[path], nn.Embedding))}


def _head_dim(parent: nn.Module, model: nn.Module) -> int | None:
    hd = safe_attr(parent, "head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    cfg = safe_attr(model, "config")
    h, n, hd = safe_attr(cfg, "hidden_size"), safe_attr(cfg, "num_attention_heads"), safe_attr(cfg, "head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    return h // n if isinstance(h, int) and isinstance(n, int) and n > 0 and h % n == 0 else None


def unequal_packed_parts(parent: nn.Module, model: nn.Module, out: int, packed: int) -> str | None:
    """Why a ``packed: k`` colwise on a fused q|k|v of ``out`` features cannot be split in k equal parts, or None."""
    cfg = safe_attr(parent, "config") or safe_attr(model, "config")
    heads, kv = safe_attr(cfg, "num_attention_heads"), safe_attr(cfg, "num_key_value_heads")
    hd = _head_dim(parent, model)
    if packed != 3 or not all(isinstance(x, int) and x > 0 for x in (heads, kv, hd)):
        return None
    if out == (heads + 2 * kv) * hd and heads != kv:
        return (f"its fused q|k|v parts are unequal ({heads * hd}|{kv * hd}|{kv * hd}: num_attention_heads {heads}, "
                f"num_key_value_heads {kv}, head_dim {hd}) and packed shards equal parts only; gather its output "
                f"instead (output_layouts: replicate, with the o_proj rule input_layouts: replicate)")
    return None


def region_errors(model: nn.Module, modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]],
                  sequence_parallel: bool | str, where: str, claimed: set[str] = frozenset(),
                  token_regions: set[str] = frozenset(), tp: int = 2) -> list[str]:
    """Every problem of modules that run on tp-local shards, and of modules on the SP stream.

    ``claimed``: paths some rule matches although no rule was assigned (conflicting rules, reported apart).
    ``token_regions``: MoE blocks of expert parallelism, which run on each tp rank's own tokens (their parameters'
    gradients are summed over tp), so they need no tensor-parallel rule. ``tp``: the degree sharded sizes must
    divide (``head_params``).
    """
    regions = local_head_regions(matched, modules)
    ruled = set(matched) | set(claimed)
    above = {path.rsplit(".", k)[0] for path in ruled for k in range(1, path.count(".") + 1)}  # ruled descendants
    errors: list[str] = []
    colwise: dict[str, list[str]] = {}
    for path, (_, rule) in matched.items():
        if STYLES[rule.style].column_parallel:
            colwise.setdefault(path.rpartition(".")[0], []).append(path)
    near = {p: ", ".join(sorted(c)) for p, c in colwise.items()}
    for parent in sorted(regions):
        errors += _region_children(model, modules, matched, parent, ruled | above, where, near.get(parent, ""))
    errors += own_param_errors(model, regions, modules, matched, where, near)
    errors += per_head_rowwise_errors(model, modules, matched, regions, tp, where)
    errors += _fanout_children(model, modules, matched, regions, ruled | above, where)
    for path, (pattern, rule) in matched.items():
        spec = STYLES[rule.style]
        if spec.head_params:
            present = {n for p, (pat, _) in matched.items() if pat == pattern
                       for n, _ in modules[p].named_parameters(recurse=False)}
            errors += head_params_errors(model, path, pattern, rule, regions, tp, where, present)
        parent = path.rpartition(".")[0]
        hd = _head_dim(modules[parent] if parent else model, model) if spec.on_local_heads or \
            spec.whole_projection else None
        if spec.on_local_heads and not spec.latent and parent in regions:  # a latent runs whole
            errors += head_norm_size_errors(model, path, pattern, hd, where)
        if spec.whole_projection:
            errors += projection_norm_errors(model, path, pattern, hd, regions, where)
        if spec.on_local_heads and path.rpartition(".")[0] not in regions:
            errors.append(f"{where}.{pattern!r}: module {path!r} ({spec.name}) is not inside a module whose colwise "
                          f"children output local shards, so its input is replicated and summing its gradients over "
                          f"tp would multiply them by tp; found no colwise sibling with local outputs, expected one "
                          f"(or use 'replicate')")
        if spec.stream_module and isinstance(modules.get(path), (nn.Linear, nn.Embedding)):
            errors.append(f"{where}.{pattern!r}: module {path!r} is {type(modules[path]).__name__}; style norm expects a "
                          f"norm or dropout on the residual stream; found {type(modules[path]).__name__}, expected "
                          f"colwise, rowwise, embedding or lm_head")
    errors += _latent_errors(model, modules, matched, where)
    if sequence_parallel is True:  # batch mode: unruled modules see this rank's samples, summed over tp
        errors += _unruled_on_stream(modules, matched, regions | set(token_regions), where) + _stream_embeddings(
            modules, matched, regions, where)
    return errors


def _region_children(model: nn.Module, modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]],
                     parent: str, covered: set[str], where: str, near: str) -> list[str]:
    """The parameterised children of one local-heads region that no rule (or the wrong one) covers; ``near``
    names its colwise children."""
    errors = []
    pmod = modules[parent] if parent else model
    hd = _head_dim(pmod, model)
    local_kids = {p.rpartition(".")[2] for p, (_, r) in matched.items() if p.rpartition(".")[0] == parent
                  and STYLES[r.style].gives_local_heads(r.overrides())}
    for name, child in pmod.named_children():
        path, kind = f"{parent}.{name}" if parent else name, type(child).__name__
        star = wildcard(path)
        if path in covered:
            rule = matched.get(path)
            if rule is not None and STYLES[rule[1].style].replicated and _per_head(child, hd):
                errors.append(f"{where}.{rule[0]!r}: module {path!r} ({kind}) runs on this rank's heads (the local "
                              f"outputs of {near}), but 'replicate' assumes replicated inputs; found replicate, "
                              f"expected head_norm")
        elif not any(True for _ in child.parameters()):
            continue
        elif isinstance(child, (nn.Linear, nn.Embedding)) or kind == "Conv1D":
            errors.append(f"{where}: module {path!r} ({kind}) sits beside the colwise {near} but no rule covers "
                          f"it; there it gets the block's converted input (a DTensor) or their local shards; "
                          f"found no rule, expected '{star}: colwise' (or rowwise if it consumes their outputs)")
        else:
            want = f"'{star}: head_norm'" if summable_on_shards(child, pmod, model) else \
                f"'{star}: projection_norm' (a norm over a whole projection: ESMC's, Olmo2's q_norm)" \
                if whole_projection_norm(child, pmod, local_kids) else _head_params_rule(model, child, star) or \
                "a rule that shards it, or gather the colwise outputs (output_layouts: replicate)"
            errors.append(f"{where}: module {path!r} ({kind}) runs on this rank's shards (the local outputs of "
                          f"{near}) but no rule covers it; its parameters' gradients would cover only this rank's "
                          f"part; found no rule, expected {want}")
    return errors


def _latent_errors(model: nn.Module, modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]],
                   where: str) -> list[str]:
    """In a block with MLA latent modules every colwise child is ``latent_colwise``
    (:func:`meshplan.hf.mla.latent_misfits`)."""
    from meshplan.hf.mla import latent_misfits
    blocks: dict[str, dict[str, Any]] = {}
    for path, (_, rule) in matched.items():
        blocks.setdefault(path.rpartition(".")[0], {})[path.rpartition(".")[2]] = rule
    errors = []
    for parent, rules in blocks.items():
        for name in latent_misfits(rules):
            path = f"{parent}.{name}" if parent else name
            pattern, rule = matched[path]
            errors.append(f"{where}.{pattern!r}: module {path!r} ({rule.style}) sits beside MLA latent modules, "
                          f"whose output it may take: a latent's gradient stays partial for the one reduction at "
                          f"the block input, {rule.style} would all-reduce it and the latent parameters' gradients "
                          f"would then be summed tp times; found {rule.style}, expected latent_colwise (it takes "
                          f"the block input like colwise)")
    return errors


def _fanout_children(model: nn.Module, modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]],
                     regions: set[str], covered: set[str], where: str) -> list[str]:
    """Projections without a rule beside a colwise whose parent converts the input once for its colwise
    children (local-heads regions are :func:`_region_children`'s): they get that converted input, a DTensor, and
    torch fails on the mixed tensors (lara_mini's ``linear_attn``: its ``out_proj`` is colwise with a gathered
    output, its input projections have no rule)."""
    errors = []
    fanout: dict[str, list[tuple[str, str]]] = {}
    for path, (pattern, rule) in matched.items():
        if STYLES[rule.style].parent_converts_input(rule.overrides()):
            fanout.setdefault(path.rpartition(".")[0], []).append((path, pattern))
    for parent, cols in sorted(fanout.items()):
        if parent in regions:
            continue
        pmod = modules[parent] if parent else model
        loose = [f"{parent}.{n}" if parent else n for n, c in pmod.named_children()
                 if features(c) is not None and
                 (f"{parent}.{n}" if parent else n) not in covered]
        if loose:
            names = ", ".join(f"'{p}'" for _, p in cols)
            errors.append(f"{where}: module {loose[0]!r} ({type(modules[loose[0]]).__name__}) has no rule, and its "
                          f"parent {parent or '(root)'!r} converts its input once (to a DTensor) for its colwise "
                          f"children {', '.join(p for p, _ in cols)}; {loose[0]!r} would get that DTensor with plain "
                          f"parameters (torch fails on the mixed tensors); found no input_layouts on {names}, "
                          f"expected input_layouts: replicate there (each converts its own input, and the rest of "
                          f"{parent or '(root)'!r} runs on plain tensors), or rules for {', '.join(loose)}")
    return errors


def _stream_embeddings(modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]], regions: set[str],
                       where: str) -> list[str]:
    """Under sequence parallelism every embedding outside the regions must produce the sharded stream."""
    errors = []
    inside = tuple(p + "." for p in regions if p)
    for path, mod in modules.items():
        if not isinstance(mod, nn.Embedding) or path.startswith(inside) or "" in regions:
            continue
        style = matched[path][1].style if path in matched else None
        if style is None or STYLES[style].replicated:
            errors.append(f"{where}: module {path!r} (nn.Embedding) writes to the sequence-sharded residual "
                          f"stream (sequence_parallel: true) but "
                          f"{'no rule covers it' if style is None else 'its rule is replicate'}, so its full "
                          f"output would be taken as one rank's shard; found {style or 'no rule'}, expected "
                          f"'{wildcard(path)}: embedding' (or embedding_colwise)")
    return errors


def _unruled_on_stream(modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]], regions: set[str],
                       where: str) -> list[str]:
    """Under sequence parallelism every parameterised module outside the local-heads regions needs a rule.

    Without one it meets the sequence-sharded stream: as a DTensor (torch fails on mixed tensors) or, after
    model code made it local, as this rank's part of the sequence, whose gradient nobody sums (silently
    wrong). Norms and embeddings are reported by their own checks.
    """
    errors = []
    inside = tuple(p + "." for p in regions if p)
    ruled = tuple(p + "." for p in matched)
    # a projection group with a rowwise but no colwise rule is the chain check's to report, once
    groups = {p.rpartition(".")[0] for p, (_, r) in matched.items()
              if STYLES[r.style].column_parallel or STYLES[r.style].row_parallel}
    for path, mod in modules.items():
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        if not own or path in matched or path.startswith(ruled) or path in regions or path.startswith(inside) \
                or "" in regions or isinstance(mod, nn.Embedding) or is_norm(mod) or \
                path.rpartition(".")[0] in groups:
            continue
        errors.append(f"{where}: module {path or '(root)'!r} ({type(mod).__name__}) has parameters "
                      f"({', '.join(own)}) but no rule covers it, and with sequence_parallel: true it would run on the "
                      f"sequence-sharded stream (torch fails on the mixed tensors, or, made local, each rank's "
                      f"gradient covers only its part of the sequence); found no rule, expected a rule for "
                      f"'{wildcard(path)}' or one of its parents, or sequence_parallel: false")
    return errors


def summable_on_shards(mod: nn.Module, parent: nn.Module, model: nn.Module) -> bool:
    """Is ``mod`` a module whose gradient on local shards is right once summed over tp (``head_norm``): a
    per-head norm (1-D parameters of ``head_dim``) or a module with scalar parameters only (a learnable
    activation such as XIELU)?"""
    params = [p for _, p in mod.named_parameters()]
    return bool(params) and (_per_head(mod, _head_dim(parent, model)) or all(p.numel() == 1 for p in params))


def _per_head(mod: nn.Module, head_dim: int | None) -> bool:
    w = getattr(mod, "weight", None)
    return head_dim is not None and getattr(w, "ndim", 0) == 1 and w.shape[0] == head_dim



def whole_projection_norm(mod: nn.Module, parent: nn.Module, colwise: set[str]) -> bool:
    """Is ``mod`` a norm over the whole output of a sibling colwise projection (``colwise``: the names of the
    parent's children whose colwise outputs stay local; ESMC's and Olmo2's ``q_norm`` over
    ``num_heads·head_dim``: ``projection_norm``)?"""
    w = getattr(mod, "weight", None)
    outs = {getattr(c, "out_features", None) for n, c in parent.named_children() if n in colwise}
    return is_norm(mod) and isinstance(w, nn.Parameter) and w.ndim == 1 and w.shape[0] in outs


def _head_params_rule(model: nn.Module, child: nn.Module, star: str) -> str | None:
    """The ``head_params`` rule of a child whose own parameters are indexed by head (NeoMME's
    ``exclusive_self_attention.alpha``, ``[num_heads]``), or None."""
    from meshplan.tensor_parallel.check.head_params import split_own_params
    per_head, shared = split_own_params(model, child)
    if not per_head or shared or any(True for _ in child.children()):
        return None
    return f"'{star}': {{style: head_params, sharded: [{', '.join(per_head)}]}}"
