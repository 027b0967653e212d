"""Tensor parallelism's static check: what ``meshplan check`` and ``parallelize`` refuse before anything changes."""
