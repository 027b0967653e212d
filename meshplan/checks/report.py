"""The result of :func:`meshplan.check`: every error, warning and explain row of one plan on one model."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import PlanError

__all__ = ["Report", "fold_errors"]


@dataclass
class Report:
    """What :func:`check` found.

    Attributes:
        ok: no errors.
        errors: every :class:`PlanError`, in check order.
        warnings: layouts that work but cost extra collectives.
        modules: one explain row per parallelized module (see :mod:`meshplan.checks.explain`).
        unsharded: ``{parameter: reason}`` for parameters every tp rank holds whole.
        totals: parameter counts/bytes and collectives per forward/backward.
        pipeline: the ``pipeline`` section's schedule and one row per stage (see
            :mod:`meshplan.pipeline.check`, the unit's ``report_key``); empty without a section or when the split failed.
        context: the summary the context axis unit's check writes (its ``report_key``; :mod:`meshplan.axes`), or
            empty.
        experts: the summary the expert axis unit's check writes (its ``report_key``; :mod:`meshplan.axes`), or
            empty.
        data: the data axis unit's ``report_key``: empty (its check adds errors only, no summary lines).
        rank_view: one rank's view (:func:`meshplan.checks.rank_view.rank_view`: coordinates, stages, parameter,
            gradient and optimizer bytes, collectives per step), or None (errors, or no dry run).
        sharding: the resolution the tensor axis unit's check writes (its ``report_key``): matched rules, the
            checker the rehearsals add their errors to, whether its static checks passed; not in :meth:`to_dict`.
    """

    source: str
    model: str
    tp: int
    world_size: int
    errors: list[PlanError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    modules: list[dict] = field(default_factory=list)
    unsharded: dict[str, str] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    experts: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    rank_view: dict[str, Any] | None = None
    sharding: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_errors(self) -> None:
        """Raise one PlanError listing every error (numbered), if there are any."""
        if self.errors:
            lines = "\n".join(f"  {i}. {e}" for i, e in enumerate(self.errors, 1))
            raise PlanError(f"{len(self.errors)} problem(s) in {self.source}:\n{lines}")

    def to_dict(self) -> dict:
        """The ``--format json`` document: ``{ok, errors, warnings, modules, unsharded, totals, pipeline, context, experts,
        rank}``."""
        return {"ok": self.ok, "source": self.source, "model": self.model, "tp": self.tp,
                "world_size": self.world_size, "errors": [str(e) for e in self.errors], "warnings": self.warnings,
                "modules": self.modules, "unsharded": self.unsharded, "totals": self.totals,
                "pipeline": self.pipeline or None, "context": self.context or None,
                "experts": self.experts or None, "rank": self.rank_view}


def per_rank_totals(report: Report) -> None:
    """The totals' per-rank figures from the report's rank view (every axis' division: the rank's stages, tp,
    the experts, FSDP2's shard), or None with the reason when there is no view; each explain row's
    ``bytes_per_rank`` becomes that rank's bytes of the module (0 for a module on another pipeline stage)."""
    v, t = report.rank_view, report.totals
    if v is None or v["parameters"] is None:
        t.update(parameters_per_rank=None, bytes_per_rank=None, gradient_bytes_per_rank=None,
                 optimizer_bytes_per_rank=None,
                 per_rank_reason=(v or {}).get("reason", "no dry run"))
        return
    for row in report.modules:
        row["bytes_per_rank"] = v["module_bytes"].get("" if row["module"] == "(root)" else row["module"], 0)
    t.update(rank=v["rank"], parameters_per_rank=v["parameters"], bytes_per_rank=v["parameter_bytes"],
             gradient_bytes_per_rank=v["gradient_bytes"], optimizer_bytes_per_rank=v["optimizer_bytes"])


def fold_errors(errors: list[PlanError]) -> list[PlanError]:
    """One error per message that differs only in layer indices (``layers.0`` … ``layers.125``)."""
    groups: dict[str, list[str]] = {}
    for e in errors:
        groups.setdefault(re.sub(r"\.\d+(?=[.'])", ".*", str(e)), []).append(str(e))
    return [PlanError(v[0] if len(v) == 1 else f"{v[0]} (and {len(v) - 1} more module(s) of the same rule)")
            for v in groups.values()]
