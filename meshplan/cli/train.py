"""``meshplan train PLAN [--SETTING VALUE …] [--nproc N] [--max-restarts N]``: train a model as the plan's ``training`` section says.

Outside torchrun it checks the plan, the settings, the model, the tokenizer and the data in this process (a bad
input is one line and exit 2, before any process starts), then runs ``torchrun --standalone --nproc-per-node N``
on itself (``--max-restarts N``: torchrun restarts every process after a failure, up to N times, and the run
resumes from its latest checkpoint); under torchrun (``RANK`` set) every rank trains. ``N`` defaults to the layout's world size when the
layout fixes it, else 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from meshplan.errors import PlanError

__all__ = ["register"]


#: the launcher's own options (torchrun's), not the plan's settings: name -> smallest value
LAUNCHER = {"nproc": 1, "max_restarts": 0}


def _launcher(settings: list[str]) -> tuple[dict[str, int], list[str]]:
    """``--nproc N`` and ``--max-restarts N`` taken out of the settings (they are torchrun's, not the plan's)."""
    rest, found, it = [], {}, iter(settings)
    for word in it:
        name = word[2:].partition("=")[0].replace("-", "_") if word.startswith("--") else ""
        if name in LAUNCHER:
            value = word.partition("=")[2] or next(it, "")
            if not value.isdigit() or int(value) < LAUNCHER[name]:
                raise PlanError(f"meshplan train: --{name.replace('_', '-')} must be an integer >= "
                                f"{LAUNCHER[name]}; got {value!r}")
            found[name] = int(value)
        else:
            rest.append(word)
    return found, rest


def _plan(path: str, settings: list[str]):
    from meshplan.plan_file.document import load_plan
    from meshplan.trainer.settings import parse_overrides, with_overrides
    return with_overrides(load_plan(path), parse_overrides(settings))


def _run(args: argparse.Namespace) -> int:
    launch, settings = _launcher(args.settings)
    plan = _plan(args.plan, settings)
    if os.environ.get("RANK") is not None:  # a torchrun child: train
        from meshplan.trainer.loop import train
        train(plan)
        return 0
    from meshplan.trainer.loop import open_data, prepare
    from meshplan.plan_file.layout import Layout
    layout = plan.layout or Layout()
    n = launch.get("nproc") or layout.smallest_world()
    plan, _, tok, vocab, _ = prepare(plan, n)  # bad settings, model, tokenizer: one line, before any process starts
    open_data(plan.training, tok, vocab, layout.resolve(n).dp)  # tokenized once here; a short corpus refused
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           f"--max-restarts={launch.get('max_restarts', 0)}", "-m", "meshplan", "train", args.plan, *settings]
    return subprocess.call(cmd)


def register(sub) -> None:
    """Add ``train`` to the ``meshplan`` subparsers."""
    p = sub.add_parser("train", help="train a model from a plan's training section (launches torchrun itself)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("plan", help="the plan file (YAML/JSON/TOML) with a training section, or overrides for one")
    p.add_argument("settings", nargs=argparse.REMAINDER,
                   help="--SETTING VALUE overrides by dotted path (--steps 10 --optimizer.lr 1e-3), and "
                        "--nproc N (processes, outside torchrun), --max-restarts N (torchrun's)")
    p.set_defaults(func=_run)
