"""The one strict base every plan model derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Strict"]


class Strict(BaseModel):
    """Frozen, unknown keys rejected, no type coercion.

    A plan is checked into a model repo and read by people: a misspelt key
    (``sequence_paralel: true``) must fail loudly instead of silently falling
    back to a default, and a validated plan must not change under the code
    that applies it. Hence ``extra="forbid"`` and ``frozen=True``.

    ``strict=True``: a value must already have the field's type. ``tp: "2"``,
    ``tp: 2.0``, ``tp: true`` and ``loss_parallel: "yes"`` are errors, not
    ``2``, ``2``, ``1`` and ``True``: a plan that only works because of a
    silent conversion is a plan whose author meant something else. YAML, JSON
    and TOML all have native integers, booleans and strings, so a correct plan
    never needs coercion. (Tuple fields take a list through a field validator:
    the file formats have no tuples.)
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)
