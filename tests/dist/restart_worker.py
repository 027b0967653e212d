"""Real gloo processes (world 2) under ``torchrun --max-restarts 1``: a rank killed (SIGKILL) in the middle of a
save leaves a torn checkpoint, torchrun restarts the group, and the restarted group resumes from the previous
complete checkpoint.

Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``): tp 2, one AdamW step, a complete checkpoint of step 1; a second step,
then the save of step 2, during which rank 1 kills itself right after writing its shards (DCP's coordinator never
gets its result: the folder stays ``step-00000002.partial``). Rank 0's collective fails and the group exits.
Attempt 1: ``meshplan.init`` meets its peers on fresh rendezvous keys (``meshplan/mesh/elastic.py``), the manager's
latest complete checkpoint is step 1 (the torn folder is ignored), loading it gives the parameters and moments of
a model trained one step from scratch (exactly), and saving step 2 again replaces the torn folder.
"""

import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import meshplan
import meshplan.checkpoint.save as saving
from _launch import run_cases
from ckpt_worker import Run, _differ, full_state

warnings.filterwarnings("ignore")
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ROOT = Path(os.environ["MESHPLAN_CKPT_DIR"])


class DieAfterWriting(saving.CommitWriter):
    """Rank 1's writer for the torn save: its shards reach the disk, then the process is killed."""

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        done.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def torn_then_resume():
    a = Run("llama", "tp2", seed=0)
    a.step(0)
    ckpt = meshplan.CheckpointManager(ROOT, every=1)
    if ATTEMPT == 0:
        ckpt.save(1, a.model, a.opt)
        a.step(1)
        if dist.get_rank() == 1:
            saving.CommitWriter = DieAfterWriting
        ckpt.save(2, a.model, a.opt)  # rank 1 dies in here; rank 0's collective fails
        raise AssertionError("attempt 0 should not get here")
    ref = full_state(a)  # one step from scratch: what step 1's checkpoint holds
    folders = sorted(p.name for p in ROOT.iterdir())
    torn = sorted(p.name for p in (ROOT / "step-00000002.partial").iterdir()) if dist.get_rank() == 0 else []
    b = Run("llama", "tp2", seed=1)
    saved = ckpt.load_latest(b.model, b.opt)
    differ = _differ(full_state(b), ref)
    b.step(1)
    ckpt.save(2, b.model, b.opt)
    ckpt.close()
    return {"attempt": ATTEMPT, "folders_before": folders, "torn_files": torn, "resumed": saved.path.name,
            "differ": differ, "folders_after": sorted(p.name for p in ROOT.iterdir())}


if __name__ == "__main__":
    with meshplan.init(None):  # the process group on torchrun's restart-safe store
        run_cases({"torn_then_resume": torn_then_resume})
