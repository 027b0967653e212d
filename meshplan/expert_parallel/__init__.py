"""Expert parallelism: experts sharded over the ``ep`` axis of the folded expert mesh.

* :mod:`.dispatch`: token dispatch and combine by all-to-all with uneven splits.
"""
