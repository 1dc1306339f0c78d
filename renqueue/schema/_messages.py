"""Wire messages and events: every payload Ren-Queue puts on NATS.

All are frozen, keyword-only ``msgspec.Struct`` types, JSON on the wire, each
carrying the schema version ``v``. The event log outlives any version of this
code, so the schema evolves by msgspec's rules: new fields get defaults and go
last; a field's type never changes; a removed field's name is never reused.

Events form one tagged union (:data:`Event`, tag field ``kind``) decoded by one
reusable decoder (:data:`EVENT_DECODER`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Final, Generic, Literal, TypeVar, cast, get_args

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "CLAIM_DECODER",
    "DISPATCH_DECODER",
    "ERROR_TYPES",
    "EVENT_DECODER",
    "MAX_CANCEL_BYTES",
    "MAX_DEADLINE_AHEAD",
    "MAX_EXTRA_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_REASON_LENGTH",
    "MAX_REQUEUES",
    "MAX_STOP_LENGTH",
    "MAX_TEXT",
    "OLDEST_VERSION",
    "REQUEST_DECODER",
    "REQUEST_HEADROOM",
    "RESERVED_EXTRA",
    "SCHEMA_VERSION",
    "SEED_MAX",
    "SEED_MIN",
    "TERMINAL_KINDS",
    "TOKEN_DECODER",
    "CancelRequested",
    "Cancelled",
    "ChatMessage",
    "ChunkTail",
    "CircuitChanged",
    "Coalesced",
    "Completed",
    "ComplexityEstimate",
    "ContentPart",
    "Decoder",
    "Dispatch",
    "ErrorType",
    "Event",
    "Expired",
    "Failed",
    "Fallback",
    "FellBack",
    "GenerationParams",
    "ImagePart",
    "ImageURL",
    "InferenceRequest",
    "JsonSchema",
    "NamedTool",
    "Preempted",
    "Probed",
    "Promoted",
    "Rejected",
    "ReportedLimit",
    "ResponseFormat",
    "Retrying",
    "Routed",
    "SplitChanged",
    "Started",
    "Stolen",
    "Submitted",
    "TerminalClaim",
    "TextPart",
    "TokenChunk",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
    "encode",
    "error_type_of",
    "facts",
    "final_chunk",
    "is_terminal",
    "kind_of",
    "request_limit",
    "too_deep",
    "tool_call_deltas",
]

#: The most characters a message's text (a prompt, an answer, a tool call's
#: arguments) may have; a whole request must also fit the broker's max_payload.
MAX_TEXT: Final = 1_000_000

#: 2: messages with content parts, names, tool calls and tool results;
#: tools, response formats, penalties, logprobs, ``user`` and pass-through
#: parameters; chunks with tool-call deltas, finish reason and usage. Every
#: version-1 message decodes as version 2 (the new fields have defaults).
SCHEMA_VERSION: Final = 2

#: Ids and names become NATS subject tokens: no dots, spaces or wildcards.
RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}(?!\n)$")]
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}(?!\n)$")]
NonNegative = Annotated[float, Meta(ge=0)]
Count = Annotated[int, Meta(ge=0)]


class ToolCall(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool the model asked to call (in an assistant message, an answer, and
    the ``completed`` event): ``arguments`` is the JSON text of its arguments,
    as the model wrote it (it may not parse: models err)."""

    #: The provider's id for the call; a ``tool`` message answers it by this id.
    id: Annotated[str, Meta(max_length=256)] = ""
    name: Annotated[str, Meta(max_length=256)]
    arguments: Annotated[str, Meta(max_length=MAX_TEXT)] = "{}"


class ToolCallDelta(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a tool call in a token chunk, as in OpenAI's stream: the
    first piece of call ``index`` carries its ``id`` and ``name``; the
    ``arguments`` of all its pieces, joined in order, are its arguments."""

    index: Annotated[int, Meta(ge=0, le=1024)] = 0
    id: str = ""
    name: str = ""
    arguments: str = ""


def tool_call_deltas(calls: Sequence[ToolCall], first: int) -> tuple[ToolCallDelta, ...]:
    """Whole tool calls as stream pieces, numbered from ``first`` (the calls
    streamed before them): one piece each, with its id, name and arguments."""
    return tuple(
        ToolCallDelta(index=first + offset, id=call.id, name=call.name, arguments=call.arguments)
        for offset, call in enumerate(calls)
    )


class TopLogprob(Struct, frozen=True, kw_only=True):
    """One of the likeliest tokens at a position, and its log probability."""

    token: str
    logprob: float
    #: The token's UTF-8 bytes (a token may be part of a character).
    bytes: list[int] | None = None


class TokenLogprob(Struct, frozen=True, kw_only=True):
    """A generated token's log probability (when the request asked for
    ``logprobs``), with the ``top_logprobs`` likeliest at its position."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()


class TextPart(Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    """Text in a message's content parts."""

    text: Annotated[str, Meta(max_length=MAX_TEXT)]


class ImageURL(Struct, frozen=True, kw_only=True, omit_defaults=True):
    #: An ``https://`` URL or a ``data:image/...;base64,`` URL (no other
    #: scheme: a backend that fetches URLs fetches them from inside the
    #: operator's network, so ``http://``, ``file://`` and the like are refused).
    url: Annotated[
        str, Meta(min_length=1, max_length=20_000_000, pattern=r"^(https://|data:image/)")
    ]
    #: OpenAI's ``detail``: ``auto``, ``low`` or ``high``.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Struct, frozen=True, kw_only=True, tag_field="type", tag="image_url"):
    """An image in a message's content parts (a model with vision reads it)."""

    image_url: ImageURL


#: One part of a message's content, tagged by ``type`` as in OpenAI's API.
ContentPart = TextPart | ImagePart


class ChatMessage(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One chat turn, as in the OpenAI chat-completions API.

    ``content`` is a string or a list of parts (text and images). An
    assistant turn may carry the ``tool_calls`` the model made (its content
    may then be empty); a ``tool`` turn answers one of them by
    ``tool_call_id`` with the tool's result in ``content``. Messages written
    before schema version 2 (a role and string content) decode unchanged.
    """

    role: Literal["system", "user", "assistant", "tool"]
    #: Always written, ``""`` when an assistant turn has only tool calls (a
    #: version-1 reader requires it, and a message keeps its bytes).
    content: (
        Annotated[str, Meta(max_length=MAX_TEXT)]
        | Annotated[list[ContentPart], Meta(max_length=1024)]
    )
    #: A participant's name (OpenAI's ``name``).
    name: Annotated[str, Meta(max_length=256)] | None = None
    tool_calls: Annotated[tuple[ToolCall, ...], Meta(max_length=1024)] = ()
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None

    @property
    def text(self) -> str:
        """Its text: the content, or its text parts joined by newlines (as
        vLLM's chat templates join them)."""
        content = self.content
        if isinstance(content, str):
            return content
        return "\n".join(part.text for part in content if isinstance(part, TextPart))

    @property
    def images(self) -> tuple[ImageURL, ...]:
        """The images among its content parts."""
        content = self.content
        if isinstance(content, str):
            return ()
        return tuple(part.image_url for part in content if isinstance(part, ImagePart))


#: Tool and function names, as OpenAI allows them.
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}(?!\n)$")]


class Tool(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A function the model may call (OpenAI's ``{"type": "function",
    "function": {...}}``, flattened: functions are the only kind)."""

    name: ToolName
    description: Annotated[str, Meta(max_length=100_000)] = ""
    #: The JSON Schema of its arguments.
    parameters: dict[str, Any] = {}
    #: Ask the provider to keep the arguments to the schema exactly.
    strict: bool | None = None


class NamedTool(Struct, frozen=True, kw_only=True):
    """``tool_choice`` naming the one function the model must call."""

    name: ToolName


class JsonSchema(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The schema a ``json_schema`` response format holds the answer to."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}(?!\n)$")]
    schema: dict[str, Any] = {}
    description: Annotated[str, Meta(max_length=100_000)] = ""
    strict: bool | None = None


class ResponseFormat(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the answer must be: ``text``, any JSON object (``json_object``),
    or JSON that fits ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


#: Keys ``GenerationParams.extra`` may not hold: fields the adapters set
#: themselves, and parameters that would change what a call costs, which
#: model answers, or what the provider keeps, behind the router's back
#: (``n`` choices, ``max_completion_tokens`` over the ``max_tokens`` a cost
#: estimate and a quota reservation were made for, OpenRouter's ``models``
#: and ``provider`` routing, ``store``, a server-side ``chat_template``,
#: reasoning budgets, ...). Parameters that stay within ``max_tokens``
#: (vLLM's ``min_tokens``, ``ignore_eos``, ``chat_template_kwargs``) pass.
#: A request carrying a reserved one is rejected ``malformed``, naming it.
RESERVED_EXTRA: Final = frozenset(
    {
        # set by the adapters, or by Ren-Queue
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "priority",
        "metadata",
        # more calls, more output or another model than the request was priced for
        "n",
        "best_of",
        "max_completion_tokens",
        "max_new_tokens",
        "num_predict",
        "echo",
        "models",
        "route",
        "provider",
        "transforms",
        "plugins",
        "reasoning",
        "reasoning_effort",
        "service_tier",
        "prediction",
        "modalities",
        "audio",
        "web_search_options",
        # kept or run by the provider on the operator's account or server
        "store",
        "chat_template",
        "adapter_id",
        "lora_request",
        # the deprecated function-calling fields (tools are carried)
        "functions",
        "function_call",
    }
)


class GenerationParams(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling parameters passed through to the backend. ``None`` = backend default.

    Each adapter translates what its provider has a counterpart for; what a
    backend cannot do at all (tools, images, a JSON schema, logprobs) is a
    feature the router matches (``policy.needs``), never dropped. ``extra``
    holds parameters Ren-Queue does not know (vLLM's ``top_k``,
    ``repetition_penalty``, ...): OpenAI-compatible backends get them in the
    body as they are (never over a field the adapter sets); native adapters
    take the ones they document and leave the rest.
    """

    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    stop: Annotated[list[str], Meta(max_length=16)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    #: Return each token's log probability (and the ``top_logprobs`` likeliest).
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[tuple[Tool, ...], Meta(max_length=128)] = ()
    #: ``none``, ``auto``, ``required``, or the one tool to call.
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    #: The end user, as the provider's abuse monitoring asks for it.
    user: Annotated[str, Meta(max_length=256)] | None = None
    #: Parameters passed through as they are (see above).
    extra: Annotated[dict[str, Any], Meta(max_length=64)] = {}


class Usage(Struct, frozen=True, kw_only=True):
    """Token counts reported by the backend (or estimated when it reports none)."""

    prompt_tokens: Count = 0
    completion_tokens: Count = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


#: The most times a request may be put back to routing after it was bound
#: (``InferenceRequest.requeues``).
MAX_REQUEUES: Final = 1000


class Fallback(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where a request stands in its route's cascade after falling back
    (``InferenceRequest.fallback``; set by workers: see
    :func:`renqueue.policy.after_failure`)."""

    #: Backends that failed it: not bound there again while another candidate
    #: can take it (and then not before ``not_before``).
    excluded: Annotated[tuple[Name, ...], Meta(max_length=256)] = ()
    #: Fallbacks so far that used one of the route's ``fallback.attempts``.
    count: Annotated[int, Meta(ge=0, le=MAX_REQUEUES)] = 0
    #: The next backend's declared context window must be at least this many tokens.
    min_context: Annotated[int, Meta(ge=1)] | None = None
    #: The next backend's tier must be at least this.
    min_tier: Annotated[int, Meta(ge=0, le=100)] | None = None
    #: The next backend must be free (the route's ``fallback.paid`` is off).
    free_only: bool = False
    #: The tier of the backend that failed it last: binding below it is a
    #: quality downgrade, said in the routing decision's reason.
    from_tier: Annotated[int, Meta(ge=0, le=100)] | None = None
    #: Not bound again to a backend in ``excluded`` before this Unix time (it
    #: goes back to one only when no other candidate can take it).
    not_before: NonNegative | None = None
    #: Times it failed as a half-open circuit's probe call (none is charged to
    #: its attempts; the next probe goes to a request with the fewest).
    probes: Annotated[int, Meta(ge=0, le=MAX_REQUEUES)] = 0
    #: Backends that said its context is too long: never bound there again
    #: (a rule, unlike ``excluded``; needed where the window is not declared).
    too_small: Annotated[tuple[Name, ...], Meta(max_length=256)] = ()
    #: Its fallbacks after a 429 (free up to 3 per attempt the route allows).
    rate_limited: Annotated[int, Meta(ge=0, le=MAX_REQUEUES)] = 0


class InferenceRequest(Struct, frozen=True, kw_only=True):
    """What a client publishes to ``rq.req.<priority>.<tenant>``.

    ``deadline`` and ``submitted_at`` are Unix times in seconds; ``max_cost`` is
    in US dollars; ``complexity`` is the minimum backend tier the request needs.
    """

    v: int = SCHEMA_VERSION
    id: RequestId
    tenant: Name = "default"
    route: Name
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=10_000)]
    params: GenerationParams = GenerationParams()
    priority: Name = "normal"
    deadline: NonNegative | None = None
    max_cost: NonNegative | None = None
    complexity: Annotated[int, Meta(ge=0, le=100)] | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=64)] = {}
    submitted_at: NonNegative = 0.0
    #: A request this one is part of: it never runs at a lower effective
    #: priority than that parent (same tenant).
    parent_id: RequestId | None = None
    #: Times the request was sent back to wait after it had been bound to a
    #: backend (a preemption, a spent quota); set by workers, not clients. At
    #: most :data:`MAX_REQUEUES`: a request bound that often is not put back
    #: again (a spent quota fails it, a run is no longer preemptible).
    requeues: Annotated[int, Meta(ge=0, le=MAX_REQUEUES)] = 0
    #: Requests of one tenant with the same key share one backend call.
    dedupe_key: RequestId | None = None
    #: Share a call with identical requests (same route, messages and params).
    coalesce: bool = False
    #: Its place in its route's cascade after a backend failed it; set by
    #: workers, with ``requeues``, on the services' requeue subject only.
    fallback: Fallback | None = None
    #: The route the client named, when that route's A/B split sent it to
    #: ``route`` (one of the split's arms); set by the binder, never by a
    #: client (a request put back to routing keeps its arm).
    split: Name | None = None
    #: Whether the client follows the request's token stream. ``False``: it
    #: only waits for the outcome, and no token chunk is stored for the
    #: request (not even a final one): the answer is whole in its
    #: ``completed`` event (``text``, ``tool_calls``, ``logprobs``). ``True``:
    #: it does, and it reads a final chunk's text (the run's last read, which
    #: also brought the backend's end of stream, is sent in the final chunk).
    #: ``None`` (not written: a client older than the field, whose reader may
    #: drop a final chunk's text): streamed, every read a chunk of its own and
    #: the final chunk empty, as before.
    stream: bool | None = None


class Dispatch(Struct, frozen=True, kw_only=True):
    """A routing decision, published to the chosen backend's subject ``rq.dispatch.<backend>``."""

    v: int = SCHEMA_VERSION
    request: InferenceRequest
    backend: Name
    attempt: Annotated[int, Meta(ge=1)] = 1
    routed_at: NonNegative = 0.0
    #: The request's level rank after aging when it was bound (0 = most urgent).
    effective_rank: Annotated[int, Meta(ge=0)] | None = None
    #: Tokens the binder reserved of the backend's token quota for this call
    #: (prompt estimate + the most it may generate); the worker reports the
    #: real usage against it.
    reserved_tokens: Count = 0
    #: Bound to a backend whose circuit is half-open: this call is the probe
    #: that closes or opens it again, and a failure here uses none of the
    #: request's fallback attempts.
    probe: bool = False


class TokenChunk(Struct, frozen=True, kw_only=True):
    """A piece of generated text on ``rq.tok.<tenant>.<request_id>``.

    ``delivery`` is the run number (as in ``started``, ``retrying``,
    ``preempted`` and ``completed``), increasing over the request's life (a
    retry, a worker crash or a preemption starts a new run); ``seq`` counts
    chunks within a run from 0. The first chunk of a run after the first has
    ``restart=True``: text streamed by an earlier run is void. ``final=True``
    closes the stream (its ``text`` is empty); it carries the number of the
    run that ended the request and that run's next ``seq``, so it sorts after
    every chunk of the request by ``(delivery, seq)``.

    Every field is written; the defaults exist so that chunks stored by
    earlier versions, which left fields at their defaults out, still decode.
    """

    v: int = SCHEMA_VERSION
    request_id: RequestId
    delivery: Annotated[int, Meta(ge=1)] = 1
    seq: Count = 0
    text: str = ""
    restart: bool = False
    final: bool = False
    #: Pieces of the tool calls the model makes (schema 2; its ``text`` may be empty).
    tool_calls: tuple[ToolCallDelta, ...] = ()
    #: On the final chunk of a completed request (schema 2): why the answer
    #: ended (``stop``, ``length``, ``tool_calls``, ``content_filter``, ...)
    #: and the tokens it counted. ``None`` on other chunks, and on the final
    #: chunk of a request that did not complete.
    finish_reason: str | None = None
    usage: Usage | None = None
    #: The log probabilities of this chunk's tokens (a request that asked for them).
    logprobs: tuple[TokenLogprob, ...] = ()


# --------------------------------------------------------------------- events


class ReportedLimit(Struct, frozen=True, kw_only=True):
    """One rate-limit window as a provider reported it with a response.

    ``kind``: ``requests``, ``tokens``, ``input_tokens`` or ``output_tokens``;
    ``window`` in seconds when known (60: per minute, 86400: per day);
    ``reset_at`` is absolute (Unix seconds, the worker's clock when the
    response came plus the delay the provider gave), so every process and
    every replay reads the same moment.
    """

    kind: str
    window: float | None = None
    limit: int | None = None
    remaining: int | None = None
    reset_at: float | None = None


class _EventBase(Struct, frozen=True, kw_only=True, tag_field="kind"):
    v: int = SCHEMA_VERSION
    request_id: str
    tenant: str
    at: float


class Submitted(_EventBase, frozen=True, kw_only=True, tag="submitted"):
    """A client submitted a request (the full request, for audit and replay)."""

    request: InferenceRequest
    #: The W3C ``traceparent`` the request arrived with (the submitting hop's
    #: span under the request's trace id), as the router validated it; a
    #: new trace's when it came with none or a malformed one. ``None`` in
    #: events from before tracing.
    traceparent: str | None = None
    #: The request's first binding, when the binder bound it in the first
    #: round after it read it: then this one stored event says both (one
    #: message fewer per request). ``None`` when the request waited (its
    #: ``routed`` event follows on its own), was settled when read, and in
    #: events from before. Readers see the pair through :func:`facts`.
    routed: Routed | None = None
    #: When the binder read the request (its clock), for one whose event was
    #: not stored as it was read (left for its first round: bound at once, or
    #: logged once that round let it wait); ``None``: its storing says it.
    read: float | None = None


#: Every ``error_type`` the services write (``rejected``, ``failed``,
#: ``retrying`` and ``fell_back`` events): the event constructors take only
#: these (see :func:`error_type_of`). On the wire the field stays a string:
#: a reader must accept one it does not know (written by a newer version).
ErrorType = Literal[
    # rejected: the request cannot be served as it is
    "malformed",
    "unknown_route",
    "no_capable_backend",
    "unsupported_feature",
    "priority_not_allowed",
    "over_cost_cap",
    "budget_exhausted",
    "unprocessable",
    "out_of_range",
    # rejected by the forwarder (binding split in groups): the tenant's route
    # subject is at router.tenant_backlog (renqueue.services.router._forward)
    "tenant_backlog_full",
    # failed (and retrying, fell_back): its runs did not end well
    "rate_limited",
    "quota_exhausted",
    "backend_unavailable",
    "backend_fatal",
    "backend_bad_request",
    "internal",
    "answer_too_large",
    "undeliverable",
    # failed: a coalesced follower, by how its leader's call ended
    "shared_call_failed",
    "shared_call_cancelled",
    "shared_call_expired",
    "shared_call_rejected",
]
ERROR_TYPES: Final[frozenset[str]] = frozenset(get_args(ErrorType))


def error_type_of(code: str) -> ErrorType:
    """``code`` (an error's :attr:`~renqueue.errors.RenQueueError.code`) as an
    ``error_type``; one that is none (a bug: every request and backend error's
    code is one, tests/test_wire_docs.py checks) is ``internal``."""
    return cast("ErrorType", code) if code in ERROR_TYPES else "internal"


class Rejected(_EventBase, frozen=True, kw_only=True, tag="rejected"):
    """Terminal: the request was invalid (malformed, unknown route, ...)."""

    error_type: str
    reason: str


class ComplexityEstimate(Struct, frozen=True, kw_only=True):
    """The tier a request that named none was judged to need, and why (its
    route's complexity estimator: :mod:`renqueue.policy._complexity`)."""

    tier: int
    #: The estimator's score in [0, 1] (1: hardest) and its name.
    score: float
    estimator: str
    #: The signals the default estimator reads (recorded whatever scored it).
    prompt_tokens: int = 0
    max_tokens: int = 0
    code_markers: int = 0
    math_markers: int = 0
    turns: int = 0


class Routed(_EventBase, frozen=True, kw_only=True, tag="routed"):
    """A router bound the request to a backend."""

    backend: str
    attempt: int
    priority: str
    queue_wait: float
    reason: str = ""
    #: The router that bound it (the binder's lease holder) and its term:
    #: which instance decided, for audits. Empty/0 in events from before it.
    router: str = ""
    term: int = 0
    #: Tokens reserved of the backend's token quota (see ``Dispatch``).
    reserved_tokens: int = 0
    #: The call is the probe of the backend's half-open circuit (``Dispatch.probe``):
    #: its outcome, and no other call's, decides the circuit.
    probe: bool = False
    #: The tier the route's estimator gave a request that named none (its floor).
    complexity_estimate: ComplexityEstimate | None = None
    #: Seconds from this decision to the call's predicted (cautious) finish,
    #: when the backend has a model (``policy.predict``); for audits of the
    #: predictions against the ``completed`` event.
    predicted: float | None = None
    #: The estimated cost (USD) of the call there, prompt estimate + the most
    #: it may generate (``policy.estimated_cost``).
    estimated_cost: float = 0.0
    #: The route the client named and the arm (a route) its A/B split sent
    #: it to; empty when the route has no split.
    split: str = ""
    arm: str = ""


class Promoted(_EventBase, frozen=True, kw_only=True, tag="promoted"):
    """A waiting request aged into a more urgent level.

    ``at`` is when it earned the promotion (submit time + ``waited``), not when
    a router noticed, so replays and restarts agree.
    """

    from_level: str
    to_level: str
    waited: float
    #: Why: empty for aging; "inherited from parent <id>" for inheritance.
    reason: str = ""


class CancelRequested(_EventBase, frozen=True, kw_only=True, tag="cancel_requested"):
    """A client asked for the request to be cancelled (not terminal: ``cancelled`` is)."""

    reason: str = ""


class Preempted(_EventBase, frozen=True, kw_only=True, tag="preempted"):
    """A running request gave its slot to a more urgent one and waits again.

    It keeps its original submit time (and so its aging credit); its next run
    streams a ``restart`` chunk first.
    """

    backend: str
    attempt: int
    delivery: int
    by: str


class Stolen(_EventBase, frozen=True, kw_only=True, tag="stolen"):
    """An idle replica took a request queued for a busy sibling in its pool."""

    from_backend: str
    to_backend: str
    attempt: int
    #: Stream sequence of the dispatch message moved (0: written before it was recorded).
    from_seq: int = 0


class Coalesced(_EventBase, frozen=True, kw_only=True, tag="coalesced"):
    """The request shares the backend call of ``leader`` (an identical request)."""

    leader: str


class Started(_EventBase, frozen=True, kw_only=True, tag="started"):
    """A worker started calling the backend (``delivery``: the run number)."""

    backend: str
    attempt: int
    delivery: int
    worker: str


class Retrying(_EventBase, frozen=True, kw_only=True, tag="retrying"):
    """A run failed transiently (``delivery``: its run number); the request
    waits ``retry_after`` seconds and runs again.

    With ``requeued``, the provider said its quota is spent: the request went
    back to routing instead (its next dispatch is a new attempt, bound to
    another candidate or held until one has room), and ``retry_after`` is how
    long this backend is left out.
    """

    backend: str
    attempt: int
    delivery: int
    error_type: str
    reason: str
    retry_after: float
    #: What the provider reported of its rate limits with this failure.
    limits: tuple[ReportedLimit, ...] = ()
    #: The provider's quota is spent until then (a daily quota): no call before.
    quota_exhausted_until: float | None = None
    #: The request was put back to routing (a spent quota), not retried here.
    requeued: bool = False
    #: The failure's class (:class:`renqueue.errors.FailureClass`; ``internal``
    #: for a worker error; empty in events from before classes).
    error_class: str = ""


class CircuitChanged(_EventBase, frozen=True, kw_only=True, tag="circuit"):
    """The binder moved a backend's circuit breaker (``state``: ``closed``,
    ``open`` or ``half_open``; see :mod:`renqueue.policy`'s health rules).

    About a backend, not a request: ``tenant`` is ``_system`` and
    ``request_id`` the backend's name (``rq.evt._system.<backend>.circuit``).
    """

    backend: str
    state: str
    previous: str
    reason: str
    #: The router that decided (the binder's lease holder) and its term.
    router: str = ""
    term: int = 0


class Probed(_EventBase, frozen=True, kw_only=True, tag="probed"):
    """A worker's active health probe of a backend changed its answer (or
    gave its first): ``ok`` for a 2xx within the probe's timeout.

    About a backend, not a request: ``tenant`` is ``_system`` and
    ``request_id`` the backend's name (``rq.evt._system.<backend>.probed``).
    """

    backend: str
    ok: bool
    detail: str = ""
    worker: str = ""


class Completed(_EventBase, frozen=True, kw_only=True, tag="completed"):
    """Terminal: the backend produced a full answer."""

    backend: str
    attempt: int
    delivery: int
    text: str
    usage: Usage
    cost: float
    finish_reason: str | None = None
    ttft: float | None = None
    duration: float = 0.0
    #: The request whose backend call this one shared (coalescing); its cost is there.
    shared_with: str | None = None
    #: What the provider reported of its rate limits with this answer.
    limits: tuple[ReportedLimit, ...] = ()
    #: Tokens the binder had reserved for this call (``Dispatch.reserved_tokens``).
    reserved_tokens: int = 0
    #: The tools the model asked to call (schema 2), whole.
    tool_calls: tuple[ToolCall, ...] = ()
    #: The answer's tokens' log probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


class Failed(_EventBase, frozen=True, kw_only=True, tag="failed"):
    """Terminal: the request cannot be completed; a copy is in the dead-letter stream."""

    error_type: str
    reason: str
    backend: str | None = None
    attempt: int = 0
    #: What the provider reported of its rate limits with this failure.
    limits: tuple[ReportedLimit, ...] = ()
    #: The provider's quota is spent until then (a daily quota): no call before.
    quota_exhausted_until: float | None = None
    #: The failure's class, when a backend call failed (see ``Retrying``).
    error_class: str = ""


class FellBack(_EventBase, frozen=True, kw_only=True, tag="fell_back"):
    """A backend failed the request; it goes back to routing for another
    candidate of its route (its next dispatch is a new attempt), keeping its wait.

    ``fallback`` is where it may go next (its ``InferenceRequest.fallback``);
    ``probe``: the failed run was a half-open circuit's probe, so this
    fallback used none of the request's attempts.
    """

    backend: str
    attempt: int
    delivery: int
    error_type: str
    error_class: str
    reason: str
    fallback: Fallback
    probe: bool = False
    #: What the provider reported of its rate limits with this failure.
    limits: tuple[ReportedLimit, ...] = ()
    #: Seconds the provider asked to wait (a 429's ``retry-after``): the
    #: backend cools down that long for everyone.
    retry_after: NonNegative = 0.0


class Expired(_EventBase, frozen=True, kw_only=True, tag="expired"):
    """Terminal: the deadline passed before the request could finish."""

    stage: str
    reason: str = ""
    #: Expired while waiting on an arm of an A/B split (as in ``routed``):
    #: counted against that arm even if it was never routed.
    split: str = ""
    arm: str = ""
    #: The run it ended at, when its worker ended it (its dispatch's backend
    #: and attempt): the call whose ``routed`` may yet be logged (a rebind logs
    #: it once the dispatch is stored). ``None``/0 when a router ended it, and
    #: in events from before these fields.
    backend: str | None = None
    attempt: int = 0


class SplitChanged(_EventBase, frozen=True, kw_only=True, tag="ab"):
    """Where an A/B split's traffic goes moved: ``rolled_back`` (all of it to
    the control arm: the binder when an arm breached the split's rollback
    thresholds, or an operator), ``promoted`` (all of it to ``arm``: an
    operator), or ``live`` again (by weight: an operator).

    About a route, not a request: ``tenant`` is ``_system`` and
    ``request_id`` the route's name (``rq.evt._system.<route>.ab``). The
    binder's own rollback (``operator`` empty) applies only to a live split.
    """

    route: str
    state: str
    #: Where all of its traffic goes (empty when ``live``).
    arm: str = ""
    previous: str = ""
    reason: str = ""
    #: The binder that decided (its lease holder) and its term, for an automatic rollback.
    router: str = ""
    term: int = 0
    #: Who asked, for an operator's action (``renqueue ab``).
    operator: str = ""


class Cancelled(_EventBase, frozen=True, kw_only=True, tag="cancelled"):
    """Terminal: the request was cancelled."""

    stage: str
    reason: str = ""
    #: The run it ended at, when its worker ended it (as in ``expired``).
    backend: str | None = None
    attempt: int = 0


Event = (
    Submitted
    | Rejected
    | Routed
    | Promoted
    | CancelRequested
    | Preempted
    | Stolen
    | Coalesced
    | Started
    | Retrying
    | FellBack
    | CircuitChanged
    | Probed
    | SplitChanged
    | Completed
    | Failed
    | Expired
    | Cancelled
)

TERMINAL_KINDS: Final = frozenset({"completed", "failed", "rejected", "expired", "cancelled"})

_TERMINAL_TYPES: Final = (Completed, Failed, Rejected, Expired, Cancelled)


class ChunkTail(Struct, frozen=True, kw_only=True):
    """Where a final chunk's own content starts in its ``completed`` event:
    the chunk carries ``text[text:]``, ``tool_calls[tool_calls:]`` (as pieces
    numbered from there) and ``logprobs[logprobs:]``; the run streamed what
    comes before in chunks of its own."""

    text: Count = 0
    tool_calls: Count = 0
    logprobs: Count = 0


class TerminalClaim(Struct, frozen=True, kw_only=True):
    """The claim on a request's one terminal outcome, value of key
    ``<tenant>.<request_id>`` in the ``rq-terminal`` KV bucket (services only).

    Created (never updated) before the terminal event is published; it holds
    the event and the ``(delivery, seq)`` of the final chunk, so that whoever
    finds a claim whose event is not in the log yet can publish both.
    """

    v: int = SCHEMA_VERSION
    event: Event
    delivery: int = 1
    seq: int = 0
    #: What of a ``completed`` event its final chunk carries itself (the
    #: run's last network read, which also ended the backend's stream);
    #: ``None``: the final chunk carries no text.
    tail: ChunkTail | None = None
    #: ``False`` for a request submitted with ``stream`` false: no final
    #: chunk is published (no chunk at all is stored for it).
    stream: bool = True


def final_chunk(claim: TerminalClaim) -> TokenChunk:
    """The final chunk of the request ``claim`` ends, at its ``(delivery, seq)``.

    The first chunk of a run after the first restarts the stream, even when
    it is the final one (a run that ended without text, or whose whole
    answer came in its last read): the text of earlier runs is void, never
    the answer. A ``completed`` outcome's chunk says why the answer ended and
    the tokens it counted, and carries its :class:`ChunkTail`, if any.
    """
    event = claim.event
    completed = event if isinstance(event, Completed) else None
    text = ""
    calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    tail = claim.tail
    if completed is not None and tail is not None:
        text = completed.text[tail.text :]
        calls = tool_call_deltas(completed.tool_calls[tail.tool_calls :], tail.tool_calls)
        logprobs = completed.logprobs[tail.logprobs :]
    return TokenChunk(
        request_id=event.request_id,
        delivery=claim.delivery,
        seq=claim.seq,
        text=text,
        final=True,
        restart=claim.delivery > 1 and claim.seq == 0,
        tool_calls=calls,
        finish_reason=None if completed is None else completed.finish_reason,
        usage=None if completed is None else completed.usage,
        logprobs=logprobs,
    )


def is_terminal(event: Event) -> bool:
    """True for events that end a request: exactly one of them exists per request."""
    return isinstance(event, _TERMINAL_TYPES)


def facts(event: Event) -> tuple[Event, ...]:
    """The events one stored event stands for, in log order: a ``submitted``
    that carries its request's first binding (``routed``) is that
    ``submitted`` (without it) and then that ``routed``; any other event is
    itself. A binding that names another request than its ``submitted``
    (no service writes one) is not a fact of it: dropped."""
    if not isinstance(event, Submitted) or event.routed is None:
        return (event,)
    bound = event.routed
    first = msgspec.structs.replace(event, routed=None)
    if bound.tenant != event.tenant or bound.request_id != event.request_id:
        return (first,)
    return (first, bound)


#: Each event type's tag, read once: ``__struct_config__`` is built anew at each access.
_KINDS: Final[dict[type, str]] = {kind: str(kind.__struct_config__.tag) for kind in get_args(Event)}


def kind_of(event: Event) -> str:
    """The event's tag, which is also the last token of its subject."""
    try:
        return _KINDS[type(event)]
    except KeyError:  # not one of the wire's own types (a subclass)
        return str(type(event).__struct_config__.tag)


_T = TypeVar("_T")


class Decoder(Generic[_T]):
    """A JSON decoder of one wire type whose every failure is a
    :class:`msgspec.DecodeError` (a :class:`msgspec.ValidationError` for a
    value of the wrong shape): JSON nested past the interpreter's recursion
    limit (``extra``, a tool's schema: about 1000 levels) raises
    ``RecursionError`` inside msgspec, which no reader of a hostile payload
    expects, and which would take down the loop that read it."""

    __slots__ = ("_decoder",)

    def __init__(self, type_: type[_T] | Any) -> None:
        self._decoder: msgspec.json.Decoder[_T] = msgspec.json.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview | str) -> _T:
        try:
            return self._decoder.decode(data)
        except RecursionError:
            raise msgspec.DecodeError("JSON is nested too deeply") from None


EVENT_DECODER: Final[Decoder[Event]] = Decoder(Event)
REQUEST_DECODER: Final[Decoder[InferenceRequest]] = Decoder(InferenceRequest)
DISPATCH_DECODER: Final[Decoder[Dispatch]] = Decoder(Dispatch)
TOKEN_DECODER: Final[Decoder[TokenChunk]] = Decoder(TokenChunk)
CLAIM_DECODER: Final[Decoder[TerminalClaim]] = Decoder(TerminalClaim)

#: Bytes a request must stay under the broker's ``max_payload`` by: the
#: services write it again inside messages of their own (its ``submitted``
#: event, its dispatch, a requeue) with headers and fields around it, and a
#: message over ``max_payload`` makes nats-server close the connection that
#: sent it, for every request on it. Clients refuse a bigger request before
#: publishing it; the router rejects one published anyway.
REQUEST_HEADROOM: Final = 64 * 1024


def request_limit(max_payload: int) -> int:
    """The largest encoded request a broker of ``max_payload`` bytes takes."""
    return max(1024, max_payload - REQUEST_HEADROOM)


#: Admission's bounds on fields a request may carry (docs/wire-format.md,
#: "Bounds"); past one it is rejected ``out_of_range``
#: (:class:`renqueue.errors.OutOfRangeError`). They are checked at admission,
#: not by the types: events stored before them must still decode.
#: The schema versions a request may carry (newer: ``malformed``).
OLDEST_VERSION: Final = 1
#: Characters in one ``params.stop`` sequence (at most 16 of them, by the type).
MAX_STOP_LENGTH: Final = 500
#: ``params.seed``: a signed 64-bit integer, what providers take.
SEED_MIN: Final = -(2**63)
SEED_MAX: Final = 2**63 - 1
#: Seconds a ``deadline`` may lie past the moment the broker stored the request.
MAX_DEADLINE_AHEAD: Final = 30 * 86400.0
#: UTF-8 bytes of a request's ``metadata``, keys and values together.
MAX_METADATA_BYTES: Final = 16_384
#: Bytes of a request's ``params.extra`` (the parameters Ren-Queue does not
#: know, passed to the backend as they are), as JSON: vLLM's sampling knobs
#: and a guided-decoding schema fit; a megabyte of them is no parameter.
MAX_EXTRA_BYTES: Final = 65_536
#: Bytes of a ``cancel_requested`` event (its JSON): a bigger one is no cancellation.
MAX_CANCEL_BYTES: Final = 4096
#: Characters of a cancellation's ``reason``.
MAX_REASON_LENGTH: Final = 1000


#: The deepest nesting of free-form JSON (``extra`` values, tool and response
#: schemas) a request may carry; real JSON Schemas stay within a dozen.
MAX_JSON_DEPTH: Final = 64


def too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether decoded JSON ``value`` nests deeper than ``limit`` (walked
    without recursion, so any depth is safe to ask about)."""
    if not value and limit > 0:  # None, {}, []: the usual ``extra`` and schemas
        return False
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


_ENCODER: Final = msgspec.json.Encoder()


def encode(message: Struct) -> bytes:
    """Encode any wire message or event as JSON."""
    return _ENCODER.encode(message)
