"""The router: binds waiting requests to backends, late, in priority order.

:class:`Router` (``_router``) is the loop that composes its stages, each a
module of plain classes and functions: the binder's lease and term
(``_term``), the intake of requests into the hold (``_intake``, over
``_hold``, ``_admission``, ``_placement``, ``_spending``), and the round that
plans and carries out the binds (``_round``, over ``_capacity``, ``_ledger``,
``_circuits``, ``_catch_up``, ``_dispatch``: the dispatch, the decision, the
ack, and ``_asking``: asking for a preemption). What they share is in
``_parts``; how a request ends here is ``_endings``.
"""

from ._router import Router

__all__ = [
    "Router",
]
