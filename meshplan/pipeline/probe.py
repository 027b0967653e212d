"""Is the eager split safe for this model? One forward of a meta-device copy, watched at the blocks.

A stage view runs the model's own forward with pass-throughs where other stages' modules were, so a later stage
is right only if the model's code around the blocks does nothing a stage would redo or lose. The probe refuses,
with the module and the reason, a model where:

* a first-stage module is not fed the model's input (GPT-2's position embedding takes position ids: a later
  stage would add its hidden state to itself);
* the first block does not get the first-stage modules' output unchanged (Gemma multiplies the embedding by
  √hidden: a later stage would scale its hidden state again);
* a block does not get the previous block's output, or blocks get different extra inputs (per-layer masks
  chosen by the layer's index, as transformers' ``layer_types`` models do: a later stage restarts the index).

Nothing is allocated: the copy and the token ids live on the meta device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.expert_parallel.apply import stand_in
from meshplan.pipeline.split import StageSplit

__all__ = ["probe_split"]


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) and x else getattr(x, "last_hidden_state", x)


def _extras(args: tuple, kwargs: dict) -> list:
    """The non-hidden inputs of a block, tensors by identity."""
    return [id(v) if isinstance(v, torch.Tensor) else v for v in (*args[1:], *kwargs.values())
            if isinstance(v, (torch.Tensor, int, float, str, bool, type(None), tuple))]


def _record(meta: nn.Module, split: StageSplit) -> tuple[dict, list]:
    calls: dict[str, list] = {}
    handles = []

    def hook(path: str):
        def fn(_m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            calls.setdefault(path, []).append((args, kwargs, out))
        return fn

    blocks = [f"{split.container}.{k}" if split.container else k for keys in split.keys for k in keys]
    for path in dict.fromkeys([*split.first, *blocks, *_around(meta, split.container)]):
        handles.append(meta.get_submodule(path).register_forward_hook(hook(path), with_kwargs=True))
    return calls, handles


def _around(model: nn.Module, container: str) -> list[str]:
    """The modules beside the blocks' container and beside each of its ancestors."""
    out, node, prefix = [], model, ""
    for name in container.split(".") if container else []:
        out += [prefix + n for n, _ in node.named_children() if n != name]
        node, prefix = getattr(node, name), prefix + name + "."
    return out


def probe_split(model: nn.Module, split: StageSplit, where: str = "pipeline", seq: int = 8,
                opaque: tuple[str, ...] = ()) -> None:
    """Run a meta copy of ``model`` on meta token ids and check the split is safe (see the module doc).

    ``opaque`` modules (MoE blocks, whose routing is data-dependent and has no meta kernels) run in the copy as
    stand-ins returning a new tensor shaped like their first input: a residual branch's contract.

    Raises:
        PlanError: naming the module and why a later stage would compute something else, or that the model
            cannot run on the meta device (then the split cannot be verified).
    """
    from meshplan.checks.dry_run import meta_copy
    try:
        copy, ids = meta_copy(model), torch.zeros(1, seq, dtype=torch.long, device="meta")
        for path in opaque:
            stand_in(copy.get_submodule(path))  # the throwaway copy only
        calls = _run(copy, split, ids)
    except Exception as meta_error:  # transformers' masks call .item(): a tiny real copy of the architecture
        copy = _tiny_copy(model, meta_error, where)
        ids = torch.zeros(1, seq, dtype=torch.long)
        try:
            calls = _run(copy, split, ids)
        except Exception as e:
            raise PlanError(f"{where}: cannot verify the stage split of {type(model).__name__}: its forward failed "
                            f"on the meta device ({type(meta_error).__name__}: {str(meta_error)[:120]}) and on a "
                            f"tiny copy ({type(e).__name__}: {str(e)[:120]}); the eager split needs one of them "
                            f"to run") from None
    _check_first(calls, split, ids, where)
    _check_blocks(calls, split, where)
    _check_after(calls, split, where)


def _check_after(calls: dict, split: StageSplit, where: str) -> None:
    """A module that runs after the last block must be a last-stage module (a middle stage would apply it)."""
    order = list(calls)  # insertion order = the order of first calls
    last_block = f"{split.container}.{split.keys[-1][-1]}" if split.container else split.keys[-1][-1]
    after = order[order.index(last_block) + 1:]
    inside = tuple(p + "." for p in split.last)
    stray = [p for p in after if p not in split.last and not p.startswith(inside)
             and not any(p.startswith(b + ".") for b in order[:order.index(last_block) + 1])]
    if stray:
        raise PlanError(f"{where}: {stray[0]!r} runs after the last block but is not a last-stage module (it has no "
                        f"parameters), so a middle stage would apply it to the hidden state it sends; found "
                        f"last_stage_modules {list(split.last)}, expected {[*split.last, *stray]}: set "
                        f"pipeline.last_stage_modules")


def _run(copy: nn.Module, split: StageSplit, ids: torch.Tensor) -> dict:
    calls, handles = _record(copy, split)
    try:
        with torch.no_grad():
            copy(ids)
    finally:
        for h in handles:
            h.remove()
    return calls


def _tiny_copy(model: nn.Module, meta_error: Exception, where: str) -> nn.Module:
    """A small CPU instance of a transformers model's architecture with as many layers (same module paths)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise PlanError(f"{where}: cannot verify the stage split of {type(model).__name__}: its forward on "
                        f"meta-device token ids failed ({type(meta_error).__name__}: {str(meta_error)[:200]}); "
                        f"the eager split needs a model that runs on the meta device") from None
    from meshplan.hf.tiny_config import tiny_config
    small = tiny_config(config, num_hidden_layers=config.num_hidden_layers)
    with torch.device("cpu"):
        return type(model)(small).eval()


def _check_first(calls: dict, split: StageSplit, ids: torch.Tensor, where: str) -> None:
    for path in split.first:
        seen = calls.get(path, [])
        if len(seen) != 1 or not seen[0][0] or seen[0][0][0] is not ids:
            raise PlanError(f"{where}: first-stage module {path!r} is not fed the model's input once (found "
                            f"{len(seen)} call(s){', on another tensor' if seen else ''}), so a later stage, which "
                            f"feeds its hidden state where the input went, would compute something else; expected "
                            f"the model's input: set pipeline.first_stage_modules, or use split: trace")


def _check_blocks(calls: dict, split: StageSplit, where: str) -> None:
    blocks = [f"{split.container}.{k}" if split.container else k for keys in split.keys for k in keys]
    prev = _first(calls[split.first[-1]][0][2]) if split.first else None
    extras = None
    for path in blocks:
        seen = calls.get(path, [])
        if len(seen) != 1:
            raise PlanError(f"{where}: block {path!r} ran {len(seen)} times in one forward; expected once")
        args, kwargs, out = seen[0]
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        if prev is not None and hidden is not prev:
            what = "the previous block's output" if path != blocks[0] else \
                f"the output of {split.first[-1]!r} unchanged (the model transforms it in between)"
            raise PlanError(f"{where}: block {path!r} does not get {what}, so a later stage would compute "
                            f"something else; found another tensor, expected {what}; use split: trace")
        mine = _extras(args, kwargs) if args else _extras((None,), dict(list(kwargs.items())[1:]))
        if extras is not None and mine != extras:
            raise PlanError(f"{where}: block {path!r} gets other extra inputs than {blocks[0]!r} (e.g. a per-layer "
                            f"attention mask chosen by the layer's index), so a later stage, which numbers its "
                            f"blocks from 0, would give them the wrong ones; found different inputs, expected the "
                            f"same for every block")
        extras, prev = mine, _first(out)
