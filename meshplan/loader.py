"""Safe reading of plan files (YAML, JSON, TOML) into plain data.

Safe loaders only (no object construction), duplicate keys rejected in every
format, and size limits so a plan file cannot exhaust memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from .errors import PlanError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_plan_data", "pydantic_message", "MAX_PLAN_BYTES", "MAX_PLAN_NODES"]

MAX_PLAN_BYTES = 1 << 20     #: a plan file larger than 1 MiB is rejected
MAX_PLAN_NODES = 100_000     #: so is one expanding (YAML aliases) to more values than this


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in out:
            raise PlanError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise PlanError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _count(obj: Any, limit: int) -> int:
    stack, n = [obj], 0
    while stack:
        o = stack.pop()
        n += 1
        if n > limit:
            raise PlanError(f"more than {limit} values (YAML aliases expanding?)")
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return n


def read_plan_data(path: str | Path) -> dict:
    """Read a plan file into a dict; the format is chosen by the suffix.

    Raises:
        PlanError: missing file, unknown suffix, too large, a syntax error, a
            duplicate key, or a top level that is not a mapping; the message
            starts with the file name.
    """
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{p}: no such plan file")
    size = p.stat().st_size
    if size > MAX_PLAN_BYTES:
        raise PlanError(f"{p}: {size} bytes; plan files are limited to {MAX_PLAN_BYTES}")
    text = p.read_text(encoding="utf-8")
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_pairs)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise PlanError(f"unknown plan format {suffix!r}; use .yaml, .yml, .json or .toml")
        if data is None:
            data = {}
        _count(data, MAX_PLAN_NODES)
    except PlanError as e:
        raise PlanError(f"{p}: {e}") from None
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise PlanError(f"{p}: not valid {suffix.lstrip('.').upper()}: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def pydantic_message(err: Exception) -> str:
    """One line per pydantic error: ``key.path: message (got value)``."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return str(err)
    parts = []
    for e in errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if not str(x).startswith("function-"))
        msg = e.get("msg", "").removeprefix("Value error, ")
        got = e.get("input")
        if e.get("type") in ("extra_forbidden", "missing") or isinstance(got, (dict, list)):
            parts.append(f"{loc or '(top)'}: {msg}")
        else:
            parts.append(f"{loc or '(top)'}: {msg} (got {got!r})")
    return "; ".join(parts)
