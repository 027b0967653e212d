"""``meshplan train``'s loop on every layout in one launch: each case trains the same transformers model (a
Starcoder2 this repo ships no plan for) from its safetensors folder on a text corpus, in float64, and returns the
losses (``*_docs``: attention masked to each packed document). argv: the model folder, the corpus folder, the output folder."""

import os
import sys
from pathlib import Path

import torch.distributed as dist
from _launch import run_cases

from meshplan.plan_file.document import Plan
from meshplan.trainer.loop import train
from meshplan.trainer.settings import with_overrides

MODEL, CORPUS, OUT = sys.argv[1:4]
WORLD = int(os.environ["WORLD_SIZE"])
BASE = {"model.path": MODEL, "model.dtype": "float64", "data.path": CORPUS, "steps": 10, "global_batch": 8,
        "seq_len": 32, "optimizer.lr": 3e-3, "schedule.warmup": 2, "log.every": 100}
LAYOUTS = {1: {"single": {}, "single_docs": {}},
           4: {"tp2_dp2": {"tp": 2}, "pp2_tp2": {"pp": 2, "tp": 2}, "cp2_tp2": {"cp": 2, "tp": 2},
               "cp2_tp2_docs": {"cp": 2, "tp": 2}, "pp2_tp2_docs": {"pp": 2, "tp": 2}}}


def _case(name: str, layout: dict):
    def run():
        over = {**BASE, **{f"layout.{k}": v for k, v in layout.items()},
                "log.jsonl": str(Path(OUT, f"{name}.jsonl")), "data.documents": name.endswith("_docs")}
        if name in ("single", "tp2_dp2"):
            over["export"] = str(Path(OUT, f"export-{name}"))
        summary = train(with_overrides(Plan.from_data({"version": 1}), over))
        return {"summary": summary}
    return run


dist.init_process_group("gloo")  # one group for every case: meshplan.init reuses it
run_cases({name: _case(name, lay) for name, lay in LAYOUTS[WORLD].items()})
