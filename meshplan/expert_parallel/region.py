"""MoE blocks under tensor parallelism with ``etp: 1``: each tp rank routes its own tokens.

With ``etp: 1`` the ``ep`` group may span tp ranks (Megatron's MoE parallel folding). Tokens must then reach the
experts once: a tp rank that sent the same tokens as its neighbours would count every expert gradient tp times.
So each MoE block becomes a token region on the tp mesh:

* in: the residual stream → this rank's shard of the sequence (``shard(1)``), as a plain tensor: nothing moves
  under sequence parallelism; with a replicated stream each rank keeps its 1/tp of the sequence (backward: an all-gather of the input gradient); in smp's batch mode each rank keeps its
  own samples; other inputs, positional or keyword, shaped like the stream's first two dims (per-token type ids,
  DeepSeek V4's ``input_ids=`` of its hash router) are cut alike;
* out: the shard back into the residual stream (an all-gather for a replicated stream). A block that returns a
  tuple (gpt-oss: ``(hidden, router_scores)``; Ernie 4.5 VL: ``(hidden, router_logits)``) has its first output
  converted so and every other tensor output gathered to the tp group's whole token set, in one device's token
  order: an extra shaped ``[B, S_local, …]`` or ``[B·S_local, …]`` becomes ``[B, S, …]`` / ``[B·S, …]``, equal on
  every tp rank and to one device (backward: each rank keeps its tokens' gradient). An extra that is not per
  token (a scalar auxiliary loss) would be each rank's statistic, not the model's: refused with the fix (``etp:
  tp``, where the block sees the whole token set). ``None`` and non-tensors pass through. A first output
  flattened to ``[B·S, hidden]`` (Llama 4's ``Llama4TextMoe``) is converted as ``[B, S, hidden]``; it comes back
  flattened as a plain tensor, and as a ``[B, S, hidden]`` DTensor (its caller reshapes it to the residual's shape).

The block's parameters outside its experts (router, shared expert) stay whole on every tp rank; each rank's
gradient covers its tokens, so they are summed over tp by the model's grad sync, in its one coalesced reduction.

With ``etp`` = ``tp`` (experts split over the tp group, :mod:`meshplan.expert_parallel.etp`) the block instead runs
on the tp group's whole token set (the stream all-gathered in, sliced out): every tp rank routes the same tokens,
its extra outputs are already whole, and its parameters get the same, whole gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.tensor_parallel.layouts import Stream, placement

__all__ = ["token_regions", "layer_region_problem"]


def layer_region_problem(blocks: Any, tp: int, etp: int) -> str | None:
    """Why ``etp: 1`` under tp > 1 cannot cut the tokens of these MoE blocks, or None: a block that is a layer of
    a list (Gemma 4's experts and router sit in the decoder layer, beside its attention) mixes tokens, so it cannot
    run on each tp rank's own share of the sequence."""
    layers = [b.region for b in blocks if b.region.rpartition(".")[2].isdigit()]
    if tp == 1 or etp > 1 or not layers:
        return None
    return (f"MoE block {layers[0]} is a whole layer (its experts' parent is an element of a layer list, holding "
            f"attention too), which with tp({tp}) and etp 1 would run on each tp rank's own tokens; set layout.etp: "
            f"{tp} (= tp: the layer sees the tp group's whole token set)")


def _input_hook(mesh: Any, stream: Stream, whole: bool):
    """The forward pre-hook giving a block its tokens (see the module docstring): the first input from the
    residual stream's layout to the block's, as a plain tensor; other inputs, positional or keyword, shaped like
    the stream's first two dims (per-token ids, masks: DeepSeek V4's hash router reads ``input_ids=``) cut alike;
    the rest unchanged."""
    from torch.distributed.tensor import DTensor, Replicate
    outer, own = _placements(stream, whole)

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], mesh, (outer,), run_check=False)

        def cut(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() >= 2 \
                    and a.shape[:2] == x.shape[:2] and not whole:
                whole_a = DTensor.from_local(a, mesh, (Replicate(),), run_check=False)
                return whole_a.redistribute(mesh, (own,)).to_local()
            return a
        rest = [cut(a) for a in args[1:]]
        return (x.redistribute(mesh, (own,)).to_local(), *rest), {k: cut(v) for k, v in kwargs.items()}
    return hook


def _placements(stream: Stream, whole: bool) -> tuple[Any, Any]:
    """``(the residual stream's placement, the placement the block runs on)``."""
    from torch.distributed.tensor import Replicate, Shard
    outer = placement(stream.layout)
    return outer, Replicate() if whole else outer if isinstance(outer, Shard) else Shard(1)


def _even(path: str, tp: int):
    def check(_mod: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
            raise PlanError(f"expert_parallel: MoE block {path} splits the sequence over tp({tp}), but its input "
                            f"{tuple(x.shape)} has {x.shape[1]} positions; expected a multiple of {tp}")
    return check


def _gathered(extra: Any, tokens: tuple[int, int], dim: int, mesh: Any, path: str, index: int) -> Any:
    """One extra output of a block that ran on this rank's tokens, on the whole token set (one device's order)."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(extra, torch.Tensor):
        return extra
    if extra.dim() >= 2 and tuple(extra.shape[:2]) == tokens:
        return DTensor.from_local(extra, mesh, (Shard(dim),), run_check=False).full_tensor()
    if extra.dim() >= 1 and extra.shape[0] == tokens[0] * tokens[1]:
        grid = extra.reshape(*tokens, *extra.shape[1:])
        whole = DTensor.from_local(grid, mesh, (Shard(dim),), run_check=False).full_tensor()
        return whole.reshape(-1, *extra.shape[1:])
    raise PlanError(f"expert_parallel: MoE block {path} returns output[{index}] of shape {tuple(extra.shape)}, not "
                    f"per token (expected [B, S, …] or [B·S, …] with B, S = {tokens} on this tp rank): computed "
                    f"over each tp rank's own tokens it would differ from one device; set layout.etp = tp (the "
                    f"block then runs on the tp group's whole token set) or tp 1")


def _output_hook(path: str, mesh: Any, stream: Stream, whole: bool):
    """The forward hook converting a block's output(s) back to the residual stream (see the module docstring)."""
    from torch.distributed.tensor import DTensor
    outer, own = _placements(stream, whole)

    def hook(_mod: nn.Module, args: tuple, out: Any) -> Any:
        single = isinstance(out, torch.Tensor)
        if not single and not (isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor)):
            raise PlanError(f"expert_parallel: MoE block {path} returned {type(out).__name__}; expected a tensor "
                            f"or a tuple whose first item is the block's [B, S, hidden] output")
        first, x = out if single else out[0], args[0]
        flat = first.dim() >= 1 and first.shape[0] == x.shape[0] * x.shape[1] != x.shape[0]
        first = first.reshape(*x.shape[:2], *first.shape[1:]) if flat else first  # Llama 4: [B·S, hidden]
        if first.dim() < 2 or first.shape[:2] != x.shape[:2]:
            raise PlanError(f"expert_parallel: MoE block {path} returned {tuple(first.shape)} for its input "
                            f"{tuple(x.shape)}; a token region needs the block's output shaped [B, S, …] like its "
                            f"input (name the module that returns the residual branch as the MoE block)")
        y = DTensor.from_local(first, mesh, (own,), run_check=False)
        y = y.redistribute(mesh, (outer,)) if own != outer else y
        y = y.to_local() if stream.local else y
        y = y.reshape(-1, *y.shape[2:]) if flat and stream.local else y  # a DTensor stays [B, S, …]
        if single:
            return y
        dim = getattr(own, "dim", 1)
        extras = [e if whole else _gathered(e, tuple(x.shape[:2]), dim, mesh, path, i)
                  for i, e in enumerate(out[1:], start=1)]
        return type(out)([y, *extras]) if isinstance(out, list) else (y, *extras)
    return hook


def token_regions(model: nn.Module, blocks: tuple, topology: Any, tensor_parallel: Any,
                  expert_params: set[str], finalizer: Any = None) -> list[str]:
    """Make the token region of every MoE block of ``blocks`` (its ``region`` module: the block, or the module
    holding several blocks) run on ``topology["tp"]``; returns the paths of their parameters outside the experts,
    added to the tp sum of ``finalizer`` (the model's one :class:`~meshplan.gradients.GradFinalizer`, which
    :func:`meshplan.parallelize` handed over).

    Raises:
        PlanError: tp > 1 without a tensor_parallel section.
    """
    tp = topology.layout.tp
    if tensor_parallel is None:
        raise PlanError(f"expert_parallel: layout.tp({tp}) > 1 needs a tensor_parallel section (the dense layers' "
                        f"rules); without one every tp rank would compute the same tokens")
    stream = Stream(tensor_parallel.sequence_parallel, False)
    whole = topology.layout.etp > 1  # etp = tp: every tp rank routes the group's tokens, gradients alike
    names = []
    for path in dict.fromkeys(b.region for b in blocks):
        block = model.get_submodule(path)
        if not stream.sequence_parallel and not whole:
            block.register_forward_pre_hook(_even(path, tp))
        block.register_forward_pre_hook(_input_hook(topology["tp"], stream, whole), with_kwargs=True)
        # first of the block's forward hooks: transformers' output recorders (installed at the first forward) see
        # the gathered outputs, equal to one device
        block.register_forward_hook(_output_hook(path, topology["tp"], stream, whole), prepend=True)
        names += [f"{path}.{n}" for n, p in block.named_parameters()
                  if p.requires_grad and f"{path}.{n}" not in expert_params and not whole and tp > 1]
    if names:
        assert finalizer is not None, "parallelize hands every axis the model's gradient finaliser"
        finalizer.track(topology["tp"].get_group(), plain=names).install(model)
    return names
