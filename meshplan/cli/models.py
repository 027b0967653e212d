"""The model of ``check``/``solve``/``estimate --model``: ``MODULE:FACTORY`` (:mod:`meshplan.checks.model_factory`)
or a transformers checkpoint folder (or its ``config.json``), the same source ``meshplan convert`` accepts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from meshplan.errors import PlanError

__all__ = ["build_user_model", "is_config_source"]


def is_config_source(spec: str) -> bool:
    """True when ``--model`` names a folder holding ``config.json`` or a ``.json`` file, not ``MODULE:FACTORY``."""
    path = Path(spec)
    return ":" not in spec and (path.is_dir() or path.suffix == ".json")


def _from_config(spec: str, overrides: dict, device: str) -> Any:
    """The causal-LM class transformers names for the folder's ``config.json`` (its ``architectures``, else the
    model type's), built from that config (``--config`` keys set on it, each checked) on ``device``."""
    import torch

    from meshplan.checks.model_factory import _check_config_keys, _failure, _quiet_transformers, _silenced
    from meshplan.hf.convert import _class_config, _config, _model_class
    if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        raise PlanError(f"--model {spec!r}: a folder without config.json; expected a transformers checkpoint "
                        f"folder or MODULE:FACTORY")
    with _quiet_transformers(), _silenced():
        config, model_type, archs = _config(spec)
        cls = _model_class(config, model_type, archs)
        config = _class_config(cls, config)
    for key, value in overrides.items():
        setattr(config, key, value)
    _check_config_keys(config, list(overrides), spec)  # a key its default instance lacks: a typo, refused
    try:
        with _quiet_transformers(), _silenced(), torch.device(device):
            return cls(config)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise PlanError(f"--model {spec!r}: {cls.__name__} cannot be built from its config: {_failure(e)}") from None


def build_user_model(args: argparse.Namespace, device: str = "meta") -> Any:
    """The ``--model`` of ``args`` (with ``--config`` and ``--path``) on ``device``."""
    from meshplan.checks.model_factory import _config_arg, build_model
    if is_config_source(args.model):
        return _from_config(args.model, _config_arg(args.config), device)
    return build_model(args.model, _config_arg(args.config), args.path or [], device=device)
