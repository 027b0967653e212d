"""Real gloo processes (pp = world size = 2): the ResNet example cut by tracing (``meshplan.pipeline.trace``) at
``layer3`` (the seeds' seq1 | seq2 split), trained with torch's ``ScheduleGPipe`` and ``Schedule1F1B``, and cut
into 4 stages (vpp=2) for ``ScheduleInterleaved1F1B`` (4 microbatches), beside one device running the whole
batch.

Everything runs in float64 (model, batches, the one-device reference; ``tests/_float64.py``), so the test holds
every quantity to the one fixed tolerance ``_float64.RTOL`` (1e-9).

Each case: 3 optimizer steps (SGD with momentum, AdamW); after each step, the loss (last stage: the mean of
the microbatch losses, each a mean over its equal share of the batch) against the one-device loss, and every
parameter this rank's stage holds (under its original name, via ``stage_state_dict``) against the reference;
the gradients of every step too. Reports the worst relative differences and the stage's keys (the test
checks that the ranks' keys together are the model's).

The ``plan_*`` cases go through the normal API: ``meshplan.parallelize(build(...), "plans/resnet_pp.yaml", topo)``
(``pipeline: {split: trace, split_points: [layer3]}``; the schedule and the layout varied from the file's) and
``meshplan.train_step`` with ``meshplan.cross_entropy`` and ``max_grad_norm``, 3 AdamW steps, beside one device
accumulating the same microbatches (see ``tests/dist/pp_worker.py::reference``): every step's loss and pre-clip
norm, and every parameter the rank holds, within ``RTOL`` relative; the state-dict keys of the ranks are disjoint and
together the full model's; the optimizer keeps only this rank's parameters.
"""

import copy
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import meshplan
from _float64 import float64_model, keep_float64
from _launch import run_cases
from meshplan.pipeline.trace import stage_state_dict, traced_stages
from resnet import build, tiny_args

warnings.filterwarnings("ignore")
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BATCH, MICROBATCHES, STEPS = 8, 4, 3
#: schedule name: (class, split points, this rank's stages): pp=2 at layer3 (the seeds' seq1 | seq2); vpp=2
#: interleaved at layer2, layer3 and avgpool, rank r running stages r and r + 2
SCHEDULES = {"gpipe": (ScheduleGPipe, ["layer3"], [RANK]), "1f1b": (Schedule1F1B, ["layer3"], [RANK]),
             "interleaved_1f1b": (ScheduleInterleaved1F1B, ["layer2", "layer3", "avgpool"], [RANK, RANK + WORLD])}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _first(pair):
    return pair[0]


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 3, 32, 32, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (BATCH,), generator=g))


def _state(traced, model):
    """This rank's part of the model's state dict, under the original names."""
    return {k: v for m in traced.modules for k, v in stage_state_dict(m, model).items()}


def _parity(schedule, optimizer):
    ref = float64_model(build(tiny_args(), seed=0))
    model = copy.deepcopy(ref)
    example = _batch(0)[0][: BATCH // MICROBATCHES]
    cls, split, stage_ids = SCHEDULES[schedule]
    traced = traced_stages(model, (example,), split, len(split) + 1, stage_ids)
    stages = traced.build(torch.device("cpu"))
    sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    params = [p for m in traced.modules for p in m.parameters()]
    opt, ref_opt = OPTIMIZERS[optimizer](params), OPTIMIZERS[optimizer](ref.parameters())
    ref_params = dict(ref.named_parameters())
    worst = {"loss": 0.0, "grad": 0.0, "grad_name": None, "param": 0.0, "param_name": None, "losses": []}
    for step in range(STEPS):
        x, y = _batch(step)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        losses = []
        if RANK == 0:
            sched.step(x)  # rank 0 holds the first stage (interleaved: 0 and 2), rank 1 the last (1 and 3)
        else:
            sched.step(target=y, losses=losses)
            loss = torch.stack(losses).mean()
            worst["loss"] = max(worst["loss"], abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
            worst["losses"].append([float(loss), float(ref_loss)])
        worst["grad"], worst["grad_name"] = max(
            [(worst["grad"], worst["grad_name"])] + [(_rel(p.grad, ref_params[n].grad), n)
                                                     for m in traced.modules for n, p in m.named_parameters()],
            key=_first)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        worst["param"], worst["param_name"] = max(
            [(worst["param"], worst["param_name"])] + [(_rel(t, ref_params[n].detach()), n)
                                                       for n, t in _state(traced, model).items()], key=_first)
    worst["keys"] = sorted(_state(traced, model))
    worst["model_keys"] = sorted(ref.state_dict())
    return worst


def _case(schedule, optimizer):
    return lambda: _parity(schedule, optimizer)


CASES = {f"{s}_{o}": _case(s, o) for s in SCHEDULES for o in OPTIMIZERS}

# ---------------------------------------------------------------- through the plan: parallelize + train_step

PLAN = Path(__file__).resolve().parents[2] / "plans" / "resnet_pp.yaml"
MAX_NORM, LR = 0.5, 1e-2


def reference(microbatches):
    """One device, the same microbatches accumulated (each summed loss divided by the batch size), clipped to
    ``MAX_NORM``, AdamW: the schedule's sums in the order it makes them."""
    ref = float64_model(build(tiny_args(), seed=0))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            part = F.cross_entropy(ref(xm), ym, reduction="sum") / len(y)
            part.backward()
            loss += float(part)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        losses.append(loss)
        opt.step()
        opt.zero_grad()
    return ref, losses, norms


def _plan(schedule, layout, split_points):
    """``plans/resnet_pp.yaml`` as it is (gpipe, pp 2), or with another schedule, layout and split points."""
    plan = meshplan.load_plan(PLAN)
    if (schedule, layout, split_points) == ("gpipe", None, None):
        return str(PLAN)
    pipe = plan.pipeline.model_copy(update={"schedule": schedule,
                                            "split_points": tuple(split_points or plan.pipeline.split_points)})
    return plan.model_copy(update={"pipeline": pipe, "layout": plan.layout.model_copy(update=layout or {})})


def plan_parity(schedule, layout=None, split_points=None):
    ref, ref_losses, ref_norms = reference(MICROBATCHES)
    topo = meshplan.build_mesh({"pp": WORLD, **(layout or {})})
    model = meshplan.parallelize(float64_model(build(tiny_args(), seed=0)), _plan(schedule, layout, split_points),
                                 topo)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    results = [meshplan.train_step(model, _batch(s), meshplan.cross_entropy, opt, max_grad_norm=MAX_NORM)
               for s in range(STEPS)]
    ref_params = dict(ref.named_parameters())
    worst = {"param": 0.0, "loss": 0.0, "norm": 0.0}
    for name, p in model.named_parameters():
        worst["param"] = max(worst["param"], _rel(p.detach(), ref_params[name].detach()))
    for res, loss, norm in zip(results, ref_losses, ref_norms):
        worst["loss"] = max(worst["loss"], abs(res.loss - loss) / abs(loss))
        worst["norm"] = max(worst["norm"], abs(res.grad_norm - norm) / norm)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, sorted(model.state_dict()))
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    ref.fc.weight.data.mul_(2)  # a full checkpoint from rank 0: each rank loads its stages' keys into its stages
    meshplan.load_state_dict(model, ref.state_dict() if RANK == 0 else None)
    worst["loaded"] = max(_rel(t, ref.state_dict()[k]) for k, t in model.state_dict().items())
    return {**worst, "keys": everyone, "model_keys": sorted(ref.state_dict()),
            "losses": [r.loss for r in results], "ref_losses": ref_losses, "norms": [r.grad_norm for r in results],
            "ref_norms": ref_norms, "num_tokens": [r.num_tokens for r in results],
            "optimizer_is_model": optimized == {id(p) for p in model.parameters()}}


VPP = {"layout": {"vpp": 2}, "split_points": ["layer2", "layer3", "avgpool"]}
PLAN_CASES = {
    "plan_gpipe": lambda: plan_parity("gpipe"),
    "plan_1f1b": lambda: plan_parity("1f1b"),
    "plan_interleaved_1f1b": lambda: plan_parity("interleaved_1f1b", **VPP),
    "plan_looped_bfs": lambda: plan_parity("looped_bfs", **VPP),
    "plan_interleaved_zero_bubble": lambda: plan_parity("interleaved_zero_bubble", **VPP),
}  # the V-shaped schedules are refused with split: trace (meshplan.pipeline.traced._refuse_v_schedule)
CASES.update(PLAN_CASES)

def launch_cases():
    """This launch's cases and the context they run in (``tests/dist/suite_worker.py`` runs several workers' in one
    launch)."""
    return CASES, keep_float64


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with keep_float64():
        run_cases(launch_cases()[0])
