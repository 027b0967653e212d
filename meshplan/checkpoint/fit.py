"""Whether a saved tensor fits a model's: the same shape, and a dtype the model's can be cast from.

Shared by :func:`meshplan.load` (DCP metadata) and :func:`meshplan.load_safetensors` (safetensors headers): both
check every tensor with it before anything large is allocated. A cast within a kind is allowed (float32 saved,
bfloat16 model: the usual precision change); a cast across kinds is refused, because ``copy_`` would do it silently
and wrongly (complex into real drops the imaginary part, float into integer truncates, anything into bool
thresholds).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dtype_kind", "misfit"]

#: safetensors' dtype names by their first letters, longest first
_SAFETENSORS_KINDS = (("BOOL", "bool"), ("BF", "float"), ("F", "float"), ("C", "complex"), ("I", "integer"),
                      ("U", "integer"))


def dtype_kind(dtype: torch.dtype | str) -> str:
    """``"float"``, ``"complex"``, ``"integer"`` or ``"bool"``, of a torch dtype or a safetensors name (``"BF16"``).

    Example::

        >>> dtype_kind(torch.bfloat16), dtype_kind("F32"), dtype_kind("C64"), dtype_kind(torch.int64)
        ('float', 'float', 'complex', 'integer')
    """
    if isinstance(dtype, str):
        return next((kind for prefix, kind in _SAFETENSORS_KINDS if dtype.upper().startswith(prefix)), dtype)
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def misfit(key: str, saved_shape: Any, saved_dtype: Any, shape: Any, dtype: Any) -> str | None:
    """What makes the saved tensor ``key`` unfit for the model's (None when it fits): ``"<key>: checkpoint shape
    (…), model (…)"`` or ``"<key>: checkpoint dtype complex64, model float32 (cannot be cast: complex into float)"``.

    ``saved_dtype`` / ``dtype`` may be None (not known: only the shape is compared).
    """
    if tuple(saved_shape) != tuple(shape):
        return f"{key}: checkpoint shape {tuple(saved_shape)}, model {tuple(shape)}"
    if saved_dtype is None or dtype is None:
        return None
    got, want = dtype_kind(saved_dtype), dtype_kind(dtype)
    if got != want:
        return (f"{key}: checkpoint dtype {_name(saved_dtype)}, model {_name(dtype)} (cannot be cast: {got} into "
                f"{want}; save the checkpoint in a {want} dtype or build the model in the checkpoint's)")
    return None
