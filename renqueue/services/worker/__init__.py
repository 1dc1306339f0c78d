"""The backend worker: serves one backend from its durable consumer.

:class:`Worker` (``_worker``) is the loop around one delivery, from fetch to
ack; it composes its parts, each a module of plain classes and functions: the
backend call and its token stream (``_tokens``), work stealing between
replicas of a pool (``_stealing``) and preemption (``_preemption``).
"""

from ._worker import Worker

__all__ = ["Worker"]
