"""The router: binds waiting requests to backends, late, in priority order.

:class:`Router` (``_router``) is the loop around the binder's lease; it
composes its parts, each a module of plain classes and functions: the hold of
fetched requests (``_hold``), the free slots per backend (``_capacity``),
reading a fetched request (``_admission``), carrying out a bind
(``_dispatch``: the dispatch, the decision, the ack) and asking for a
preemption (``_asking``).
"""

from ._router import Router

__all__ = [
    "Router",
]
