"""Every error Ren-Queue raises, under one root.

The tree, by what a caller can do about it::

    RenQueueError
    ├── ConfigError                 bad config file or value; carries the field path
    ├── ProvisionError              a stream/consumer change NATS cannot apply in place
    ├── EmbeddedServerError         the embedded nats-server did not start
    ├── ConnectionFailedError       NATS unreachable / JetStream not answering
    ├── NatsError                   a NATS operation failed (translated in renqueue.schema)
    │   ├── NatsUnavailableError    the broker did not answer; try again
    │   │   ├── NatsTimeoutError    no answer in time (also a TimeoutError)
    │   │   ├── NatsNoRespondersError  no one subscribes to a request's subject
    │   │   ├── NatsClosedError     the connection is closed for good
    │   │   └── StoreFullError      a stream's max_bytes or the server's store is full
    │   ├── NatsNotFoundError       no such message, key, stream, consumer or bucket
    │   ├── WrongLastSequenceError  a compare-and-set found its subject moved on
    │   └── NatsApiError            JetStream refused; carries status, err_code
    │       └── TenantBacklogFullError  the tenant has router.tenant_backlog requests
    │                                   waiting at that level: not stored; later
    ├── ServiceFailedError          a service loop cannot go on: the process stops
    ├── ProjectionVersionError      the stored projection is a newer version's: a
    │                               newer projector runs; this one must not write
    ├── InvalidRequestError         the request itself is wrong (never retried)
    │   ├── MalformedRequestError   payload does not decode or fails validation
    │   ├── UnknownRouteError       no such route (model group)
    │   ├── NoCapableBackendError   no backend of the route has the tier asked for
    │   ├── OverCostCapError        every backend of the route would cost more than max_cost
    │   ├── BudgetExhaustedError    the tenant's hard daily budget is spent (until 00:00 UTC)
    │   ├── UnknownPriorityError    no such priority level
    │   ├── OutOfRangeError         a field past its bound (stop, seed, deadline, v, metadata)
    │   └── UnprocessableRequestError  the services failed on it again and again: ended
    ├── BackendError                a backend call failed; carries backend, request_id,
    │   │                           and its class (``failure``, a FailureClass)
    │   ├── RateLimitedError        429 / quota; carries retry_after seconds, quota_exhausted
    │   ├── RetryableBackendError   5xx, timeouts, connection errors, broken streams
    │   ├── FatalBackendError       auth, unknown model: this backend cannot serve
    │   └── BadRequestError         the backend says the request is invalid (4xx)
    ├── RequestFailedError          client side: a request ended in a non-completed state
    │   ├── RequestRejectedError    rejected as invalid before routing
    │   ├── RequestExpiredError     its deadline passed
    │   └── RequestCancelledError   cancelled
    ├── TokensExpiredError          client side: a request ended, its token stream is no
    │                               longer stored (past ``nats.tokens.max_age``)
    └── TokensNotStreamedError      client side: the request was submitted with
                                    ``stream=False``: it has no token stream

Foreign errors (httpx, nats, msgspec) are translated once, at the boundary
where they occur, with ``raise ... from exc``. Messages never contain secrets.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

__all__ = [
    "BackendError",
    "BadRequestError",
    "BudgetExhaustedError",
    "ConfigError",
    "ConnectionFailedError",
    "EmbeddedServerError",
    "FailureClass",
    "FatalBackendError",
    "InvalidRequestError",
    "MalformedRequestError",
    "NatsApiError",
    "NatsClosedError",
    "NatsError",
    "NatsNoRespondersError",
    "NatsNotFoundError",
    "NatsPayloadTooLargeError",
    "NatsTimeoutError",
    "NatsUnavailableError",
    "NoCapableBackendError",
    "OutOfRangeError",
    "OverCostCapError",
    "PriorityNotAllowedError",
    "ProjectionVersionError",
    "ProvisionError",
    "RateLimitedError",
    "RenQueueError",
    "RequestCancelledError",
    "RequestExpiredError",
    "RequestFailedError",
    "RequestRejectedError",
    "RetryableBackendError",
    "ServiceFailedError",
    "StoreFullError",
    "TenantBacklogFullError",
    "TokensExpiredError",
    "TokensNotStreamedError",
    "UnknownPriorityError",
    "UnknownRouteError",
    "UnprocessableRequestError",
    "UnsupportedFeatureError",
    "WrongLastSequenceError",
]


class RenQueueError(Exception):
    """Root of every error Ren-Queue raises."""

    #: Stable machine-readable name, used as ``error_type`` in events.
    code = "error"


class ConfigError(RenQueueError):
    """The configuration is invalid. ``path`` names the offending field."""

    code = "config"

    def __init__(self, message: str, *, path: str = "$", source: str | None = None) -> None:
        self.path = path
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{message} (at {path})")


class ProvisionError(RenQueueError):
    """A stream or consumer exists with a config that cannot be changed in place."""

    code = "provision"


class EmbeddedServerError(RenQueueError):
    """The embedded nats-server could not be started or stopped."""

    code = "embedded_server"


class ConnectionFailedError(RenQueueError):
    """NATS or JetStream is not reachable."""

    code = "connection"


class NatsError(RenQueueError):
    """A NATS or JetStream operation failed (nats-py's error, translated once,
    in ``renqueue.schema``; the original is the ``__cause__``)."""

    code = "nats"


class NatsUnavailableError(NatsError):
    """The broker did not answer: no responders, no stream leader yet, a
    reconnect, a full outbound buffer. Worth trying again."""

    code = "nats_unavailable"


class NatsTimeoutError(NatsUnavailableError, TimeoutError):
    """No answer in time, or a fetch that found no message within its timeout."""

    code = "nats_timeout"


class NatsNoRespondersError(NatsUnavailableError):
    """A request found no one subscribed to its subject (JetStream not up, a
    worker gone)."""

    code = "nats_no_responders"


class NatsClosedError(NatsUnavailableError):
    """The connection is closed: it will not come back by itself."""

    code = "nats_closed"


class StoreFullError(NatsUnavailableError):
    """JetStream refused to store a message: the stream is at its ``max_bytes``
    (``discard: new``: ``RQ_REQUESTS``, ``RQ_DISPATCH``, ``RQ_EVENTS``, the
    buckets) or the server's file store is full (its ``max_file_store``).
    Nothing was stored. It passes when room comes back (a limit raised, old
    data aged out, waiting work done): the services wait for it; a submit
    raises it at once (docs/operations.md#storage)."""

    code = "store_full"

    def __init__(self, message: str, *, err_code: int | None = None) -> None:
        self.err_code = err_code
        super().__init__(message)


class NatsNotFoundError(NatsError):
    """No such message, key, stream, consumer or bucket."""

    code = "nats_not_found"


class WrongLastSequenceError(NatsError):
    """A compare-and-set (a KV create or update, a publish with an expected
    last subject sequence) found its subject moved on."""

    code = "nats_wrong_last_sequence"


class NatsApiError(NatsError):
    """JetStream refused the operation. ``status`` is the HTTP-like code,
    ``err_code`` nats-server's own (its errors.json)."""

    code = "nats_api"

    def __init__(
        self, message: str, *, status: int | None, err_code: int | None, plain: bool = False
    ) -> None:
        self.status = status
        self.err_code = err_code
        # ``plain``: ``message`` is for the submitter (a rejected event's reason,
        # which the gateway answers with): the broker's codes stay in the fields.
        super().__init__(message if plain else f"{message} (status {status}, err_code {err_code})")


class TenantBacklogFullError(NatsApiError):
    """A submit refused by the broker: the tenant already has
    ``router.tenant_backlog`` requests waiting to be routed at that level (the
    requests stream's ``max_msgs_per_subject``; its subject is the tenant's).
    Nothing was stored; submit it again once some of those are routed. With
    binding split in groups, also why a request sent without its route is
    ended ``rejected`` (its route's subject full: it cannot be forwarded)."""

    code = "tenant_backlog_full"


class NatsPayloadTooLargeError(NatsError):
    """A message over the server's ``max_payload`` (1 MB by default; the
    embedded server's is 8 MB): refused before it was sent, so never stored."""

    code = "nats_payload_too_large"


class ServiceFailedError(RenQueueError):
    """A background loop of a service cannot go on; the process shuts down.

    Raised by :func:`renqueue.services.run_until_signalled` after an orderly
    shutdown, so a process supervisor restarts the process.
    """

    code = "service_failed"


class ProjectionVersionError(RenQueueError):
    """The stored projection has a newer schema than this projector folds.

    Overwriting it would make the newer projector fold the log again from the
    start, and so on in turn: this one stops instead (upgrade every projector,
    or stop the newer ones).
    """

    code = "projection_version"

    def __init__(self, stored: int, current: int) -> None:
        super().__init__(
            f"the stored projection has schema v{stored}, newer than this version's"
            f" v{current}: a newer projector runs; stop this one or upgrade it"
        )
        self.stored = stored
        self.current = current


class InvalidRequestError(RenQueueError):
    """The request is invalid; retrying it unchanged cannot succeed."""

    code = "invalid_request"

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        self.request_id = request_id
        super().__init__(message)


class MalformedRequestError(InvalidRequestError):
    """The payload does not decode, or a field fails validation."""

    code = "malformed"


class UnknownRouteError(InvalidRequestError):
    """The request names a route (model group) that is not configured."""

    code = "unknown_route"

    def __init__(self, route: str, *, request_id: str | None = None) -> None:
        self.route = route
        super().__init__(f"unknown route {route!r}", request_id=request_id)


class NoCapableBackendError(InvalidRequestError):
    """The request's ``complexity`` is above the tier of every backend of its route.

    Decided from the config alone, so it is final: waiting would never help.
    """

    code = "no_capable_backend"

    def __init__(
        self, route: str, complexity: int, best: int, *, request_id: str | None = None
    ) -> None:
        self.route = route
        super().__init__(
            f"complexity {complexity} is above every backend of route {route!r} "
            f"(the highest tier there is {best})",
            request_id=request_id,
        )


class UnprocessableRequestError(InvalidRequestError):
    """Handling the request failed again and again for a reason other than
    the broker (a bug it triggers): it is ended (rejected, with a dead letter)
    instead of stopping the loop that reads its level on every delivery."""

    code = "unprocessable"


class UnsupportedFeatureError(InvalidRequestError):
    """The request needs what no backend of its route can do (tools, images,
    a JSON schema, logprobs: ``policy.needs``, each backend's ``features``).

    Decided from the config alone, so it is final: waiting would never help.
    """

    code = "unsupported_feature"

    def __init__(self, route: str, features: list[str], *, request_id: str | None = None) -> None:
        self.route = route
        self.features = features
        super().__init__(
            f"no backend of route {route!r} supports {', '.join(features)} "
            "(each backend's features in the config)",
            request_id=request_id,
        )


class PriorityNotAllowedError(InvalidRequestError):
    """The request's level is more urgent than its tenant's ``max_priority``."""

    code = "priority_not_allowed"

    def __init__(
        self, tenant: str, level: str, allowed: str, *, request_id: str | None = None
    ) -> None:
        super().__init__(
            f"tenant {tenant!r} may submit at {allowed!r} or less urgent, not {level!r}",
            request_id=request_id,
        )


class OverCostCapError(InvalidRequestError):
    """The request's ``max_cost`` is below the estimated cost of every backend of its route.

    The estimate (prompt characters / 4 and ``max_tokens``, or 1024 output
    tokens, at each backend's prices) is from the config alone, so it is
    final: set ``max_tokens``, raise the cap, or add a cheaper backend.
    """

    code = "over_cost_cap"

    def __init__(
        self, route: str, max_cost: float, cheapest: float, *, request_id: str | None = None
    ) -> None:
        self.route = route
        self.max_cost = max_cost
        self.cheapest = cheapest
        super().__init__(
            f"max_cost ${max_cost:.6g} is below the estimated cost on every backend of route"
            f" {route!r} (the cheapest: ${cheapest:.6g}; set max_tokens for a closer estimate)",
            request_id=request_id,
        )


class BudgetExhaustedError(InvalidRequestError):
    """The tenant's daily budget refuses the request until the UTC day ends
    (``resets_at``, Unix time): its hard budget is spent (``cost`` is
    ``None``), or what is left of its budget, soft or hard (``mode``), is
    less than the request would cost (``cost``: its cheapest estimate) on
    every backend of its route (all paid). Unlike the other invalid requests,
    the same request may be sent again after that, or a smaller one now."""

    code = "budget_exhausted"

    def __init__(
        self,
        tenant: str,
        daily: float,
        spent: float,
        resets_at: float,
        *,
        request_id: str | None = None,
        mode: str = "hard",
        cost: float | None = None,
    ) -> None:
        self.tenant = tenant
        self.daily = daily
        self.spent = spent
        self.resets_at = resets_at
        self.mode = mode
        self.cost = cost
        when = datetime.fromtimestamp(resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if cost is None:
            message = (
                f"tenant {tenant!r} spent {_dollars(spent)} of its {mode} daily budget of"
                f" {_dollars(daily)}; new requests are refused until {when}"
            )
        else:
            message = (
                f"tenant {tenant!r} has {_dollars(max(0.0, daily - spent))} left of its {mode}"
                f" daily budget of {_dollars(daily)} ({_dollars(spent)} spent today), and this"
                f" request would cost up to {_dollars(cost)} on the cheapest backend of its"
                f" route (all paid): ask for fewer tokens (max_tokens), or send it after {when}"
            )
        super().__init__(message, request_id=request_id)


def _dollars(amount: float) -> str:
    """US dollars for a person: cents from a cent on, else four significant digits."""
    if amount >= 0.01:
        return f"${amount:,.2f}"
    return f"${amount:.4g}"


class UnknownPriorityError(InvalidRequestError):
    """The request names a priority level that is not configured."""

    code = "unknown_priority"

    def __init__(self, priority: str, *, request_id: str | None = None) -> None:
        self.priority = priority
        super().__init__(
            f"unknown priority level {priority!r} (no stream stores rq.req.{priority}.>; "
            "or the NATS cluster did not answer in time)",
            request_id=request_id,
        )


class OutOfRangeError(InvalidRequestError):
    """A field is past the bound admission holds it to (``field`` names it:
    ``params.stop``, ``params.seed``, ``deadline``, ``v``, ``metadata``, a
    cancellation's ``reason``), however well-formed: see docs/wire-format.md."""

    code = "out_of_range"

    def __init__(self, field: str, message: str, *, request_id: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}", request_id=request_id)


class FailureClass(enum.StrEnum):
    """What went wrong with a backend call, as the failure policy sees it.

    Adapters classify every failure they raise (``BackendError.failure``);
    the class, not the exception type, decides what happens next (retry here,
    fall back down the route, fail: :func:`renqueue.policy.after_failure`).
    The value is what events carry (``error_class``).
    """

    #: Connection refused, reset or dropped before an answer began.
    CONNECT = "connect"
    #: No connection within ``connect_timeout``.
    CONNECT_TIMEOUT = "connect_timeout"
    #: Connected, but no first token within ``first_token_timeout``.
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"  # noqa: S105 - not a password
    #: The whole call took longer than ``total_timeout``.
    TOTAL_TIMEOUT = "total_timeout"
    #: The backend went silent between tokens for longer than ``timeout``.
    STALL = "stall"
    #: 429: too many requests or tokens for now; ``retry_after`` says when.
    RATE_LIMITED = "rate_limited"
    #: 429 saying the quota is spent for long (a daily quota, no credit).
    QUOTA_EXHAUSTED = "quota_exhausted"
    #: 503 / 529: the backend is overloaded or not ready.
    OVERLOADED = "overloaded"
    #: Any other 5xx (and 408, 409).
    SERVER_ERROR = "server_error"
    #: The backend says the request is invalid (4xx): no backend will take it.
    BAD_REQUEST = "bad_request"
    #: The prompt (plus the requested output) does not fit this model's context.
    CONTEXT_LENGTH = "context_length"
    #: The provider's content filter refused the prompt or the answer.
    CONTENT_FILTER = "content_filter"
    #: A response or stream that does not parse, or an error sent in-band.
    MALFORMED = "malformed"
    #: The call failed after tokens had already been streamed (its cause in the message).
    BROKEN_STREAM = "broken_stream"
    #: This backend cannot serve at all (auth, unknown model, misconfiguration).
    UNAVAILABLE = "unavailable"


class BackendError(RenQueueError):
    """A backend call failed. ``failure`` is its class (see :class:`FailureClass`)."""

    code = "backend"
    #: Whether the same request may succeed if tried again (here or elsewhere).
    retryable = False
    #: The class of a failure raised without one.
    default_failure = FailureClass.UNAVAILABLE

    def __init__(
        self,
        message: str,
        *,
        backend: str,
        request_id: str | None = None,
        status: int | None = None,
        failure: FailureClass | None = None,
    ) -> None:
        self.backend = backend
        self.request_id = request_id
        self.status = status
        self.failure = failure if failure is not None else self.default_failure
        super().__init__(f"{backend}: {message}")


class RateLimitedError(BackendError):
    """The backend refused for rate or quota reasons; try again after ``retry_after``.

    ``quota_exhausted``: the provider said the quota is gone for long (a daily
    quota, or out of credit), so retrying soon is pointless;
    ``quota_exhausted_until`` is the Unix time it comes back, ``None`` if unknown.
    """

    code = "rate_limited"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        backend: str,
        retry_after: float | None = None,
        request_id: str | None = None,
        status: int | None = 429,
        quota_exhausted: bool = False,
        quota_exhausted_until: float | None = None,
    ) -> None:
        self.retry_after = retry_after
        self.quota_exhausted = quota_exhausted
        self.quota_exhausted_until = quota_exhausted_until
        super().__init__(
            message,
            backend=backend,
            request_id=request_id,
            status=status,
            failure=FailureClass.QUOTA_EXHAUSTED if quota_exhausted else FailureClass.RATE_LIMITED,
        )


class RetryableBackendError(BackendError):
    """A transient failure: server error, timeout, dropped connection."""

    code = "backend_unavailable"
    retryable = True
    default_failure = FailureClass.SERVER_ERROR


class FatalBackendError(BackendError):
    """This backend cannot serve requests (auth, unknown model, misconfiguration)."""

    code = "backend_fatal"


class BadRequestError(BackendError):
    """The backend rejected the request itself as invalid."""

    code = "backend_bad_request"
    default_failure = FailureClass.BAD_REQUEST


class RequestFailedError(RenQueueError):
    """Client side: the request ended in a terminal state other than completed."""

    code = "failed"

    def __init__(self, message: str, *, request_id: str, error_type: str = "failed") -> None:
        self.request_id = request_id
        self.error_type = error_type
        super().__init__(f"request {request_id}: {message}")


class RequestRejectedError(RequestFailedError):
    """The request was rejected as invalid before it was routed."""

    code = "rejected"


class RequestExpiredError(RequestFailedError):
    """The request's deadline passed before it could finish."""

    code = "expired"


class RequestCancelledError(RequestFailedError):
    """The request was cancelled."""

    code = "cancelled"


class TokensExpiredError(RenQueueError):
    """Client side: the request has ended, but its token stream is no longer stored.

    Token chunks are kept ``nats.tokens.max_age`` (1 h by default) in
    ``RQ_TOKENS``; a stream followed after that cannot be replayed. The
    outcome (and a completed request's whole text) is still in the event log:
    use ``RequestHandle.result()``. ``outcome`` is the terminal event's kind
    (``completed``, ``failed``, ...).
    """

    code = "tokens_expired"

    def __init__(self, *, request_id: str, outcome: str) -> None:
        self.request_id = request_id
        self.outcome = outcome
        super().__init__(
            f"request {request_id} has ended ({outcome}) but its token stream is no longer "
            "stored (tokens are kept for nats.tokens.max_age, 1 h by default): "
            "use result() for its outcome and text"
        )


class TokensNotStreamedError(RenQueueError):
    """Client side: ``stream()`` on a request submitted with ``stream=False``.

    Such a request stores no token chunk: its answer is whole in its
    ``completed`` event. Use ``RequestHandle.result()``.
    """

    code = "tokens_not_streamed"

    def __init__(self, *, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(
            f"request {request_id} was submitted with stream=False: it has no token "
            "stream; use result() for its outcome and whole text"
        )
