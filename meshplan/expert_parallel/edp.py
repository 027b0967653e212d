"""Data parallelism on the experts: FSDP2 (DDP in ``ddp`` mode) over ``edp`` on each expert-sharded module.

The experts of expert parallelism are DTensors on the folded expert mesh (``ep``, or ``(ep, etp)``); FSDP2 over
``edp`` adds one more placement on ``(edp, ep[, etp])``. By default that is FSDP2's shard of dim 0, the experts
dim ``ep`` shards too, so torch labels it ``_StridedShard(0, split_factor=ep)``. Where ``edp`` does not divide
the local experts (fewer local experts than edp ranks: ``ep · edp > num_experts``), dim 0 would leave some edp
ranks every weight and others none; such a parameter is sharded on its first other dim edp divides instead
(:func:`expert_shard_placement`), so every rank holds ``1/edp`` of it, the bytes ``meshplan estimate`` counts. Under ``etp`` a packed ``gate|up``
weight already holds a ``_StridedShard`` (its FFN dim, :mod:`meshplan.expert_parallel.etp`), and torch 2.13's
redistribute cannot undo two strided placements in one spec: ``full_tensor()`` on the parameter or its gradient
(``(_StridedShard(0, 2), Shard(0), _StridedShard(1, 2))`` on ``(edp 2, ep 2, etp 2)``) fails in
``_maybe_unpad_tensor`` although the shards hold the right values. Such a parameter is sharded over ``edp`` on a
dim no placement shards (the model dim of ``[E, 2·ffn, dim]``) instead: ``(Shard(2), Shard(0),
_StridedShard(1, 2))``, which torch gathers, DCP and meshplan's checkpoints read, and clipping counts alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["expert_shard_placement", "shard_experts"]


def expert_shard_placement(param: Any, edp: int) -> Any:
    """FSDP2's placement over ``edp`` for the expert parameter ``param``: None (FSDP2's default ``Shard(0)``, the
    experts dim), or ``Shard(d)``: the first dim after the experts dim that no placement shards and ``edp`` divides
    evenly (FSDP2 shards a dim other than 0 only evenly), for

    * a parameter holding a ``_StridedShard`` (a packed ``gate|up`` split over etp), which torch's redistribute
      cannot undo together with FSDP2's strided shard of dim 0;
    * a parameter whose local experts ``edp`` does not divide (``ep · edp > num_experts``: 1 local expert over
      edp 2 would leave edp rank 0 every weight and the others nothing; 3 over 2 would hold 2 and 1). Each edp rank
      then holds ``1/edp`` of every local expert, as torchtitan does when ``ep · edp`` exceeds the experts.

    None where no dim fits: the experts dim, chunked as ``torch.chunk`` does (training stays right; for a packed
    etp weight only torch's ``full_tensor`` of that parameter fails).

    Example::

        >>> expert_shard_placement(gate_up_proj, 2)  # [E, 2·ffn, dim] on (ep, etp): (Shard(0), _StridedShard(1))
        Shard(dim=2)
        >>> expert_shard_placement(w1, 2)  # [1, ffn, dim] local: one expert on this ep rank
        Shard(dim=1)
    """
    from torch.distributed.tensor import DTensor, Shard

    from meshplan._torch import StridedShard
    if not isinstance(param, DTensor):
        return None
    local = param.to_local().shape
    strided = any(isinstance(pl, StridedShard) for pl in param.placements)
    if not strided and local[0] % edp == 0:
        return None
    taken = {pl.dim for pl in param.placements if isinstance(pl, (Shard, StridedShard))}
    return next((Shard(d) for d in range(1, len(local)) if d not in taken and local[d] % edp == 0), None)


def shard_experts(modules: "list[nn.Module]", mesh: Any, mode: str, policies: dict, reshard: Any) -> None:
    """FSDP2 (DDP in ``ddp`` mode) over the 1-D ``edp`` ``mesh`` on each expert-sharded module of ``modules``, each
    packed etp parameter sharded on the dim :func:`expert_shard_placement` gives."""
    from torch.distributed.fsdp import fully_shard

    from meshplan._torch import replicate
    edp = mesh.size()
    for experts in modules:
        if mode == "ddp":
            replicate(experts, mesh=mesh, **policies)
        else:
            fully_shard(experts, mesh=mesh, reshard_after_forward=reshard, **policies,
                        shard_placement_fn=lambda p: expert_shard_placement(p, edp))
