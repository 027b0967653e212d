"""Tiny random transformers models of any architecture, on the CPU (the zoo sweep, ``tests/test_zoo.py``).

The config is shrunk by :func:`meshplan.hf.tiny_config.tiny_config` (every layer kind kept, every sharded size divisible
by tp); :func:`model_class` picks the class to build.
"""

from __future__ import annotations

from meshplan.hf.tiny_config import tiny_config, with_layers

__all__ = ["model_class", "tiny_model"]


def model_class(model_type: str):
    """The class :func:`tiny_model` builds: the causal LM of ``model_type``, else its base model, else a model class
    of the config's own modeling module whose ``config_class`` is the config (causal LM first); None if none."""
    import importlib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        name = mapping.get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    cfg_cls = CONFIG_MAPPING[model_type]
    try:
        module = importlib.import_module(cfg_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "config_class", None) is cfg_cls
             and hasattr(c, "base_model_prefix") and not c.__name__.endswith("PreTrainedModel")]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    return found[0] if found else None


def tiny_model(model_type: str, tp: int = 2, seed: int = 0, layers: int | None = None, **overrides):
    """A tiny random model of ``model_type`` on the CPU in fp32, and why not when it cannot be built.

    Args:
        model_type: a key of transformers' ``CONFIG_MAPPING``.
        tp: passed to :func:`tiny_config`.
        seed: ``torch.manual_seed`` before construction.
        layers: the number of layers (default: the tiny config's, one per kind); per-layer lists such as
            ``layer_types`` repeat (:func:`~meshplan.hf.tiny_config.with_layers`).
        **overrides: config values (``logits_scaling=8.0``), passed to :func:`tiny_config`.

    Returns:
        ``(model, None)``, or ``(None, reason)`` with the specific reason (no model class, the config or the
        model refused the tiny sizes: the exception).
    """
    import torch
    cls = model_class(model_type)
    if cls is None:
        return None, f"no model class in transformers takes {model_type!r} configs"
    try:
        config = tiny_config(model_type, tp=tp, **overrides)
        config = with_layers(config, layers) if layers else config
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return None, f"tiny config refused: {type(e).__name__}: {_short(e)}"
    if cls.config_class is not type(config) and getattr(config, "text_config", None) is not None \
            and isinstance(config.text_config, cls.config_class):
        config = config.text_config  # a text-only causal LM of a multimodal type: skip the vision tower
    config._attn_implementation = "eager"
    try:
        torch.manual_seed(seed)
        model = cls(config).float().eval()
    except Exception as e:  # noqa: BLE001
        return None, f"{cls.__name__} refused the tiny config: {type(e).__name__}: {_short(e)}"
    return model, None


def _short(e: BaseException, n: int = 300) -> str:
    return " ".join(str(e).split())[:n]
