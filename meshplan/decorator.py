"""``@meshplan.plan(PLAN)``: a plan that travels with the model class.

The decorator stores the (validated) plan as ``cls.__meshplan_plan__``, which
:func:`meshplan.parallelize` uses when it is given no plan. When a meshplan
topology is active (``with meshplan.init(...):`` or ``with topo:``), every
instance is parallelized as soon as its outermost ``__init__`` returns, so
subclasses finish constructing first (nothing is stored on the instance: the
wrapper of the most-derived class is the one that parallelizes). A decorated subclass extends its
parent's plan: its data is merged over the parent's (mappings merge key by key,
so ``{"tensor_parallel": {"rules": {...}}}`` adds or overrides rules).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Callable, Mapping

from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan

__all__ = ["plan"]

_DATA = "__meshplan_plan_data__"
_WRAPPER = "__meshplan_init__"  # class attribute: the wrapper meshplan installed as that class's __init__


def _data_of(p: Plan | Mapping[str, Any] | str | Path) -> tuple[dict, str | None]:
    if isinstance(p, Plan):
        return p.model_dump(exclude_unset=True, exclude_none=True), p.source
    if isinstance(p, (str, Path)):
        from meshplan.plan_file.reading import read_plan_data
        return read_plan_data(p), str(p)
    if isinstance(p, Mapping):
        return copy.deepcopy(dict(p)), None
    raise PlanError(f"@meshplan.plan takes a plan path, a dict or a meshplan.Plan, got {type(p).__name__}")


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _wrap_init(cls: type) -> None:
    """Make ``cls.__init__`` parallelize the instance when it is the outermost planned ``__init__`` to return.

    Nothing is stored on instances: the wrapper of the most-derived wrapped class (see :func:`_outermost`) is
    the one that runs last, after every ``super().__init__`` it calls. A decorated class without its own
    ``__init__`` gets one that calls the inherited one.
    """
    init = cls.__dict__.get("__init__")
    if init is not None and cls.__dict__.get(_WRAPPER) is init:
        return
    if init is None:
        if "__meshplan_plan__" not in cls.__dict__:
            return  # an undecorated class without __init__: its parent's wrapper is the outermost

        def init(self, *args, **kwargs):
            super(cls, self).__init__(*args, **kwargs)
        init.__name__, init.__qualname__ = "__init__", f"{cls.__qualname__}.__init__"

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _outermost(type(self)) is __init__:  # construction finished: subclasses' __init__ returned too
            _auto_parallelize(self)

    cls.__init__ = __init__
    setattr(cls, _WRAPPER, __init__)


def _outermost(cls: type) -> Callable | None:
    """The wrapped ``__init__`` of the most-derived class in ``cls.__mro__`` whose ``__init__`` meshplan wrapped."""
    for klass in cls.__mro__:
        wrapper = klass.__dict__.get(_WRAPPER)
        if wrapper is not None and klass.__dict__.get("__init__") is wrapper:
            return wrapper
    return None


def _auto_parallelize(model: Any) -> None:
    from meshplan.mesh.topology import current_topology
    from meshplan.state import parallel_state
    topo = current_topology()
    cls = type(model)
    if topo is None or not getattr(cls, "__meshplan_auto__", True) or parallel_state(model) is not None:
        return
    from meshplan.apply import parallelize
    parallelize(model, cls.__meshplan_plan__, topo)


def plan(p: Plan | Mapping[str, Any] | str | Path, *, auto: bool = True) -> Callable[[type], type]:
    """Attach a plan to an ``nn.Module`` class.

    Args:
        p: a plan path, a dict of a plan's content (may be partial on a subclass of a
            decorated class: it is merged over the parent's), or a :class:`Plan`.
        auto: parallelize instances on construction when a topology is active. Default: True.

    Returns:
        The class decorator; the class gets ``__meshplan_plan__`` (a validated :class:`Plan`).

    Raises:
        PlanError: the (merged) plan does not validate; names the plan file when there is one.

    Example::

        @meshplan.plan("plans/llama.yaml")
        class MyLlama(Transformer): ...

        @meshplan.plan({"tensor_parallel": {"rules": {"extra_proj": "colwise"}}})
        class MyLlamaPlus(MyLlama): ...

        with meshplan.init("plans/llama.yaml"):
            model = MyLlamaPlus(args)          # parallelized when __init__ returns
    """
    data, source = _data_of(p)

    def decorate(cls: type) -> type:
        import torch.nn as nn
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PlanError(f"@meshplan.plan decorates nn.Module classes, got {cls!r}")
        parent = getattr(cls, _DATA, None)
        merged = _merge(parent[0], data) if parent is not None else data
        src = source or (parent[1] if parent is not None else None)
        where = f"{src} (extended by {cls.__name__})" if parent is not None and src else src
        plan_obj = Plan.from_data(merged, source=where or f"@meshplan.plan on {cls.__name__}")
        setattr(cls, _DATA, (merged, src))
        cls.__meshplan_plan__ = plan_obj
        cls.__meshplan_auto__ = auto
        for klass in cls.__mro__:  # decorated ancestors' and this class's __init__ parallelize when outermost
            if getattr(klass, "__meshplan_plan__", None) is not None:
                _wrap_init(klass)
        _wrap_init(cls)
        if "__init_subclass__" not in cls.__dict__:
            def __init_subclass__(sub, **kw):
                super(cls, sub).__init_subclass__(**kw)
                _wrap_init(sub)  # undecorated subclasses finish __init__ before parallelizing
            cls.__init_subclass__ = classmethod(__init_subclass__)
        return cls

    return decorate

