"""Checks of what acts on a module's local heads besides its projections: its own parameters (attention sinks,
differential-attention lambdas; the ``head_params`` style) and norms on the heads (``head_norm``).

In a local-heads region (a module whose colwise children hand it this rank's heads) every parameter of the
module's own is used on those heads: one indexed by head (``sinks``, ``[num_heads]``) must be split with them
(``head_params`` ``sharded``), one shared by all heads (DiffLlama's ``lambda_q1``, ``[head_dim]``) gets only this
rank's heads' gradient, which must be summed over tp (``head_params`` ``summed``). A ``head_norm`` normalises each
head alone, so its weight has ``head_dim`` entries; a norm over the whole projection (Olmo2's ``q_norm`` over
``num_heads·head_dim``) needs the whole projection, i.e. its colwise outputs gathered. A rowwise projection in such
a region whose output holds one value per head (Doge's ``dt_proj``, ``[num_kv_heads·head_dim] → [num_kv_heads]``)
must hand each rank its own heads' values (a reduce-scatter), not all of them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from meshplan.plan_file.patterns import wildcard
from meshplan.tensor_parallel.heads import safe_attr
from meshplan.tensor_parallel.style_table import STYLES

__all__ = ["head_counts", "split_own_params", "suggested_rule", "own_param_errors", "head_params_errors",
           "head_norm_size_errors", "projection_norm_errors", "per_head_outputs", "PER_HEAD_ROWWISE",
           "per_head_rowwise_errors"]

#: the rowwise fields that hand each rank its own heads' values (the reduction is a reduce-scatter)
PER_HEAD_ROWWISE = {"output_layouts": "shard(-1)", "use_local_output": True}


def head_counts(model: nn.Module, mod: nn.Module) -> set[int]:
    """The model's global head counts (query and key/value heads), from its config or the module's attributes."""
    cfg = safe_attr(mod, "config") or safe_attr(model, "config")
    names = ("num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads", "num_heads",
             "num_key_value_groups")
    found = {safe_attr(cfg, n) for n in names[:5]} | {safe_attr(mod, n) for n in names[3:6]}
    return {n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0}


def per_head_outputs(model: nn.Module, parent: nn.Module, mod: nn.Module) -> int | None:
    """The head count ``mod``'s output features are (one value per head, e.g. Doge's ``dt_proj`` onto
    ``num_key_value_heads``), or None (the hidden size, or no head count)."""
    out = getattr(mod, "out_features", None)
    hidden = safe_attr(safe_attr(parent, "config") or safe_attr(model, "config"), "hidden_size")
    return out if isinstance(out, int) and out != hidden and out in head_counts(model, parent) else None


def split_own_params(model: nn.Module, mod: nn.Module, skip: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """``(per_head, shared)``: the own parameters of ``mod`` (but ``skip``) whose leading dim is a head count
    (split with the heads), and the others (shared by all heads: gradients summed over tp)."""
    own = [(n, p) for n, p in mod.named_parameters(recurse=False) if n not in skip]
    heads = head_counts(model, mod)
    per_head = [n for n, p in own if p.ndim >= 1 and p.shape[0] in heads]
    return per_head, [n for n, _ in own if n not in per_head]


def _unsure(model: nn.Module, mod: nn.Module, shared: list[str]) -> list[str]:
    """The shared parameters that may act outside the heads: neither ``head_dim`` long nor scalars."""
    hd = safe_attr(mod, "head_dim")
    return [n for n in shared if getattr(mod, n).numel() > 1 and getattr(mod, n).shape[-1] != hd]


def suggested_rule(per_head: list[str], shared: list[str]) -> dict[str, Any]:
    """The ``head_params`` rule for :func:`split_own_params`' result (plain data)."""
    return {"style": "head_params", **({"sharded": per_head} if per_head else {}),
            **({"summed": shared} if shared else {})}


def _suggest(path: str, sharded: list[str], summed: list[str]) -> str:
    parts = ([f"sharded: [{', '.join(sharded)}]"] if sharded else []) + \
            ([f"summed: [{', '.join(summed)}]"] if summed else [])
    return f"'{wildcard(path)}': {{style: head_params, {', '.join(parts)}}}"


def own_param_errors(model: nn.Module, regions: set[str], modules: dict[str, nn.Module],
                     matched: dict[str, tuple[str, Any]], where: str, near: dict[str, str]) -> list[str]:
    """The own parameters of local-heads regions that no ``head_params`` rule names (``near``: a region's
    colwise children, for the message)."""
    errors = []
    for parent in sorted(regions):
        mod = modules[parent] if parent else model
        rule = matched.get(parent)
        named = set()
        if rule is not None and STYLES[rule[1].style].head_params:
            named = set(rule[1].sharded) | set(rule[1].summed) | set(rule[1].replicated)
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if n not in named]
        if not own:
            continue
        heads = head_counts(model, mod)
        per_head, shared = split_own_params(model, mod, named)
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in own)
        unsure = _unsure(model, mod, shared)
        either = f" ({', '.join(unsure)}: 'replicated' instead if it acts only after the heads are reduced)" \
            if unsure else ""
        errors.append(f"{where}: module {parent or '(root)'!r} ({type(mod).__name__}) runs on this rank's heads (the "
                      f"local outputs of {near.get(parent, 'its colwise children')}) but no rule names its own "
                      f"parameters ({shapes}; head counts {sorted(heads)}): one indexed by head must be split with "
                      f"the heads, one shared by all heads gets only this rank's heads' gradient; found no rule, "
                      f"expected {_suggest(parent, per_head, shared)}{either}")
    return errors


def head_params_errors(model: nn.Module, path: str, pattern: str, rule: Any, regions: set[str], tp: int,
                       where: str, present: set[str]) -> list[str]:
    """A ``head_params`` rule: on a local-heads region, naming its own parameters, sharded sizes divisible.
    ``present``: the own parameter names of every module the rule matches (a wildcard rule may match layers that
    lack one, such as sinks on some layers only: a name is wrong when no matched module has it)."""
    mod, loc = model.get_submodule(path), f"{where}.{pattern!r}"
    if path not in regions and path.rpartition(".")[0] not in regions:  # a child runs on its parent's heads too
        return [f"{loc}: module {path or '(root)'!r} (head_params) has no colwise child with local outputs, nor is it "
                f"the child of a module that has, so its heads are not split over tp; found no colwise child giving "
                f"shard(-1), expected one (or drop the rule: its parameters then act on every head)"]
    own = dict(mod.named_parameters(recurse=False))
    errors = [f"{loc}: module {path!r} ({type(mod).__name__}) has no parameter {n!r} of its own, nor has any module "
              f"the rule matches; found {sorted(present) or 'none'}, expected one of them" for n in [*rule.sharded, *rule.summed, *rule.replicated]
              if n not in present]
    for n in rule.sharded:
        p = own.get(n)
        if p is None:
            continue
        if p.ndim <= rule.dim:
            errors.append(f"{loc}: module {path!r}: parameter {n!r} has shape {list(p.shape)}, no dim {rule.dim}; "
                          f"expected the head dim of a per-head parameter (dim: 0 for [num_heads])")
        elif p.shape[rule.dim] % tp:
            errors.append(f"{loc}: module {path!r}: tp({tp}) does not divide {n}.shape[{rule.dim}] "
                          f"({p.shape[rule.dim]}); found {p.shape[rule.dim]}, expected a multiple of {tp}")
    return errors


def head_norm_size_errors(model: nn.Module, path: str, pattern: str, head_dim: int | None, where: str) -> list[str]:
    """A ``head_norm`` whose weight is not one head's size: a norm over the whole projection (Olmo2)."""
    mod = model.get_submodule(path)
    w = getattr(mod, "weight", None)
    n = w.shape[-1] if isinstance(w, nn.Parameter) and w.ndim == 1 else None
    if head_dim is None or n is None or n == head_dim:
        return []
    return [f"{where}.{pattern!r}: module {path!r} ({type(mod).__name__}, head_norm) normalises {n} features, not "
            f"one head (head_dim {head_dim}): a norm over the whole projection needs all of its features, but its "
            f"input is this rank's heads only; found normalized size {n}, expected {head_dim}; use "
            f"'{wildcard(path)}: projection_norm' (its weight sharded like the projection, the mean of squares summed "
            f"over tp), or gather the projection (output_layouts: replicate on the colwise rules feeding it, "
            f"input_layouts: replicate on the rowwise one, no rule for it: transformers' Olmo2 plan)"]


def projection_norm_errors(model: nn.Module, path: str, pattern: str, head_dim: int | None, regions: set[str],
                           where: str) -> list[str]:
    """A ``projection_norm``: inside a local-heads region, over more than one head."""
    loc, parent = f"{where}.{pattern!r}", path.rpartition(".")[0]
    if parent not in regions:
        return [f"{loc}: module {path!r} (projection_norm) is not inside a module whose colwise children output "
                f"local shards, so its input is not sharded; found no colwise sibling with local outputs, expected "
                f"one (or no rule: the module runs whole on a gathered input)"]
    w = getattr(model.get_submodule(path), "weight", None)
    if head_dim is not None and getattr(w, "ndim", 0) == 1 and w.shape[0] == head_dim:
        return [f"{loc}: module {path!r} (projection_norm) normalises {head_dim} features, one head (head_dim "
                f"{head_dim}): each head is normalised alone, so its weight must stay whole; found normalized size "
                f"{head_dim}, expected a whole projection; use '{wildcard(path)}: head_norm'"]
    return []


def per_head_rowwise_errors(model: nn.Module, modules: dict[str, nn.Module], matched: dict[str, tuple[str, Any]],
                            regions: set[str], tp: int, where: str) -> list[str]:
    """Rowwise rules in a local-heads region whose output is one value per head: reduced whole, every rank gets
    every head's value, which then meets this rank's heads (a shape error, or with one local head a silent
    broadcast); each rank needs its own heads' values (:data:`PER_HEAD_ROWWISE`, a reduce-scatter)."""
    errors = []
    for path, (pattern, rule) in matched.items():
        parent = path.rpartition(".")[0]
        if not STYLES[rule.style].row_parallel or parent not in regions or path not in modules:
            continue
        n = per_head_outputs(model, modules[parent] if parent else model, modules[path])
        if n is None:
            continue
        o, loc = rule.overrides(), f"{where}.{pattern!r}"
        layouts = o.get("output_layouts")
        got = {"output_layouts": layouts[0] if isinstance(layouts, list) and len(layouts) == 1 else layouts,
               "use_local_output": o.get("use_local_output")}
        if got != PER_HEAD_ROWWISE:
            errors.append(f"{loc}: module {path!r} (rowwise) outputs one value per head ({n} features, a head "
                          f"count of {type(modules[parent] if parent else model).__name__}) inside a module that "
                          f"runs on this rank's heads: reduced whole, each rank gets all {n} heads' values beside "
                          f"its own {n // tp if n % tp == 0 else '?'} heads; found output_layouts "
                          f"{got['output_layouts'] or 'default'}, use_local_output {got['use_local_output']}, "
                          f"expected '{wildcard(path)}': {{style: rowwise, output_layouts: shard(-1), "
                          f"use_local_output: true}} (a reduce-scatter: each rank gets its own heads' values)")
        elif n % tp:
            errors.append(f"{loc}: module {path!r}: tp({tp}) does not divide its {n} per-head outputs; found {n}, "
                          f"expected a multiple of {tp}")
    return errors
