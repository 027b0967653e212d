"""Faults: ranks that disagree, die or stop answering, and a job that ends cleanly.

* :mod:`~meshplan.faults.agree` — before the first step every rank has the same software, world layout, plan and
  model, else every rank raises the same :class:`~meshplan.errors.PlanError` with a diff;
* :mod:`~meshplan.faults.watch` — the plan's ``faults`` timeouts on every process group, a heartbeat per rank,
  and a failed collective turned into one :class:`~meshplan.errors.RankFailure` naming the silent rank and the
  mesh axis (:mod:`~meshplan.faults.report`, :mod:`~meshplan.faults.flight`, :mod:`~meshplan.faults.heartbeat`);
* :mod:`~meshplan.faults.shutdown` — what the end of ``with meshplan.init(...)`` does so that the process exits 0.
"""
