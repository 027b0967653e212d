"""Expert parallelism: experts sharded over the ``ep`` axis of the folded expert mesh.

* :mod:`.dispatch`: token dispatch and combine by all-to-all with uneven splits;
* :mod:`.experts`: :class:`~meshplan.expert_parallel.experts.ExpertParallel`, the style sharding a grouped-experts
  module over ``ep`` and routing its rows (not yet reachable from a plan).
"""
