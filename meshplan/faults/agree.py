"""Before the first step every rank agrees on the software, the world layout, the whole plan and the model.

A rank that loaded another plan, built the model with another shape or runs another torch would otherwise hang
in a collective the others never issue, or die in gloo with a size mismatch naming nothing. ``meshplan.init``
and ``meshplan.parallelize`` exchange one small record of hashes (one ``all_gather_object``); where the hashes
differ, the first rank's and the first differing rank's full values follow (two broadcasts), so every rank
raises the same one-line :class:`PlanError` with a diff of the differing keys, parameters or versions.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

from meshplan.errors import PlanError

__all__ = ["software", "plan_fingerprint", "model_signature", "agree", "MAX_DIFF_KEYS"]

#: at most this many differing keys or parameters are spelled out in a mismatch error
MAX_DIFF_KEYS = 8


def software() -> dict[str, str]:
    """What must be the same build on every rank: torch (and its CUDA), meshplan, Python."""
    import torch

    from meshplan.version import __version__
    return {"torch": str(torch.__version__), "torch.version.cuda": str(torch.version.cuda),
            "meshplan": __version__, "python": platform.python_version()}


def _canonical(plan: Any) -> str:
    return json.dumps(plan.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def plan_fingerprint(plan: Any) -> str:
    """SHA-256 of the validated plan's canonical JSON (sorted keys; ``source`` left out: the path may differ)."""
    return hashlib.sha256(_canonical(plan).encode()).hexdigest()


def model_signature(model: Any) -> list[list]:
    """``[[name, shape, dtype], …]`` of every parameter and buffer, in the model's order (devices left out: a
    rank may build on ``meta`` and another on CPU to load and broadcast the weights)."""
    out = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in model.named_parameters()]
    return out + [[n, list(b.shape), str(b.dtype).removeprefix("torch.")] for n, b in model.named_buffers()]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"tensor_parallel.rules.'wq'.style": "colwise", …}``: a key with a dot in it is quoted."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        seg = k if k.isidentifier() else repr(k)
        out.update(_flat(v, f"{prefix}.{seg}" if prefix else seg))
    return out


def _key_diff(a: dict[str, Any], b: dict[str, Any], r0: int, r1: int, missing: str = "no such key") -> tuple[str, int]:
    """``key: rank 0 has X, rank R has Y; …`` over the differing keys (the first :data:`MAX_DIFF_KEYS`), and their
    count."""
    keys = list(dict.fromkeys([*a, *b]))
    keys = [k for k in keys if a.get(k, ...) != b.get(k, ...)]

    def shown(d: dict[str, Any], k: str) -> str:
        return json.dumps(d[k]) if k in d else missing

    parts = [f"{k}: rank {r0} has {shown(a, k)}, rank {r1} has {shown(b, k)}" for k in keys[:MAX_DIFF_KEYS]]
    if len(keys) > MAX_DIFF_KEYS:
        parts.append(f"and {len(keys) - MAX_DIFF_KEYS} more")
    return "; ".join(parts), len(keys)


def _layout_text(a: str, b: str, r0: int, r1: int) -> str:
    diff = [f"{x} vs {y}" for x, y in zip(a.split(";"), b.split(";")) if x != y]
    return (f"ranks disagree on the layout: rank {r0} has {a!r}, rank {r1} differs ({'; '.join(diff)}); every rank "
            f"must load the same plan and run in the same world")


def _texts(item: str, a: Any, b: Any, r0: int, r1: int, where: str) -> str:
    """One sentence for one differing item, from rank ``r0``'s value ``a`` and rank ``r1``'s ``b``."""
    if item == "layout":
        return _layout_text(a, b, r0, r1)
    if item == "software":
        return (f"ranks disagree on the software: {_key_diff(a, b, r0, r1)[0]}; every rank must run the same "
                f"torch, meshplan and Python (one image, one environment)")
    if item == "model":
        by = [{n: f"{shape} {dtype}" for n, shape, dtype in sig} for sig in (a, b)]
        diff, n = _key_diff(*by, r0, r1, missing="no such parameter or buffer")
        return (f"ranks disagree on the model given to {where}: {diff.replace(chr(34), '')} ({n} of "
                f"{len(set(by[0]) | set(by[1]))} parameters and buffers differ); every rank must build the same "
                f"model")
    if a is None or b is None:
        kinds = ["no plan (a layout only)" if p is None else "a plan" for p in (a, b)]
        return f"ranks disagree on the plan given to {where}: rank {r0} has {kinds[0]}, rank {r1} has {kinds[1]}"
    whole = {k for k in a.keys() | b.keys() if (a.get(k) is None) != (b.get(k) is None)}  # a section on one side
    flat = [{**{k: v for k, v in p.items() if k in whole}, **_flat({k: v for k, v in p.items() if k not in whole})}
            for p in (a, b)]
    return f"ranks disagree on the plan given to {where}: {_key_diff(*flat, r0, r1)[0]}"


def _fetch(value: Any, src: int, group: Any) -> Any:
    import torch.distributed as dist
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(claims: dict[str, Any], group: Any = None, where: str = "meshplan.init",
          init_digest: str | None = None) -> None:
    """Fail on every rank of ``group`` (default: the world), with one diff, unless all ranks have the same claims.

    Args:
        claims: ``{"software" | "layout" | "plan" | "model": value}``; a value None on every rank is skipped.
            ``plan`` is the plan's JSON data (or None for a layout only).
        init_digest: this rank's hash of the plan it gave ``meshplan.init``: ranks whose plan changed since are named.

    Raises:
        PlanError: e.g. ``ranks disagree on the plan given to meshplan.parallelize:
            tensor_parallel.sequence_parallel: rank 0 has true, rank 1 has false; … every rank must load the same
            plan``.
    """
    import torch.distributed as dist
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    mine = {item: _digest(value) for item, value in claims.items()}
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, (mine, init_digest), group=group)
    texts = []
    for item, value in claims.items():
        digests = [e[0][item] for e in everyone]
        odd = next((i for i, d in enumerate(digests) if d != digests[0]), None)
        if odd is None:
            continue
        r0, r1 = ranks[0], ranks[odd]
        text = _texts(item, _fetch(value, r0, group), _fetch(value, r1, group), r0, r1, where)
        more = sum(d != digests[0] for d in digests) - 1
        text += f" ({more} more rank(s) differ from rank {r0})" if more else ""
        if item == "plan":
            changed = [r for r, (d, i) in zip(ranks, everyone) if i is not None and d["plan"] != i]
            text += f"; rank(s) {changed} pass another plan than they gave meshplan.init" if changed else ""
            text += "; every rank must load the same plan"
        texts.append(text)
    if texts:
        raise PlanError("; and ".join(texts))
