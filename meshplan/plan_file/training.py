"""The ``training`` plan section, as data: what ``meshplan train`` trains, on what, for how long and how. Torch-free.

The plan says how to shard; this section says how to train, with the same strictness (unknown keys, wrong types
and impossible values are errors naming the key). Every field can be overridden from the command line by its
dotted path (``meshplan train plan.yaml --steps 10 --optimizer.lr 1e-3``), so a job file is the plan itself.

Example (YAML)::

    training:
      model: {path: ./tiny-llama}           # a transformers folder: config.json + *.safetensors
      data: {path: ./corpus, eval_fraction: 0.05}
      steps: 200
      global_batch: 16
      seq_len: 128
      optimizer: {lr: 3.0e-3, weight_decay: 0.1}
      schedule: {warmup: 20, decay: cosine}
      checkpoint: {folder: runs/ckpt, every: 50, keep: 2}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from meshplan.plan_file.strict import Strict

__all__ = ["Training", "TrainModel", "TrainData", "Optimizer", "Schedule", "Evaluation", "Checkpointing", "Logging"]


class TrainModel(Strict):
    """Which model ``meshplan train`` builds (on the meta device) and where its weights come from: exactly one of
    ``path``, ``config`` and ``factory``."""

    path: str | None = Field(None, description="A local transformers checkpoint folder (config.json + *.safetensors, "
                                               "tokenizer files): its weights are loaded slice by slice.")
    config: str | None = Field(None, description="A transformers config.json (or a folder holding one): the model "
                                                 "is initialised from the seed (init.mode of the plan).")
    factory: str | None = Field(None, description="MODULE:FACTORY, a function returning an nn.Module (called under "
                                                  "the meta device); initialised from the seed.")
    tokenizer: str | None = Field(None, description="The tokenizer folder (transformers, local files only); default "
                                                    "the model's path. Needed for text data, not for token files.")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="The parameters' dtype (mixed precision for compute/reduction is the plan's "
                               "data_parallel.param_dtype/reduce_dtype).")

    @model_validator(mode="after")
    def _one_source(self) -> "TrainModel":
        given = [k for k in ("path", "config", "factory") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, config, factory; got {', '.join(given) or 'none'}")
        if self.factory is not None and ":" not in self.factory:
            raise ValueError(f"factory must be MODULE:FACTORY; got {self.factory!r}")
        return self


class TrainData(Strict):
    """The training corpus: text (tokenized once with the model's tokenizer and cached) or a token file."""

    path: str = Field(description="A folder or file of .txt/.md (one document per file) and .jsonl (one document "
                                  "per line) text, or a pre-tokenized X.bin with its X.json (meshplan.data).")
    text_key: str = Field("text", description="The JSONL field holding a document's text.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="The share of packed windows held out for "
                                                                  "evaluation (chosen by a hash of the seed).")
    documents: bool = Field(False, description="Mask attention to each document of a packed window: position ids "
                                               "restart after every end-of-document token (transformers' packed-"
                                               "sequence convention; context parallelism masks by them too). "
                                               "False: documents see the ones before them in the window.")


class Optimizer(Strict):
    """AdamW (torch.optim.AdamW; decoupled weight decay)."""

    lr: float = Field(3e-4, gt=0.0, description="The peak learning rate (after warmup).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2).")
    eps: float = Field(1e-8, gt=0.0, description="AdamW's epsilon.")
    weight_decay: float = Field(0.1, ge=0.0, description="Decoupled weight decay (applied to every parameter).")

    @field_validator("betas", mode="before")
    @classmethod
    def _pair(cls, v):
        return tuple(v) if isinstance(v, list) else v


class Schedule(Strict):
    """The learning-rate schedule: linear warmup from 0, then a decay to ``min_lr_ratio · lr`` at the last step."""

    warmup: int = Field(0, ge=0, description="Warmup steps (linear from 0 to lr).")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="The decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="The final learning rate as a share of lr.")


class Evaluation(Strict):
    """Evaluation on the held-out split (data.eval_fraction > 0)."""

    every: int | None = Field(None, ge=1, description="Evaluate every N steps (and after the last); None: never.")
    batches: int = Field(4, ge=1, description="Global batches per evaluation (the same ones every time).")


class Checkpointing(Strict):
    """Distributed checkpoints (meshplan.CheckpointManager) and resuming from them."""

    folder: str | None = Field(None, description="Where step-N checkpoints go; None: no checkpoints.")
    every: int | None = Field(None, ge=1, description="Save every N steps (and after the last); None: only the last.")
    keep: int = Field(3, ge=0, description="Complete checkpoints kept (the latest K; 0 keeps all).")
    resume: bool = Field(True, description="Resume from the latest complete checkpoint in folder, if any.")
    async_save: bool = Field(False, description="Write checkpoints in the background.")


class Logging(Strict):
    """What the run prints and records."""

    every: int = Field(1, ge=1, description="Print one line every N steps (and the first and last).")
    jsonl: str | None = Field(None, description="Append one JSON object per step (and per evaluation) to this file "
                                                "(rank 0).")
    peak_tflops: float | None = Field(None, gt=0.0, description="Peak dense TFLOP/s of one device in the compute "
                                                               "dtype, for MFU (H100 SXM bf16: 989); None: MFU "
                                                               "is not shown.")


class Training(Strict):
    """The ``training`` plan section: everything ``meshplan train`` needs besides the layout."""

    model: TrainModel = Field(description="The model to train and where its weights come from.")
    data: TrainData = Field(description="The training corpus.")
    steps: int = Field(100, ge=1, description="Optimizer steps.")
    global_batch: int = Field(8, ge=1, description="Sequences per optimizer step over all data-parallel ranks.")
    seq_len: int = Field(128, ge=1, description="Tokens per sequence.")
    microbatches: int = Field(1, ge=1, description="Gradient accumulation: each rank's batch is run in this many "
                                                   "pieces (under a pipeline, the schedule's microbatches instead).")
    seed: int = Field(0, ge=0, description="Seeds the initialisation, the data order, the split and dropout.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the global gradient norm to this; None: "
                                                                  "no clipping (the norm is still reported).")
    optimizer: Optimizer = Field(default_factory=Optimizer, description="AdamW's settings.")
    schedule: Schedule = Field(default_factory=Schedule, description="The learning-rate schedule.")
    eval: Evaluation = Field(default_factory=Evaluation, description="Held-out evaluation.")
    checkpoint: Checkpointing = Field(default_factory=Checkpointing, description="Checkpoints and resuming.")
    export: str | None = Field(None, description="Write the trained model here at the end as a transformers folder "
                                                 "(safetensors + config), loadable with from_pretrained.")
    log: Logging = Field(default_factory=Logging, description="Printing and the metrics file.")

    @model_validator(mode="after")
    def _consistent(self) -> "Training":
        if self.schedule.warmup >= self.steps and self.schedule.decay != "constant":
            raise ValueError(f"schedule.warmup ({self.schedule.warmup}) must be below steps ({self.steps})")
        if self.eval.every is not None and self.data.eval_fraction == 0.0:
            raise ValueError("eval.every needs held-out data: set data.eval_fraction > 0")
        return self
