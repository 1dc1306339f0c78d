"""Backend adapters: one protocol, one implementation per wire format."""

from __future__ import annotations

import httpx

from ..config import BackendConfig
from ..errors import ConfigError
from ._limits import LearnedLimits, LimitKind, LimitWindow, parse_limits
from .base import Backend, Delta, Generation
from .openai import OpenAIBackend

__all__ = [
    "Backend",
    "Delta",
    "Generation",
    "LearnedLimits",
    "LimitKind",
    "LimitWindow",
    "OpenAIBackend",
    "make_backend",
    "parse_limits",
]


def make_backend(
    name: str,
    config: BackendConfig,
    *,
    client: httpx.AsyncClient | None = None,
    send_priority: bool = False,
) -> Backend:
    """Build the adapter ``config.adapter`` names.

    ``client`` shares one connection pool between adapters (never closed by
    them); ``send_priority`` passes the request's priority rank to backends
    that schedule by it (vLLM).
    """
    if config.adapter == "openai":
        return OpenAIBackend(name, config, client=client, send_priority=send_priority)
    # Unreachable for a validated config; a hand-built one may still carry anything.
    raise ConfigError(f"unknown adapter {config.adapter!r}", path=f"$.backends.{name}.adapter")
