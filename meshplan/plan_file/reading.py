"""Safe reading of plan files (YAML, JSON, TOML) into plain data.

Safe loaders only (no object construction), duplicate keys rejected in every
format, and size limits so a plan file cannot exhaust memory, the stack or the
clock: at most :data:`MAX_PLAN_BYTES` bytes of UTF-8 text, :data:`MAX_PLAN_NODES`
values, :data:`MAX_PLAN_DEPTH` levels of nesting and integers of
:data:`MAX_INT_BITS` bits. Whatever the bytes, the result is a dict or one
:class:`PlanError` naming the file, in bounded time.

Depth and size are refused BEFORE a YAML file is built: :func:`_yaml_bounds` walks
the parser's event stream (libyaml's, when PyYAML has it) and stops at the first
level past the limit or the first value past the count, aliases counted as the
values they expand to. Building a document first cost 0.5 s for a 4 KB file
nested 2,000 deep (PyYAML's scanner is quadratic in flow nesting) and 5-9 s for a
1 MiB list; every file now ends in under 50 ms (``benchmarks/plan_load.py``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from meshplan.errors import PlanError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_plan_data", "check_data", "pydantic_message", "read_text", "read_json", "MAX_PLAN_BYTES",
           "MAX_PLAN_NODES", "MAX_PLAN_DEPTH", "MAX_INT_BITS", "MAX_INPUT_BYTES"]

MAX_PLAN_BYTES = 1 << 18     #: a plan file larger than 256 KiB is rejected (the largest shipped plan: 1.3 KB)
MAX_PLAN_NODES = 5_000       #: so is one expanding (YAML aliases) to more values than this (a real plan: < 300)
MAX_PLAN_DEPTH = 32          #: or nested deeper than this (a real plan nests 5 levels)
MAX_INPUT_BYTES = 4 << 20    #: a converter source, model config or cluster file larger than 4 MiB is refused unread
MAX_INT_BITS = 13_000        #: or holding an integer of more bits (about 3,900 digits; Python prints up to 4,300)


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: the same events, 20x faster


class _UniqueKeyLoader(_SafeLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that rejects a key repeated in one mapping."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            raise PlanError(f"line {key_node.start_mark.line + 1}: a mapping key must be a scalar (a name), "
                            f"got a {type(key).__name__}")
        if key in out:
            raise PlanError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_bounds(text: str) -> None:
    """Refuse YAML nested deeper than :data:`MAX_PLAN_DEPTH` or of more than :data:`MAX_PLAN_NODES` values (an
    alias counts as every value of its anchor, and as deep) from the parser's events, before anything is built.

    Raises:
        PlanError: naming the key path of the first collection too deep, or the count.
    """
    stack: list[list] = []  # per open collection: [path, is_map, index or key, expecting a key, height, start, anchor]
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (values, height)
    count = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, yaml.CollectionEndEvent):
            path, _, _, _, height, start, anchor = stack.pop()
            if anchor is not None:
                sizes[anchor] = (count - start, height)
            if stack:
                stack[-1][4] = max(stack[-1][4], height + 1)
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue
        path = _event_path(stack, event)
        n, height = sizes.get(event.anchor, (1, 0)) if isinstance(event, yaml.AliasEvent) else (1, 0)
        count += n
        if count > MAX_PLAN_NODES:
            raise PlanError(f"more than {MAX_PLAN_NODES} values (a plan has a few hundred; YAML aliases expanding?)")
        if isinstance(event, yaml.CollectionStartEvent):
            if len(stack) + 1 > MAX_PLAN_DEPTH:
                raise PlanError(f"{path}: nested deeper than {MAX_PLAN_DEPTH} levels")
            stack.append([path, isinstance(event, yaml.MappingStartEvent), 0, True, 0, count - 1, event.anchor])
        elif isinstance(event, yaml.AliasEvent) and height and len(stack) + height > MAX_PLAN_DEPTH:
            raise PlanError(f"{path}: nested deeper than {MAX_PLAN_DEPTH} levels (through the alias *{event.anchor})")
        elif stack:
            stack[-1][4] = max(stack[-1][4], height + 1)
        if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
            sizes[event.anchor] = (1, 0)


def _event_path(stack: list[list], event: Any) -> str:
    """The key path of the node ``event`` opens, as :func:`check_data` prints it; records a scalar key."""
    if not stack:
        return ""
    frame = stack[-1]
    if frame[1] and frame[3]:  # a mapping's key
        frame[3] = False
        frame[2] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
        return frame[0]
    if frame[1]:
        frame[3] = True
        key = frame[2] if frame[2].isprintable() and 0 < len(frame[2]) <= 80 else _shown(frame[2])
    else:
        key, frame[2] = str(frame[2]), frame[2] + 1
    return f"{frame[0]}.{key}" if frame[0] else key


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise PlanError(f"duplicate key {k!r}")
        out[k] = v
    return out


def check_data(obj: Any, max_nodes: int = MAX_PLAN_NODES, max_depth: int = MAX_PLAN_DEPTH) -> None:
    """Bound plain data before validation: at most ``max_nodes`` values, ``max_depth`` levels, no huge integer.

    An integer of more than :data:`MAX_INT_BITS` bits (about 3,900 digits) is refused here: Python cannot print
    it (``repr`` raises past 4,300 digits), so no error message could show it, and no plan value comes close.

    Raises:
        PlanError: naming the key path of the offending value.
    """
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    n = 0
    while stack:
        o, depth, path = stack.pop()
        n += 1
        if n > max_nodes:
            raise PlanError(f"more than {max_nodes} values (YAML aliases expanding?)")
        if isinstance(o, int) and o.bit_length() > MAX_INT_BITS:
            raise PlanError(f"{path or '(top)'}: an integer of {o.bit_length()} bits; plan integers have at most "
                            f"{MAX_INT_BITS} bits")
        if isinstance(o, (dict, list, tuple, set, frozenset)):  # tuples and sets: a plan built in Python
            if depth > max_depth:
                raise PlanError(f"{path}: nested deeper than {max_depth} levels")
            items = o.items() if isinstance(o, dict) else enumerate(o)
            for k, v in items:
                if isinstance(k, int) and k.bit_length() > MAX_INT_BITS:
                    raise PlanError(f"{path or '(top)'}: a key that is an integer of {k.bit_length()} bits")
                key = k if isinstance(k, str) and k.isprintable() and 0 < len(k) <= 80 else _shown(k)
                stack.append((v, depth + 1, f"{path}.{key}" if path else key))


def read_text(path: str | Path, what: str = "file", max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, reading at most ``max_bytes + 1`` bytes.

    Raises:
        PlanError: missing, a directory, not a regular file (``/dev/zero``, a pipe: they never end), unreadable,
            larger than ``max_bytes``, or not UTF-8 (one line starting with the path, naming ``what`` it should be).
    """
    p = Path(path)
    if p.is_dir():
        raise PlanError(f"{p}: is a directory, expected a {what}")
    if not p.exists():
        raise PlanError(f"{p}: no such {what}")
    if not p.is_file():
        raise PlanError(f"{p}: not a regular file (a device, pipe or socket), expected a {what}")
    try:
        with p.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise PlanError(f"{p}: cannot read the {what}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise PlanError(f"{p}: {p.stat().st_size} bytes; {what}s are limited to {max_bytes}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{p}: not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason}); "
                        f"expected a {what}") from None


def read_json(path: str | Path, what: str = "JSON file", max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """The JSON document in ``path`` (:func:`read_text`'s bounds); any failure is one :class:`PlanError`."""
    text = read_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except RecursionError:
        raise PlanError(f"{path}: not valid JSON: nested too deeply; expected a {what}") from None
    except ValueError as e:  # JSONDecodeError, an integer past 4,300 digits
        raise PlanError(f"{path}: not valid JSON: {_one_line(str(e))[:200]}; expected a {what}") from None


def _read_text(p: Path) -> str:
    """The plan file's text, or a PlanError: not a file, unreadable, too large, not UTF-8."""
    return read_text(p, "plan file", MAX_PLAN_BYTES)


def read_plan_data(path: str | Path) -> dict:
    """Read a plan file into a dict; the format is chosen by the suffix.

    Raises:
        PlanError: missing or unreadable file, unknown suffix, too large, not
            UTF-8, a syntax error, a duplicate or non-scalar key, too deep, or
            a top level that is not a mapping; the message starts with the file name.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json", ".toml"):
        raise PlanError(f"{p}: unknown plan format {suffix!r}; use .yaml, .yml, .json or .toml")
    text = _read_text(p)
    try:
        if suffix in (".yaml", ".yml"):
            _yaml_bounds(text)
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_pairs)
        else:
            data = tomllib.loads(text)
        if data is None:
            data = {}
        check_data(data)
    except PlanError as e:
        raise PlanError(f"{p}: {e}") from None
    except RecursionError:
        raise PlanError(f"{p}: nested deeper than {MAX_PLAN_DEPTH} levels") from None
    except (yaml.YAMLError, ValueError, TypeError) as e:  # JSON/TOML decode errors, ints past 4300 digits, …
        why = _one_line(str(e))
        if "exceeded maximum nesting depth" in why:  # libyaml's own limit (1,000 flow levels), met before an event
            raise PlanError(f"{p}: nested deeper than {MAX_PLAN_DEPTH} levels") from None
        if "integer string conversion" in why:
            why = f"an integer of more than {sys.get_int_max_str_digits()} digits; plan integers are far smaller"
        raise PlanError(f"{p}: not valid {suffix.lstrip('.').upper()}: {why}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened; an int too long for ``repr`` (over 4300 digits) is described instead."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"an integer of {value.bit_length()} bits"
        return f"a {type(value).__name__} holding an integer too long to print"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def pydantic_message(err: Exception) -> str:
    """Every pydantic error on one line, joined by ``"; "``: ``key.path: message (got value)``."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return str(err)
    parts = []
    for e in errors():
        loc = ".".join(x if isinstance(x, str) and x and x.isprintable() and len(x) <= 80 else _shown(x)
                       for x in e.get("loc", ()) if not (isinstance(x, str) and x.startswith("function-")))
        msg = _one_line(e.get("msg", "").removeprefix("Value error, "))
        msg = msg if len(msg) <= 300 else f"{msg[:300]}…"
        got = e.get("input")
        if e.get("type") in ("extra_forbidden", "missing") or isinstance(got, (dict, list)):
            parts.append(f"{loc or '(top)'}: {msg}")
        else:
            parts.append(f"{loc or '(top)'}: {msg} (got {_shown(got)})")
    return "; ".join(parts)
