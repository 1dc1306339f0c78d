"""The backend worker: serves one backend from its durable consumer.

:class:`Worker` (``_worker``) is the loop around one delivery, from fetch to
ack; it composes its parts, each a module of plain classes and functions: the
backend call and its token stream (``_call``), work stealing between
replicas of a pool (``_stealing``) and preemption (``_yielding``).
"""

from ._worker import Worker

__all__ = [
    "Worker",
]
