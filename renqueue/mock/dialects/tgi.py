"""Text Generation Inference, ``POST /generate_stream`` (and ``POST /generate``).

TGI serves one model, whatever a request names. Its last event always
carries an end-of-sequence token (``special: true``), which
``generated_tokens`` does not count. TGI sends no rate-limit headers of its
own: the mock's ``limit_style`` is used.
"""

from __future__ import annotations

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
)

__all__ = ["TGIDialect"]


class _TGIGrammar(Struct, forbid_unknown_fields=True):
    type: Literal["json", "regex"]
    #: A JSON schema (``json``) or a regular expression (``regex``).
    value: dict[str, Any] | str


class _TGIParameters(Struct):
    max_new_tokens: Annotated[int, Meta(ge=1)] | None = None
    frequency_penalty: float | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    top_k: Annotated[int, Meta(gt=0)] | None = None
    typical_p: Annotated[float, Meta(gt=0, lt=1)] | None = None
    grammar: _TGIGrammar | None = None


class _TGIBody(Struct):
    inputs: str
    parameters: _TGIParameters | None = None
    stream: bool = False


_TGI_DECODER: Final = msgspec.json.Decoder(_TGIBody)


class TGIDialect(Dialect):
    """``/generate_stream``: ``data:{"index","token","generated_text","details"}`` events.

    As TGI's router writes them (``data:`` with no space; recorded in TGI's
    docs and users' transcripts), the last with ``details``.
    """

    name = "tgi"
    names_model = False
    finish_names: ClassVar[Mapping[str, str]] = {
        "stop": "eos_token",
        "length": "length",
        "content_filter": "eos_token",
    }
    error_names: ClassVar[Mapping[str, str]] = {
        "bad_request": "validation",
        "auth": "authentication",
        "not_found": "not_found",
        "server_error": "generation",
        "busy": "overloaded",
    }

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _TGI_DECODER.decode(raw)
        return Call(
            model="tgi",
            prompt_tokens=prompt_tokens_of(len(body.inputs)),
            stream=bool(target.stream),
            cap=body.parameters.max_new_tokens if body.parameters is not None else None,
        )

    def piece(self, text: str, index: int) -> bytes:
        return (
            b'{"index":%d,"token":{"id":%d,"text":"%s","logprob":-0.25,"special":false},'
            b'"generated_text":null,"details":null}\n\n' % (index + 1, index + 100, text.encode())
        )

    def _details(self, reply: Reply) -> dict[str, Any]:
        return {
            "finish_reason": self.finish(reply.finish_reason),
            "generated_tokens": reply.completion_tokens,
            "prompt_tokens": reply.prompt_tokens,
            "seed": None,
        }

    def frames(self, reply: Reply) -> Frames:
        final = {
            "index": reply.completion_tokens + 1,
            "token": {"id": 2, "text": "</s>", "logprob": -0.01, "special": True},
            "generated_text": answer_text(reply.completion_tokens),
            "details": self._details(reply),
        }
        return Frames(
            head=b"data:",
            tail=b"",
            opening=b"",
            closing=b"data:" + to_json(final) + b"\n\n",
            done=b"",
        )

    def answer(self, reply: Reply) -> bytes:
        return to_json(
            {
                "generated_text": answer_text(reply.completion_tokens),
                "details": {**self._details(reply), "prefill": [], "tokens": []},
            }
        )

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        if kind == "busy":
            message = "Model is overloaded"
        return to_json({"error": message, "error_type": self.error_names.get(kind, "generation")})

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            return 500, to_json(
                {"error": "Incomplete generation", "error_type": "incomplete_generation"}
            )
        if kind == "context_length":
            limit = window or 4096
            message = (
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {limit}. "
                f"Given: {max(prompt_tokens, limit)} `inputs` tokens and 20 `max_new_tokens`"
            )
            return 422, to_json({"error": message, "error_type": "validation"})
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        error = {
            "error": "Request failed during generation: Server error: CUDA out of memory",
            "error_type": "generation",
        }
        return b"data:" + to_json(error) + b"\n\n"

    def not_found(self, model: str) -> tuple[int, bytes]:  # pragma: no cover - names no model
        return 404, self.error(404, "not_found", f"model {model} not found")
