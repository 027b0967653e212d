"""The FSDP2 units of a root's own parameters (the ones outside its blocks): the input embedding, and the rest (the
final norm and the head), each a unit of its own before the root is wrapped, as torchtitan's ``apply_fsdp`` does.

Why: a root unit holding the embedding *and* the head gathers both at the first forward and keeps them (torch does
not reshard a root after forward); in its backward a rank holds the gathered head, its unsharded gradient and FSDP2's
reduce-scatter input and output at once, with the gathered embedding too (measured: +727 MiB on ``pp2fsdp2``'s last
stage at ``benchmarks/scale.py --size dev``, docs/scale.md). As units of their own:

* the **embedding** unit reshards after forward like a block (``reshard_after_forward``), and in backward is
  gathered last, after every block's gradient was reduce-scattered;
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
    from collections.abc import Callable

    import torch.nn as nn

__all__ = ["end_units", "end_groups"]


def end_groups(root: "nn.Module", wrapped: "Callable[[str, nn.Module], bool]") -> list[tuple[list[str], bool]]:
    """The rule of :func:`end_units` on module paths (pure: nothing is wrapped, so ``meshplan check``'s rank view
    and the model picture name the units exactly as :func:`end_units` builds them): ``[(paths under root, keep
    gathered after forward)]``, the embedding unit(s) first, then the head unit; empty when a parameter is shared
    between them.

    Args:
        root: the module that runs as a root (the model, or a pipeline stage's view).
        wrapped: ``wrapped(path, module)`` holds for the modules already wrapped (or not in this root): they and
            everything under them are not counted.
    """
    import torch.nn as nn
    ends: list[tuple[str, nn.Module]] = []
    todo = list(root.named_children())
    while todo:
        path, m = todo.pop(0)
        if wrapped(path, m):
            continue
        if any(True for _ in m.parameters(recurse=False)):
            ends.append((path, m))  # with its children: what FSDP2 wrapped already stays out of its unit
        else:
            todo[:0] = [(f"{path}.{k}", c) for k, c in m.named_children()]
    owners: dict[int, int] = {}
    for i, (_, m) in enumerate(ends):
        for p in m.parameters(recurse=False):
            if owners.setdefault(id(p), i) != i:
                return []  # a tied parameter: one unit must own it (the root, as before)
    embeddings = [p for p, m in ends if isinstance(m, nn.Embedding)]
    rest = [p for p, m in ends if not isinstance(m, nn.Embedding)]
    return [([p], False) for p in embeddings] + ([(rest, True)] if rest else [])


def end_units(root: "nn.Module") -> list[tuple[list["nn.Module"], bool]]:
    """The units to wrap in ``root`` before ``root`` itself: ``[(modules, keep gathered after forward)]``, the
    embedding unit(s) first (False), then the head unit (True); empty when a parameter is shared between them.

    ``root``'s modules already wrapped (the blocks, experts over edp) and everything under them are not counted;
    the first module on each path that holds parameters itself (``recurse=False``) counts, with its children
    (:func:`end_groups` on the FSDP2 modules).
    """
    from torch.distributed.fsdp import FSDPModule
    groups = end_groups(root, lambda path, m: isinstance(m, FSDPModule))
    return [([root.get_submodule(p) for p in paths], keep) for paths, keep in groups]
