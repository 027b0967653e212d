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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["end_units", "reads_ids_only"]


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
