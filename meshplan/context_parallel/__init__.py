"""Context parallelism: sequences split across the ``cp`` axis, attention exact across the shards.

* :mod:`.chunks` (torch-free): which tokens each rank holds (head-tail load balance) and the attention work;
* :mod:`.attention`: the all-gather-K/V attention; :mod:`.ring`: meshplan's ring attention (any backend), on
  :mod:`.blocks` (the block kernel) and :mod:`.masks`; :mod:`.torch_ring`: torch's ring attention (CUDA);
* :mod:`.runtime`: positions, attention routing and the first-forward audit, per model;
* :mod:`.apply`: the section checked against the model and installed; :mod:`.batch`: a batch's share per rank.
"""
