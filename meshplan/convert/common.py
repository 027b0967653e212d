"""What every converter shares: the record of what a direction dropped or assumed, the sections a format cannot
hold, and a rule written with only the layouts that differ from meshplan's generated ones. Torch-free apart from
the style table (imported lazily)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from meshplan.axes import AXES

__all__ = ["Notes", "context_section", "unheld_sections", "acts", "layout_overrides", "rule_data", "is_replicate", "SECTION_NAMES", "HEAD_NAMES"]

#: what each plan section is, for the dropped lines (in this order; an axis unit's section without its own words:
#: "the <section> section")
_DESCRIBED = {"blocks": "the blocks section (activation checkpointing, compile)",
              "data_parallel": "the data_parallel section (FSDP2/HSDP/DDP settings)",
              "tensor_parallel": "the tensor_parallel rules"}
SECTION_NAMES = {k: _DESCRIBED.get(k, f"the {k} section")
                 for k in ("blocks", "data_parallel", *(axis.section for axis in AXES), "tensor_parallel")}


#: the last path segment of common output heads (a name is all a source without a model says)
HEAD_NAMES = ("lm_head", "embed_out", "output")


def is_replicate(layout: Any) -> bool:
    """Is a layout text (``replicate``, ``shard(1)``, …; not None) Replicate?"""
    from meshplan.plan_file.tensor_parallel import layout_kind
    return isinstance(layout, str) and layout_kind(layout) == "R"


@dataclass
class Notes:
    """What a conversion could not carry (``dropped``) and what it had to guess (``assumed``): one line each,
    printed on stderr by ``meshplan convert``; ``lost``: the dropped rules that held parameters' sharding."""

    dropped: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def drop(self, what: str, why: str) -> None:
        self.dropped.append(f"{what}: {why}")

    def lose(self, what: str, why: str) -> None:
        """A dropped rule for a module that has (or may have) parameters: ``meshplan convert`` refuses to write
        the result unless ``--allow-drop``."""
        self.drop(what, why)
        self.lost.append(what)

    def assume(self, what: str, why: str) -> None:
        self.assumed.append(f"{what}: {why}")

    def lines(self) -> list[str]:
        return [f"meshplan convert: dropped {d}" for d in self.dropped] + \
               [f"meshplan convert: assumed {a}" for a in self.assumed]


def unheld_sections(plan: Any, held: set[str], target: str, notes: Notes) -> None:
    """One dropped line per plan section ``target`` cannot hold (a ``blocks`` section that only names the blocks
    holds nothing to drop: every target finds the repeated blocks itself)."""
    for name, what in SECTION_NAMES.items():
        if getattr(plan, name, None) is not None and name not in held and (name != "blocks" or acts(plan.blocks)):
            notes.drop(what, f"{target} has no equivalent")


def acts(blocks: Any) -> bool:
    """Does a ``blocks`` section do something to the blocks (checkpointing, compile), beyond naming them?"""
    return blocks is not None and (blocks.activation_checkpointing.mode != "none" or blocks.compile)


def layout_overrides(layout: Any, held: set[str], target: str, notes: Notes) -> None:
    """One dropped line per degree or the order (set in the plan's layout) that ``target`` cannot hold."""
    if layout is None:
        return
    for key, value in layout.model_dump(exclude_defaults=True).items():
        if key not in held:
            notes.drop(f"layout.{key} ({value})", f"{target} has no equivalent")


def rule_data(style: str, overrides: Mapping[str, Any], stream: Any) -> str | dict:
    """A plan rule (a style name, or a mapping) keeping only the overrides meshplan would not generate itself for
    ``stream`` (a :class:`~meshplan.plan_file.layout_text.Stream`)."""
    from meshplan.plan_file.style_semantics import SEMANTICS
    spec = SEMANTICS[style]
    generated = spec.layouts({}, stream)
    kept = {k: v for k, v in overrides.items() if v is not None and generated.get(k, object()) != v}
    return {"style": style, **kept} if kept else style


def context_section(data: dict, modules: Mapping[str, str] | None, notes: Notes, source: str) -> None:
    """A plan with ``cp > 1`` gets its ``context_parallel`` section: the model's attention modules (``--model``:
    the patterns of modules whose class ends in ``Attention``, outermost), or a refusal naming what to pass."""
    from meshplan.errors import PlanError
    cp = (data.get("layout") or {}).get("cp", 1)
    if not isinstance(cp, int) or cp <= 1 or "context_parallel" in data:
        return
    found = sorted(k for k, cls in (modules or {}).items() if "*" in k and cls.endswith("Attention"))
    found = [k for k in found if not any(k.startswith(o + ".") for o in found)]
    if not found:
        raise PlanError(f"{source}: cp {cp} needs a context_parallel section naming the attention modules, and "
                        f"the source names none; pass --model MODULE:FACTORY (meshplan finds the modules whose "
                        f"class ends in Attention){' - the model has none' if modules else ''}")
    data["context_parallel"] = {"attention": found}
    notes.assume(f"context_parallel: {{attention: {found}}}", f"cp {cp}: the model's attention modules (the source "
                 f"names none)")
