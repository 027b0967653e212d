"""A user script under torchrun whose layout does not fit the world (tp 3 on 4 ranks): every rank raises the same
PlanError from ``meshplan.init``, uncaught (tests/test_dist_errors.py counts the lines meshplan prints)."""

import meshplan

with meshplan.init({"tp": 3}):
    pass
