"""Expert parallelism: mixture-of-experts layers on the folded expert mesh (``pp, edp, ep, etp``).

* :mod:`.dispatch`: token dispatch and combine by all-to-all with uneven splits;
* :mod:`.experts`: :class:`~meshplan.expert_parallel.experts.ExpertParallel`, the ``experts`` style;
* :mod:`.etp`: experts split over ``etp`` = ``tp``;
* :mod:`.region`: MoE blocks as tp token regions (``etp: 1``);
* :mod:`.apply`: the ``expert_parallel`` section checked and applied (:func:`meshplan.parallelize` calls it).
"""
