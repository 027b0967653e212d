"""``meshplan check`` and ``meshplan convert``: registered into :mod:`meshplan.cli` on import.

The model convention of ``check --model MODULE:FACTORY [--config JSON]``:

* ``MODULE`` is imported with the ``--path`` directories, the current directory and its
  ``examples/`` directory on ``sys.path`` (``examples.llama:build`` and ``llama:build`` both work
  from a repo root);
* ``FACTORY`` (a dotted attribute of the module) is called **under** ``torch.device("meta")``, so
  nothing is allocated, with the ``--config`` object (JSON text or a ``.json`` file) as:

  1. ``FACTORY(HFConfigClass(**config))`` when it is a transformers ``PreTrainedModel`` class
     (``--model transformers:LlamaForCausalLM``);
  2. ``FACTORY(**config)`` when its signature takes those keywords (``examples.hf_models:llama``);
  3. ``FACTORY(Args(**config))`` when it takes one argument annotated with a class
     (``examples.llama:build`` with ``args: ModelArgs``).

  It must return an ``nn.Module``. Any failure is one ``meshplan: error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from . import cli
from .errors import PlanError

__all__ = ["build_model", "load_factory", "register"]


def _config_arg(text: str | None) -> dict:
    if not text:
        return {}
    if not text.lstrip().startswith("{"):
        p = Path(text.removeprefix("@"))
        if not p.is_file():
            raise PlanError(f"--config: {text!r} is neither a JSON object nor a .json file")
        text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"--config: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"--config: expected a JSON object, got {type(data).__name__}")
    return data


def load_factory(spec: str, paths: list[str] = ()) -> Callable:
    """``"pkg.module:attr.sub"`` → the attribute, importing with ``paths``, cwd and cwd/examples on sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"--model {spec!r}: expected MODULE:FACTORY, e.g. examples.hf_models:llama")
    cwd = os.getcwd()
    for p in reversed([*paths, cwd, os.path.join(cwd, "examples")]):
        if p not in sys.path and os.path.isdir(p):
            sys.path.insert(0, p)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module failing at import time
        raise PlanError(f"--model {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(f"--model {spec!r}: {attr!r} is not callable")
    return obj


def _call(factory: Callable, config: dict, spec: str):
    config_class = getattr(factory, "config_class", None)
    if inspect.isclass(factory) and config_class is not None and hasattr(factory, "base_model_prefix"):
        return factory(config_class(**config))
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory(**config)
    params = list(sig.parameters.values())
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if takes_kwargs or (set(config) <= names and not required):
        return factory(**config)
    if len(required) == 1:
        try:
            hint = typing.get_type_hints(factory).get(required[0].name)
        except Exception:
            hint = None
        if inspect.isclass(hint):
            return factory(hint(**config))
    raise PlanError(f"--model {spec!r}: cannot call it with --config {json.dumps(config)}: it takes "
                    f"({', '.join(p.name for p in params)}); see `meshplan check --help` for the convention")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' config warnings (stderr) would break the one-line error contract."""
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def build_model(spec: str, config: dict | None = None, paths: list[str] = ()):
    """Build ``MODULE:FACTORY`` on the meta device with ``config`` (the convention in this module's docstring)."""
    import torch
    factory = load_factory(spec, paths)
    try:
        with _quiet_transformers(), torch.device("meta"):
            model = _call(factory, dict(config or {}), spec)
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"--model {spec!r}: the factory failed: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"--model {spec!r}: returned {type(model).__name__}, expected an nn.Module")
    return model


def _check(args: argparse.Namespace) -> int:
    import warnings

    from .explain import render_table
    from .plan_file import load_plan
    from .validate import check
    plan = load_plan(args.plan)
    base = plan.layout.model_dump(exclude_unset=True) if plan.layout else None
    layout = cli.layout_from_args(args, base)
    layout.resolve(args.world_size or layout.tp * layout.cp * layout.pp)  # bad flags: one line, before the model
    model = build_model(args.model, _config_arg(args.config), args.path or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check(model, plan, world_size=args.world_size, layout=layout)
    if args.format == "json":
        sys.stdout.write(json.dumps(report.to_dict(), separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(render_table(report) + "\n")
    return 0 if report.ok else 2


def _convert(args: argparse.Namespace) -> int:
    if (args.from_, args.to) == ("hf", "meshplan"):
        from .convert import from_hf, plan_yaml
        text = plan_yaml(from_hf(args.source, sequence_parallel=not args.no_sequence_parallel,
                                 loss_parallel=not args.no_loss_parallel))
    elif (args.from_, args.to) == ("meshplan", "hf"):
        from .convert import to_hf
        from .plan_file import load_plan
        text = json.dumps(to_hf(load_plan(args.source)), indent=2) + "\n"
    else:
        raise PlanError(f"convert: --from {args.from_} --to {args.to} is not supported; use --from hf --to meshplan "
                        f"or --from meshplan --to hf")
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def register(sub) -> None:
    """Add ``check`` and ``convert`` to the ``meshplan`` subparsers."""
    c = sub.add_parser("check", help="validate a plan against a model on the meta device and explain it",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("plan", help="plan file (.yaml/.json/.toml)")
    c.add_argument("--model", required=True, help="MODULE:FACTORY building the model (see below)")
    c.add_argument("--config", default=None, help="JSON object (or .json file) passed to the factory")
    c.add_argument("--path", action="append", help="extra import directory for MODULE (repeatable)")
    cli._add_layout_flags(c, world_required=False)
    c.add_argument("--format", choices=("table", "json"), default="table")
    c.set_defaults(func=_check)
    v = sub.add_parser("convert", help="convert a transformers tp_plan to a meshplan plan (offline), or back")
    v.add_argument("source", help="--from hf: a model type (llama, mistral, qwen2, gpt2, …), a config.json or a "
                                  "directory holding one; --from meshplan: a plan file")
    v.add_argument("--from", dest="from_", choices=("hf", "meshplan"), default="hf")
    v.add_argument("--to", choices=("meshplan", "hf"), default="meshplan")
    v.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    v.add_argument("--no-sequence-parallel", action="store_true", help="write sequence_parallel: false")
    v.add_argument("--no-loss-parallel", action="store_true", help="write loss_parallel: false")
    v.set_defaults(func=_convert)


if register not in cli._EXTRA:
    cli._EXTRA.append(register)
