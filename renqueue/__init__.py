"""Ren-Queue: a priority queue and router for LLM inference on NATS JetStream."""

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
    ProvisionError,
    RateLimitedError,
    RenQueueError,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    RetryableBackendError,
    ServiceFailedError,
    TokensExpiredError,
    UnknownPriorityError,
    UnknownRouteError,
)
from .messages import ChatMessage, Event, GenerationParams, InferenceRequest, TokenChunk, Usage
from .service import Services

__version__ = "0.1.0"

__all__ = [
    "BackendConfig",
    "BackendError",
    "BadRequestError",
    "ChatMessage",
    "Client",
    "Config",
    "ConfigError",
    "ConnectionFailedError",
    "EmbeddedServerError",
    "Event",
    "FatalBackendError",
    "GenerationParams",
    "InferenceRequest",
    "InvalidRequestError",
    "MalformedRequestError",
    "ProvisionError",
    "RateLimitedError",
    "RenQueueError",
    "RequestCancelledError",
    "RequestExpiredError",
    "RequestFailedError",
    "RequestHandle",
    "RequestRejectedError",
    "Result",
    "RetryableBackendError",
    "RouteConfig",
    "ServiceFailedError",
    "Services",
    "TokenChunk",
    "TokensExpiredError",
    "UnknownPriorityError",
    "UnknownRouteError",
    "Usage",
    "load_config",
    "parse_config",
]
