"""float64 parity helpers: a model built in float64 that computes in float64 end to end.

Parity tests compare a parallel run with one device in float64 (gloo reduces float64), so that a reordered sum
differs by ~1e-16 instead of ~1e-7 and AdamW, which divides each gradient element by its own running size, has
no fp32 noise to amplify into lr-sized moves. Model code keeps float32 islands that would cast float64 down:
transformers' norms (``hidden_states.to(torch.float32)``, Gemma's ``x.float()`` and ``weight.float()``) and
causal-LM loss (``logits.float()``), torch's test ``Transformer`` (``self.output(h).float()``).
:func:`float64_model` converts a model to float64 and, during its forward, keeps float64 tensors that code
OUTSIDE meshplan casts to float32 in float64 (the same math without the downcast). meshplan's own casts are left
alone, so a meshplan downcast still shows up as a parity error.

Example::

    ref = float64_model(factory())
    model = copy.deepcopy(ref)          # the copy's forward keeps float64 too
    meshplan.parallelize(model, plan)
"""

from __future__ import annotations

import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

import meshplan

__all__ = ["RTOL", "float64_model"]

#: The one relative tolerance of float64 parity (loss, gradient, parameter after AdamW steps; ``||got - want|| /
#: ||want||``). Reordered float64 sums differ by ~1e-16; AdamW amplifies that on elements whose gradient cancels
#: to ~0, and the worst seen on the architectures, transformers and pipelines is 8e-13 (Gemma2's norm weight
#: after 3 steps): 1e-9 leaves three orders of margin for other CPUs' kernels and sits six orders below the
#: 1e-4..1e-3 that fp32 noise, or any real sharding bug, produces.
RTOL = 1e-9

_MESHPLAN = os.path.dirname(os.path.abspath(meshplan.__file__)) + os.sep


def _downcast(func, args, kwargs) -> bool:
    """Is this ``Tensor.float()`` / ``Tensor.to(torch.float32)`` a float64 tensor cast to float32?"""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
        return False
    if func is torch.Tensor.float:
        return True
    if func is torch.Tensor.to:
        dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
        return dtype == torch.float32
    return False


class _KeepFloat64(TorchFunctionMode):
    """A float64 tensor cast to float32 by code outside meshplan is returned as it is; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _downcast(func, args, kwargs) and not sys._getframe(1).f_code.co_filename.startswith(_MESHPLAN):
            return args[0]
        return func(*args, **kwargs)


def _forward(self, *args, **kwargs):
    with _KeepFloat64():
        return type(self).forward(self, *args, **kwargs)


def float64_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64, its forward (its own loss included) keeping float64 where model code casts down.

    Args:
        model: a freshly built model (not yet parallelized).

    Returns:
        ``model`` itself, converted in place; ``copy.deepcopy`` copies keep the float64 forward.
    """
    model.to(torch.float64)
    model.forward = types.MethodType(_forward, model)
    return model
