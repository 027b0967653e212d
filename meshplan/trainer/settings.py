"""The trainer's settings: the plan's ``training`` section with command-line overrides by dotted path. Torch-free.

``--steps 10``, ``--optimizer.lr=1e-3``, ``--checkpoint.folder runs/a`` set ``training.steps``,
``training.optimizer.lr`` and ``training.checkpoint.folder``, and ``--layout.tp 2`` the layout's degree; values are read as JSON (else YAML) scalars (``10`` is an int,
``1e-3`` a float, ``null``/``true`` what JSON says, ``[0.9, 0.95]`` a list) and the whole plan is validated again,
so an override gets the plan's own strictness and messages, naming the flag.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import yaml

from meshplan.errors import PlanError
from meshplan.plan_file.document import Plan
from meshplan.plan_file.layout import Layout
from meshplan.plan_file.training import Training

__all__ = ["with_overrides", "parse_overrides", "setting_names"]


def setting_names(model: type = Training, prefix: str = "") -> list[str]:
    """Every dotted setting the trainer takes (``steps``, ``optimizer.lr``, …), for help and suggestions."""
    out = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        out.extend(setting_names(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"])
    return out


def _submodel(annotation: Any) -> type | None:
    args = getattr(annotation, "__args__", None) or (annotation,)
    return next((a for a in args if isinstance(a, type) and hasattr(a, "model_fields")), None)


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """``["--steps", "10", "--optimizer.lr=1e-3"]`` → ``{"steps": 10, "optimizer.lr": 0.001}``.

    Raises:
        PlanError: a word that is not ``--name value`` / ``--name=value``, a value missing, an unknown name
            (with the closest valid ones).
    """
    out: dict[str, Any] = {}
    names = setting_names() + [f"layout.{k}" for k in Layout.model_fields]
    it = iter(argv)
    for word in it:
        if not word.startswith("--") or word == "--":
            raise PlanError(f"meshplan train: expected --SETTING VALUE, got {word!r}")
        name, eq, value = word[2:].partition("=")
        if not eq:
            value = next(it, None)
            if value is None:
                raise PlanError(f"meshplan train: --{name} needs a value")
        name = name.replace("-", "_")
        if name not in names:
            near = [n for n in names if n.split(".")[-1] == name.split(".")[-1] or n.startswith(name + ".")]
            raise PlanError(f"meshplan train: unknown setting --{name}"
                            + (f"; did you mean {', '.join('--' + n for n in near[:4])}?" if near else
                               f"; settings: {', '.join(names)}"))
        out[name] = _value(value)
    return out


def _value(text: str) -> Any:
    """A flag's value: JSON first (``1e-3`` is a float there, not in YAML 1.1), then YAML, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def with_overrides(plan: Plan, overrides: dict[str, Any]) -> Plan:
    """``plan`` with its ``training`` section overridden, validated again.

    Raises:
        PlanError: the plan has no ``training`` section and the overrides do not make a valid one, or an override
            of the wrong type/range (naming the flag).
    """
    data = plan.model_dump(mode="json", exclude_unset=True)
    train = copy.deepcopy(data.get("training") or {})
    for name, value in overrides.items():
        if name.startswith("layout."):
            data.setdefault("layout", {})[name.partition(".")[2]] = value
            continue
        node = train
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p), dict) or p not in node else node[p]
        node[leaf] = value
    data["training"] = train
    try:
        return Plan.from_data(data, source=plan.source)
    except PlanError as e:
        msg = str(e)
        for name in sorted(overrides, key=len, reverse=True):
            msg = msg.replace(f"training.{name}:", f"training.{name} (--{name}):")
            msg = msg.replace(f"{name}:", f"{name} (--{name}):") if name.startswith("layout.") else msg
        if not plan.training and ("training.model: Field required" in msg or "training.data: Field required" in msg):
            msg += "; the plan has no training section: give --model.path (or --model.config/--model.factory) " \
                   "and --data.path"
        raise PlanError(msg) from None
