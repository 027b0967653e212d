"""Is the eager split right for this model? The chained stage views' output against the whole model's.

A stage view runs the model's own forward (:mod:`meshplan.pipeline.ends`: other stages' blocks pass through,
a later stage feeds what it receives to its first block, an earlier one sends what the model hands the next
stage's first block). Whatever the model computes outside the blocks then runs on the first or last stage as in
the model, but a forward can still depend on its *input* in a way a later stage, fed a hidden state, does not
reproduce (masks or per-layer inputs computed from the token ids' values, blocks called twice or out of order).
The probe runs the same stage views (:func:`~meshplan.pipeline.split.stage_view`, the code ``parallelize``
builds the stages with) one after another on a small real copy of the model and compares their output with the
whole copy's, at one fixed tolerance; it refuses a split whose output differs, or that fails.

The copy: a tiny instance of the architecture for transformers models (same number of layers, so the same module
paths; ``meshplan.hf.tiny_config``), a copy of the model itself when it has at most :data:`REAL_LIMIT` elements
(parameters on the meta device get fixed pseudo-random values), else a meta-device copy, where only the shapes
and the block calls can be checked (the output values cannot).
"""

from __future__ import annotations

import copy as copying
from typing import Any

import torch
import torch.nn as nn

from meshplan.errors import PlanError
from meshplan.pipeline.split import StageSplit, stage_view
from meshplan.pipeline.stages import output_field

__all__ = ["probe_split", "REAL_LIMIT", "TOLERANCE"]

#: the largest model (parameters and buffers, in elements) the probe copies for real when it has no tiny copy
REAL_LIMIT = 1 << 24
#: max |chained − whole| / max |whole| the chained stages may differ by (the same ops run: it is 0 in practice)
TOLERANCE = 1e-6


def _output(out: Any) -> Any:
    """What a stage gives, as the pipeline's boundary hooks take it (:func:`~meshplan.pipeline.stages.output_field`):
    a transformers output's logits, else its last hidden state (a base model), else the first element or the
    tensor."""
    key = output_field(out)
    if key is not None:
        return getattr(out, key)
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _record(copy: nn.Module, split: StageSplit) -> tuple[list[str], list]:
    order: list[str] = []
    blocks = [f"{split.container}.{k}" if split.container else k for keys in split.keys for k in keys]
    handles = [copy.get_submodule(p).register_forward_pre_hook(lambda _m, _a, p=p: order.append(p))
               for p in blocks]
    return order, handles


def probe_split(model: nn.Module, split: StageSplit, where: str = "pipeline", seq: int = 24,
                opaque: tuple[str, ...] = ()) -> None:
    """Run the stage views of ``split`` one after another on a copy of ``model`` and compare with the whole copy.

    ``seq`` tokens (more than the tiny copies' 8-token sliding windows, so a sliding mask differs from a full
    one), batch 2. ``opaque`` modules (MoE blocks: data-dependent routing has no meta kernels) run as
    shape-preserving stand-ins in a meta-device copy.

    Raises:
        PlanError: naming the model and what differs (a block that ran other than once or out of order, the
            output's shape or values, with the numbers), or that the stage views fail where the model runs.
    """
    # the caller's random stream and default device (a model built under torch.device("meta")) left alone
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        _probe(model, split, where, seq, opaque)


def _probe(model: nn.Module, split: StageSplit, where: str, seq: int, opaque: tuple[str, ...]) -> None:
    copy, ids, real = _probe_copy(model, where, seq, opaque)
    order, handles = _record(copy, split)
    try:
        with torch.no_grad():
            whole = _output(copy(ids))
    except Exception as e:
        raise PlanError(f"{where}: cannot verify the stage split of {type(model).__name__}: its forward failed on "
                        f"a {'small' if real else 'meta-device'} copy ({type(e).__name__}: {str(e)[:160]})") from None
    finally:
        for h in handles:
            h.remove()
    if not isinstance(whole, torch.Tensor):
        raise PlanError(f"{where}: {type(model).__name__} returns a {type(whole).__name__}; expected a tensor, a "
                        f"tuple of tensors or a transformers ModelOutput with logits or last_hidden_state (torch's "
                        f"pipeline stages send tensors only): return one from its forward, or use pp 1")
    try:
        _check_blocks(order, split, where)
    except PlanError as e:
        raise PlanError(f"{e}; {_instead(copy, split, ids, whole, real)}") from None
    try:
        with torch.no_grad():
            h = ids
            for s in range(split.num_stages):
                h = _output(stage_view(copy, split, s)(h))
    except Exception as e:
        raise PlanError(f"{where}: the eager split of {type(model).__name__} fails where the model runs: stage "
                        f"{s} of {split.num_stages} raised {type(e).__name__}: {str(e)[:160]}; expected the chained "
                        f"stages to run like the model; {_instead(copy, split, ids, whole, real)}") from None
    problem = _compare(whole, h, real, split, type(model).__name__, where)
    if problem:
        raise PlanError(f"{problem}; {_instead(copy, split, ids, whole, real)}")


def _compare(whole: Any, chained: Any, real: bool, split: StageSplit, name: str, where: str) -> str:
    """What differs between the chained stages' output and the model's ("" if nothing)."""
    shape = tuple(getattr(whole, "shape", ()))
    if not isinstance(chained, torch.Tensor) or tuple(chained.shape) != shape:
        return (f"{where}: the {split.num_stages} chained stages of {name} give {type(chained).__name__} "
                f"{tuple(getattr(chained, 'shape', ()))}, the model {shape}; expected the model's output")
    if not real:
        return ""
    ref, got = whole.double(), chained.double()
    scale = float(ref.nan_to_num().abs().max()) or 1.0
    same_nan, keep = torch.equal(got.isnan(), ref.isnan()), ~ref.isnan()
    diff = float("inf") if not same_nan else float((got - ref)[keep].abs().max()) if keep.any() else 0.0
    if diff <= TOLERANCE * scale:
        return ""
    return (f"{where}: the {split.num_stages} chained stages of {name} compute another output than the model (max "
            f"|difference| {diff:.3g}, {diff / scale:.3g} of max |output| {scale:.3g}, on a small copy; expected at "
            f"most {TOLERANCE:g} of it): its forward depends on its input in a way a later stage, fed a hidden state "
            f"instead of the token ids, does not reproduce")


def _instead(copy: nn.Module, split: StageSplit, ids: Any, whole: Any, real: bool) -> str:
    """The suggestion of a refusal: ``split: trace`` with the same cuts if torch.export traces the small copy
    and its traced stages give the model's output there, else no pipeline (a meta-only check cannot try)."""
    points = [f"{split.container}.{keys[0]}" if split.container else keys[0] for keys in split.keys[1:]]
    trace = f"pipeline.split: trace with split_points {points}"
    if not real:
        return f"try {trace} (not verified: the model is too large to copy for real), else pp 1"
    from meshplan.pipeline.trace import traced_stages
    try:  # traced and run with autograd on, as train_step traces (under no_grad torch.export cuts other graphs:
        # GLM-MoE-DSA's ran under no_grad, its stages failed with grad on: a suggestion that did not work)
        with torch.enable_grad():
            traced = traced_stages(copying.deepcopy(copy), (ids,), points, split.num_stages,
                                   list(range(split.num_stages)))
            h: Any = (ids,)
            for module in traced.modules:
                h = module(*h) if isinstance(h, tuple) else module(h)
        out = _output(h)
        ok = not _compare(whole, out.detach() if isinstance(out, torch.Tensor) else out, True, split, "", "")
    except Exception:  # noqa: BLE001 - any failure means: do not suggest it
        ok = False
    if ok:
        return (f"use {trace} (traced and checked on the same small copy; the traced split runs without "
                f"tensor_parallel, data_parallel and blocks sections)")
    return f"{trace} does not run it either (tried on the same small copy): use pp 1 (no pipeline) for this model"


def _check_blocks(order: list[str], split: StageSplit, where: str) -> None:
    blocks = [f"{split.container}.{k}" if split.container else k for keys in split.keys for k in keys]
    for path in blocks:
        if order.count(path) != 1:
            raise PlanError(f"{where}: block {path!r} ran {order.count(path)} times in one forward; expected once "
                            f"(each stage runs its blocks once)")
    if order != blocks:
        raise PlanError(f"{where}: the model runs its blocks in the order {order[:4]}…, not the container's "
                        f"{blocks[:4]}…; expected the container's order (stages hold consecutive blocks)")


def _probe_copy(model: nn.Module, where: str, seq: int, opaque: tuple[str, ...]) -> tuple[nn.Module, Any, bool]:
    """``(copy, token ids, real)``: a small real copy (tiny transformers copy, or the model's own values), or a
    meta-device copy with its MoE blocks standing in."""
    config = getattr(model, "config", None)
    size = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    if config is not None and hasattr(config, "num_hidden_layers"):
        copy = _tiny_copy(model, where)
    elif size <= REAL_LIMIT:
        copy = _own_copy(model)
    else:
        from meshplan.model_copies import meta_copy
        from meshplan.model_copies import stand_in
        copy = meta_copy(model)
        for path in opaque:
            stand_in(copy.get_submodule(path))  # the throwaway copy only
        return copy.eval(), torch.zeros(2, seq, dtype=torch.long, device="meta"), False
    vocab = _vocab(copy)
    seq = min(seq, _max_len(copy) or seq)  # a model that refuses longer inputs (examples/llama.py: max_seq_len)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    return copy.eval(), ids, True


_LENGTH_NAMES = ("max_seq_len", "max_position_embeddings", "n_positions", "max_seq_length", "block_size")


def _max_len(model: nn.Module) -> int | None:
    """The longest input the model declares (its own, its ``config``'s or its ``args``' length attributes)."""
    found = [getattr(owner, name, None) for owner in (model, getattr(model, "config", None),
                                                      getattr(model, "args", None), getattr(model, "params", None))
             if owner is not None for name in _LENGTH_NAMES]
    found = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(found) if found else None


def _vocab(model: nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 1


def _own_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of a small model: its values, or fixed pseudo-random ones where it is on the meta device."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return copying.deepcopy(model)
    copy = copying.deepcopy(model).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*copy.parameters(), *copy.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float64) - 0.5)
            else:
                t.zero_()
    return copy


def _tiny_copy(model: nn.Module, where: str) -> nn.Module:
    """A small CPU instance of a transformers model's architecture with as many layers (same module paths)."""
    from meshplan.hf.tiny_config import tiny_config, with_layers
    try:
        small = with_layers(tiny_config(model.config), model.config.num_hidden_layers, like=model.config)
        small._attn_implementation = "eager"
        small.use_cache = getattr(model.config, "use_cache", False)  # as the model runs (a cache in its output)
        torch.manual_seed(0)
        with torch.device("cpu"):
            return type(model)(small).float()
    except Exception as e:
        raise PlanError(f"{where}: cannot verify the stage split of {type(model).__name__}: a small copy of its "
                        f"architecture could not be built ({type(e).__name__}: {str(e)[:160]}); the eager split "
                        f"is checked on one") from None
