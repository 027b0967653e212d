"""``materialize(mode="sharded")``: each rank runs the model's own initializers on its local shards only.

The initializers (transformers' ``_init_weights``, ``reset_parameters``, a model-level ``init_weights()``, the
``nn.init`` functions they call) run on the parameters as they are after :func:`meshplan.parallelize`: DTensors
keep the GLOBAL shape, so fans (kaiming, xavier, a Linear bias's bound) are the one-device ones, and constant writes
(``ones_``, ``zeros_``, ``fill_``) and elementwise steps apply to the local shard.
A dispatch mode takes every random draw into a parameter and writes keyed values instead
(:mod:`meshplan.weights.keyed`): element ``i`` of parameter ``name`` depends on (seed, name, i) only, so replicas are
bit-identical without communication, the order ranks run in does not matter, and two layouts give the same full
tensors. ``trunc_normal_`` (which torch 2.13 rejection-samples through temporaries) is keyed in its inverse-CDF
form. ``weight[i]`` / ``weight[a:b]`` of a parameter (the padding row of an embedding) become views of the local
shard that know their global indices. Initializers that read the whole tensor (``orthogonal_``, ``sparse_``,
``eye_``, ``dirac_``) are run whole for that one tensor (a transient full tensor, keyed generator, this rank keeps
its shard: exact per tensor, O(tensor)); anything else that would not act on the shard is refused with a
:class:`~meshplan.errors.PlanError` naming the module and the operation.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from meshplan._torch import CHECKPOINT_PREFIX, TorchDispatchMode, local_tensor
from meshplan.errors import PlanError
from meshplan.weights.keyed import Keyed, fill_keyed, module_seed, tensor_key
from meshplan.weights.shards import local_slices

__all__ = ["MODES", "resolve_mode", "keyed_targets", "keyed_init", "WHOLE_TENSOR_INITS"]

MODES = ("exact", "sharded")
#: nn.init functions that read or structure the whole tensor: run whole for that one tensor in sharded mode
WHOLE_TENSOR_INITS = ("orthogonal_", "sparse_", "eye_", "dirac_")
_aten = torch.ops.aten
_DRAWS = {_aten.normal_: ("normal", "mean", "std", 0.0, 1.0), _aten.uniform_: ("uniform", "from", "to", 0.0, 1.0)}
_OTHER_DRAWS = (_aten.bernoulli_, _aten.exponential_, _aten.random_, _aten.log_normal_, _aten.cauchy_,
                _aten.geometric_)
_log = logging.getLogger(__name__)


def resolve_mode(model: nn.Module, mode: str | None) -> str:
    """The init mode: the call's ``mode``, else the plan's ``init.mode``, else ``"exact"``.

    Raises:
        PlanError: ``mode`` is not one of :data:`MODES`.
    """
    if mode is None:
        from meshplan.state import parallel_state
        plan = getattr(parallel_state(model), "plan", None)
        section = getattr(plan, "init", None)
        mode = section.mode if section is not None else "exact"
    if mode not in MODES:
        raise PlanError(f"materialize: mode={mode!r}; expected one of {', '.join(map(repr, MODES))}")
    return mode


def one_device_name(name: str) -> str:
    """A parameter or module name as the one-device model spells it (activation checkpointing's and compile's
    wrapper segments removed), so the keys do not depend on the plan's blocks section."""
    return name.replace(CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")


def _ident(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def keyed_targets(model: nn.Module, seed: int) -> tuple[dict[tuple, Keyed], set[int]]:
    """Every allocated parameter's local tensor → where its elements sit in the full tensor, keyed by its name
    (the first name of a tied parameter: the one-device model's); and the storages they live in."""
    out: dict[tuple, Keyed] = {}
    storages: set[int] = set()
    for name, p in model.named_parameters():
        name, local = one_device_name(name), local_tensor(p)
        if p.is_meta or local.numel() == 0:
            continue
        shape = tuple(p.shape)
        if isinstance(p, DTensor):
            runs = local_slices(shape, p.placements, p.device_mesh)
            idx = tuple(torch.cat([torch.arange(a, b) for a, b in r]) for r in runs)
        else:
            idx = tuple(torch.arange(n) for n in shape)
        assert tuple(len(i) for i in idx) == tuple(local.shape), (name, shape, tuple(local.shape))
        out[_ident(local)] = Keyed(name, tensor_key(seed, name), 0, idx, _strides(shape),
                                   tuple((0, 1, n) for n in shape))
        storages.add(local.untyped_storage().data_ptr())
    return out, storages


class _KeyedDraws(TorchDispatchMode):
    """Random draws into parameters (and their ``[i]`` / ``[a:b]`` views) replaced by keyed values."""

    def __init__(self, targets: dict[tuple, Keyed], storages: set[int]):
        super().__init__()
        self.targets, self.storages, self.where = targets, storages, ""
        self.views: dict[int, tuple[torch.Tensor, Keyed]] = {}  # by id: a view may share its parent's memory

    def find(self, t) -> tuple[torch.Tensor, Keyed | None]:
        local = local_tensor(t)
        if not isinstance(local, torch.Tensor) or local.is_meta:
            return local, None
        view = self.views.get(id(t))
        if view is not None and view[0] is t:
            return local, view[1]
        return local, self.targets.get(_ident(local))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet in _DRAWS or packet in _OTHER_DRAWS:
            return self._draw(func, args, kwargs)
        if packet in (_aten.select, _aten.slice) and isinstance(first, torch.Tensor):
            local, target = self.find(first)
            if target is not None:
                return self._view(packet, first, local, target, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(first, DTensor) and func.is_view and self.find(first)[1] is not None:
            src, got = local_tensor(first), local_tensor(out) if isinstance(out, DTensor) else out
            if not isinstance(got, torch.Tensor) or got.untyped_storage().data_ptr() != \
                    src.untyped_storage().data_ptr():
                raise PlanError(f"materialize(mode='sharded'): {self.where}: {packet.__name__} of parameter "
                                f"{self.find(first)[1].name!r} (placements {first.placements}) is a copy, not a "
                                f"view of this rank's shard, so a write through it would be lost; use "
                                f"mode='exact' or an initializer that writes the whole parameter")
        return out

    def _draw(self, func, args, kwargs):
        t = args[0]
        local, target = self.find(t)
        if local.is_meta or local.numel() == 0:
            return t
        if target is None:
            if isinstance(t, DTensor) or local.untyped_storage().data_ptr() in self.storages:
                raise PlanError(f"materialize(mode='sharded'): {self.where}: {func.overloadpacket.__name__} into "
                                f"a tensor that is not a parameter or its [i] / [a:b] view ({tuple(t.shape)}: "
                                f"{_caller()}); use mode='exact' for this model")
            return func(*args, **kwargs)  # a temporary: the global stream, seeded per module
        if func.overloadpacket not in _DRAWS:
            raise PlanError(f"materialize(mode='sharded'): {self.where}: {func.overloadpacket.__name__} into "
                            f"parameter {target.name!r} has no keyed form (normal_ and uniform_ have); use "
                            f"mode='exact'")
        kind, ka, kb, da, db = _DRAWS[func.overloadpacket]
        a = args[1] if len(args) > 1 else kwargs.get(ka, da)
        b = args[2] if len(args) > 2 else kwargs.get(kb, db)
        fill_keyed(local, target, kind, float(a), float(b))
        return t

    def _view(self, packet, t, local, target: Keyed, args, kwargs):
        """``t[j]`` or ``t[a:b:s]`` of a parameter (or of such a view): a view of the local tensor that knows
        its elements' indices in the full tensor."""
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % t.dim()
        if packet is _aten.select:
            pos, new = target.select(dim, args[2])
            if pos is None:
                return local.new_empty((0,))  # this rank holds no element of it
            view = local.select(dim, pos)
        else:
            bounds = [args[i] if len(args) > i else kwargs.get(k) for i, k in ((2, "start"), (3, "end"), (4, "step"))]
            pos, new = target.slice(dim, *bounds)
            gaps = {b - a for a, b in zip(pos, pos[1:])}
            if len(gaps) > 1:
                raise PlanError(f"materialize(mode='sharded'): {self.where}: parameter {target.name!r}, dim {dim}"
                                f"[{':'.join('' if v is None else str(v) for v in bounds)}] is not one strided "
                                f"block of this rank's shard; use mode='exact'")
            k = gaps.pop() if gaps else 1
            view = local[(slice(None),) * dim + (slice(pos[0], pos[-1] + 1, k) if pos else slice(0, 0),)]
        if view.numel():
            self.views[id(view)] = (view, new)
        return view

    def forget_views(self) -> None:
        self.views.clear()


def _caller() -> str:
    """The ``nn.init`` (or transformers' ``initialization``) function on the stack, for an error."""
    frame, found = inspect.currentframe(), "not an nn.init function"
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in ("torch.nn.init", "transformers.initialization") and not frame.f_code.co_name.startswith("_"):
            found = f"{module}.{frame.f_code.co_name}"  # the outermost public one
        frame = frame.f_back
    return found


def _index(target: Keyed) -> tuple[torch.Tensor, ...]:
    n = len(target.idx)
    return tuple(i.view([-1 if e == d else 1 for e in range(n)]) for d, i in enumerate(target.idx))


def _whole_tensor(draws: _KeyedDraws, name: str, orig: Callable) -> Callable:
    """``orig`` (an nn.init function that reads the whole tensor) run whole for one parameter: a transient full
    tensor, a generator keyed by (seed, name), this rank's shard kept."""
    def run(tensor, *args, **kwargs):
        local, target = draws.find(tensor)
        if target is None or not target.whole:
            if target is not None or (isinstance(tensor, DTensor) and not local.is_meta):
                raise PlanError(f"materialize(mode='sharded'): {draws.where}: {name} on "
                                f"{'a view of parameter ' + repr(target.name) if target else 'a DTensor that is not a parameter'}"
                                f" reads the whole tensor; use mode='exact' for this model")
            return orig(tensor, *args, **kwargs)
        full = torch.empty(tuple(tensor.shape), dtype=local.dtype, device=local.device)
        if name in ("orthogonal_", "sparse_"):
            kwargs["generator"] = torch.Generator(local.device).manual_seed(target.key & ((1 << 63) - 1))
        orig(full, *args, **kwargs)
        local.copy_(full[_index(target)] if target.idx else full)
        _log.info("materialize(mode='sharded'): %s: %s of %s %s run whole (exact for this tensor, O(tensor))",
                  draws.where, name, target.name, tuple(tensor.shape))
        return tensor
    return run


def _trunc_normal(draws: _KeyedDraws, name: str, orig: Callable) -> Callable:
    """``trunc_normal_`` keyed on a parameter (torch 2.13 rejection-samples, which would draw into temporaries and
    reduce over ranks): the inverse-CDF form, a keyed uniform between the bounds' CDFs through ``erfinv``."""
    def run(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        local, target = draws.find(tensor)
        if target is None:
            return orig(tensor, mean=mean, std=std, a=a, b=b, generator=generator)
        cdf = lambda x: (1.0 + math.erf((x - mean) / std / math.sqrt(2.0))) / 2.0  # noqa: E731
        fill_keyed(local, target, "uniform", 2 * cdf(a) - 1, 2 * cdf(b) - 1)
        local.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)
        return tensor
    return run


@contextlib.contextmanager
def _whole_tensor_inits(draws: _KeyedDraws) -> Iterator[None]:
    """:data:`WHOLE_TENSOR_INITS` in ``torch.nn.init`` (and transformers' table of torch's originals) replaced by
    :func:`_whole_tensor`, and ``trunc_normal_`` by :func:`_trunc_normal`, for the block."""
    tables = [vars(torch.nn.init)]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None:
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    names = (*WHOLE_TENSOR_INITS, "trunc_normal_")
    saved = [(table, name, table[name]) for table in tables for name in names if name in table]
    try:
        for table, name, orig in saved:
            table[name] = (_trunc_normal if name == "trunc_normal_" else _whole_tensor)(draws, name, orig)
        yield
    finally:
        for table, name, orig in reversed(saved):
            table[name] = orig


def keyed_init(model: nn.Module, calls: list | None, whole: Callable | None, seed: int, device) -> None:
    """Run the initializer (per-module ``calls`` in order, or the model-level ``whole``) on the local shards,
    random draws into parameters keyed by (seed, name, global index); each module's temporaries drawn from the
    global stream seeded by (seed, module name), the caller's random state restored afterwards."""
    targets, storages = keyed_targets(model, seed)
    names = {id(m): one_device_name(n) for n, m in model.named_modules()}
    draws = _KeyedDraws(targets, storages)
    rng = torch.random.fork_rng(devices=[torch.device(device).index or 0] if torch.device(device).type == "cuda"
                                else [])  # the per-module seeds leave the caller's stream as it was
    with rng, torch.no_grad(), _whole_tensor_inits(draws), draws:
        if whole is not None:
            draws.where = f"{type(model).__name__}.init_weights"
            torch.manual_seed(module_seed(seed, ""))
            whole(**({"buffer_device": device} if "buffer_device" in inspect.signature(whole).parameters else {}))
            return
        for mod, call in calls:
            name = names.get(id(mod), "")
            draws.where = f"{name or '<model>'} ({type(mod).__name__})"
            torch.manual_seed(module_seed(seed, name))
            call(mod)
            draws.forget_views()
