"""Backend adapters: one protocol, one implementation per wire format.

Each provider is one unit, its parts named alike: the adapter here
(``renqueue/backends/<adapter>.py``), the mock that stands in for it in
tests, the demo and benchmarks (``renqueue/mock/dialects/<adapter>.py``),
and its rate-limit dialect, read from its responses here and written by the
mock (docs/backends.md has the same map):

=============  =========================  =========================  ==========================
``adapter``    class (``backends/``)      mock (``mock/dialects/``)  what it speaks
=============  =========================  =========================  ==========================
``openai``     :class:`OpenAIBackend`     ``OpenAIDialect``          ``/chat/completions``
               (``openai.py``)            (``openai.py``)            (most servers)
``anthropic``  :class:`AnthropicBackend`  ``AnthropicDialect``       Anthropic Messages,
               (``anthropic.py``)         (``anthropic.py``)         ``/messages``
``ollama``     :class:`OllamaBackend`     ``OllamaDialect``          Ollama's ``/api/chat``
               (``ollama.py``)            (``ollama.py``)            (JSON lines)
``tgi``        :class:`TGIBackend`        ``TGIDialect``             TGI's ``/generate_stream``
               (``tgi.py``)               (``tgi.py``)
``gemini``     :class:`GeminiBackend`     ``GeminiDialect``          Gemini
               (``gemini.py``)            (``gemini.py``)            ``:streamGenerateContent``
=============  =========================  =========================  ==========================

=============  =========================================  ===============================
``adapter``    read from its responses                    sent by its mock
               (``backends/_limits.py``)                  (``mock/_rate_limits.py``)
=============  =========================================  ===============================
``openai``     by its config's ``limit_style``            by the mock's ``limit_style``:
               (``auto``: every reader):                  ``_openai_headers`` (and Groq),
               ``_read_openai`` (and Groq),               ``_cerebras_headers``,
               ``_read_cerebras``, ``_read_openrouter``,  ``_openrouter_headers``,
               ``_read_ietf``                             ``_ietf_headers``
``anthropic``  ``_read_anthropic``                        ``_anthropic_headers``
``ollama``     ``auto`` (none of its own)                 the mock's ``limit_style``
``tgi``        ``auto`` (none of its own)                 the mock's ``limit_style``
``gemini``     ``_read_gemini`` (429 bodies)              ``_gemini_body`` (429 bodies)
=============  =========================================  ===============================

Whatever the style, every response's ``retry-after`` (``_read_retry``) and an
``insufficient_quota`` error (``_read_quota_error``) are read; :func:`parse_limits`
calls the readers. The mock's 429 bodies are ``rate_limited`` and
``quota_exhausted`` in the same style, and its dialect picks the style:
Anthropic's and Gemini's their provider's, the others the mock's
``limit_style`` (Ollama and TGI send no rate-limit headers of their own).

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
