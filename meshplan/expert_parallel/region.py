"""MoE blocks under tensor parallelism with ``etp: 1``: each tp rank routes its own tokens.

With ``etp: 1`` the ``ep`` group may span tp ranks (Megatron's MoE parallel folding). Tokens must then reach the
experts once: a tp rank that sent the same tokens as its neighbours would count every expert gradient tp times.
So each MoE block becomes a token region on the tp mesh (torch's ``PrepareModuleInputOutput``):

* in: the residual stream → this rank's shard of the sequence (``shard(1)``), as a plain tensor: nothing moves
  under sequence parallelism; with a replicated stream each rank keeps its 1/tp of the sequence (backward: an
  all-gather of the input gradient); in smp's batch mode each rank keeps its own samples;
* out: the shard back into the residual stream (an all-gather for a replicated stream).

The block's parameters outside its experts (router, shared expert) stay whole on every tp rank; each rank's
gradient covers its tokens, so they are summed over tp by the model's grad sync, in its one coalesced reduction.

With ``etp`` = ``tp`` (experts split over the tp group, :mod:`meshplan.expert_parallel.etp`) the block instead runs
on the tp group's whole token set (the stream all-gathered in, sliced out): every tp rank routes the same tokens
and its parameters get the same, whole gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.tensor_parallel.layouts import Stream, placement

__all__ = ["token_regions", "region_style"]


def region_style(stream: Stream, whole: bool = False) -> Any:
    """The ``PrepareModuleInputOutput`` making a block run on this rank's tokens for the residual stream
    ``stream`` (``whole``: on the tp group's whole token set, for experts split over etp = tp)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput
    outer = placement(stream.layout)
    own = Replicate() if whole else outer if isinstance(outer, Shard) else Shard(1)
    return PrepareModuleInputOutput(input_layouts=(outer,), desired_input_layouts=(own,), use_local_input=True,
                                    output_layouts=(own,), desired_output_layouts=(outer,),
                                    use_local_output=stream.local)


def _even(path: str, tp: int):
    def check(_mod: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
            raise PlanError(f"expert_parallel: MoE block {path} splits the sequence over tp({tp}), but its input "
                            f"{tuple(x.shape)} has {x.shape[1]} positions; expected a multiple of {tp}")
    return check


def token_regions(model: nn.Module, blocks: tuple, topology: Any, tensor_parallel: Any,
                  expert_params: set[str]) -> list[str]:
    """Make every MoE block of ``blocks`` a token region on ``topology["tp"]``; returns the paths of their
    parameters outside the experts, added to the tp sum of ``tensor_parallel.finalizer``.

    Raises:
        PlanError: tp > 1 without a tensor_parallel section.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from meshplan.tensor_parallel.grad_sync import TpGradSync
    tp = topology.layout.tp
    if tensor_parallel is None:
        raise PlanError(f"expert_parallel: layout.tp({tp}) > 1 needs a tensor_parallel section (the dense layers' "
                        f"rules); without one every tp rank would compute the same tokens")
    stream = Stream(tensor_parallel.sequence_parallel, False)
    whole = topology.layout.etp > 1  # etp = tp: every tp rank routes the group's tokens, gradients alike
    names = []
    for b in blocks:
        block = model.get_submodule(b.path)
        if not stream.sequence_parallel and not whole:
            block.register_forward_pre_hook(_even(b.path, tp))
        parallelize_module(block, topology["tp"], region_style(stream, whole))
        names += [f"{b.path}.{n}" for n, p in block.named_parameters()
                  if p.requires_grad and f"{b.path}.{n}" not in expert_params and not whole and tp > 1]
    if names:
        sync = tensor_parallel.finalizer
        if sync is None:
            sync = tensor_parallel.finalizer = TpGradSync(topology["tp"].get_group(), (), (),
                                                          tensor_parallel.sequence_parallel)
        sync.add_plain(names)
        sync.install(model)
    return names
