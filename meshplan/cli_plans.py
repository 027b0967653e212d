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

  It must return an ``nn.Module``. Any failure is one ``meshplan: error:`` line and exit 2, and so
  is a module or factory that calls ``sys.exit``. What they print is discarded (stdout carries the
  report). A ``--config`` key that a transformers config does not have (not an attribute of its
  default instance, e.g. ``num_hiden_layers``) is an error naming the key and its close matches,
  not a silently stored extra attribute.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
import typing
import warnings
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
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"--config: cannot read {str(p)!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise PlanError("--config: not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, an integer past 4300 digits
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
        with _silenced():
            obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # ImportError, the module failing or exiting at import time
        raise PlanError(f"--model {spec!r}: cannot import {module_name!r}: {_failure(e)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PlanError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
        except Exception as e:  # a module-level __getattr__ failing
            raise PlanError(f"--model {spec!r}: cannot get {attr!r}: {_failure(e)}") from None
    if not callable(obj):
        raise PlanError(f"--model {spec!r}: {attr!r} is not callable")
    return obj


def _failure(e: BaseException) -> str:
    """``TypeError: message`` on one line; ``sys.exit(3)`` as ``called sys.exit(3)``."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


@contextlib.contextmanager
def _silenced():
    """User code's prints and warnings would break the one-line error and the report on stdout."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _check_config_keys(hf_config: Any, keys: list[str], spec: str) -> None:
    """Reject ``--config`` keys a transformers config only stored as unknown extras.

    A key is unknown when the built config has it but a freshly built default
    instance of its class does not (``rope_theta`` or ``attn_implementation``
    are consumed, not stored, so they pass).
    """
    try:
        default = type(hf_config)()
    except Exception:  # a config class that needs arguments: nothing to compare with
        return
    unknown = [k for k in keys if hasattr(hf_config, k) and not hasattr(default, k)]
    if unknown:
        known = [a for a in dir(default) if not a.startswith("_")] + list(getattr(default, "attribute_map", {}))
        hints = []
        for k in unknown:
            near = difflib.get_close_matches(k, known, n=3)
            hints.append(f"{k!r}" + (f" (did you mean {', '.join(near)}?)" if near else ""))
        raise PlanError(f"--model {spec!r}: --config key(s) {', '.join(hints)} are not attributes of "
                        f"{type(hf_config).__name__}; expected keys of its default instance")


def _hf_config_of(model: Any) -> Any:
    """The transformers config of ``model``, or None (transformers is not imported for other models)."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedConfig", None) or getattr(tf, "PretrainedConfig", None)
    cfg = getattr(model, "config", None)
    return cfg if base is not None and isinstance(cfg, base) else None


def _call(factory: Callable, config: dict, spec: str):
    config_class = getattr(factory, "config_class", None)
    if inspect.isclass(factory) and config_class is not None and hasattr(factory, "base_model_prefix"):
        hf_config = config_class(**config)
        _check_config_keys(hf_config, list(config), spec)
        return factory(hf_config)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory(**config)
    params = list(sig.parameters.values())
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if takes_kwargs or (set(config) <= names and not required):
        model = factory(**config)
        hf_config = _hf_config_of(model)
        if takes_kwargs and hf_config is not None:  # the extra keywords likely went to a transformers config
            _check_config_keys(hf_config, [k for k in config if k not in names], spec)
        return model
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


def build_model(spec: str, config: dict | None = None, paths: list[str] = (), device: str = "meta"):
    """Build ``MODULE:FACTORY`` on ``device`` (default meta) with ``config`` (the convention in this module's
    docstring)."""
    import torch
    factory = load_factory(spec, paths)
    try:
        with _quiet_transformers(), _silenced(), torch.device(device):
            model = _call(factory, dict(config or {}), spec)
    except PlanError:
        raise
    except (Exception, SystemExit) as e:
        raise PlanError(f"--model {spec!r}: the factory failed: {_failure(e)}") from None
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
    if plan.layout is None and args.tp is None:
        raise PlanError(f"{args.plan}: the plan has no layout and no --tp was given, so nothing would be sharded; "
                        f"add `layout: {{tp: N}}` to the plan or pass --tp N")
    model = build_model(args.model, _config_arg(args.config), args.path or [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check(model, plan, world_size=args.world_size, layout=layout)
    numerics = _numerics(args, model, plan, layout.tp) if args.numerics and report.ok else None
    if args.format == "json":
        doc = {**report.to_dict(), **({"numerics": numerics.to_dict()} if numerics else {})}
        sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(render_table(report) + "\n" + (f"numerics: {numerics.summary()}\n" if numerics else ""))
    return 0 if report.ok and (numerics is None or numerics.ok) else 2


def _numerics(args: argparse.Namespace, meta_model: Any, plan: Any, tp: int):
    """``check --numerics``: a small real instance (a transformers model: its config shrunk by
    :func:`meshplan.hf_tiny.tiny_config`, keeping the architecture; else the factory with ``--config``), then
    :func:`meshplan.numerics.check_numerics` at the plan's tp."""
    import torch

    from .numerics import check_numerics
    torch.manual_seed(0)
    hf_config = _hf_config_of(meta_model)
    if hf_config is not None:
        from .hf_tiny import tiny_config
        try:
            with _quiet_transformers(), _silenced():
                model = type(meta_model)(tiny_config(hf_config, tp=tp))
        except Exception as e:
            raise PlanError(f"check --numerics: cannot build a small {type(meta_model).__name__}: {_failure(e)}") from None
    else:
        model = build_model(args.model, _config_arg(args.config), args.path or [], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_numerics(model, plan, tp=tp)


def _convert(args: argparse.Namespace) -> int:
    if (args.from_, args.to) == ("hf", "meshplan"):
        from .convert import from_hf, plan_yaml
        try:
            with _quiet_transformers(), _silenced():
                rules = from_hf(args.source, sequence_parallel=not args.no_sequence_parallel,
                                loss_parallel=not args.no_loss_parallel)
        except PlanError:
            raise
        except (Exception, SystemExit) as e:  # transformers rejecting a malformed config.json
            raise PlanError(f"convert {args.source!r}: transformers cannot use this config: {_failure(e)}") from None
        text = plan_yaml(rules)
    elif (args.from_, args.to) == ("meshplan", "hf"):
        from .convert import to_hf
        from .plan_file import load_plan
        text = json.dumps(to_hf(load_plan(args.source)), indent=2) + "\n"
    else:
        raise PlanError(f"convert: --from {args.from_} --to {args.to} is not supported; use --from hf --to meshplan "
                        f"or --from meshplan --to hf")
    if args.output:
        out = Path(args.output)
        if out.is_dir():
            raise PlanError(f"-o {args.output!r}: is a directory, expected a file path")
        try:
            out.write_text(text, encoding="utf-8")
        except (OSError, ValueError) as e:  # missing folder, no permission, a NUL in the path
            raise PlanError(f"-o {args.output!r}: cannot write: {getattr(e, 'strerror', None) or e}") from None
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
    c.add_argument("--numerics", action="store_true",
                   help="also run the plan on a small real instance, tp ranks simulated in this process, and "
                        "compare the loss and every gradient with the unparallelized model (exit 2 if any differs)")
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
