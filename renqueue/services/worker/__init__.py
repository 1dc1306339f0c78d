"""The backend worker: serves one backend from its durable consumer.

:class:`Worker` (``_worker``) is the loop around one delivery, from fetch to
its answer; it composes its parts, each a module of plain classes and
functions: one delivered message and every answer the broker gets for it
(``_delivery``), what a delivery must pass before its backend call
(``_gate``), how a delivery ends, recorded then answered (``_outcomes``),
what a failed run leads to (``_failures``), the backend call and its token
stream (``_call``), work stealing between replicas of a pool (``_stealing``),
preemption (``_yielding``) and the backend's health probe (``_probe``).
"""

from ._worker import Worker

__all__ = [
    "Worker",
]
