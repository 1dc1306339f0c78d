"""What the mock backend is told and what it counts: :class:`MockSettings`
(changed at run time by ``POST /admin/settings`` or :meth:`MockBackend.update
<renqueue.mock.MockBackend.update>`) and :class:`MockStats` (``GET /stats``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from ._fault_injection import FaultSpec
from ._rate_limits import MockLimitStyle

__all__ = ["TRACEPARENTS_KEPT", "Counters", "MockSettings", "MockStats"]

Seconds = Annotated[float, Meta(ge=0)]
Limit = Annotated[int, Meta(ge=0)]


class MockSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the mock behaves. Zero means "off" / "unlimited" for limits and rates.

    - ``models``: names accepted (others get 404 ``model_not_found``); empty = any.
    - ``ttft``: seconds before the first token.
    - ``tokens_per_second``: generation speed; 0 = all tokens at once.
    - ``output_tokens``: answer length; a request's ``max_tokens`` (or
      ``max_completion_tokens``) caps it, and then ``finish_reason`` is ``"length"``.
    - ``failure_rate``: share of admitted requests answered ``failure_status``
      (500) with an OpenAI-style error body.
    - ``seed``: seeds the failure draws, for reproducible runs.
    - ``rpm`` / ``tpm``: declared requests and tokens per minute, enforced with
      429s (see the module docstring).
    - ``concurrency``: requests generating at once; beyond it,
      ``busy_status`` (429 like a provider, or 503 like an overloaded server).
    - ``require_api_key``: when set, requests without ``Authorization: Bearer
      <it>`` get 401, whose message echoes the key sent (as some providers
      do), so tests can prove clients scrub keys from errors.
    - ``rpd``: declared requests per day (a bucket refilled over 24 hours),
      enforced with 429s like ``rpm``.
    - ``limit_style``: the provider dialect of the rate-limit headers and 429
      bodies (``openai``, ``groq``, ``cerebras``, ``openrouter``,
      ``openrouter-body``, ``anthropic``, ``gemini``, ``ietf``: see
      :mod:`._rate_limits` and docs/rate-limits.md).
    - ``quota_exhausted``: every chat request is refused with the dialect's
      quota-exhausted 429 (OpenAI ``insufficient_quota``, a per-day Gemini
      quota id, daily counters at 0 until UTC midnight), and not charged.
    - ``faults``: scripted and random faults (:class:`._fault_injection.FaultSpec`;
      the kinds and their wire formats are in :mod:`._fault_injection`). Setting
      it at run time replaces it whole and starts its script over.
    - ``down``: every connection to a chat path, ``/v1/models`` and ``/health`` is reset, as a
      backend that is down (``/stats`` and ``/admin/settings`` still answer).
    - ``context_window``: prompts estimated over this many tokens (characters
      / 4) get OpenAI's ``context_length_exceeded`` 400; 0 = no limit.
    """

    models: tuple[str, ...] = ()
    ttft: Seconds = 0.0
    tokens_per_second: Seconds = 0.0
    output_tokens: Annotated[int, Meta(ge=0, le=1_000_000)] = 16
    failure_rate: Annotated[float, Meta(ge=0, le=1)] = 0.0
    failure_status: Annotated[int, Meta(ge=400, le=599)] = 500
    seed: int | None = None
    rpm: Limit = 0
    tpm: Limit = 0
    #: The window ``rpm`` and ``tpm`` count over, in seconds (60: per minute;
    #: shorter compresses the clock, as tests and benchmarks do).
    rate_window: Annotated[float, Meta(gt=0)] = 60.0
    concurrency: Limit = 0
    busy_status: Literal[429, 503] = 429
    require_api_key: str | None = None
    rpd: Limit = 0
    limit_style: MockLimitStyle = "openai"
    quota_exhausted: bool = False
    faults: FaultSpec = msgspec.field(default_factory=FaultSpec)
    down: bool = False
    context_window: Limit = 0


#: Chat requests whose ``traceparent`` header :class:`MockStats` keeps (the last ones).
TRACEPARENTS_KEPT: Final = 1000


class MockStats(Struct, frozen=True, kw_only=True):
    """Counters since start. ``rate_limited`` counts every 429 (rate or busy);
    ``busy`` counts concurrency rejections (429 or 503); ``failed`` counts
    injected failures; ``disconnects`` counts clients that went away before
    their answer was complete (while sending the request, waiting or
    streaming: a normal event, never logged as an error); ``last_request`` is
    the last chat request body, as sent; ``faults`` counts injected faults by
    kind (``down`` for connections reset while down), which are counted in
    none of the other counters but ``requests``, ``streamed`` and
    ``disconnects``; ``traceparents`` is the ``traceparent`` header of each of
    the last :data:`TRACEPARENTS_KEPT` chat requests, in arrival order
    (``None``: it had none).
    """

    requests: int = 0
    streamed: int = 0
    completed: int = 0
    failed: int = 0
    rate_limited: int = 0
    busy: int = 0
    bad_requests: int = 0
    tokens_out: int = 0
    in_flight: int = 0
    max_in_flight_seen: int = 0
    disconnects: int = 0
    last_request: Any = None
    faults: dict[str, int] = {}
    traceparents: list[str | None] = []


class Counters:
    """The live counters :class:`MockStats` reports, kept by the server and its answers."""

    __slots__ = (
        "bad_requests",
        "busy",
        "completed",
        "disconnects",
        "failed",
        "in_flight",
        "max_in_flight_seen",
        "rate_limited",
        "requests",
        "streamed",
        "tokens_out",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    requests: int
    streamed: int
    completed: int
    failed: int
    rate_limited: int
    busy: int
    bad_requests: int
    tokens_out: int
    in_flight: int
    max_in_flight_seen: int
    disconnects: int

    def stats(
        self,
        *,
        last_request: Any,
        faults: dict[str, int],
        traceparents: list[str | None] | None = None,
    ) -> MockStats:
        """The counters as :class:`MockStats`, with the last request, the faults
        counted and the last requests' ``traceparent`` headers."""
        return MockStats(
            requests=self.requests,
            streamed=self.streamed,
            completed=self.completed,
            failed=self.failed,
            rate_limited=self.rate_limited,
            busy=self.busy,
            bad_requests=self.bad_requests,
            tokens_out=self.tokens_out,
            in_flight=self.in_flight,
            max_in_flight_seen=self.max_in_flight_seen,
            disconnects=self.disconnects,
            last_request=last_request,
            faults=faults,
            traceparents=traceparents or [],
        )
