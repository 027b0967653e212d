"""What the solver chooses and what it is given: a :class:`Candidate` layout and the :class:`Training` run.

A candidate is everything ``meshplan solve`` varies: the degrees (tp, cp, ep/etp, pp, vpp, dp_replicate ×
dp_shard), the Megatron order, the pipeline schedule, the micro-batch size (hence the microbatch count) and
activation checkpointing. The training run fixes the rest: sequence length, global batch, dtypes, and the plan
settings a layout does not change (sequence parallelism, loss parallelism, resharding, offload). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.errors import PlanError

__all__ = ["Candidate", "Training", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class Training:
    """The run a layout serves.

    Attributes:
        seq: tokens per sequence. global_batch: sequences per optimizer step over all data-parallel ranks.
        dtype: compute dtype (activations, gathered parameters: FSDP's ``param_dtype``).
        master_dtype: parameters, gradients and optimizer state as stored. reduce_dtype: gradient reduction.
        sequence_parallel / loss_parallel / save_gathered_inputs: the ``tensor_parallel`` settings.
        reshard_after_forward / cpu_offload: the ``data_parallel`` settings.
        cp_method: ``allgather_kv``, ``ring`` or ``torch_ring``. clip: the step clips the gradient norm (one all-reduce).
        optimizer_states: tensors the optimizer keeps per parameter (AdamW: 2).
        matmul_dtype: the dtype linear layers multiply in when it differs from ``dtype`` (``float8``: torchao's
            float8 training, activations and gathered parameters staying in ``dtype``).
    """

    seq: int
    global_batch: int
    dtype: str = "bfloat16"
    master_dtype: str = "float32"
    reduce_dtype: str = "float32"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    save_gathered_inputs: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    cp_method: str = "allgather_kv"
    clip: bool = True
    optimizer_states: int = 2
    matmul_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.seq < 1 or self.global_batch < 1:
            raise PlanError(f"training: seq({self.seq}) and global batch({self.global_batch}) must be >= 1")
        for name in ("dtype", "master_dtype", "reduce_dtype", "matmul_dtype"):
            if getattr(self, name) not in (*DTYPE_BYTES, None if name == "matmul_dtype" else ""):
                raise PlanError(f"training: {name} {getattr(self, name)!r} is not one of {', '.join(DTYPE_BYTES)}")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.master_dtype]

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.seq * self.global_batch


@dataclass(frozen=True)
class Candidate:
    """One layout: degrees, order, schedule, microbatching and activation checkpointing.

    Attributes:
        tp, cp, ep, etp, pp, vpp, dp_replicate, dp_shard: the degrees (``layout`` keys; ``etp`` already resolved).
        order: Megatron order string, innermost first.
        schedule: pipeline schedule (``None`` without pipelining).
        micro_batch: sequences per microbatch on one data-parallel rank.
        microbatches: microbatches per step on one data-parallel rank (the pipeline's, or gradient accumulation).
        ac: ``none``, ``full`` or ``selective`` (every ``ac_every``-th block; ``ac_ops``: op level, matmul
            outputs kept; ``ac_policy`` ``megatron``: op level, colwise matmul outputs and reduced row-parallel
            outputs kept, :mod:`meshplan.recompute`). dp_mode: ``fsdp``, ``hsdp``, ``ddp`` or ``none`` (default: from the degrees).
        accumulate_unsharded: ``data_parallel.accumulate_unsharded``: FSDP keeps parameters and gradients
            unsharded between accumulated microbatches (fewer collectives, more memory).
        vocab_ends: ``data_parallel.ends: vocab_parallel``: the embedding and the head are sharded by rows over the
            FSDP2 data ranks for good (no FSDP2 unit; activation collectives each microbatch instead).
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    order: str = "tp-cp-ep-dp-pp"
    schedule: str | None = None
    micro_batch: int = 1
    microbatches: int = 1
    ac: str = "none"
    ac_every: int = 1
    ac_ops: bool = False
    ac_policy: str | None = None
    dp_mode: str | None = None
    accumulate_unsharded: bool = True
    vocab_ends: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp_replicate * self.dp_shard

    def rank_tokens(self, seq: int) -> float:
        """Tokens of one microbatch on one rank: ``micro_batch`` sequences of ``seq``, cut over the sequence axis."""
        return self.micro_batch * seq / self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (each holding different sequences; cp ranks share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """The data-parallel mode, as ``data_parallel.mode``'s default (:func:`meshplan.data_parallel.mode.resolve_mode`)."""
        if self.dp_mode is not None:
            return self.dp_mode
        rep, shard = self.dp_replicate, self.dp_shard
        return ("hsdp" if rep > 1 and shard > 1 else "ddp" if rep > 1 and shard == 1
                else "fsdp" if shard * self.cp > 1 else "none")

    def checkpointed(self, block: int) -> bool:
        """Does block ``block`` (from 0) recompute its forward in backward?"""
        if self.ac == "full":
            return True
        return self.ac == "selective" and not self.op_level and (block + 1) % self.ac_every == 0

    @property
    def op_level(self) -> bool:
        """Selective checkpointing at the op level (``ops`` or ``policy``): every block keeps part of its ops."""
        return self.ac == "selective" and (self.ac_ops or self.ac_policy is not None)

    @property
    def megatron(self) -> bool:
        """``policy: megatron`` (:mod:`meshplan.recompute`)."""
        return self.ac == "selective" and self.ac_policy == "megatron"

    def layout_dict(self) -> dict:
        """The plan's ``layout`` section."""
        out = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "etp": self.etp, "pp": self.pp, "vpp": self.vpp,
               "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "order": self.order}
        default = {"tp": 1, "cp": 1, "ep": 1, "etp": self.tp, "pp": 1, "vpp": 1, "dp_replicate": 1,
                   "order": "tp-cp-ep-dp-pp"}
        return {k: v for k, v in out.items() if k == "dp_shard" or v != default[k]}

    def label(self) -> str:
        """A short text: ``tp8 cp1 pp16(1f1b, v1) dp2×64 mb1×16 ac=full``."""
        parts = [f"tp{self.tp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"×etp{self.etp}" if self.etp > 1 else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"×v{self.vpp}" if self.vpp > 1 else "")
                         + (f" {self.schedule}" if self.schedule else ""))
        parts.append(f"dp{self.dp_replicate}×{self.dp_shard}({self.mode})")
        parts.append(f"mb{self.micro_batch}×{self.microbatches}")
        ac = self.ac if self.ac != "selective" else (f"selective({self.ac_policy})" if self.ac_policy else
                                                     "selective(ops)" if self.ac_ops else f"every{self.ac_every}")
        parts.append(f"ac={ac}")
        if not self.accumulate_unsharded and self.microbatches > 1:
            parts.append("reshard-each-microbatch")
        if self.vocab_ends:
            parts.append("vocab-parallel-ends")
        if self.order != "tp-cp-ep-dp-pp":
            parts.append(self.order)
        return " ".join(parts)

    def with_(self, **kw) -> "Candidate":
        return replace(self, **kw)
