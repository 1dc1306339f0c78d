"""The router: binds waiting requests to backends, late, in priority order.

:class:`Router` (``_router``) is the loop; it composes its parts, each a module
of its own.
"""

from ._router import Router

__all__ = ["Router"]
