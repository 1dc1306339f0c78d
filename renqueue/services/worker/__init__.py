"""The backend worker: serves one backend from its durable consumer.

:class:`Worker` (``_worker``) is the loop; it composes its parts, each a module
of its own.
"""

from ._worker import Worker

__all__ = ["Worker"]
