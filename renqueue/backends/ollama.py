"""The adapter for Ollama's native chat API (``adapter = "ollama"``).

``POST {base_url}/api/chat`` (https://github.com/ollama/ollama/blob/main/docs/api.md).
Why native beside Ollama's OpenAI-compatible ``/v1``: ``keep_alive`` (how
long the model stays loaded) and the model ``options`` (``num_ctx``, the
context it is loaded with, ...) exist only here, and the native stream
reports its token counts without asking.

The body is the chat (system, user, assistant and tool messages, each
message's text as ``content``), ``stream``, ``keep_alive``, ``options``,
``tools`` and ``format``:

- images go in a message's ``images`` list as base64: only ``data:`` URLs
  can be sent (the adapter does not fetch ``https`` URLs: such a request is
  refused, ``BadRequestError``);
- an assistant's tool calls as ``tool_calls: [{"function": {"name",
  "arguments"}}]``, the arguments an object (their JSON text parsed: text
  that does not parse is refused); a tool message as role ``tool`` with
  ``tool_name``, the name of the call it answers (found by its
  ``tool_call_id`` among the assistant's calls), when known;
- ``tools`` as ``[{"type": "function", "function": {...}}]``. Ollama has no
  ``tool_choice``: ``none`` sends no tools, a named tool sends that tool
  alone; ``required`` sends them all (the model is asked, not forced, to
  call one);
- ``response_format`` ``json_object`` as ``"format": "json"``,
  ``json_schema`` as ``"format": <the schema>``;
- ``options``: the config's, the request's parameters over them
  (``max_tokens`` as ``num_predict``, ``temperature``, ``top_p``, ``stop``,
  ``seed``, ``presence_penalty``, ``frequency_penalty``) and the request's
  ``extra`` parameters Ollama documents as sampling options (``top_k``,
  ``min_p``, ``repeat_penalty``, ...: :data:`OPTION_EXTRAS`), under the
  config's; other extra parameters (the load-time ``num_ctx``, ``num_gpu``,
  ... among them) are left out.

A key, when configured (Ollama behind a proxy, or ollama.com), goes as
``Authorization: Bearer``.

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
``length``; others (``load``, ``unload``) pass through. Ollama has no log
probabilities here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct

from ..config import OllamaConfig
from ..schema import ChatMessage, InferenceRequest, NamedTool
from ._http import (
    HTTPBackend,
    InBandError,
    LineParser,
    error_detail,
    given_params,
    image_source,
    tool_arguments,
)
from .base import Generation

__all__ = ["OPTION_EXTRAS", "OllamaBackend"]


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
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
#: The ``extra`` parameters that go into ``options``: the sampling options
#: Ollama documents (docs/modelfile.md, docs/api.md). Others are left out,
#: the load-time ones above all (``num_ctx``, ``num_gpu``, ``num_thread``,
#: ...): a tenant's value would reload the model, for every tenant, with a
#: context or placement the operator did not choose.
OPTION_EXTRAS: Final = frozenset(
    {
        "top_k",
        "min_p",
        "typical_p",
        "repeat_last_n",
        "repeat_penalty",
        "penalize_newline",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
    }
)
_JSON_DECODER: Final = msgspec.json.Decoder()


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
                self.add_tool_call(call.id or "", function.name, tool_arguments(function.arguments))
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
        params = request.params
        extra = {name: value for name, value in params.extra.items() if name in OPTION_EXTRAS}
        # The operator's options over a tenant's extras; the request's own
        # parameters (max_tokens, temperature, ...) over both.
        options = {**extra, **self._options, **given_params(request, _OPTION_NAMES)}
        body: dict[str, Any] = {
            "model": self._ollama.model,
            "messages": self._messages(request),
            "stream": stream,
        }
        if params.tools and params.tool_choice != "none":
            choice = params.tool_choice
            offered = [
                tool
                for tool in params.tools
                if not isinstance(choice, NamedTool) or tool.name == choice.name
            ]
            body["tools"] = [
                {"type": "function", "function": msgspec.to_builtins(tool)} for tool in offered
            ]
        response_format = params.response_format
        if response_format is not None and response_format.type == "json_object":
            body["format"] = "json"
        elif response_format is not None and response_format.type == "json_schema":
            schema = response_format.json_schema
            body["format"] = schema.schema if schema is not None else {}
        if options:
            body["options"] = options
        if self._ollama.keep_alive is not None:
            body["keep_alive"] = self._ollama.keep_alive
        return body

    def _messages(self, request: InferenceRequest) -> list[dict[str, Any]]:
        """The chat in Ollama's shape (module docstring)."""
        names = {call.id: call.name for m in request.messages for call in m.tool_calls if call.id}
        return [self._message(request, message, names) for message in request.messages]

    def _message(
        self, request: InferenceRequest, message: ChatMessage, names: dict[str, str]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": message.text}
        images = []
        for image in message.images:
            try:
                source = image_source(image.url)
            except ValueError as exc:
                raise self._untranslatable(request, f"Ollama image: {exc}") from None
            if source.data is None:
                raise self._untranslatable(
                    request,
                    "Ollama image: not a data: URL (this backend takes image bytes, not URLs)",
                )
            images.append(source.data)
        if images:
            out["images"] = images
        calls = []
        for call in message.tool_calls:
            try:
                arguments = _JSON_DECODER.decode(call.arguments)
            except msgspec.DecodeError:
                raise self._untranslatable(
                    request, f"tool call {call.name!r}: its arguments are not JSON"
                ) from None
            calls.append({"function": {"name": call.name, "arguments": arguments}})
        if calls:
            out["tool_calls"] = calls
        if message.role == "tool" and message.tool_call_id in names:
            out["tool_name"] = names[message.tool_call_id]
        return out

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        parser = _LineParser()
        text = parser.line(body)
        return parser.whole(text, request)
