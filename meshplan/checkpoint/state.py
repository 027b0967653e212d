"""The state a checkpoint holds, as ONE flat dict DCP saves, or fills in place when loading: the model's
parameters and buffers (``model.<name>``), the optimizer's state and hyperparameters (``optim.state.<name>.<key>``,
``optim.param_groups.<name>.<key>``) and each rank's RNG state (``rng.rank<R>.cpu`` / ``.cuda``).

The model and optimizer parts come from torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (FSDP2,
DDP, checkpoint wrappers and ``torch.compile`` prefixes handled by torch), with the optimizer flattened per
parameter (``flatten_optimizer_state_dict``): every entry is keyed by the model's own parameter name, so a
pipeline stage saves and loads exactly its parameters' entries, whatever the other stages hold. Names, not
positions, make a checkpoint reshardable across pipeline splits.

Tied parameters (one tensor under several names: tied embeddings) are written under EVERY name. A pipelined model
holds the embedding on its first stage and the head on its last, each under its own name with its own optimizer
state, while the unsplit model has one parameter and torch lists its optimizer state under one name only; writing
all names lets either load the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["MODEL", "OPTIM", "RNG", "tied_names", "gather_state", "apply_state", "rng_keys", "parts"]

MODEL, OPTIM, RNG = "model.", "optim.", "rng."
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def tied_names(model: nn.Module) -> list[list[str]]:
    """The state-dict names of each parameter registered under more than one name (``[["tok_embeddings.weight",
    "output.weight"]]``), in state-dict order."""
    by_id: dict[int, list[str]] = {}
    params = {id(p) for p in model.parameters()}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in params:
            by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _alias_optimizer(osd: dict[str, Any], ties: list[list[str]]) -> dict[str, Any]:
    """``osd`` with each tied parameter's entries repeated under its other names."""
    out = dict(osd)
    for names in ties:
        have = next((n for n in names if any(k.startswith(f"state.{n}.") for k in osd)), None)
        if have is None:
            continue
        for section in ("state.", "param_groups."):
            prefix = f"{section}{have}."
            for k, v in osd.items():
                if k.startswith(prefix):
                    out.update({f"{section}{n}.{k[len(prefix):]}": v for n in names if n != have})
    return out


def rng_keys(rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states: ``rng.rank<R>.cpu`` (and ``.cuda`` for the current CUDA device, when in use)."""
    out = {f"{RNG}rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{RNG}rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int | None,
                 aliases: bool = True) -> dict[str, Any]:
    """The flat state of ``model`` (and ``optimizer``; RNG states when ``rank`` is given), tensors shared with
    the model and optimizer (nothing copied).

    ``aliases``: repeat tied parameters' optimizer entries under every name (saving); loading asks for the names
    torch lists.
    """
    out = {MODEL + k: v for k, v in get_model_state_dict(model).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        if aliases:
            osd = _alias_optimizer(osd, tied_names(model))
        out.update({OPTIM + k: v for k, v in osd.items()})
    if rank is not None:
        out.update(rng_keys(rank))
    return out


def parts(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(model, optimizer, rng)`` parts of a flat state, their prefixes removed."""
    split: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, {}, {})
    for k, v in state.items():
        for i, prefix in enumerate((MODEL, OPTIM, RNG)):
            if k.startswith(prefix):
                split[i][k[len(prefix):]] = v
                break
    return split


def apply_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Hand a loaded flat state to the model, the optimizer and the RNGs (torch's ``set_*_state_dict``)."""
    msd, osd, rng = parts(state)
    set_model_state_dict(model, msd)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=_OPTIONS)
    for key, value in rng.items():
        if key.endswith(".cpu"):
            torch.set_rng_state(value)
        elif key.endswith(".cuda"):
            torch.cuda.set_rng_state(value)
