"""Data parallelism over ``dp_replicate × dp_shard`` (and the sequence ranks): FSDP2, HSDP or replication, as a unit (:mod:`.unit`).

:mod:`.unit` (torch-free): :data:`~meshplan.data_parallel.unit.AXIS`, the one value the rest of meshplan reaches it
through; :mod:`.costs` (torch-free): its terms in the solver's cost model; :mod:`.mode` resolves and checks,
:mod:`.wrap` wraps, :mod:`.fsdp` keeps the public entry points (``apply_data_parallel``: import it from
:mod:`meshplan.data_parallel.fsdp`). The package itself imports nothing, so the solver can read :mod:`.costs`
without the runtime.
"""
