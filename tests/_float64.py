"""float64 parity helpers: models built in float64 that compute in float64 end to end.

Parity tests compare a parallel run with one device in float64 (gloo reduces float64), so that a reordered sum
differs by ~1e-16 instead of ~1e-7 and AdamW, which divides each gradient element by its own running size, has
no fp32 noise to amplify into lr-sized moves. Model code keeps float32 islands that would cast float64 down:
transformers' norms (``hidden_states.to(torch.float32)``, Gemma's ``x.float()`` and ``weight.float()``) and
causal-LM loss (``logits.float()``), torch's test ``Transformer`` (``self.output(h).float()``), the examples'
RoPE and RMSNorm (``x.float()``), DiffLlama's lambdas (``torch.sum(..., dtype=torch.float32)``). Inside :func:`keep_float64`, a float64 tensor that MODEL code casts to float32
stays float64 (the same math without the downcast); casts made by meshplan or torch are left alone, so a
meshplan downcast still shows up as a parity error.

Example::

    with keep_float64():                # a worker's whole run
        ref = float64_model(factory())
        model = meshplan.parallelize(copy.deepcopy(ref), plan)
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

import meshplan

__all__ = ["RTOL", "float64_model", "keep_float64"]

#: The one relative tolerance of float64 parity (loss, gradient, parameter after AdamW steps; ``||got - want|| /
#: ||want||``). Reordered float64 sums differ by ~1e-16; AdamW amplifies that on elements whose gradient cancels
#: to ~0, and the worst seen on the architectures, transformers and pipelines is 8e-13 (Gemma2's norm weight
#: after 3 steps): 1e-9 leaves three orders of margin for other CPUs' kernels and sits six orders below the
#: 1e-4..1e-3 that fp32 noise, or any real sharding bug, produces.
RTOL = 1e-9

#: code whose casts are kept: meshplan's (a downcast there is a bug the tests must see) and torch's (FSDP's
#: mixed precision, DTensor internals), except torch's test models (``torch.testing``: model code)
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (meshplan, torch))
_TORCH_TEST_MODELS = os.path.join(_LIBRARIES[1], "testing") + os.sep


def _caller() -> str:
    """The file of the code that made the cast: the first frame outside any TorchFunctionMode's methods (another
    mode, e.g. meshplan's dropout mode, re-issues the op from its own ``__torch_function__``)."""
    frame = sys._getframe(2)
    while frame is not None and isinstance(frame.f_locals.get("self"), TorchFunctionMode):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def _library_code(filename: str) -> bool:
    return filename.startswith(_LIBRARIES) and not filename.startswith(_TORCH_TEST_MODELS)


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


def _float32_result(args, kwargs) -> bool:
    """Is this a float64 tensor reduced or converted with ``dtype=torch.float32`` (DiffLlama's lambdas:
    ``torch.sum(q * k, dim=-1, dtype=torch.float32)``)?"""
    return (kwargs.get("dtype") == torch.float32 and bool(args) and isinstance(args[0], torch.Tensor)
            and args[0].dtype == torch.float64)


class _KeepFloat64(TorchFunctionMode):
    """A float64 tensor cast to float32 by model code is returned as it is; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _downcast(func, args, kwargs) and not _library_code(_caller()):
            return args[0]
        if _float32_result(args, kwargs) and not _library_code(_caller()):  # torch.sum(x, dtype=torch.float32)
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64():
    """Within: float64 tensors that model code (transformers, the examples, tests) casts to float32 stay float64.

    Example::

        with keep_float64():
            loss = float64_model(model)(input_ids=ids, labels=ids).loss    # float64
    """
    with _KeepFloat64(), _grouped_mm_fallback_for_float64(), _recompute_in_float64():
        yield


@contextlib.contextmanager
def _recompute_in_float64():
    """Checkpointed blocks recompute under :class:`_KeepFloat64` too: torch runs the recompute inside backward,
    where no TorchFunctionMode is active, so the forward would keep float64 and the recompute cast to float32
    (checkpoint's metadata check fails). The checkpoint wrappers made inside (``checkpoint_wrapper``, which meshplan
    applies) get a ``context_fn`` whose recompute context enters the mode, around the one they were given."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapper  # tests may touch privates
    from torch.utils.checkpoint import noop_context_fn
    original = wrapper.torch_utils_checkpoint

    def checkpoint(fn, *args, context_fn=noop_context_fn, **kwargs):
        def contexts():
            forward, recompute = context_fn()
            return forward, _Entered(recompute, _KeepFloat64())
        return original(fn, *args, context_fn=contexts, **kwargs)
    with mock.patch.object(wrapper, "torch_utils_checkpoint", checkpoint):
        yield


class _Entered:
    """Context managers entered in order and left in reverse (one recompute context for torch's checkpoint)."""

    def __init__(self, *managers) -> None:
        self.managers, self.stack = managers, None

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        for m in self.managers:
            self.stack.enter_context(m)

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)


@contextlib.contextmanager
def _grouped_mm_fallback_for_float64():
    """transformers' ``grouped_mm`` experts run its own fallback kernel on float64 (torch's CPU ``grouped_mm`` has no
    float64 kernel); the experts implementation, and what meshplan shards, stay the same."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = moe._can_use_grouped_mm
    with mock.patch.object(moe, "_can_use_grouped_mm",
                           lambda input, weight, offs: weight.dtype != torch.float64 and original(input, weight, offs)):
        yield


def float64_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` converted to float64 in place (run it inside :func:`keep_float64`).

    Args:
        model: a freshly built model (not yet parallelized).

    Returns:
        ``model`` itself.
    """
    return model.to(torch.float64)
