"""The zoo's torchrun worker: many (model, axis) items in one gloo launch, each vs one device in float64.

Run by ``benchmarks/zoo_launch.py`` (never by hand): ``ZOO_ITEMS`` names a JSON list of items
``{"i", "type", "axis", "plan"}`` (plans ``meshplan.check`` passed), ``ZOO_OUT`` a folder. For each item every rank
builds the tiny model (``zoo_plans.build``, seed 0), runs one ``meshplan.train_step`` (one forward + backward,
``zoo_plans.loss_sum`` over the global batch, normalised by its token count) through ``meshplan.parallelize``
with an optimizer that only records the gradients, and compares the step's loss and every gradient it holds
(``full_tensor``) with the same step of an unparallelized copy: ``‖g − g_ref‖ ≤ TOL · max(‖g_ref‖, FLOOR ·
max‖g_ref‖)`` and ``|loss − loss_ref| ≤ TOL · |loss_ref|``. A rank appends one JSON line per item to
``rank<R>.jsonl`` (rank 0 first a ``start`` line): ``{"i", "ok", "loss_err", "worst", "failed"}`` or
``{"i", "error"}``. An item that raises is recorded and the next one runs; the process groups time out after
``ZOO_TIMEOUT`` seconds so a rank left in a collective raises too (the parent relaunches what a dead launch left).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_inputs import call, rows_of, step_inputs  # noqa: E402
from zoo_plans import batch, build, loss_sum  # noqa: E402

TOL, FLOOR = 1e-9, 1e-6


class KeepFloat64(torch.overrides.TorchFunctionMode):
    """Turns the model code's casts of float64 tensors to fp32 (``.float()``, ``.to``/``.type(torch.float32)``: the
    RMSNorms, rotary tables and routers of most transformers models; ``dtype=torch.float32`` reductions: DiffLlama's
    lambdas) into no-ops, on both sides: the whole step is
    float64, so parity is exact to reduction order (about 1e-16) and one tolerance fits every model."""

    def __init__(self):
        super().__init__()
        self.kept = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.to, torch.Tensor.type) and args \
                and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            if func is torch.Tensor.float:
                self.kept += 1
                return args[0]
            if any(a is torch.float32 for a in args[1:]) or kwargs.get("dtype") is torch.float32:
                self.kept += 1
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        elif kwargs.get("dtype") is torch.float32 and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:  # torch.sum(x, dtype=torch.float32): DiffLlama's lambdas
            self.kept += 1
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64_in_recompute():
    """:class:`KeepFloat64` entered around every module call too: activation checkpointing re-runs a block's forward
    during backward without the torch-function modes active at the forward (torch restores RNG and autocast state,
    not modes), so a mode around the step alone misses the recompute (selective recompute then finds casts the
    forward did not make: ``aten._to_copy ... not found in storage``). Module hooks run again in the recompute."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    modes: list = []

    def enter(_m, _args):
        modes.append(KeepFloat64())
        modes[-1].__enter__()

    def leave(_m, _args, _out):
        modes.pop().__exit__(None, None, None)

    pre = register_module_forward_pre_hook(enter)
    post = register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose ``step`` records each parameter's gradient instead of moving it."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = p.grad.detach().clone()


def _reference(model, axis: str = "tp"):
    """Loss and ``{name: grad}`` of one forward + backward on one device (the global batch; the axis' keyword
    inputs, ``zoo_inputs.step_inputs``)."""
    x, y = batch(model)
    loss = loss_sum(call(model, step_inputs(model, axis, x)[0]), y) / (y != -100).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def run_item(item: dict, topologies: dict) -> dict:
    """One item on this rank: parallelize, one step, compare (see the module docstring)."""
    import meshplan
    from torch.distributed.tensor import DTensor
    model, _ = build(item["type"])
    ref_loss, ref = _reference(copy.deepcopy(model), item["axis"])
    key = json.dumps(item["plan"]["layout"], sort_keys=True)
    if key not in topologies:
        timeout = float(os.environ.get("ZOO_TIMEOUT", 300))
        topologies[key] = meshplan.build_mesh(item["plan"]["layout"], timeout_s=timeout)
    topo = topologies[key]
    pmodel = meshplan.parallelize(model, item["plan"], topo)
    x, y = batch(pmodel)
    inputs = step_inputs(model, item["axis"], x)[0]
    rows, r = x.shape[0] // topo.data_world_size, topo.data_rank
    opt = GradRecorder(pmodel.parameters())
    res = meshplan.train_step(pmodel, (rows_of(inputs, r * rows, (r + 1) * rows), y[r * rows:(r + 1) * rows]),
                              loss_sum, opt)
    top = max((float(g.norm()) for g in ref.values()), default=0.0)
    errors, held = {}, []
    for name, p in pmodel.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "")
        held.append(name)
        g = opt.grads.get(id(p))
        g = g.full_tensor() if isinstance(g, DTensor) else g
        want = ref.get(name)
        if want is None and g is None:
            continue
        if want is None or g is None or g.shape != want.shape:
            errors[name] = float("inf")
            continue
        errors[name] = float((g - want).norm()) / max(float(want.norm()), FLOOR * top, 1e-300)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    missing = sorted(set(ref) - {n for h in everyone for n in h})
    loss_err = abs(res.loss - ref_loss) / abs(ref_loss)
    failed = sorted((n for n, e in errors.items() if not e <= TOL), key=lambda n: -errors[n])
    return {"ok": loss_err <= TOL and not failed and not missing, "loss_err": loss_err,
            "worst": max(errors.values(), default=0.0), "params": len(errors),
            "failed": [f"{n} ({errors[n]:.1e})" for n in failed[:6]] + [f"{n} (held by no rank)" for n in missing[:4]],
            "loss": [res.loss, ref_loss], **_layout_note(pmodel)}


def _layout_note(model) -> dict:
    """``{"by_documents": bool}`` for a context-parallel model: whether its last batch was laid out per document."""
    cp = getattr(getattr(model, "_meshplan_state", None), "context_parallel", None)
    runtime = getattr(cp, "runtime", None)
    return {} if runtime is None else {"by_documents": bool(runtime.by_documents)}


def main() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging
    logging.set_verbosity_error()
    timeout = datetime.timedelta(seconds=float(os.environ["ZOO_TIMEOUT"]))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    with open(os.environ["ZOO_ITEMS"]) as f:
        items = json.load(f)
    out = open(os.path.join(os.environ["ZOO_OUT"], f"rank{rank}.jsonl"), "a", buffering=1)
    topologies: dict = {}
    for item in items:
        if rank == 0:
            out.write(json.dumps({"i": item["i"], "start": time.time()}) + "\n")
        t0 = time.perf_counter()
        try:
            with KeepFloat64(), keep_float64_in_recompute():
                row = run_item(item, topologies)
        except Exception as e:  # noqa: BLE001 - recorded; the next item runs
            row = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}",
                   "where": traceback.format_exc()[-800:]}
        ok = [None] * dist.get_world_size()
        dist.all_gather_object(ok, "error" not in row)
        if not all(ok):  # a rank failed mid-item: its groups may hold unfinished collectives
            topologies.clear()
        out.write(json.dumps({"i": item["i"], "seconds": round(time.perf_counter() - t0, 2), **row}) + "\n")
    out.close()
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # tests/_launch.py: a gloo worker thread may abort an interpreter that finalizes


if __name__ == "__main__":
    main()
