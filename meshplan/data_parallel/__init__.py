"""Data parallelism over ``dp_replicate × dp_shard`` (and the sequence ranks): FSDP2, HSDP or replication, as a unit (:mod:`.unit`).

:mod:`.mode` resolves and checks (torch-free), :mod:`.wrap` wraps, :mod:`.fsdp` keeps the public entry points
(``apply_data_parallel``: import it from :mod:`meshplan.data_parallel.fsdp`; this package imports no module that
reaches the state module, so no import cycle runs through it).
"""

from meshplan.data_parallel.mode import DataParallelState, check_data_parallel, resolve_mode

__all__ = ["DataParallelState", "check_data_parallel", "resolve_mode"]
