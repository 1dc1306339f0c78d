"""The faults the mock backend injects: their names, how they are scheduled, and their wire bodies.

A fault replaces the answer to one chat request. Which request gets which
fault is set by :class:`FaultSpec` (``MockSettings.faults``): a **script**,
applied to chat requests in arrival order (``"ok"`` is a normal answer; then
normal answers, or the script again with ``repeat``), and a **random mix**,
kind -> probability, drawn with the mock's ``seed`` once the script is done.
Only chat requests whose body parses take a step of the script (a 400 for a
bad body does not). A fault comes before every other check (API key, model,
limits) and is never charged against the rate limits.

The kinds and what each puts on the wire in the OpenAI format (the other
providers' forms of each are in :mod:`.dialects`, one module each;
``after_tokens``, ``drip_gap`` and ``retry_after`` are fields of
:class:`FaultSpec`):

- ``ok``: a normal answer.
- ``500``: 500, OpenAI's ``{"error": {"message": "The server had an error while
  processing your request. Sorry about that!", "type": "server_error", "param":
  null, "code": null}}``.
- ``503``: 503, ``{"error": {"message": "The server is overloaded or not ready
  yet.", "type": "server_error", "param": null, "code": null}}``.
- ``529``: 529, Anthropic's ``{"type": "error", "error": {"type":
  "overloaded_error", "message": "Overloaded"}}``.
- ``reset``: the connection is reset (TCP RST), no response.
- ``hang``: nothing is sent (not even a status line) until the client gives up,
  or the mock shuts down (then the connection is dropped unanswered).
- ``drip``: the headers at once, then one token every ``drip_gap`` seconds (a
  non-streaming answer's body goes out in as many pieces as it has tokens, one
  every ``drip_gap`` seconds).
- ``429``: a 429 in the ``limit_style`` dialect (``_rate_limits``), as if the
  per-minute request bucket were empty for ``retry_after`` seconds, with a
  ``retry-after`` header (added when the dialect sends none).
- ``429_bare``: the same 429 without ``retry-after`` or ``retry-after-ms``.
- ``quota``: the dialect's quota-exhausted 429 (as ``quota_exhausted = true``).
- ``malformed``: non-stream, a 200 ``application/json`` body cut in half (not
  JSON); stream, the ``data:`` line of token ``after_tokens`` is cut (not JSON)
  and the rest of the stream is normal.
- ``break``: stream, ``after_tokens`` tokens and then the connection is closed:
  no finish chunk, no ``[DONE]``, no end of the chunked body; non-stream, the
  headers and half the body, then closed.
- ``no_done``: stream, a normal stream (finish chunk, usage) without
  ``data: [DONE]``; a non-streaming request is answered normally.
- ``no_finish``: stream, ``after_tokens`` tokens, then ``data: [DONE]`` and a
  clean end: no chunk carries a ``finish_reason``, and no usage chunk comes,
  as llama-cpp-python's server ends a running stream when a second call takes
  its one slot (docs/backends.md, "Tried with a real server"). In the other
  dialects: their end marker without the finish before it (Anthropic's
  ``message_stop`` with no ``message_delta``), or, where the end marker is the
  finish (Ollama's ``done``, TGI's final event, Gemini's ``finishReason``), a
  clean end without it. A non-streaming request is answered normally.
- ``sse_error``: stream, ``after_tokens`` tokens, then ``data: {"error": {...}}``
  (OpenAI's server_error; in the ``openrouter`` dialects OpenRouter's chunk
  with ``"error": {"code": "server_error", ...}`` and ``finish_reason:
  "error"``), then the stream ends cleanly without ``[DONE]``; a non-streaming
  request is answered normally.
- ``context_length``: 400, OpenAI's ``context_length_exceeded`` (``param:
  "messages"``, "This model's maximum context length is 8192 tokens. However,
  your messages resulted in 9000 tokens. ...").
- ``content_filter``: 400, Azure OpenAI's prompt filter, ``{"error": {"code":
  "content_filter", "message": ..., "param": "prompt", "status": 400,
  "innererror": {"code": "ResponsibleAIPolicyViolation",
  "content_filter_result": {...}}}}``.
- ``filtered``: Azure's output filter, a 200 whose answer stops after
  ``after_tokens`` tokens with ``finish_reason: "content_filter"`` (streamed:
  the finish chunk, usage and ``[DONE]`` follow as usual).

Errors carry the rate-limit headers of the ``limit_style`` dialect, as a real
response would. ``GET /stats`` counts the faults injected, by kind
(``faults``).

Two settings of ``MockSettings`` fault a backend without a script:
``down = true`` resets every connection to a chat path, ``/v1/models`` and ``/health`` (counted
as ``down``; ``/stats`` and ``/admin/settings`` still answer, so it can be
brought back up), and ``context_window = N`` answers every prompt estimated
over ``N`` tokens with the ``context_length`` 400.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Annotated, Final, Literal, get_args

import msgspec
from msgspec import Meta, Struct

__all__ = ["FAULT_KINDS", "FaultKind", "FaultSchedule", "FaultSpec"]

FaultKind = Literal[
    "ok",
    "500",
    "503",
    "529",
    "reset",
    "hang",
    "drip",
    "429",
    "429_bare",
    "quota",
    "malformed",
    "break",
    "no_done",
    "no_finish",
    "sse_error",
    "context_length",
    "content_filter",
    "filtered",
]
FAULT_KINDS: Final[tuple[FaultKind, ...]] = get_args(FaultKind)
#: Kinds that only change a stream; a non-streaming request gets a normal answer.
STREAM_ONLY: Final = frozenset({"no_done", "no_finish", "sse_error"})

Probability = Annotated[float, Meta(ge=0, le=1)]


class FaultSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which chat requests get which fault (see the module docstring for the kinds).

    - ``script``: kinds applied to chat requests in arrival order, ``"ok"`` a
      normal answer; after the last, normal answers (or the random mix).
    - ``repeat``: start the script over after its last step, forever.
    - ``random``: kind -> probability, drawn per request (with the mock's
      ``seed``) once the script is done; the probabilities add up to at most 1,
      the rest are normal answers.
    - ``after_tokens``: tokens streamed before ``break``, ``no_finish``,
      ``sse_error``, ``malformed`` or ``filtered`` strike.
    - ``drip_gap``: seconds between the tokens of a ``drip``.
    - ``retry_after``: seconds the ``429`` fault asks to wait.
    """

    script: tuple[FaultKind, ...] = ()
    repeat: bool = False
    random: dict[FaultKind, Probability] = {}
    after_tokens: Annotated[int, Meta(ge=0)] = 2
    drip_gap: Annotated[float, Meta(gt=0)] = 5.0
    retry_after: Annotated[float, Meta(ge=0)] = 2.0

    def __post_init__(self) -> None:
        total = sum(self.random.values())
        if total > 1 + 1e-9:
            raise ValueError(f"fault probabilities add up to {total:g}, more than 1")

    @property
    def active(self) -> bool:
        """Whether any request can get a fault."""
        return bool(self.script or any(self.random.values()))


class FaultSchedule:
    """The fault each chat request gets, in arrival order: a pure decision, no I/O."""

    __slots__ = ("_cumulative", "_next", "_spec")

    def __init__(self, spec: FaultSpec) -> None:
        self._spec = spec
        self._next = 0
        total = 0.0
        cumulative: list[tuple[float, FaultKind]] = []
        for kind, probability in spec.random.items():
            if probability:
                total += probability
                cumulative.append((total, kind))
        self._cumulative = tuple(cumulative)

    def next(self, rng: random.Random) -> FaultKind:
        """The kind for the next chat request (``"ok"``: none)."""
        script = self._spec.script
        if script and (self._next < len(script) or self._spec.repeat):
            kind = script[self._next % len(script)]
            self._next += 1
            return kind
        if self._cumulative:
            draw = rng.random()
            for bound, kind in self._cumulative:
                if draw < bound:
                    return kind
        return "ok"


def _kind(text: str) -> FaultKind:
    name = text.strip()
    for kind in FAULT_KINDS:
        if kind == name:
            return kind
    raise ValueError(f"unknown fault kind {name!r} (kinds: {', '.join(FAULT_KINDS)})")


def parse_fault_script(text: str) -> list[FaultKind]:
    """``"500,ok,reset"`` -> ``["500", "ok", "reset"]`` (``ValueError`` on an unknown kind)."""
    return [_kind(part) for part in text.split(",")] if text.strip() else []


def parse_fault_rates(items: Iterable[str]) -> dict[FaultKind, float]:
    """``["503=0.1", "reset=0.05"]`` -> ``{"503": 0.1, "reset": 0.05}`` (``ValueError`` if bad)."""
    rates: dict[FaultKind, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"a fault rate is KIND=PROBABILITY, got {item!r}")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"fault rate {item!r}: {value!r} is not a number") from None
        rates[_kind(name)] = rate
    return rates


# ------------------------------------------------------------ wire bodies

_ENCODER: Final = msgspec.json.Encoder()

SERVER_ERROR: Final = _ENCODER.encode(
    {
        "error": {
            "message": "The server had an error while processing your request. Sorry about that!",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
)
OVERLOADED: Final = _ENCODER.encode(
    {
        "error": {
            "message": "The server is overloaded or not ready yet.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
)
ANTHROPIC_OVERLOADED: Final = _ENCODER.encode(
    {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
)
CONTENT_FILTER: Final = _ENCODER.encode(
    {
        "error": {
            "code": "content_filter",
            "message": "The response was filtered due to the prompt triggering Azure OpenAI's "
            "content management policy. Please modify your prompt and retry. To learn more "
            "about our content filtering policies please read our documentation: "
            "https://go.microsoft.com/fwlink/?linkid=2198766",
            "param": "prompt",
            "status": 400,
            "innererror": {
                "code": "ResponsibleAIPolicyViolation",
                "content_filter_result": {
                    "hate": {"filtered": False, "severity": "safe"},
                    "jailbreak": {"filtered": False, "detected": False},
                    "self_harm": {"filtered": False, "severity": "safe"},
                    "sexual": {"filtered": False, "severity": "safe"},
                    "violence": {"filtered": True, "severity": "medium"},
                },
            },
        }
    }
)
#: The default context window named by a scripted ``context_length``.
DEFAULT_CONTEXT_WINDOW: Final = 8192


def context_length_body(window: int, prompt_tokens: int) -> bytes:
    """OpenAI's 400 for a prompt over ``window`` (the configured ``context_window``, or
    8192 and 9000 tokens when the fault is scripted and the prompt is short)."""
    if prompt_tokens > (window or DEFAULT_CONTEXT_WINDOW):
        used = prompt_tokens
    else:
        used = window + 1 if window else 9000
    message = (
        f"This model's maximum context length is {window or DEFAULT_CONTEXT_WINDOW} tokens. "
        f"However, your messages resulted in {used} tokens. "
        "Please reduce the length of the messages."
    )
    return _ENCODER.encode(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    )


#: Status and body of the faults that are a plain error response.
ERROR_ANSWERS: Final[dict[str, tuple[int, bytes]]] = {
    "500": (500, SERVER_ERROR),
    "503": (503, OVERLOADED),
    "529": (529, ANTHROPIC_OVERLOADED),
    "content_filter": (400, CONTENT_FILTER),
}


def stream_error_line(openrouter: bool, head: bytes) -> bytes:
    """The ``data:`` line of an error mid-stream. ``head`` is the stream's chunk
    opening (``data: {"id":...,"created":...,"model":...``), which OpenRouter's
    form continues; OpenAI's is a bare error object."""
    if openrouter:
        return (
            head + b',"provider":"mock","error":{"code":"server_error",'
            b'"message":"Provider disconnected unexpectedly"},'
            b'"choices":[{"index":0,"delta":{"content":""},"finish_reason":"error"}]}\n\n'
        )
    return b"data: " + SERVER_ERROR + b"\n\n"
