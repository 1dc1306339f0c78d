"""The adapter for Ollama's native chat API (``adapter = "ollama"``).

``POST {base_url}/api/chat`` (https://github.com/ollama/ollama/blob/main/docs/api.md).
Why native beside Ollama's OpenAI-compatible ``/v1``: ``keep_alive`` (how
long the model stays loaded) and the model ``options`` (``num_ctx``, the
context it is loaded with, ...) exist only here, and the native stream
reports its token counts without asking.

The body is the chat as it is (system, user, assistant and tool messages),
``stream``, ``keep_alive`` and ``options``: the config's options, with the
request's parameters over them (``max_tokens`` as ``num_predict``,
``temperature``, ``top_p``, ``stop``, ``seed``). A key, when configured
(Ollama behind a proxy, or ollama.com), goes as ``Authorization: Bearer``.

The stream is one JSON object per line (``application/x-ndjson``): each has
``message.content`` (answer text; ``message.thinking`` is not) and
``done: false``; the last ``done: true`` with ``done_reason``,
``prompt_eval_count`` and ``eval_count``. A model's tool calls come whole in
``message.tool_calls`` (``function.name``, ``function.arguments`` as an
object). An error mid-stream is a line ``{"error": "..."}``, a server
error; before the stream, an HTTP status with the same body, classified by
its status (a 400 saying the input "exceeds the context length" is a
context-length failure). A non-streaming answer is one such object.

``done_reason``: ``stop`` (``tool_calls`` when the model called tools),
``length``; others (``load``, ``unload``) pass through.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct

from ..config import OllamaConfig
from ..wire._messages import InferenceRequest
from ._http import (
    HTTPBackend,
    InBandError,
    LineParser,
    error_detail,
    given_params,
    tool_arguments,
)
from .base import Generation, ToolCall

__all__ = ["OllamaBackend"]


class _Function(Struct):
    name: str = ""
    arguments: Any = None


class _ToolCall(Struct):
    function: _Function | None = None
    id: str | None = None


class _Message(Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Line(Struct):
    message: _Message | None = None
    done: bool = False
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None
    error: str | None = None


_LINE_DECODER: Final = msgspec.json.Decoder(_Line)
_DONE_REASONS: Final = {"stop": "stop", "length": "length"}
#: The request's parameters, as Ollama's option names.
_OPTION_NAMES: Final = {
    "max_tokens": "num_predict",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
}


class _LineParser(LineParser):
    """Folds ``/api/chat`` lines into text, done reason, counts and tool calls."""

    incomplete: ClassVar[str] = "stream ended before its done line"

    def line(self, line: bytes) -> str:
        data = _LINE_DECODER.decode(line)
        if data.error is not None:
            raise InBandError(error_detail(line))
        text = ""
        message = data.message
        if message is not None:
            text = message.content or ""
            for call in message.tool_calls or ():
                function = call.function or _Function()
                self.tool_calls.append(
                    ToolCall(
                        id=call.id or "",
                        name=function.name,
                        arguments=tool_arguments(function.arguments),
                    )
                )
        if data.done:
            self.complete = True
            self.finish_or_tools(data.done_reason or "stop", _DONE_REASONS)
            self.prompt_tokens = data.prompt_eval_count
            self.completion_tokens = data.eval_count
        return self.counted(text)


class OllamaBackend(HTTPBackend):
    """A backend that speaks Ollama's native ``/api/chat`` (module docstring)."""

    parser = _LineParser
    paths = ("/api/chat", "/api/chat")

    def __init__(
        self, name: str, config: OllamaConfig, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self._ollama = config
        self._options: dict[str, Any] = msgspec.to_builtins(config.options)
        super().__init__(name, config, client=client)

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        options = {**self._options, **given_params(request, _OPTION_NAMES)}
        body: dict[str, Any] = {
            "model": self._ollama.model,
            "messages": request.messages,
            "stream": stream,
        }
        if options:
            body["options"] = options
        if self._ollama.keep_alive is not None:
            body["keep_alive"] = self._ollama.keep_alive
        return body

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        parser = _LineParser()
        text = parser.line(body)
        return parser.whole(text, request)
