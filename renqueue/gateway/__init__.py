"""The OpenAI-compatible HTTP gateway (``renqueue gateway``): see docs/gateway.md.

Imported on its own (``from renqueue.gateway import Gateway``): it loads
aiohttp, which the client API does not need.
"""

from ._errors import ApiError
from ._keys import KeyStore, digest, new_key
from ._server import Gateway, run_gateway

__all__ = [
    "ApiError",
    "Gateway",
    "KeyStore",
    "digest",
    "new_key",
    "run_gateway",
]
