"""Ren-Queue: a priority queue and router for LLM inference on NATS JetStream.

``import renqueue`` gives the client API (:class:`Client`, config loading, the
errors, the wire types) and imports nothing of the services: :class:`Services`
(``renqueue.services``, which loads the router, the worker and
prometheus_client) is imported when it is first named.
"""

import importlib
import typing

from .broker import export_spans
from .client import Client, RequestHandle, Result
from .config import BackendConfig, Config, RouteConfig, load_config, parse_config
from .errors import (
    BackendError,
    BadRequestError,
    ConfigError,
    ConnectionFailedError,
    EmbeddedServerError,
    FatalBackendError,
    InvalidRequestError,
    MalformedRequestError,
    NoCapableBackendError,
    OutOfRangeError,
    ProvisionError,
    RateLimitedError,
    RenQueueError,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    RetryableBackendError,
    ServiceFailedError,
    StoreFullError,
    TokensExpiredError,
    TokensNotStreamedError,
    UnknownPriorityError,
    UnknownRouteError,
    UnprocessableRequestError,
    UnsupportedFeatureError,
)
from .schema import (
    ChatMessage,
    ContentPart,
    Event,
    GenerationParams,
    ImagePart,
    ImageURL,
    InferenceRequest,
    JsonSchema,
    NamedTool,
    ResponseFormat,
    TextPart,
    TokenChunk,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

if typing.TYPE_CHECKING:
    from .services import Services

__version__ = "0.1.0"

#: Public names loaded on first use (PEP 562), each from the module that holds it.
_LAZY = {"Services": "renqueue.services"}

__all__ = [
    "BackendConfig",
    "BackendError",
    "BadRequestError",
    "ChatMessage",
    "Client",
    "Config",
    "ConfigError",
    "ConnectionFailedError",
    "ContentPart",
    "EmbeddedServerError",
    "Event",
    "FatalBackendError",
    "GenerationParams",
    "ImagePart",
    "ImageURL",
    "InferenceRequest",
    "InvalidRequestError",
    "JsonSchema",
    "MalformedRequestError",
    "NamedTool",
    "NoCapableBackendError",
    "OutOfRangeError",
    "ProvisionError",
    "RateLimitedError",
    "RenQueueError",
    "RequestCancelledError",
    "RequestExpiredError",
    "RequestFailedError",
    "RequestHandle",
    "RequestRejectedError",
    "ResponseFormat",
    "Result",
    "RetryableBackendError",
    "RouteConfig",
    "ServiceFailedError",
    "Services",
    "StoreFullError",
    "TextPart",
    "TokenChunk",
    "TokenLogprob",
    "TokensExpiredError",
    "TokensNotStreamedError",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "UnknownPriorityError",
    "UnknownRouteError",
    "UnprocessableRequestError",
    "UnsupportedFeatureError",
    "Usage",
    "export_spans",
    "load_config",
    "parse_config",
]


def __getattr__(name: str) -> typing.Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
