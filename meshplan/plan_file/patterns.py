"""Match plan rules (module-path patterns) to a model's modules."""

from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Mapping

from meshplan.errors import PlanError

if TYPE_CHECKING:  # plan_file/ imports no torch
    import torch.nn as nn

__all__ = ["match_rules", "match_pattern", "path_matches", "is_pattern", "wildcard", "pattern_regex", "regex_patterns"]


def is_pattern(path: str) -> bool:
    return any(c in path for c in "*?[")


def wildcard(path: str) -> str:
    """``model.layers.3.mlp`` → ``model.layers.*.mlp``: the rule pattern that covers a module of every layer."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def match_pattern(model: nn.Module, pattern: str, where: str) -> list[str]:
    """The module paths one pattern matches (as :func:`match_rules` matches a rule), in the model's module order.

    Args:
        model: the module whose paths the pattern matches.
        pattern: a module path or pattern (``'*'`` = one path segment), e.g. ``layers.*``.
        where: prefix of the error message (plan key, e.g. ``blocks``).

    Returns:
        The matching paths (at least one).

    Raises:
        PlanError: the pattern matches no module; names the pattern, the model and its top-level children.
    """
    paths = list(match_rules(model, {pattern: pattern}, where, errors=[]))
    if not paths:
        top = ", ".join(n for n, _ in model.named_children()) or "none"
        raise PlanError(f"{where}: pattern {pattern!r} matched no module of {type(model).__name__} "
                        f"(top-level children: {top})")
    return paths


def path_matches(pattern: str, path: str) -> bool:
    """Does ``pattern`` (``'*'`` = one segment) match the module path ``path`` segment by segment?"""
    ps, qs = pattern.split("."), path.split(".")
    return len(ps) == len(qs) and all(fnmatchcase(q, p) for p, q in zip(ps, qs))


def _hits(pattern: str, known: set[str], by_depth: dict[int, list[tuple[str, list[str]]]]) -> list[str]:
    """The paths ``pattern`` matches: itself if it is a known path, else those of its depth matching segment-wise."""
    if not is_pattern(pattern):
        return [pattern] if pattern in known else []
    ps = [(s, is_pattern(s)) for s in pattern.split(".")]
    last, last_wild = ps[-1]
    return [p for p, segs in by_depth.get(len(ps), ()) if (last_wild or segs[-1] == last)
            and all(fnmatchcase(q, s) if wild else q == s for (s, wild), q in zip(ps, segs))]


def _closest(pattern: str, paths: list[str]) -> list[str]:
    probe = re.sub(r"\*", "0", pattern)
    return difflib.get_close_matches(probe, paths, n=3, cutoff=0.3)


def match_rules(model: nn.Module, rules: Mapping[str, Any], where: str = "tensor_parallel.rules",
                errors: list[PlanError] | None = None, conflicts: set[str] | None = None) -> dict[str, tuple[str, Any]]:
    """Assign each module path the rule that claims it.

    An exact path beats a wildcard; two wildcard rules that claim one module
    with different rules are an error, and so is a rule that matches nothing
    (the message names the closest module paths).

    Args:
        model: the module whose paths the patterns match.
        rules: ``{pattern: rule}`` from the plan.
        where: prefix of error messages (plan file and key).
        errors: when given, errors are appended here and matching goes on (validation reports them all).
        conflicts: when given, the paths claimed by clashing rules (left unassigned) are added here.

    Returns:
        ``{module_path: (pattern, rule)}`` in the model's module order.

    Raises:
        PlanError: unmatched rule or conflicting rules (when ``errors`` is None); names ``where`` and the pattern.
    """
    def fail(msg: str) -> None:
        if errors is None:
            raise PlanError(msg)
        errors.append(PlanError(msg))

    paths = [name for name, _ in model.named_modules() if name]
    known = set(paths)
    by_depth: dict[int, list[tuple[str, list[str]]]] = {}  # split once; a pattern only meets paths as deep
    for p in paths:
        segs = p.split(".")
        by_depth.setdefault(len(segs), []).append((p, segs))
    claims: dict[str, list[tuple[str, Any]]] = {}
    for pattern, rule in rules.items():
        hits = _hits(pattern, known, by_depth)
        if not hits:
            near = _closest(pattern, paths)
            hint = f"closest module paths: {', '.join(near)}" if near else f"the model has {len(paths)} modules"
            fail(f"{where}.{pattern!r}: matches no module of {type(model).__name__}; found none, expected at least "
                 f"one; {hint}")
        for h in hits:
            claims.setdefault(h, []).append((pattern, rule))
    out: dict[str, tuple[str, Any]] = {}
    for path in paths:
        cands = claims.get(path)
        if not cands:
            continue
        exact = [c for c in cands if not is_pattern(c[0])]
        if exact:
            out[path] = exact[0]
            continue
        clash = [c for c in cands[1:] if c[1] != cands[0][1]]
        if clash and conflicts is not None:
            conflicts.add(path)
        for other in clash:
            fail(f"{where}: module {path!r} is claimed by {cands[0][0]!r} ({cands[0][1].style}) and "
                 f"{other[0]!r} ({other[1].style}); expected one rule: give it an exact rule or narrow a pattern")
        if not clash:
            out[path] = cands[0]
    return out



def pattern_regex(pattern: str, leaf: str = "weight") -> str:
    """The regular expression of the parameter ``leaf`` of the modules a pattern matches (DeepSpeed AutoTP's
    ``layer_specs`` match parameter names with ``re.match``): ``layers.*.wq`` → ``layers\\.[^.]+\\.wq\\.weight$``.

    Example::

        >>> pattern_regex("model.layers.*.mlp.up_proj")
        'model\\.layers\\.[^.]+\\.mlp\\.up_proj\\.weight$'
    """
    segs = ["[^.]+" if seg == "*" else re.escape(seg).replace(r"\*", "[^.]*").replace(r"\?", "[^.]")
            for seg in pattern.split(".")]
    return r"\.".join(segs + ([re.escape(leaf)] if leaf else [])) + "$"


_ANY_SEGMENT = {r"[^.]+", r"[^.]*", r"[^\.]+", r"[^\.]*", r"\d+", r"[0-9]+", r"\w+", r"[\w]+"}
_PARAM_LEAF = re.compile(r"\\\.(weight|bias)\$?$|\$$")


def _segment_options(seg: str) -> list[str] | None:
    """A regex of one path segment → the fnmatch-style segments it stands for, or None when it is not one of the
    simple forms (literal text, a class of literal letters ``[qkv]``, a group of literal words ``(up|gate)``)."""
    if seg in _ANY_SEGMENT:
        return ["*"]
    opts = [""]
    for tok in re.findall(r"\[\^\\?\.\][*+]|\\.|\[[A-Za-z0-9_]+\]|\((?:[A-Za-z0-9_]+\|)*[A-Za-z0-9_]+\)|[A-Za-z0-9_\-]|.",
                          seg):
        if tok.startswith("[^"):
            alts = ["*"]
        elif tok.startswith("[") and len(tok) > 2:
            alts = list(tok[1:-1])
        elif tok.startswith("(") and len(tok) > 2:
            alts = tok[1:-1].split("|")
        elif re.fullmatch(r"[A-Za-z0-9_\-]|\\[_\-]", tok):
            alts = [tok[-1]]
        else:
            return None
        opts = [o + a for o in opts for a in alts]
    return opts


def regex_patterns(regex: str) -> list[str] | None:
    """The module patterns a parameter-name regex stands for, when it is written as :func:`pattern_regex`
    writes one (segments of literal text, ``[^.]+`` / ``\\d+`` for a whole segment, ``[qkv]`` and ``(up|gate)``
    alternatives, ending in ``\\.weight$``): ``model\\.layers\\.\\d+\\.self_attn\\.[qk]_proj\\.weight$`` →
    ``[model.layers.*.self_attn.q_proj, model.layers.*.self_attn.k_proj]``. None for any other regex (a leading
    ``.*`` matches any prefix: only a model's parameter names can resolve it).
    """
    body = _PARAM_LEAF.sub("", regex.removeprefix("^"))
    segs = re.split(r"\\\.", body)
    if not body or any(not s for s in segs):
        return None
    out = [""]
    for seg in segs:
        opts = _segment_options(seg)
        if opts is None:
            return None
        out = [f"{o}.{x}" if o else x for o in out for x in opts]
    return out
