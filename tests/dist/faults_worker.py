"""Real gloo processes that lose a rank, or race at exit.

The first argument says what happens:

* ``sigstop`` / ``sigkill`` VICTIM ``tp|pp`` ``step|forward``: train the example Llama (tp 2 × dp_shard with SP
  and loss_parallel, or pp 2 (1F1B) × dp_shard; ``faults``: 4 s timeout, 1 s heartbeat); at step 3 rank VICTIM
  stops or kills itself, before the step or inside the forward of its last Linear (mid-schedule). Every other rank must end with one
  RankFailure naming it: a handler on the ``meshplan.faults`` logger writes ``rank<R>.json`` (the message and when
  it came) the moment meshplan logs it, before torchrun's SIGTERM can end the rank. The victim writes its pid and
  the time first. The last survivor to report kills a stopped victim, so the launch ends at once.
* ``exit_race``: the torch 2.13 + gloo race at interpreter exit made likely (:mod:`meshplan.faults.shutdown`):
  rank 0 issues an all_reduce with ``async_op=True`` inside ``saved_tensors_hooks`` and never waits for it; rank 1
  joins it 0.5 s later. Inside ``with meshplan.init(...)`` the process then simply ends: its exit status is the
  test. ``exit_race_close`` keeps the topology without ``with`` and calls ``topo.close()``; ``exit_race_plain``
  uses ``init_process_group``/``destroy_process_group`` (torch alone), for the counts of ``benchmarks/faults.py``.
"""

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import meshplan
from llama import ModelArgs, build

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
OUT = Path(os.environ["MESHPLAN_CASE_OUT"])
TIMEOUT_S = 4.0
PLAN = {"layout": {"tp": 2},
        "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True, "rules": {
            "tok_embeddings": "embedding", "layers.*.attention_norm": "norm", "layers.*.attention.wq": "colwise",
            "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
            "layers.*.attention.wo": "rowwise", "layers.*.ffn_norm": "norm", "layers.*.feed_forward.w1": "colwise",
            "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise", "norm": "norm",
            "output": "lm_head"}},
        "faults": {"init_timeout_s": 60.0, "timeout_s": TIMEOUT_S, "heartbeat_s": 1.0, "dump_dir": str(OUT / "dumps")}}
#: pipeline stages (1F1B) × FSDP: the victim stops inside its forward, peers wait in sends and receives
PP_PLAN = {"layout": {"pp": 2}, "blocks": {"pattern": "layers.*"}, "pipeline": {"schedule": "1f1b", "microbatches": 2},
           "faults": PLAN["faults"]}


def _write(case: str, value: dict) -> None:
    (OUT / f"rank{RANK}.json").write_text(json.dumps({case: {"value": value}}))


class _Report(logging.Handler):
    """Writes this rank's RankFailure message (and its time) when meshplan logs it; the last survivor to report
    kills a stopped victim."""

    def emit(self, record: logging.LogRecord) -> None:
        _write("fault", {"t": time.time(), "message": record.getMessage()})
        victim = json.loads((OUT / "victim.json").read_text())
        reported = len(list(OUT.glob("rank*.json")))
        if reported >= WORLD and sys.argv[1] == "sigstop":  # every survivor + the victim's file
            os.kill(victim["pid"], signal.SIGKILL)


def _stop_at(model: torch.nn.Module, sig: str, where: str, step: list) -> None:
    """Signal this rank at step 3: before it (``step``), or inside its last Linear's forward (``forward``)."""
    def now():
        info = {"pid": os.getpid(), "t": time.time(), "signal": sig}
        (OUT / "victim.json").write_text(json.dumps(info))
        _write("victim", info)
        os.kill(os.getpid(), signal.SIGSTOP if sig == "sigstop" else signal.SIGKILL)
    if where == "forward":
        last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.register_forward_hook(lambda *_: now() if step[0] == 3 else None)
    else:
        model.register_forward_pre_hook(lambda *_: now() if step[0] == 3 else None)


def lose_a_rank(sig: str, victim: int, kind: str, where: str) -> None:
    logging.getLogger("meshplan.faults").addHandler(_Report())
    logging.getLogger("meshplan.faults").addHandler(logging.StreamHandler())  # stderr, as logging's last resort
    plan = PP_PLAN if kind == "pp" else PLAN
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=128, max_seq_len=16)
    with meshplan.init(plan) as topo:
        torch.manual_seed(0)
        model = meshplan.parallelize(build(args), plan, topo)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(topo.data_rank)
        step = [0]
        if RANK == victim:
            _stop_at(model, sig, where, step)
        for step[0] in range(1, 6):
            x = torch.randint(0, 128, (4, 16), generator=g)
            meshplan.train_step(model, (x, x.roll(-1, 1)), meshplan.cross_entropy, opt, topology=topo)


def _race() -> None:
    t = torch.ones(4096)
    if RANK == 0:
        with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):  # Python objects in the TLS
            dist.all_reduce(t, async_op=True)  # never waited
    else:
        time.sleep(0.5)
        dist.all_reduce(t)


KEPT: list = []


def exit_race(mode: str) -> None:
    """Returns, and the interpreter finalizes as any script's does. ``plain``: torch alone; ``with``: inside
    ``with meshplan.init(...)``; ``close``: ``topo = meshplan.init(...)`` … ``topo.close()``."""
    if mode == "plain":
        dist.init_process_group("gloo")
        KEPT.append(dist.group.WORLD)  # what a DeviceMesh or an FSDP module keeps until the interpreter ends
        _race()
        _write("exit", {"mode": mode})
        dist.destroy_process_group()
    elif mode == "with":
        with meshplan.init({"tp": 1}):
            _race()
            _write("exit", {"mode": mode})
    else:
        topo = meshplan.init({"tp": 1})
        _race()
        _write("exit", {"mode": mode})
        topo.close()


if __name__ == "__main__":
    if sys.argv[1].startswith("exit_race"):
        exit_race({"exit_race": "with", "exit_race_plain": "plain", "exit_race_close": "close"}[sys.argv[1]])
    else:
        from train import EXIT_RANK_FAILURE
        try:
            lose_a_rank(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
        except meshplan.RankFailure:  # as examples/train.py ends: the logged line alone, a distinct status
            sys.exit(EXIT_RANK_FAILURE)
