"""Model helpers on the ground floor, shared by parallelize's checks, the axes and the rehearsals above apply: a
meta-device copy, a small CPU copy to run, a default batch, a root's end modules grouped as FSDP2 wraps them
(:func:`end_groups`). Imports nothing of meshplan above ``errors`` and the
torch-free ``hf.tiny_config``."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["default_batch", "end_groups", "end_modules", "is_hf", "meta_copy", "small_copy", "stand_in", "vocab_ends",
           "vocab_size"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (the model is not changed)."""
    if all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return copy.deepcopy(model)
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)



def small_copy(model: nn.Module, tp: int, notes: list[str]) -> nn.Module | None:
    """A small CPU instance to run (values do not matter: uninitialized weights, a fake group): a transformers
    model rebuilt from its config shrunk by :func:`meshplan.hf.tiny_config.tiny_config`; another model, copied empty
    when it has at most 50M parameters. None (with a note) otherwise."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(type(model), "base_model_prefix"):
        from meshplan.hf.tiny_config import tiny_config
        try:
            with torch.device("meta"):
                small = type(model)(tiny_config(cfg, tp=tp))
            return small.to_empty(device="cpu")
        except Exception as e:
            notes.append(f"cross-shard check skipped: cannot build a small {type(model).__name__}: {type(e).__name__}")
            return None
    n = sum(p.numel() for p in model.parameters())
    if n > 50_000_000:
        notes.append(f"cross-shard check skipped: {n:,} parameters (it runs models up to 50M on the CPU)")
        return None
    return meta_copy(model).to_empty(device="cpu")



def vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None



def is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(type(model), "base_model_prefix")



def default_batch(model: nn.Module, tp: int, seed: int = 0) -> dict[str, Any]:
    """Token ids ``(2, 8·tp)`` below the vocabulary size, labels with a few ``-100``; as keyword arguments
    for a transformers model (``input_ids``, ``labels`` = the ids: the model shifts them), else
    ``{"tokens", "labels"}`` with random labels (a tied model would otherwise predict its input at ~0 loss).

    Raises:
        PlanError: the model has no vocabulary (no ``config.vocab_size``, no ``nn.Embedding``).
    """
    vocab = vocab_size(model)
    if vocab is None:
        raise PlanError(f"check --numerics: cannot make inputs for {type(model).__name__}: it has no config.vocab_size "
                        f"and no nn.Embedding; pass batch=")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 8 * tp), generator=g)
    hf = is_hf(model)  # transformers shifts the labels itself; other models get next-token-like targets
    labels = ids.clone() if hf else torch.randint(0, vocab, (2, 8 * tp), generator=g)
    labels[0, :3] = -100
    return {"input_ids" if hf else "tokens": ids, "labels": labels}


def stand_in(module: nn.Module) -> None:
    """Make ``module`` (a module an axis calls opaque, :func:`meshplan.axes.opaque_modules`: an MoE block, say, of a
    THROWAWAY copy: the split probe's, the shadow run's) return a new tensor
    shaped like its first input, without running: routing is data-dependent (no meta kernels, no DTensor rules)
    and a block's contract is a residual branch's. A block whose forward returns an n-tuple (gpt-oss:
    ``return hidden_states, router_scores``) returns that tensor and n - 1 empty ones, so its caller unpacks it."""
    module.forward = functools.partial(_same_shape, _returns(type(module).forward))


def _returns(forward: Any) -> int:
    """How many values every ``return`` of ``forward`` gives (1 unless all are tuples of one length)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return 1
    sizes = {len(r.value.elts) if isinstance(r.value, ast.Tuple) else 1
             for r in ast.walk(tree) if isinstance(r, ast.Return) and r.value is not None}
    return sizes.pop() if len(sizes) == 1 else 1


def _same_shape(n: int, x: Any, *args: Any, **kwargs: Any) -> Any:
    out = torch.empty_like(x)
    return out if n == 1 else (out, *(x.new_empty(0) for _ in range(n - 1)))


def end_modules(root: nn.Module, wrapped: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """``[(path, module)]``: the first module on each path under ``root`` that holds parameters itself
    (``recurse=False``), with its children, outside the modules ``wrapped(path, module)`` names (and everything
    under them): the modules :func:`end_groups` groups."""
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
    return ends


def vocab_ends(root: nn.Module, wrapped: Callable[[str, nn.Module], bool]) -> list[tuple[str, str]]:
    """``[(path, "embedding" | "head")]``: the modules the ``ends: vocab_parallel`` option shards by rows over
    the ranks of FSDP2's mesh: each ``nn.Embedding`` and each ``nn.Linear`` in or under :func:`end_modules` (the embedding,
    the head; a final norm stays in the root's FSDP2 unit). Pure: ``meshplan check --rank R`` reads it too."""
    out, skip = [], []
    for path, m in end_modules(root, wrapped):
        for sub, c in m.named_modules():
            full = f"{path}.{sub}" if sub else path
            if any(full.startswith(s + ".") for s in skip):
                continue
            if sub and wrapped(full, c):  # blocks under an end module holding parameters itself (HRM's z_L_init)
                skip.append(full)
            elif isinstance(c, (nn.Embedding, nn.Linear)):
                out.append((full, "embedding" if isinstance(c, nn.Embedding) else "head"))
    return out


def end_groups(root: nn.Module, wrapped: Callable[[str, nn.Module], bool]) -> list[tuple[list[str], bool]]:
    """The end modules of ``root`` grouped as FSDP2 wraps them before ``root`` itself (``ends.py``'s ``end_units``
    applies this rule; pure: nothing is wrapped here, so ``meshplan check --rank R`` and the model picture name the
    same units): ``[(paths under root, keep gathered after forward)]``, each ``nn.Embedding`` alone first (False),
    then every other parameter-holding module outside the blocks in one unit (True: the final norm with the head);
    empty when a parameter is shared between them (a tied head: the root keeps them). The first module on each
    path that holds parameters itself (``recurse=False``) counts, with its children.

    Args:
        root: the module that runs as a root (the model, or a stage's view).
        wrapped: ``wrapped(path, module)`` holds for the modules already wrapped (or not in this root): they and
            everything under them are not counted.
    """
    ends = end_modules(root, wrapped)
    owners: dict[int, int] = {}
    for i, (_, m) in enumerate(ends):
        for p in m.parameters(recurse=False):
            if owners.setdefault(id(p), i) != i:
                return []  # a tied parameter: one unit must own it (the root, as before)
    embeddings = [p for p, m in ends if isinstance(m, nn.Embedding)]
    rest = [p for p, m in ends if not isinstance(m, nn.Embedding)]
    return [([p], False) for p in embeddings] + ([(rest, True)] if rest else [])
