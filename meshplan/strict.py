"""The one strict base every plan model derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Strict"]


class Strict(BaseModel):
    """Frozen, unknown keys rejected.

    A plan is checked into a model repo and read by people: a misspelt key
    (``sequence_paralel: true``) must fail loudly instead of silently falling
    back to a default, and a validated plan must not change under the code
    that applies it. Hence ``extra="forbid"`` and ``frozen=True``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
