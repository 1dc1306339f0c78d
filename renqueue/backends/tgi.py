"""The adapter for Hugging Face Text Generation Inference's own API (``adapter = "tgi"``).

``POST {base_url}/generate_stream`` (``/generate`` not streaming), as TGI
documents it (https://huggingface.github.io/text-generation-inference/).
TGI also serves the OpenAI chat format at ``/v1/chat/completions`` (its
Messages API, the ``openai`` adapter, which applies the model's own chat
template); this one is for a server or model without a chat template, and
for TGI's own ``parameters`` (``top_k``, ``repetition_penalty``,
``truncate``, ...).

The chat becomes one prompt, ``inputs``, in the config's ``prompt_format``:
``chatml`` (``<|im_start|>role\\n...<|im_end|>``), ``llama3``
(``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``; the
tokenizer adds the begin-of-text token) or ``plain`` (the messages' text, a
blank line apart), ending where the assistant's turn begins. ``parameters``
are the config's, the request's over them: ``max_tokens`` as
``max_new_tokens``, ``temperature`` (TGI refuses 0: greedy decoding,
``do_sample = false``, is sent instead), ``top_p`` (below 1 only, as TGI
requires), ``stop``, ``seed``, ``frequency_penalty``; a ``response_format``
as a ``grammar`` (``json_schema``: ``{"type": "json", "value": <the
schema>}``; ``json_object``: the same with the schema ``{"type":
"object"}``, any object); the request's ``extra`` parameters TGI documents
(``top_k``, ``repetition_penalty``, ``typical_p``, ...:
:data:`PARAMETER_EXTRAS`, under the config's; others, ``adapter_id`` and
``truncate`` among them, are left out); always ``details = true``
(the finish reason and token counts) and ``return_full_text = false``.
Tools, tool calls and tool messages, images and log probabilities have no
counterpart here: a request with any is refused (``BadRequestError``; the
router sends none, as the adapter's features say). A key, when configured
(Inference Endpoints), goes as ``Authorization: Bearer``.

The stream is server-sent events, one per token: ``{"index", "token":
{"text", "special", ...}, "generated_text": null, "details": null}``; the
last carries ``generated_text`` and ``details`` (``finish_reason``,
``generated_tokens``, and in recent versions ``prompt_tokens`` or
``input_length``). Special tokens (end-of-sequence) are not answer text. An
error is ``{"error": "...", "error_type": "..."}``, in-band or with a
status: ``overloaded`` (which TGI sends as a 429 when its
``max_concurrent_requests`` is reached: an overload, not a rate limit) is
overloaded, ``validation`` a bad request (a context-length one when it says
``inputs tokens + max_new_tokens must be <= ...``), ``generation`` and
``incomplete_generation`` server errors.

Finish reasons: ``eos_token`` and ``stop_sequence`` are ``stop``, ``length``
``length``. TGI has no tool calls on this endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct

from ..config import TGIConfig
from ..errors import FailureClass
from ..schema import ChatMessage, InferenceRequest
from ._http import (
    HTTPBackend,
    InBandError,
    SSEParser,
    common_finish,
    decoded,
    error_detail,
    given_params,
    named_class,
)
from ._sse import ServerSentEvent
from .base import Generation

__all__ = ["PARAMETER_EXTRAS", "TGIBackend", "render_prompt"]


class _Token(Struct):
    text: str = ""
    special: bool = False


class _Details(Struct):
    finish_reason: str | None = None
    generated_tokens: int | None = None
    prompt_tokens: int | None = None
    input_length: int | None = None


class _Event(Struct):
    token: _Token | None = None
    generated_text: str | None = None
    details: _Details | None = None
    error: str | None = None
    error_type: str | None = None


class _Answer(Struct):
    generated_text: str = ""
    details: _Details | None = None


class _ErrorBody(Struct):
    error_type: str | None = None


_EVENT_DECODER: Final = msgspec.json.Decoder(_Event)
_ANSWER_DECODER: Final = msgspec.json.Decoder(_Answer)
_ERROR_DECODER: Final = msgspec.json.Decoder(_ErrorBody)
_FINISH_REASONS: Final = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
#: The request's parameters TGI takes as they are, as it names them (``temperature``
#: and ``top_p`` have bounds of their own: see ``_payload``).
_PARAMETER_NAMES: Final = {
    "max_tokens": "max_new_tokens",
    "stop": "stop",
    "seed": "seed",
    "frequency_penalty": "frequency_penalty",
}
#: The ``extra`` parameters that go into ``parameters``: the ones TGI
#: documents for ``/generate`` that Ren-Queue has no field of its own for,
#: but ``adapter_id`` (another LoRA than the operator's) and ``truncate``.
PARAMETER_EXTRAS: Final = frozenset(
    {
        "top_k",
        "typical_p",
        "repetition_penalty",
        "watermark",
        "top_n_tokens",
        "decoder_input_details",
    }
)
#: ``json_object``'s grammar: any JSON object.
_ANY_OBJECT: Final = {"type": "object"}
#: The class of each ``error_type`` (``validation``: by its message).
_ERROR_CLASSES: Final[dict[str, FailureClass | None]] = {
    "validation": None,
    "overloaded": FailureClass.OVERLOADED,
    "generation": FailureClass.SERVER_ERROR,
    "incomplete_generation": FailureClass.SERVER_ERROR,
}


# -------------------------------------------------------------- prompt formats


def _chatml(messages: Sequence[ChatMessage]) -> str:
    turns = [f"<|im_start|>{m.role}\n{m.text}<|im_end|>\n" for m in messages]
    return "".join(turns) + "<|im_start|>assistant\n"


def _llama3(messages: Sequence[ChatMessage]) -> str:
    def header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    # Llama 3 calls a tool's answer "ipython".
    turns = [
        header("ipython" if m.role == "tool" else m.role) + m.text + "<|eot_id|>" for m in messages
    ]
    return "".join(turns) + header("assistant")


def _plain(messages: Sequence[ChatMessage]) -> str:
    return "\n\n".join(m.text for m in messages)


_FORMATS: Final[dict[str, Callable[[Sequence[ChatMessage]], str]]] = {
    "chatml": _chatml,
    "llama3": _llama3,
    "plain": _plain,
}


def render_prompt(messages: Sequence[ChatMessage], prompt_format: str) -> str:
    """The chat as one prompt in ``prompt_format`` (``chatml``, ``llama3``, ``plain``).

    ``ValueError`` for what a prompt cannot hold: images, an assistant's
    tool calls, a tool message answering one (by ``tool_call_id``; one
    without is text, llama3's ``ipython`` turn)."""
    for message in messages:
        if message.images:
            raise ValueError("a prompt cannot hold images")
        if message.tool_calls or message.tool_call_id is not None:
            raise ValueError("a prompt cannot hold tool calls or the results that answer them")
    return _FORMATS[prompt_format](messages)


def _count(parser: SSEParser, details: _Details) -> None:
    """Take the finish reason and counts of a final event's (or an answer's) ``details``."""
    if details.finish_reason is not None:
        parser.finish_reason = common_finish(details.finish_reason, _FINISH_REASONS)
    parser.completion_tokens = details.generated_tokens
    prompt = details.prompt_tokens if details.prompt_tokens is not None else details.input_length
    if prompt is not None:
        parser.prompt_tokens = prompt


class _TokenParser(SSEParser):
    """Folds ``/generate_stream`` events into text, finish reason and counts."""

    incomplete: ClassVar[str] = "stream ended before its final event"

    def event(self, event: ServerSentEvent) -> str:
        data = _EVENT_DECODER.decode(event.data)
        if data.error is not None or event.event == "error":
            body = event.data.encode()
            raise InBandError(error_detail(body), body=body)
        text = ""
        if data.token is not None and not data.token.special:
            text = data.token.text
        if data.details is not None or data.generated_text is not None:
            self.complete = True
            if data.details is not None:
                _count(self, data.details)
        return self.counted(text)


class TGIBackend(HTTPBackend):
    """A backend that speaks TGI's ``/generate_stream`` (module docstring)."""

    parser = _TokenParser
    paths = ("/generate_stream", "/generate")

    def __init__(
        self, name: str, config: TGIConfig, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self._tgi = config
        self._parameters: dict[str, Any] = msgspec.to_builtins(config.parameters)
        super().__init__(name, config, client=client)

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        params = request.params
        if params.tools or params.logprobs or params.top_logprobs:
            raise self._untranslatable(request, "TGI's /generate has no tools or log probabilities")
        try:
            inputs = render_prompt(request.messages, self._tgi.prompt_format)
        except ValueError as exc:
            raise self._untranslatable(request, str(exc)) from None
        extra = {name: value for name, value in params.extra.items() if name in PARAMETER_EXTRAS}
        # The operator's parameters over a tenant's extras; the request's own over both.
        parameters = {**extra, **self._parameters, **given_params(request, _PARAMETER_NAMES)}
        if params.temperature == 0:
            parameters.pop("temperature", None)
            parameters["do_sample"] = False
        elif params.temperature is not None:
            parameters["temperature"] = params.temperature
        if params.top_p is not None and params.top_p < 1:
            parameters["top_p"] = params.top_p
        response_format = params.response_format
        if response_format is not None and response_format.type == "json_object":
            parameters["grammar"] = {"type": "json", "value": _ANY_OBJECT}
        elif response_format is not None and response_format.type == "json_schema":
            schema = response_format.json_schema
            value = schema.schema if schema is not None and schema.schema else _ANY_OBJECT
            parameters["grammar"] = {"type": "json", "value": value}
        parameters["details"] = True
        parameters["return_full_text"] = False
        return {"inputs": inputs, "parameters": parameters}

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        answer = _ANSWER_DECODER.decode(body)
        parser = _TokenParser()
        if answer.details is not None:
            _count(parser, answer.details)
        return parser.whole(answer.generated_text, request)

    def _error_class(self, body: bytes) -> FailureClass | None:
        error = decoded(_ERROR_DECODER, body)
        return named_class(error.error_type if error else None, _ERROR_CLASSES, body)
