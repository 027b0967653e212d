"""Data parallelism over ``dp_replicate × dp_shard (× cp)``: FSDP2, HSDP or replication (:mod:`.fsdp`)."""

from meshplan.data_parallel.fsdp import (DataParallelState, apply_data_parallel, check_data_parallel,
                                         data_parallel_state, resolve_mode)

__all__ = ["DataParallelState", "apply_data_parallel", "check_data_parallel", "data_parallel_state", "resolve_mode"]
