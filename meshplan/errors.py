"""Errors meshplan raises: bad user input (:class:`PlanError`) and a failed peer (:class:`RankFailure`)."""

from __future__ import annotations

__all__ = ["PlanError", "RankFailure"]


class PlanError(ValueError):
    """A plan, layout or model does not fit together.

    The message always says where (plan file, plan key, module path), what was
    found and what was expected, e.g.
    ``tp(3) does not divide world_size(16); valid tp: 1, 2, 4, 8, 16``.
    It is a ``ValueError`` so callers that catch user errors generically keep working.
    """


class RankFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering.

    Raised in place of torch's error (kept as ``__cause__``), once, where meshplan sees it: in
    ``meshplan.train_step``, ``meshplan.parallelize``, ``meshplan.init``, or at the end of
    ``with meshplan.init(...)``. Not a :class:`PlanError`: nothing in the input is wrong, the job lost a peer.
    A ``RuntimeError``, as torch's collective errors are, so code that catches those keeps working.

    Example message::

        rank 1 stopped answering (process stopped (SIGSTOP); last heartbeat 20.3 s ago); rank 0 was waiting in
        all_reduce #41 over mesh axis tp (ranks 0-1) for 20.0 s, issued from examples/llama.py:88 (forward)
        (timeout: faults.timeout_s = 20 s, plans/x.yaml)

    Attributes:
        silent: the ranks named as dead or stopped (empty when none could be found).
        axis: the mesh axis of the collective this rank was waiting in (``"world"``, ``"tp"``, …), or None.
        group_ranks: that collective's ranks (global), or ().
        op: the collective (``"all_reduce"``), or None.
        waited_s: how long this rank waited, or None.
    """

    def __init__(self, message: str, *, silent: tuple[int, ...] = (), axis: str | None = None,
                 group_ranks: tuple[int, ...] = (), op: str | None = None, waited_s: float | None = None):
        super().__init__(message)
        self.silent = silent
        self.axis = axis
        self.group_ranks = group_ranks
        self.op = op
        self.waited_s = waited_s
