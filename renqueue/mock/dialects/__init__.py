"""The wire formats the mock backend speaks: one :class:`Dialect` per provider API.

One mock serves them all, each at the path its provider uses (the URL an
adapter's ``base_url`` is: :meth:`MockBackend.url_for
<renqueue.mock.MockBackend.url_for>`), each in a module of its own, named
as the adapter it stands in front of (``renqueue/backends/<name>.py``):

==============  ================================================  ==================
dialect         endpoint                                          module
==============  ================================================  ==================
``openai``      ``POST /v1/chat/completions``                     :mod:`.openai`
``anthropic``   ``POST /v1/messages``                             :mod:`.anthropic`
``ollama``      ``POST /api/chat``                                :mod:`.ollama`
``tgi``         ``POST /generate_stream``, ``POST /generate``     :mod:`.tgi`
``gemini``      ``POST /v1beta/models/<m>:streamGenerateContent``  :mod:`.gemini`
                (``?alt=sse`` only), ``:generateContent``
==============  ================================================  ==================

What they share (the :class:`Call` a body is read into, the :class:`Reply`
an answer says, the stream's :class:`Frames`, the generated text and the
tool an answer calls) is :mod:`.base`. Each is written from its provider's
documentation and recorded streams (the adapters' tests hold the
recordings, so a round trip checks one against the other).

Rate-limit headers and 429 bodies are :mod:`renqueue.mock._rate_limits`':
Anthropic's and Gemini's dialects use their provider's; OpenAI's, Ollama's
and TGI's the mock's ``limit_style`` (Ollama and TGI send none of their
own). docs/backends.md has the whole map, provider by provider.
"""

from __future__ import annotations

from typing import Final

from .anthropic import AnthropicDialect
from .base import (
    Call,
    Dialect,
    ErrorKind,
    Frames,
    Reply,
    Target,
    answer_text,
    token_text,
    tool_arguments,
    tool_to_call,
)
from .gemini import GeminiDialect
from .ollama import OllamaDialect
from .openai import OpenAIDialect
from .tgi import TGIDialect

__all__ = [
    "DIALECTS",
    "AnthropicDialect",
    "Call",
    "Dialect",
    "ErrorKind",
    "Frames",
    "GeminiDialect",
    "OllamaDialect",
    "OpenAIDialect",
    "Reply",
    "TGIDialect",
    "Target",
    "answer_text",
    "token_text",
    "tool_arguments",
    "tool_to_call",
]

#: Every dialect, by name: one instance each (they cache their token pieces).
DIALECTS: Final[dict[str, Dialect]] = {
    dialect.name: dialect
    for dialect in (
        OpenAIDialect(),
        AnthropicDialect(),
        OllamaDialect(),
        TGIDialect(),
        GeminiDialect(),
    )
}
