"""The zoo's axes: a tiny float64 model of a transformers model type, one plan per axis, ``meshplan.check`` on each.

Axes (``AXES``), each with its layout and world size:

==========  ==========================================  =====  =====================================================
axis        layout                                      world  plan
==========  ==========================================  =====  =====================================================
tp          tp 2                                        2      ``from_hf`` (SP + loss parallel; plain if refused)
pp          pp 2                                        2      ``blocks`` + ``pipeline`` (1f1b, 2 microbatches)
cp          cp 2                                        2      ``blocks`` + ``context_parallel`` (the attention
                                                               modules of the blocks, positions: position_ids)
ep          ep 2 (MoE models only)                      2      ``from_hf(ep=2, tp=1)`` (experts from the config)
3d          pp 2 × tp 2 × dp_shard 2 (dense);           8      ``from_hf`` + ``blocks`` + ``pipeline``; MoE:
            tp 2 × ep 2 (etp 1) × dp_shard 4 (MoE)             ``from_hf(ep=2, tp=2)``
sel         tp 2                                        2      tp's plan + ``blocks.activation_checkpointing:
                                                               {mode: selective, policy: megatron}``
cpdoc       cp 2                                        2      cp's plan with ``method: ring``; packed documents
                                                               (``zoo_inputs``: restarting position_ids)
ppkw        pp 2                                        2      pp's plan; position_ids and a padding
                                                               attention_mask as keyword inputs (``zoo_inputs``)
vocab       dp_shard 2                                  2      ``blocks`` + ``data_parallel`` (``VOCAB``: ends
                                                               vocab_parallel, reduce_scatter chunked, no prefetch)
ppvocab     pp 2 × dp_shard 2                           4      pp's plan + ``data_parallel`` (``VOCAB`` and
                                                               accumulate_unsharded: false)
==========  ==========================================  =====  =====================================================

:func:`plan_model` builds the model once, writes every axis' plan and checks it at its world size (the offline
check with its dry run, as ``meshplan check`` does). A plan that check passes is run on real gloo processes by
``benchmarks/zoo_dist.py``: "check ok ⇒ it runs".
"""

from __future__ import annotations

import json
import os
import tempfile

from zoo_inputs import KW_AXES

AXES = ("tp", "pp", "cp", "ep", "3d", "sel", "cpdoc", "ppkw", "vocab", "ppvocab")
WORLD = {"tp": 2, "pp": 2, "cp": 2, "ep": 2, "3d": 8, "sel": 2, "cpdoc": 2, "ppkw": 2, "vocab": 2, "ppvocab": 4}
#: axes whose plan is tp's (sequence + loss parallel first, the plain plan where that is refused)
TP_LIKE = ("tp", "ep", "3d", "sel")
SELECTIVE = {"mode": "selective", "policy": "megatron"}
PIPELINE = {"schedule": "1f1b", "microbatches": 2}
#: the data-parallel memory knobs the ``vocab`` and ``ppvocab`` axes run (docs/data-parallel.md)
VOCAB = {"ends": "vocab_parallel", "reduce_scatter": "chunked", "prefetch": False}
ROWS, SEQ = 4, 16


def short(e: BaseException | str, n: int = 400) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:n]


def build(model_type: str, seed: int = 0):
    """``(model, attn)``: the tiny model of ``model_type`` (``meshplan.hf.tiny_models``' class and config) in
    float64, SDPA attention where the class takes it (context parallelism routes SDPA), else eager; raises
    when it cannot be built."""
    import torch

    from meshplan.hf.tiny_config import tiny_config
    from meshplan.hf.tiny_models import model_class
    cls = model_class(model_type)
    if cls is None:
        raise ValueError(f"no model class in transformers takes {model_type!r} configs")
    config = tiny_config(model_type, tp=2)
    if cls.config_class is not type(config) and isinstance(getattr(config, "text_config", None), cls.config_class):
        config = config.text_config
    config._experts_implementation = "batched_mm"  # grouped_mm takes no float64; "eager" loops in Python
    last = None
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        try:
            torch.manual_seed(seed)
            return cls(config).double().train(), attn
        except Exception as e:  # noqa: BLE001 - try eager, then report
            last = e
    raise last


def batch(model, step: int = 0):
    """``(tokens, targets)``: ``ROWS × SEQ`` random ids; targets masked unevenly (-100), row 1 entirely."""
    import torch
    g = torch.Generator().manual_seed(3000 + step)
    vocab = model.config.get_text_config().vocab_size
    x = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    y = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    keep = torch.rand(ROWS, SEQ, generator=g) < torch.linspace(0.3, 1.0, SEQ)[None, :]
    keep[1] = False
    return x, torch.where(keep, y, -100)


def loss_sum(out, y):
    """The summed loss ``train_step`` normalises: cross-entropy of the logits (vocab-parallel when sharded), or for
    a model without a head the square of the last hidden state projected on a fixed vector, over valid targets."""
    import torch
    from torch.distributed.tensor import DTensor

    import meshplan
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, torch.Tensor):
        logits = out
    if logits is not None and getattr(out, "last_hidden_state", None) is None:
        return meshplan.cross_entropy(logits, y, reduction="sum")
    h = getattr(out, "last_hidden_state", None)
    h = h if h is not None else out[0]
    h = h.full_tensor() if isinstance(h, DTensor) else h
    w = torch.arange(h.shape[-1], dtype=h.dtype).mul(0.7).sin()
    return ((h @ w).square() * (y != -100)).sum()


def blocks_pattern(model) -> str | None:
    """The repeated blocks: the ``nn.ModuleList`` (not experts, not a vision/audio tower) holding the most
    parameters, as ``path.*``."""
    import torch
    best, size = None, 0
    for name, m in model.named_modules():
        towers = ("expert", "visual", "vision", "audio", "image")  # the text decoder's blocks, not a tower's
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and name and not any(t in name for t in towers):
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    return f"{best}.*" if best else None


def attention_patterns(model, blocks: str) -> list[str]:
    """Module-path patterns of the blocks' attention modules: the outermost module under each block whose class
    name contains ``Attention`` (one pattern per distinct relative path), in ``blocks`` and in every other block
    list (not a tower's) that holds attention: HRM's ``H_module.layers`` beside ``L_module.layers``."""
    import torch
    towers = ("expert", "visual", "vision", "audio", "image")
    lists = [blocks[:-2]] + [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n and
                             n != blocks[:-2] and not any(t in n for t in towers)]
    out: list[str] = []
    for prefix in lists:
        out += [p for p in _attention_under(model, prefix) if p not in out]
    return out


def _attention_under(model, prefix: str) -> list[str]:
    """The attention patterns under the block list ``prefix`` (see :func:`attention_patterns`)."""
    rel: list[str] = []
    for name, m in model.named_modules():
        if not name.startswith(prefix + ".") or "Attention" not in type(m).__name__:
            continue
        parts = name[len(prefix) + 1:].split(".")
        if len(parts) < 2 or any(r == ".".join(parts[1:k]) for r in rel for k in range(2, len(parts))):
            continue
        if ".".join(parts[1:]) not in rel:
            rel.append(".".join(parts[1:]))
    return [f"{prefix}.*.{r}" for r in rel]


def _from_hf(model, **kw) -> dict:
    """``meshplan.hf.convert.from_hf`` on the tiny model's own config (so the built class is converted)."""
    from meshplan.hf.convert import from_hf
    with tempfile.TemporaryDirectory() as d:
        data = model.config.to_dict()
        data.update(model_type=model.config.model_type, architectures=[type(model).__name__])
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(data, f, default=str)
        plan = from_hf(d, **kw)
    plan.pop("_origin", None)
    return plan


def is_moe(model) -> bool:
    """Whether ``from_hf`` finds experts in the model's tp_plan (it then writes an expert_parallel section)."""
    try:
        return "expert_parallel" in _from_hf(model, tp=2)
    except Exception:  # noqa: BLE001 - a refused conversion is reported by the tp axis
        return False


def axis_plan(model, axis: str, moe: bool, sp: bool = True) -> dict | None:
    """The plan of ``axis`` (see the module docstring); None for ``ep`` on a model without experts. Raises
    PlanError where ``from_hf`` refuses the model."""
    blocks = blocks_pattern(model)
    base = {"version": 1, **({"blocks": {"pattern": blocks}} if blocks else {})}
    if axis in ("tp", "sel"):
        plan = {**base, **_from_hf(model, tp=2, sequence_parallel=sp, loss_parallel=sp), "layout": {"tp": 2}}
        if axis == "sel":
            plan["blocks"] = {"pattern": blocks or "<no repeated blocks>", "activation_checkpointing": SELECTIVE}
        return plan
    if axis in ("pp", "ppkw"):
        return {**base, "layout": {"pp": 2}, "pipeline": dict(PIPELINE)}
    if axis in ("cp", "cpdoc"):
        attn = attention_patterns(model, blocks) if blocks else []
        section = {"attention": attn or ["<no attention module>"], **({"method": "ring"} if axis == "cpdoc" else {})}
        return {**base, "layout": {"cp": 2}, "context_parallel": section}
    if axis == "vocab":
        return {**base, "layout": {"dp_shard": 2}, "data_parallel": dict(VOCAB)}
    if axis == "ppvocab":
        return {**base, "layout": {"pp": 2, "dp_shard": 2}, "pipeline": dict(PIPELINE),
                "data_parallel": {**VOCAB, "accumulate_unsharded": False}}
    if axis == "ep":
        if not moe:
            return None
        return {**base, **_from_hf(model, tp=1, ep=2, sequence_parallel=sp, loss_parallel=sp), "layout": {"ep": 2}}
    if moe:
        plan = _from_hf(model, tp=2, ep=2, sequence_parallel=sp, loss_parallel=sp)
        return {**base, **plan, "layout": {"tp": 2, "ep": 2, "etp": 1}}
    plan = _from_hf(model, tp=2, sequence_parallel=sp, loss_parallel=sp)
    return {**base, **plan, "layout": {"pp": 2, "tp": 2}, "pipeline": dict(PIPELINE)}


def check_axis(model, axis: str, moe: bool) -> dict:
    """``{"status": "ok", "plan", "mode"}``, ``{"status": "refused", "reason", "errors"}``, ``{"status": "-"}``
    (ep of a dense model) or ``{"status": "crash", "reason"}`` (convert or check raised). Tensor-parallel axes
    try sequence + loss parallel first and the plain plan when that is refused."""
    import meshplan
    from meshplan.errors import PlanError
    errors: list[str] = []
    if axis in KW_AXES:  # the keyword inputs must run on one device first
        why = _keyword_inputs_run(model, axis)
        if why:
            return {"status": "-", "reason": why}
    for sp in ((True, False) if axis in TP_LIKE else (True,)):
        try:
            plan = axis_plan(model, axis, moe, sp)
            if plan is None:
                return {"status": "-", "reason": "no experts"}
            report = meshplan.check(model, plan, world_size=WORLD[axis])
        except PlanError as e:
            errors.append(f"convert: {short(str(e), 600)}")
            continue
        except Exception as e:  # noqa: BLE001 - check must not raise: a finding
            return {"status": "crash", "reason": f"check raised {short(e, 600)}"}
        if report.ok:
            mode = ("sp+lp" if sp else "plain") if axis in TP_LIKE else ""
            return {"status": "ok", "plan": plan, "mode": mode, **({"sp_refused": errors[0]} if errors else {})}
        errors.append("; ".join(short(str(e), 600) for e in report.errors[:2]))
    return {"status": "refused", "reason": errors[-1], "errors": errors}


def _keyword_inputs_run(model, axis: str) -> str | None:
    """Why the model cannot take ``axis``' keyword inputs (``zoo_inputs.step_inputs``) on one device, or None."""
    from zoo_inputs import call, step_inputs
    x, y = batch(model)
    inputs, why = step_inputs(model, axis, x)
    if why:
        return why
    try:
        loss_sum(call(model, inputs), y)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"the tiny {type(model).__name__} does not run on {axis}'s keyword inputs (one device): {short(e, 200)}"
    return None


def plan_model(model_type: str, axes=AXES) -> dict:
    """One model's offline row: ``{type, model, attn, moe, axes: {axis: check_axis(...)}}``, or a
    ``not buildable tiny`` row with the reason."""
    row: dict = {"type": model_type}
    try:
        model, attn = build(model_type)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return {**row, "class": "not buildable tiny", "reason": f"not built: {short(e, 300)}"}
    row.update(model=type(model).__name__, attn=attn)
    try:
        x, y = batch(model)
        loss_sum(model(x), y).backward()
    except Exception as e:  # noqa: BLE001
        return {**row, "class": "not buildable tiny",
                "reason": f"the tiny {type(model).__name__} does not run on token ids (one device): {short(e, 300)}"}
    model.zero_grad(set_to_none=True)
    row["moe"] = moe = is_moe(model)
    row["axes"] = {axis: check_axis(model, axis, moe) for axis in axes}
    return row
