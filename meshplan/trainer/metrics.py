"""What a training run shows: one line per logged step, a JSONL record per step and evaluation, the summary."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["StepRecord", "MetricsLog", "memory_bytes"]


def memory_bytes() -> int:
    """This process's peak memory: CUDA's peak allocated bytes when on a GPU, else the peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the log reports it (``kind`` ``"train"``) or one evaluation (``"eval"``)."""

    step: int
    loss: float
    kind: str = "train"
    grad_norm: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    seconds: float | None = None


@dataclass
class MetricsLog:
    """Rank 0's log: lines on ``out`` every ``every`` steps (and the first and last), every record to ``jsonl``.

    Args:
        every: print every N steps.
        steps: the run's last step (always printed).
        jsonl: the metrics file (appended to: a resumed run continues it), or None.
        out: where lines go (stdout).
        active: False on ranks other than 0: nothing is printed or written.
    """

    every: int
    steps: int
    jsonl: str | None = None
    out: IO[str] = sys.stdout
    active: bool = True
    records: list[StepRecord] = field(default_factory=list)

    def add(self, rec: StepRecord) -> None:
        """Record ``rec``; print it when it is due."""
        self.records.append(rec)
        if not self.active:
            return
        if self.jsonl:
            Path(self.jsonl).parent.mkdir(parents=True, exist_ok=True)
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({k: v for k, v in asdict(rec).items() if v is not None}) + "\n")
        if rec.kind == "eval" or rec.step in (1, self.steps) or rec.step % self.every == 0:
            print(self.line(rec), file=self.out, flush=True)

    @staticmethod
    def line(rec: StepRecord) -> str:
        """``step   10  loss 5.1234  grad_norm 1.234  lr 3.00e-03  tokens/s 1,234  mfu 12.3%  mem 1.23 GiB``."""
        if rec.kind == "eval":
            return f"eval {rec.step:5d}  loss {rec.loss:.4f}  ppl {_ppl(rec.loss):.2f}"
        parts = [f"step {rec.step:5d}", f"loss {rec.loss:.4f}"]
        if rec.grad_norm is not None:
            parts.append(f"grad_norm {rec.grad_norm:.3f}")
        if rec.lr is not None:
            parts.append(f"lr {rec.lr:.2e}")
        if rec.tokens_per_s is not None:
            parts.append(f"tokens/s {rec.tokens_per_s:,.0f}")
        if rec.mfu is not None:
            parts.append(f"mfu {100 * rec.mfu:.1f}%")
        if rec.memory_gib is not None:
            parts.append(f"mem {rec.memory_gib:.2f} GiB")
        return "  ".join(parts)

    def summary(self, world: int, wall_s: float) -> dict[str, Any]:
        """The run's summary (printed at the end): steps, first/last/best loss, mean tokens/s after the first step,
        last evaluation."""
        train = [r for r in self.records if r.kind == "train"]
        evals = [r for r in self.records if r.kind == "eval"]
        speeds = [r.tokens_per_s for r in train[1:] if r.tokens_per_s] or [r.tokens_per_s for r in train
                                                                          if r.tokens_per_s]
        out = {"steps": len(train), "world": world, "wall_s": round(wall_s, 2),
               "first_loss": train[0].loss if train else None, "last_loss": train[-1].loss if train else None,
               "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
               "eval_loss": evals[-1].loss if evals else None}
        if self.active:
            print("summary: " + "  ".join(f"{k} {_fmt(v)}" for k, v in out.items()), file=self.out, flush=True)
        return out


def _ppl(loss: float) -> float:
    return float(torch.tensor(loss).clamp(max=80.0).exp())


def _fmt(v: Any) -> str:
    return f"{v:,.4f}" if isinstance(v, float) else str(v)
