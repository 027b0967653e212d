"""Find model code that computes across tp shards inside a tensor-parallel region, before anything runs for real.

Inside a local-heads region (a module whose colwise children hand it local shards) meshplan relies on the
model's own code acting per head or per feature. Code that reduces over the sharded features (Gemma-3n's
activation sparsity takes the mean and std of the gate projection over its features) would silently compute
per-shard statistics. The *shadow run* finds it without data: a meta-device copy is parallelized with every
such colwise output kept a DTensor (its global view), and one forward runs under a ``fake`` process group.
DTensor computes correctly by construction, so any collective it issues inside a region's own code (not in
its ruled children, not in its input conversion) is a cross-shard computation that local shards would get
wrong. Plain tensors the model mixes in (rotary tables, masks) are treated as replicated.

It runs on a small CPU instance (a transformers model rebuilt from its config shrunk by
:mod:`meshplan.hf.tiny_config`; another model copied empty up to 50M parameters), values uninitialized: only which
collectives DTensor needs matters. A shadow run that cannot finish (an op without a DTensor rule) says nothing;
:func:`cross_shard_errors` then returns no error and a note. It needs its own ``fake`` process group, so
:func:`meshplan.check` runs it when no process group is initialized (offline, the CLI); under torchrun
:func:`meshplan.parallelize` runs the other checks only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from meshplan._torch import TorchDispatchMode, tree_map
from meshplan.model_copies import small_copy

__all__ = ["cross_shard_errors"]

_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")


class _ReplicatePlain(TorchFunctionMode):
    """Plain tensors that meet DTensors in one call are taken as replicated on the mesh."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        plain = lambda t: isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0  # noqa: E731
        if any(isinstance(a, DTensor) for a in flat) and any(plain(a) for a in flat):
            wrap = lambda t: DTensor.from_local(t, self.mesh, [Replicate()], run_check=False) \
                if plain(t) else t  # noqa: E731
            args, kwargs = tree_map(wrap, args), tree_map(wrap, kwargs)
        return func(*args, **kwargs)


class _Collectives(TorchDispatchMode):
    """Collectives issued while a region's own code (top of ``stack``) runs."""

    def __init__(self):
        super().__init__()
        self.stack: list[str | None] = []
        self.hits: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into collectives first
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).rpartition(".")[-1]
        if self.stack and self.stack[-1] is not None and any(name.startswith(c) for c in _COLLECTIVES):
            self.hits.setdefault(self.stack[-1], set()).add(name.replace("_into_tensor", ""))
        return out


def _shadow_section(section: Any, regions_rules: list[str]) -> Any:
    from meshplan.plan_file.tensor_parallel import TensorParallel
    data = section.model_dump(exclude_unset=True)
    rules = dict(data.get("rules", {}))
    for pattern in regions_rules:
        rule = rules[pattern]
        rule = {"style": rule} if isinstance(rule, str) else dict(rule)
        rules[pattern] = {**rule, "use_local_output": False}
    return TensorParallel.model_validate({**data, "rules": rules})


def cross_shard_errors(model: nn.Module, plan: Any, tp: int, where: str, notes: list[str]) -> list[str]:
    """The regions whose own code computes across tp shards (see the module docstring), as error messages."""
    from meshplan.checks.dry_run import fake_group
    from meshplan.model_copies import default_batch
    from meshplan.tensor_parallel.check.regions import local_head_regions
    from meshplan.axes import opaque_modules
    from meshplan.model_copies import stand_in
    from meshplan.mesh.topology import build_mesh
    from meshplan.plan_file.patterns import match_rules
    from meshplan.tensor_parallel.apply import apply_tensor_parallel
    from meshplan.tensor_parallel.style_table import STYLES
    section = plan.tensor_parallel
    if tp == 1 or not local_head_regions(match_rules(model, section.rules, where), dict(model.named_modules())):
        return []
    meta = small_copy(model, tp, notes)
    if meta is None:
        return []
    unmatched: list = []  # exact paths of layers the small copy does not have: not its concern
    matched = match_rules(meta, section.rules, where, errors=unmatched)
    if unmatched:
        notes.append(f"cross-shard check skipped: the small copy lacks modules the plan names ({unmatched[0]})")
        return []
    regions = local_head_regions(matched, dict(meta.named_modules()))
    # packed outputs stay local: their split into parts is exactly what packed sharding makes right
    local_rules = sorted({pat for path, (pat, r) in matched.items() if STYLES[r.style].gives_local_heads(r.overrides())
                          and (getattr(r, "packed", None) or 1) == 1 or STYLES[r.style].head_params
                          or STYLES[r.style].whole_projection
                          or STYLES[r.style].row_parallel and r.overrides().get("output_layouts") == "shard(-1)"})
    tracker = _Collectives()
    try:
        with fake_group(tp):
            mesh = build_mesh({"tp": tp})["tp"]
            apply_tensor_parallel(meta, _shadow_section(section, local_rules), mesh, plan.source)
            modules = dict(meta.named_modules())
            for path in opaque_modules(meta, plan):  # routing: its own all-to-alls, not this run's
                stand_in(modules[path])
            for path in sorted(regions):
                _track(modules[path] if path else meta, path, tracker, push=True)
            for path in matched:
                if path.rpartition(".")[0] in regions:
                    _track(modules[path], path, tracker, push=False)
            batch = {k: v for k, v in default_batch(model, tp).items() if k != "labels"}
            with torch.no_grad(), _ReplicatePlain(mesh), tracker:
                meta(**batch) if hasattr(meta, "config") else meta(*batch.values())
    except Exception as e:  # inconclusive: say so, refuse nothing
        notes.append(f"cross-shard check skipped: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return []
    return [f"{where}: module {path or '(root)'!r} computes across the tp-sharded features of its colwise outputs "
            f"(its own code needed {', '.join(sorted(ops))} when they were kept as DTensors), so on local shards "
            f"its result would be wrong; found cross-shard ops, expected per-head/per-feature code; gather those "
            f"outputs (output_layouts: replicate) or leave the module unsharded"
            for path, ops in sorted(tracker.hits.items())]


def _track(module: nn.Module, path: str, tracker: _Collectives, push: bool) -> None:
    """Region: its own code is tracked after its input conversion. Ruled child: not tracked, hooks included."""
    mark = path if push else None
    module.register_forward_pre_hook(lambda m, a: tracker.stack.append(mark), prepend=not push)
    module.register_forward_hook(lambda m, a, o: tracker.stack.pop() and None, always_call=True, prepend=push)
