"""Build the user's model for ``meshplan check --model MODULE:FACTORY [--config JSON]`` (the convention is in
:mod:`meshplan.cli.plans`): import with extra paths, call the factory under a device, reject ``--config`` keys a
transformers config would only store as unknown extras; every failure is one :class:`~meshplan.PlanError` line.
"""

from __future__ import annotations

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

from meshplan.errors import PlanError

__all__ = ["build_model", "load_factory"]


def _config_arg(text: str | None) -> dict:
    if not text:
        return {}
    if not text.lstrip().startswith("{"):
        from meshplan.plan_file.reading import read_text
        p = Path(text.removeprefix("@"))
        if not p.is_file():
            raise PlanError(f"--config: {text!r} is neither a JSON object nor a .json file")
        text = read_text(p, "JSON config file")  # bounded: at most 4 MiB
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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # ImportError, the module failing, exiting or raising pytest.skip at import time
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
    except (PlanError, KeyboardInterrupt):
        raise
    except BaseException as e:  # SystemExit, and BaseException subclasses such as pytest.skip's
        raise PlanError(f"--model {spec!r}: the factory failed: {_failure(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"--model {spec!r}: returned {type(model).__name__}, expected an nn.Module")
    return model
