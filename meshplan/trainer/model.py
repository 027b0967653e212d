"""What ``meshplan train`` trains: a model built on the meta device and its tokenizer, from the plan's
``training.model``; the weights come later (``load_safetensors`` of the folder, or ``materialize`` from the seed),
after ``parallelize``, so each rank only ever allocates its shards.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.plan_file.training import TrainModel

__all__ = ["ModelSource", "meta_model", "load_tokenizer", "model_vocab"]


@dataclass(frozen=True)
class ModelSource:
    """A meta-device model and where its weights come from.

    Attributes:
        model: the model, every parameter on the meta device.
        weights: the safetensors folder to load, or None (initialise from the seed).
        config: the transformers config, or None (a factory's model).
    """

    model: nn.Module
    weights: Path | None
    config: Any


def _config_path(where: str, key: str) -> Path:
    path = Path(where)
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file() and not (path.is_file() and path.suffix == ".json"):
        raise PlanError(f"training.model.{key}: {where}: no config.json there")
    return path


def meta_model(spec: TrainModel) -> ModelSource:
    """Build the model of ``spec`` on the meta device.

    Raises:
        PlanError: a missing folder or config, a folder without safetensors, a factory that cannot be imported
            or does not return an ``nn.Module``.
    """
    dtype = getattr(torch, spec.dtype)
    if spec.factory is not None:
        mod_name, _, fn_name = spec.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise PlanError(f"training.model.factory: cannot import {spec.factory} ({e})") from None
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise PlanError(f"training.model.factory: {spec.factory} returned {type(model).__name__}, not an "
                            f"nn.Module")
        return ModelSource(model.to(dtype), None, getattr(model, "config", None))
    from transformers import AutoConfig, AutoModelForCausalLM

    key = "path" if spec.path is not None else "config"
    where = _config_path(spec.path or spec.config, key)
    config = (AutoConfig.from_pretrained(str(where), local_files_only=True) if where.is_dir() else
              AutoConfig.for_model(**json.loads(where.read_text())))
    weights = None
    if spec.path is not None:
        weights = Path(spec.path)
        if not any(weights.glob("*.safetensors")):
            raise PlanError(f"training.model.path: {spec.path}: no *.safetensors weights there (give "
                            f"model.config instead to start from the seed)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return ModelSource(model, weights, config)


def load_tokenizer(spec: TrainModel) -> Any:
    """The model's tokenizer (transformers, local files only): ``model.tokenizer``, else the model's folder.

    Raises:
        PlanError: no tokenizer setting for a config/factory model, or no tokenizer files in the folder.
    """
    where = spec.tokenizer or spec.path or (spec.config if spec.config and Path(spec.config).is_dir() else None)
    if where is None:
        raise PlanError("training.model.tokenizer: text data needs a tokenizer folder (or use a token file as "
                        "data.path)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except (OSError, ValueError) as e:
        raise PlanError(f"training.model.tokenizer: {where}: no tokenizer there "
                        f"({str(e).splitlines()[0][:160]})") from None


def model_vocab(source: ModelSource) -> int:
    """The model's vocabulary size: its config's, else its input embedding's rows.

    Raises:
        PlanError: neither is known.
    """
    vocab = getattr(source.config, "vocab_size", None)
    if vocab is None and hasattr(source.model, "get_input_embeddings"):
        vocab = source.model.get_input_embeddings().weight.shape[0]
    if vocab is None:
        emb = next((m for m in source.model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    if vocab is None:
        raise PlanError("training.model: cannot tell the model's vocabulary size (no config.vocab_size and no "
                        "nn.Embedding)")
    return int(vocab)
