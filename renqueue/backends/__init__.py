"""Backend adapters: one protocol, one implementation per wire format.

=============  ===========================  =========================================
``adapter``    class                        what it speaks
=============  ===========================  =========================================
``openai``     :class:`OpenAIBackend`       ``/chat/completions`` (most servers)
``anthropic``  :class:`AnthropicBackend`    Anthropic Messages, ``/messages``
``ollama``     :class:`OllamaBackend`       Ollama's native ``/api/chat`` (JSON lines)
``tgi``        :class:`TGIBackend`          TGI's ``/generate_stream``
``gemini``     :class:`GeminiBackend`       Gemini ``:streamGenerateContent``
=============  ===========================  =========================================

The config's class (a tagged union on ``adapter``,
:data:`renqueue.config.AnyBackendConfig`) picks the adapter: one table,
no if-chain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import httpx
import msgspec

from ..config import (
    AnthropicConfig,
    BackendConfig,
    BaseBackendConfig,
    GeminiConfig,
    OllamaConfig,
    TGIConfig,
)
from ..errors import ConfigError
from ._http import MAX_TOOL_CALLS, HTTPBackend
from ._limits import LearnedLimits, LimitKind, LimitWindow, parse_limits, reported
from .anthropic import AnthropicBackend
from .base import Backend, Delta, Generation, ToolCall
from .gemini import GeminiBackend
from .ollama import OllamaBackend
from .openai import OpenAIBackend
from .tgi import TGIBackend

__all__ = [
    "MAX_TOOL_CALLS",
    "AnthropicBackend",
    "Backend",
    "Delta",
    "GeminiBackend",
    "Generation",
    "HTTPBackend",
    "LearnedLimits",
    "LimitKind",
    "LimitWindow",
    "OllamaBackend",
    "OpenAIBackend",
    "TGIBackend",
    "ToolCall",
    "parse_limits",
    "reported",
]

#: The adapter of each config class.
ADAPTERS: Final[dict[type[BaseBackendConfig], Callable[..., HTTPBackend]]] = {
    BackendConfig: OpenAIBackend,
    AnthropicConfig: AnthropicBackend,
    OllamaConfig: OllamaBackend,
    TGIConfig: TGIBackend,
    GeminiConfig: GeminiBackend,
}


def make_backend(
    name: str,
    config: BaseBackendConfig,
    *,
    client: httpx.AsyncClient | None = None,
    send_priority: bool | None = None,
) -> Backend:
    """Build the adapter ``config.adapter`` names.

    ``client`` shares one connection pool between adapters (never closed by
    them); ``send_priority`` overrides an OpenAI-compatible backend's own
    ``send_priority`` (the request's priority rank, for vLLM).
    """
    adapter = ADAPTERS.get(type(config))
    if adapter is None:
        # Unreachable for a validated config; a hand-built one may still carry anything.
        raise ConfigError(
            f"unknown adapter {type(config).__name__}", path=f"$.backends.{name}.adapter"
        )
    if send_priority is not None and isinstance(config, BackendConfig):
        config = msgspec.structs.replace(config, send_priority=send_priority)
    return adapter(name, config, client=client)
