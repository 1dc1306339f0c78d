"""Ollama's native chat, ``POST /api/chat``: JSON lines.

Tools are OpenAI's shape (:class:`~.openai.ToolIn`), tool calls and results
and base64 images are checked, and a request that asks for a tool by ``call
<name>`` (Ollama has no ``tool_choice``) gets the call whole, in a line of
its own, after the text. Its durations are fixed numbers. Ollama sends no
rate-limit headers of its own: the mock's ``limit_style`` is used.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta, Struct

from .base import (
    Call,
    Dialect,
    ErrorKind,
    Frames,
    Reply,
    Target,
    answer_text,
    prompt_tokens_of,
    to_json,
    tool_to_call,
)
from .openai import ToolIn

__all__ = ["OllamaDialect"]


class _OllamaOptions(Struct):
    num_predict: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None


class _OllamaFunctionIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    #: An object, not JSON text (unlike OpenAI's).
    arguments: dict[str, Any]


class _OllamaToolCallIn(Struct, forbid_unknown_fields=True):
    function: _OllamaFunctionIn


class _OllamaMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    #: Base64 image bytes (no URLs, no data: prefix).
    images: list[str] | None = None
    tool_calls: list[_OllamaToolCallIn] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _OllamaBody(Struct):
    model: str
    messages: Annotated[list[_OllamaMessage], Meta(min_length=1)]
    stream: bool = True  # Ollama streams unless told not to
    options: _OllamaOptions | None = None
    tools: list[ToolIn] | None = None
    #: ``"json"`` or a JSON schema.
    format: Literal["json"] | dict[str, Any] | None = None


_OLLAMA_DECODER: Final = msgspec.json.Decoder(_OllamaBody)


def _ollama_checked(body: _OllamaBody) -> None:
    """Images must be bare base64 (Ollama reads no URLs)."""
    for message in body.messages:
        for image in message.images or ():
            try:
                base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise msgspec.ValidationError("an image is not base64 (no URLs here)") from None


#: The durations (ns) every answer reports.
_OLLAMA_TIMINGS: Final = {
    "total_duration": 4883583458,
    "load_duration": 1334875,
    "prompt_eval_duration": 342546000,
    "eval_duration": 4535599000,
}


class OllamaDialect(Dialect):
    """``/api/chat``: one JSON object per line, the last ``done: true`` with counts.

    As in Ollama's docs/api.md ("Chat Request (Streaming)").
    """

    name = "ollama"
    content_type = "application/x-ndjson"
    terminator = b"\n"
    finish_names: ClassVar[Mapping[str, str]] = {"content_filter": "stop", "tool_calls": "stop"}

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _OLLAMA_DECODER.decode(raw)
        _ollama_checked(body)
        predict = body.options.num_predict if body.options is not None else None
        users = [m for m in body.messages if m.role == "user"]
        return Call(
            model=body.model,
            prompt_tokens=prompt_tokens_of(sum(len(m.content) for m in body.messages)),
            stream=body.stream,
            cap=predict if predict is not None and predict > 0 else None,
            # Ollama has no tool_choice: only a request for a tool calls one.
            tool=tool_to_call(
                [tool.function.name for tool in body.tools or ()],
                None,
                users[-1].content if users else "",
            ),
        )

    def piece(self, text: str, index: int) -> bytes:
        return b'"message":{"role":"assistant","content":"' + text.encode() + b'"},"done":false}\n'

    def _head(self, reply: Reply) -> bytes:
        created = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())
        return b'{"model":' + to_json(reply.model) + b',"created_at":"' + created.encode() + b'",'

    def _final(self, reply: Reply, text: str) -> dict[str, Any]:
        return {
            "message": {"role": "assistant", "content": text},
            "done_reason": self.finish(reply.finish_reason),
            "done": True,
            **_OLLAMA_TIMINGS,
            "prompt_eval_count": reply.prompt_tokens,
            "eval_count": reply.completion_tokens,
        }

    def _tool_calls(self, reply: Reply) -> list[dict[str, Any]]:
        arguments = {"text": answer_text(reply.completion_tokens)}
        return [{"function": {"name": reply.tool, "arguments": arguments}}]

    def frames(self, reply: Reply) -> Frames:
        head = self._head(reply)
        final = to_json(self._final(reply, ""))
        closing = head + final[1:] + b"\n"
        if reply.tool is not None:  # the call comes whole, in a line of its own, after the text
            message = {"role": "assistant", "content": "", "tool_calls": self._tool_calls(reply)}
            closing = head + to_json({"message": message, "done": False})[1:] + b"\n" + closing
        return Frames(head=head, tail=b"", opening=b"", closing=closing, done=b"")

    def answer(self, reply: Reply) -> bytes:
        final = self._final(reply, answer_text(reply.completion_tokens))
        if reply.tool is not None:
            final["message"]["tool_calls"] = self._tool_calls(reply)
        return self._head(reply) + to_json(final)[1:]

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        if kind == "busy" and status == 503:
            message = "server busy, please try again.  maximum pending requests exceeded"
        return to_json({"error": message})

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            return 500, to_json({"error": "llama runner process has terminated: exit status 2"})
        if kind == "context_length":
            return 400, to_json({"error": "the input length exceeds the context length"})
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        return (
            to_json({"error": "an error was encountered while running the model: unexpected EOF"})
            + b"\n"
        )

    def not_found(self, model: str) -> tuple[int, bytes]:
        return 404, to_json({"error": f'model "{model}" not found, try pulling it first'})
