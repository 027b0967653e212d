"""Meta-device models made real: ``exact`` initialization (equal to a one-device one) or ``sharded`` (per shard).

The flow for a model too large for one device::

    with torch.device("meta"):
        model = Model(config)                    # nothing allocated
    meshplan.parallelize(model, plan, topo)      # DTensor parameters, still meta
    meshplan.materialize(model, seed=0)          # or: meshplan.load_state_dict(model, "ckpt/")

:func:`materialize` allocates each rank's shards (``to_empty``: the parameter
objects, and the hooks meshplan put on them, are kept) and runs the model's own
initializer so the result equals a one-device initialization with the same
seed and initializer: every rank initializes the *full* tensor of each
parameter, in the initializer's order, from the same RNG stream, and keeps its
shard. Memory: per-module initializers (transformers' ``_init_weights``,
``reset_parameters``) hold one module's full parameters at a time; a
model-level ``init_weights()`` (torchtitan style) is one opaque call, so it
holds the full model once per rank, transiently. Compute: every rank does the
whole model's initialization. ``mode="sharded"`` (the call's, else the plan's ``init.mode``) runs the
initializers on the local shards instead, with draws keyed by (seed, name, global index):
:mod:`meshplan.weights.sharded_init` (``docs/initialization.md``).

Loading a checkpoint instead lives in :mod:`meshplan.weights.load`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import torch
import torch.nn as nn

from meshplan._torch import module_buffers, module_parameters, tensor_version
from meshplan.errors import PlanError
from meshplan.weights.shards import local_slices, take_slices

__all__ = ["materialize"]

def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    out: dict[int, list] = {}
    for mod in model.modules():
        for name, p in module_parameters(mod).items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, name, "p"))
        for name, b in module_buffers(mod).items():
            if b is not None:
                out.setdefault(id(b), []).append((mod, name, "b"))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _store(orig: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of ``full`` into ``orig``'s local tensor (nothing for a meta ``orig``: a module
    of another pipeline stage, initialized only to advance the random stream)."""
    if orig.is_meta:
        return
    with torch.no_grad():
        if hasattr(orig, "placements"):
            ranges = local_slices(tuple(orig.shape), orig.placements, orig.device_mesh)
            _local(orig).copy_(take_slices(lambda sl: full[sl], ranges))
        else:
            orig.copy_(full)


@contextlib.contextmanager
def _full(mods: list[nn.Module], device, keep: dict[int, torch.Tensor], probe: list[nn.Module] = ()) -> Iterator[None]:
    """Swap full-size tensors into the own parameters of ``mods`` (kept ones reused) and full-size meta
    placeholders into those of ``probe``; afterwards store every shard and refuse a written placeholder."""
    swapped, probes = [], []
    for mod in mods:
        params = module_parameters(mod)
        for name, p in list(params.items()):
            if p is None:
                continue
            full = keep.get(id(p))
            if full is None:
                full = keep[id(p)] = torch.empty(p.shape, dtype=p.dtype, device=device)
            params[name] = nn.Parameter(full, requires_grad=p.requires_grad)
            swapped.append((params, name, p))
    for mod in probe:
        params = module_parameters(mod)
        for name, p in list(params.items()):
            if p is not None and id(p) not in keep:
                ph = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
                params[name] = ph
                probes.append((params, name, p, ph, tensor_version(ph)))
    try:
        yield
    finally:
        for params, name, p in swapped:
            keep[id(p)] = params[name].data  # the initializer may have replaced it
            params[name] = p
            _store(p, keep[id(p)])
        written = [name for params, name, p, ph, v in probes if params[name] is not ph or tensor_version(ph) != v]
        for params, name, p, _, _ in probes:
            params[name] = p
        if written:
            raise PlanError(f"materialize: the initializer of {type(mods[0]).__name__} writes parameters of modules "
                            f"two levels below it ({', '.join(written[:4])}); pass init=, or load a checkpoint with "
                            f"meshplan.load_state_dict")


def _plan_init(model: nn.Module, init: Callable | None) -> tuple[list[tuple[nn.Module, Callable]] | None, Callable | None]:
    """(per-module calls in order, or None; the model-level call, or None)."""
    if init is not None:
        return [(m, init) for m in model.modules()], None
    if hasattr(model, "_initialize_weights") and hasattr(model, "initialize_weights"):  # transformers
        from transformers import PreTrainedModel
        calls: list = []

        def walk(mod: nn.Module, owner) -> None:  # transformers' smart_apply: children first, sub-models own
            for child in mod.children():
                walk(child, child if isinstance(child, PreTrainedModel) else owner)
            calls.append((mod, owner._initialize_weights))
        walk(model, model)
        return calls, None
    if callable(getattr(model, "init_weights", None)):
        return None, model.init_weights
    return [(m, lambda mod: mod.reset_parameters()) for m in model.modules()
            if callable(getattr(m, "reset_parameters", None))], None


def _device(model: nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        if hasattr(p, "device_mesh"):
            return torch.device(p.device_mesh.device_type)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def materialize(model: nn.Module, init: Callable[[nn.Module], None] | None = None, *, device=None,
                seed: int | None = None, mode: str | None = None) -> nn.Module:
    """Allocate a (parallelized) meta-device model's shards and initialize them (``exact``: as one device would).

    Args:
        model: a model whose parameters are on the meta device (DTensors after
            :func:`meshplan.parallelize`, or plain).
        init: a per-module initializer ``init(module)``. Default: the model's own:
            transformers' ``_init_weights`` (children first, as ``initialize_weights`` does),
            else a model-level ``init_weights()``, else each module's ``reset_parameters()``.
        device: where the shards live. Default: the tp mesh's device type.
        seed: ``torch.manual_seed(seed)`` first. Every rank must draw the same stream:
            pass a seed, or seed every rank alike before calling (``sharded``: the keys use
            ``torch.initial_seed()`` then).
        mode: ``"exact"`` (every rank replays the one-device stream for every full tensor: O(model) per
            rank) or ``"sharded"`` (:mod:`meshplan.weights.sharded_init`: each rank runs the initializers on
            its local shards with draws keyed by (seed, parameter name, global index): O(shard) per rank).
            Default: the plan's ``init.mode``, else ``"exact"``.

    Returns:
        ``model``, on ``device``. ``exact``: equal (shard for shard) to a one-device model built the same
        way and initialized with the same seed and initializer. ``sharded``: the same distribution per
        tensor; the same full tensors under every layout and rank order (replicas bit-identical).

    A pipelined model (split on the meta device) allocates its own stages only: the other stages' modules,
    kept as meta modules by the split, are put back for the walk, each initialized into a transient full
    tensor (one module at a time) and dropped, so the random stream is the one-device one.

    Raises:
        PlanError: ``mode`` is not ``exact`` or ``sharded``; the model was cut into pipeline stages off the meta
            device (the other stages' modules are gone, so the one-device module walk cannot be replayed);
            ``sharded``: an initializer that cannot act on a shard (naming the module and the operation).
    """
    from meshplan.weights.sharded_init import resolve_mode
    mode = resolve_mode(model, mode)
    whole = whole_of(model, "materialize", "meshplan.load_state_dict")
    dev = _device(model, device)
    _to_empty(model, dev)
    if seed is not None:
        torch.manual_seed(seed)
    with whole:
        _init(model, init, dev, mode, torch.initial_seed() if seed is None else seed)
    return model


def whole_of(model: nn.Module, what: str, instead: str) -> contextlib.AbstractContextManager:
    """The context in which ``model`` has the full model's module structure (the axes' ``whole`` hook: a
    pipeline's other stages as meta modules), a null one when the rank holds every module.

    Raises:
        PlanError: this rank holds part of the model and the rest is gone (pruned off the meta device).
    """
    from meshplan.axes import held_part, held_whole
    from meshplan.state import parallel_state
    state = parallel_state(model)
    part = held_part(state)  # the axes' records: which part of the model this rank holds
    whole = held_whole(state, model) if part is not None else contextlib.nullcontext()
    if whole is None:
        raise PlanError(f"{what}: this {type(model).__name__} holds {part[0]} only and was built off the meta "
                        f"device, so the other stages' modules are gone and its initializer cannot walk the "
                        f"one-device module sequence; build it under `with torch.device('meta')` before "
                        f"meshplan.parallelize, or use {instead}")
    return whole


def _init(model: nn.Module, init: Callable | None, dev: torch.device, mode: str = "exact", seed: int = 0) -> None:
    """Run the initializer over ``model``'s modules (whole or per module), storing each rank's shards."""
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    calls, whole = _plan_init(model, init)
    keep: dict[int, torch.Tensor] = {}
    guard = contextlib.nullcontext()
    if calls is not None and hasattr(model, "_initialize_weights"):
        from transformers import initialization
        guard = initialization.guard_torch_init_functions()
    with torch.no_grad(), guard:
        if mode == "sharded":
            from meshplan.weights.sharded_init import keyed_init
            keyed_init(model, calls, whole, seed, dev)
        elif whole is not None:
            with _full(list(model.modules()), dev, keep):
                kw = {"buffer_device": dev} if "buffer_device" in inspect.signature(whole).parameters else {}
                whole(**kw)
        else:
            _stream(model, calls, dev, keep)


def _stream(model: nn.Module, calls: list, device, keep: dict[int, torch.Tensor]) -> None:
    """Per-module initialization holding one module and its children's full parameters at a time."""
    parent = {id(c): m for m in model.modules() for c in m.children()}
    tied = {k for k, v in _owners(model).items() if len(v) > 1}
    done: set[int] = set()

    def release(mod: nn.Module) -> None:
        for p in module_parameters(mod).values():
            if p is not None and id(p) not in tied:
                keep.pop(id(p), None)

    for mod, call in calls:
        kids = list(mod.children())
        deeper = [m for k in kids for m in k.modules() if m is not k]
        with _full([mod, *kids], device, keep, probe=deeper):
            call(mod)
        done.add(id(mod))
        for k in kids:
            release(k)  # their parent (this module) has run
        if id(parent.get(id(mod))) in done or mod is model:
            release(mod)
    keep.clear()


def _to_empty(model: nn.Module, device) -> None:
    """``model.to_empty(device)`` keeping tied parameters tied (torch re-creates plain meta parameters)."""
    groups = [v for v in _owners(model).values() if len(v) > 1]
    model.to_empty(device=device)
    for group in groups:
        first_mod, first_name, kind = group[0]
        table = module_parameters if kind == "p" else module_buffers
        for mod, name, _ in group[1:]:
            table(mod)[name] = table(first_mod)[first_name]


def _init_buffers(model: nn.Module, device: torch.device) -> None:
    """Compute buffers (RoPE tables, …) by running the initializer with throwaway meta parameters."""
    calls, whole = _plan_init(model, None)
    swapped = []
    for mod in model.modules():
        params = module_parameters(mod)
        for name, p in list(params.items()):
            if p is not None:
                params[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                            requires_grad=p.requires_grad)
                swapped.append((params, name, p))
    try:
        with torch.no_grad():
            if whole is not None:
                kw = {"buffer_device": device} if "buffer_device" in inspect.signature(whole).parameters else {}
                whole(**kw)
            else:
                for mod, call in calls:
                    call(mod)
    finally:
        for params, name, p in swapped:
            params[name] = p
        for m in model.modules():
            m.__dict__.pop("_is_hf_initialized", None)
