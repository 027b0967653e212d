"""The FSDP2 units of a root's own parameters (the ones outside its blocks): the input embedding, and the rest (the
final norm and the head), each a unit of its own before the root is wrapped, as torchtitan's ``apply_fsdp`` does.

Why: a root unit holding the embedding *and* the head gathers both at the first forward and keeps them (torch does
not reshard a root after forward); in its backward a rank holds the gathered head, its unsharded gradient and FSDP2's
reduce-scatter input and output at once, with the gathered embedding too (measured: +727 MiB on ``pp2fsdp2``'s last
ranks at ``benchmarks/scale.py --size dev``, docs/scale.md). As units of their own:

* the **embedding** unit reshards after forward like a block (``reshard_after_forward``) and is not gathered
  again in backward (:func:`reads_ids_only`: an embedding's weight gradient needs the token ids and the output's
  gradient, not the weight): its backward holds its unsharded gradient and FSDP2's reduce-scatter buffers, not the
  gathered weight too (measured: 250 MiB at ``benchmarks/scale.py --size full``, docs/scale.md);
* the **head** unit (every other parameter-holding module outside the blocks: the final norm, the head) is *not*
  resharded after forward: backward starts with it right away (torchtitan's default), so resharding would only
  re-gather it;
* the root itself keeps only what is left (parameters held directly by the root module: usually none, so it issues
  no collective).

A tied head (a parameter shared between two of those modules, e.g. GPT-2's ``wte``/``lm_head``) stays in the root:
one FSDP2 unit must own a shared parameter.

With ``data_parallel.ends: vocab_parallel`` (:func:`shard_vocab_ends`) the embedding and the head are no FSDP2 units:
each data rank keeps its rows of them for good, torch's ``RowwiseParallel`` / ``ColwiseParallel`` over FSDP2's data
mesh with the batch as the sharded input (``Shard(0)``): the tokens' activations are all-gathered, each rank computes
its rows for every data rank's tokens, and the outputs go back to their ranks (the embedding's by a reduce-scatter,
the head's logits by an all-to-all). No weight is ever whole on a rank, and its gradient needs no reduction: a
rank's rows already sum every data rank's tokens (docs/data-parallel.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["end_units", "reads_ids_only", "shard_vocab_ends", "vocab_ends_problem", "vocab_problem"]


def end_units(root: "nn.Module") -> list[tuple[list["nn.Module"], bool]]:
    """The units to wrap in ``root`` before ``root`` itself: ``[(modules, keep gathered after forward)]``, the
    embedding unit(s) first (False), then the head unit (True); empty when a parameter is shared between them.

    ``root``'s modules already wrapped (the blocks, experts over edp) and everything under them are not counted;
    the first module on each path that holds parameters itself (``recurse=False``) counts, with its children
    (:func:`meshplan.model_copies.end_groups` on the FSDP2 modules: the one rule, which ``meshplan check --rank R`` and
    the model picture read too).
    """
    from torch.distributed.fsdp import FSDPModule

    from meshplan.model_copies import end_groups
    groups = end_groups(root, lambda path, m: isinstance(m, FSDPModule))
    return [([root.get_submodule(p) for p in paths], keep) for paths, keep in groups]


def reads_ids_only(module: "nn.Module") -> bool:
    """Does ``module``'s backward leave its weight unread? True for an ``nn.Embedding`` (or a subclass) running
    ``nn.Embedding.forward`` unchanged, dense: its weight gradient is the output's gradient scattered by the token
    ids. A subclass with a forward of its own (a scale, a lookup of its own) may read the weight: False, and FSDP2
    gathers it for backward as usual.
    """
    import torch.nn as nn
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and "forward" not in vars(module) and not module.sparse)


def vocab_problem(module: "nn.Module", path: str, ranks: int) -> str | None:
    """Why ``ends: vocab_parallel`` cannot shard ``module`` (at ``path``: an embedding or a head) over ``ranks``
    data ranks, or None."""
    import torch.nn as nn
    rows = module.weight.shape[0]
    what = f"data_parallel.ends: vocab_parallel: {path} ({type(module).__name__})"
    lookup = isinstance(module, nn.Embedding)
    if lookup and not (reads_ids_only(module) and module.max_norm is None):
        return (f"{what} is not a plain dense nn.Embedding (a forward of its own, sparse or max_norm): its rows "
                f"cannot be looked up shard by shard; use ends: fsdp")
    if not lookup and not isinstance(module, nn.Linear):
        return f"{what} is not an nn.Linear; use ends: fsdp"
    if rows % ranks:
        from meshplan.mesh.ranks import divisors_text
        return (f"{what}: {ranks} data ranks do not divide its {rows} rows; data ranks that do: "
                f"{divisors_text(rows, lambda d: d <= max(ranks, 64))}; or use ends: fsdp")
    return None


def vocab_ends_problem(model: "nn.Module", blocks: list[str], ranks: int) -> str | None:
    """``ends: vocab_parallel`` on ``model`` before anything changes (``meshplan check``, ``parallelize``'s prepare,
    ``apply_data_parallel``): a module outside the ``blocks`` (paths) it cannot shard over ``ranks`` data ranks
    (:func:`vocab_problem`), or none at all to shard; else None."""
    from meshplan.model_copies import vocab_ends
    inside = lambda path, m: any(path == b or path.startswith(b + ".") for b in blocks)  # noqa: E731
    found = vocab_ends(model, inside)
    if not found:
        return (f"data_parallel.ends: vocab_parallel found no nn.Embedding or nn.Linear outside the blocks "
                f"({len(blocks)} blocks: {', '.join(blocks[:2])}{', ...' if len(blocks) > 2 else ''}); "
                f"use ends: fsdp")
    return next((p for p in (vocab_problem(model.get_submodule(path), path, ranks) for path, _ in found)
                 if p is not None), None)


def shard_vocab_ends(root: "nn.Module", mesh: Any, divide: int) -> set:
    """Shard ``root``'s embedding(s) and head(s) (:func:`meshplan.model_copies.vocab_ends`) by rows over the 1-D
    data mesh ``mesh``, the batch being the sharded input; returns their parameters (FSDP2 leaves them to these
    styles). ``divide``: the factor each gradient contribution is divided by (``gradient_reduction: mean``: the
    data ranks; ``sum``: 1). A head tied to an embedding stays tied (one parameter, both styles' rows).

    Raises:
        PlanError: a module the styles cannot shard (:func:`vocab_problem`).
    """
    import torch.nn as nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshplan.errors import PlanError
    from meshplan.model_copies import vocab_ends
    found = [(p, k, root.get_submodule(p)) for p, k in vocab_ends(root, lambda path, m: isinstance(m, FSDPModule))]
    for path, _, m in found:
        problem = vocab_problem(m, path, mesh.size())
        if problem is not None:
            raise PlanError(problem)
    owner = {}  # a weight shared by two of them: the first one's sharded parameter, re-tied after
    for _, _, m in found:
        shared = owner.get(id(m.weight))
        owner.setdefault(id(m.weight), m)
        style = (RowwiseParallel if isinstance(m, nn.Embedding) else ColwiseParallel)(input_layouts=Shard(0),
                                                                                       output_layouts=Shard(0))
        parallelize_module(m, mesh, style)
        if shared is not None:
            m.weight = shared.weight
        if not isinstance(m, nn.Embedding):  # mixed precision: activations reach the head in param_dtype, the
            m.register_forward_pre_hook(_to_weight_dtype)  # ends compute in their parameters' dtype
    rows = _RowsHook(divide=divide)  # one for all: a tied parameter gets one gradient hook
    for _, _, m in found:  # on the parameter each forward uses: materialize and loading replace them
        m.register_forward_pre_hook(rows)
    return {p for _, _, m in found for p in m.parameters()}


class _RowsHook:
    """A forward pre-hook giving the module's current parameters (once each) the gradient hook
    :func:`_own_rows`; parameters replaced since (``materialize``, a checkpoint load) get it at their first forward."""

    def __init__(self, *, divide: int) -> None:
        self.divide, self.hooked = divide, {}  # id → weak reference (tensors compare by value)

    def __call__(self, module: "nn.Module", args: tuple) -> None:
        import weakref
        for p in module.parameters(recurse=False):
            known = self.hooked.get(id(p))
            if p.requires_grad and (known is None or known() is not p):
                p.register_hook(lambda g, want=tuple(p.placements), d=self.divide: _own_rows(g, want, d))
                self.hooked[id(p)] = weakref.ref(p)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(divide={self.divide})"


def _own_rows(grad: Any, placements: tuple, divide: int) -> Any:
    """A gradient contribution as its parameter's rows: torch 2.13's sharded embedding backward computes the whole
    weight's gradient on every rank (``Replicate``: each rank sees every token); keeping it would hold the full
    gradient until the optimizer step. Replicate → Shard(0) is a local slice (no communication)."""
    if tuple(grad.placements) != tuple(placements):
        rows = grad.redistribute(placements=placements)
        local = rows.to_local()
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():  # a view of the whole: copy
            from torch.distributed.tensor import DTensor
            rows = DTensor.from_local(local.clone(), rows.device_mesh, placements, shape=rows.shape,
                                      stride=rows.stride())
        grad = rows
    return grad / divide if divide > 1 else grad


def _to_weight_dtype(module: "nn.Module", args: tuple) -> tuple:
    w = module.weight.dtype
    return tuple(a.to(w) if hasattr(a, "is_floating_point") and a.is_floating_point() and a.dtype != w else a
                 for a in args)
