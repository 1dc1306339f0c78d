"""Every way a gateway call fails, as the HTTP status and OpenAI error body it gets.

OpenAI's error shape, which the official SDKs turn into their typed errors
(``AuthenticationError`` for 401, ``NotFoundError`` for 404,
``RateLimitError`` for 429, ``InternalServerError`` for 5xx, ...)::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

The mapping is one pure function per source: :func:`from_terminal` for a
request's terminal event (what Ren-Queue decided), :func:`from_error` for an
exception raised while submitting or following it. Messages name what went
wrong and never carry a key or another tenant's data; an unexpected error is
a 500 whose message says only that (its traceback goes to the log).

``retry_after`` becomes a ``retry-after`` header. ``retry`` sets the SDKs'
``x-should-retry`` header: ``False`` where sending the same request again
cannot help (an expired deadline, a spent budget, a failure that is final),
so the SDK does not retry it for nothing.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from ..errors import (
    InvalidRequestError,
    MalformedRequestError,
    NatsPayloadTooLargeError,
    NatsUnavailableError,
    OutOfRangeError,
    RenQueueError,
    StoreFullError,
    TenantBacklogFullError,
    UnknownPriorityError,
    UnknownRouteError,
    UnsupportedFeatureError,
)
from ..policy import ALL_FEATURES, day_ends, nothing_could_serve
from ..schema import Cancelled, Event, Expired, Failed, Rejected

__all__ = ["ApiError", "from_error", "from_terminal", "reason_of", "validation_code"]

INVALID: Final = "invalid_request_error"
SERVER: Final = "server_error"

#: Failure classes (``Failed.error_class``) that say no backend could serve
#: the request (503), and those that say the request itself is at fault (400).
_UNAVAILABLE: Final = frozenset(
    {"connect", "connect_timeout", "overloaded", "unavailable", "rate_limited", "quota_exhausted"}
)
_BAD_REQUEST: Final = frozenset({"bad_request", "context_length", "content_filter"})
_CODES: Final = {"context_length": "context_length_exceeded", "content_filter": "content_filter"}
#: The body field that asks for each feature (``policy.needs``).
_FEATURE_PARAMS: Final = {
    "tools": "tools",
    "vision": "messages",
    "image_urls": "messages",
    "json": "response_format",
    "json_schema": "response_format",
    "logprobs": "logprobs",
}


#: The code of an answer whose raiser gave none, by status: no answer's
#: ``code`` is null, so a client can always tell one refusal from another.
STATUS_CODES: Final = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    410: "gone",
    413: "request_too_large",
    422: "unprocessable_entity",
    429: "rate_limit_exceeded",
    431: "headers_too_large",
    500: "internal_error",
    502: "backend_error",
    503: "unavailable",
    504: "deadline_exceeded",
}

#: Every ``code`` the gateway itself answers with (docs/gateway.md's table has
#: each): the label values of ``renqueue_gateway_rejected_total``. A code from
#: elsewhere (a rejection's ``error_type``) outside this set is counted as
#: ``other``, so the label stays bounded whatever an event says.
CODES: Final = frozenset(
    {
        *STATUS_CODES.values(),
        # Validation of a body (msgspec's messages, as OpenAI names them).
        "invalid_json",
        "missing_required_parameter",
        "unknown_parameter",
        "unsupported_parameter",
        "invalid_type",
        "invalid_value",
        "string_above_max_length",
        "string_below_min_length",
        "array_above_max_length",
        "array_below_min_length",
        "object_above_max_size",
        "integer_above_max_value",
        "integer_below_min_value",
        "decimal_above_max_value",
        "decimal_below_min_value",
        "too_many_parameters",
        "invalid_image_url",
        "invalid_header",
        "invalid_id",
        "invalid_tenant",
        # Rejections (the router's, the gateway's own check before it).
        "unknown_priority",
        "priority_not_allowed",
        "over_cost_cap",
        "no_capable_backend",
        "unsupported_feature",
        "malformed",
        "budget_exhausted",
        "context_length_exceeded",
        "content_filter",
        "model_not_found",
        "request_not_found",
        "request_cancelled",
        "stream_expired",
        "stream_restarted",
        "idempotency_key_reused",
        "idempotency_key_unverified",
        "too_many_in_flight",
        "key_in_flight_limit",
        "store_full",
        "tenant_backlog_full",
        "out_of_range",
        "no_backend_available",
        # The HTTP layer: a request that never got as far as a handler.
        "header_timeout",
        "body_timeout",
        "malformed_http",
        "malformed_body",
        "unsupported_content_encoding",
        # The console.
        "admin_key_required",
        "console_disabled",
        "cross_origin",
    }
)


def reason_of(code: str | None) -> str:
    """``code`` as a bounded metric label: itself if the gateway knows it, else ``other``."""
    return code if code in CODES else "other"


class ApiError(Exception):
    """A failure as the HTTP answer it becomes. Without a ``code`` it gets its
    status's (:data:`STATUS_CODES`): never null."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code: str = code if code is not None else STATUS_CODES.get(status, "error")
        self.param = param
        self.retry_after = retry_after
        self.retry = retry

    def body(self) -> bytes:
        return msgspec.json.encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.retry_after is not None:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
        if self.retry is not None:
            out["x-should-retry"] = "true" if self.retry else "false"
        return out


def bearer_key(values: list[str]) -> str | None:
    """The key of a request's ``Authorization: Bearer <key>`` header (its
    values, ``headers.getall``), or None without one; 400 ``invalid_header``
    when it is sent more than once, since which one would speak is a guess."""
    if len(values) > 1:
        raise ApiError(
            400,
            "the Authorization header is sent more than once: send one",
            code="invalid_header",
            param="Authorization",
        )
    scheme, _, key = (values[0] if values else "").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


def from_terminal(event: Event, *, now: float) -> ApiError:
    """The answer for a request that ended other than completed."""
    rid = event.request_id
    if isinstance(event, Rejected):
        return _rejected(event, now=now)
    if isinstance(event, Expired) and nothing_could_serve(event.reason):
        # Not slow: nothing could serve the route (every backend down).
        return ApiError(
            503,
            f"request {rid} expired: {event.reason}",
            type=SERVER,
            code="no_backend_available",
            retry=False,
        )
    if isinstance(event, Expired):
        return ApiError(
            504,
            f"request {rid} expired: {event.reason or 'its deadline passed'} ({event.stage})",
            type=SERVER,
            code="deadline_exceeded",
            retry=False,
        )
    if isinstance(event, Cancelled):
        return ApiError(
            409,
            f"request {rid} was cancelled: {event.reason or 'cancelled'}",
            code="request_cancelled",
            retry=False,
        )
    if isinstance(event, Failed):
        return _failed(event)
    return ApiError(500, f"request {rid} ended unexpectedly", type=SERVER, code="internal_error")


def _rejected(event: Rejected, *, now: float) -> ApiError:
    rid, kind = event.request_id, event.error_type
    message = f"request {rid} rejected: {event.reason}"
    if kind == "budget_exhausted":
        # The budget is per UTC day: it resets at the end of the day it was refused on.
        resets_at = day_ends(event.at)
        return ApiError(
            429,
            message,
            type="insufficient_quota",
            code="budget_exhausted",
            retry_after=max(1.0, resets_at - now),
            retry=False,
        )
    if kind == TenantBacklogFullError.code:
        # Binding split in groups: sent without its route, to a route where the
        # tenant is at router.tenant_backlog (the forwarder's). Its own limit,
        # as when the broker refuses the submit; not retried as it is (the
        # same body joins this ended request): sent again under a new id.
        return ApiError(429, message, code=kind, retry_after=_STORE_FULL_RETRY, retry=False)
    if kind == "unknown_route":
        return ApiError(404, message, code="model_not_found", param="model", retry=False)
    if kind == "priority_not_allowed":
        return ApiError(403, message, code=kind, param="priority", retry=False)
    if kind == UnsupportedFeatureError.code:
        return _unsupported_feature(message, features_named(event.reason))
    param = {"unknown_priority": "priority", "over_cost_cap": "max_cost"}.get(kind)
    if kind == OutOfRangeError.code:
        # Its reason begins with the field (``params.stop[0]: ...``): the chat API's name.
        field = event.reason.partition(": ")[0].removeprefix("params.")
        param = field.partition("[")[0] or None
    return ApiError(400, message, code=kind, param=param, retry=False)


def _failed(event: Failed) -> ApiError:
    rid, kind = event.request_id, event.error_class
    message = f"request {rid} failed: {event.reason}"
    if kind in _BAD_REQUEST:
        return ApiError(400, message, code=_CODES.get(kind, event.error_type), retry=False)
    if kind in _UNAVAILABLE or event.error_type == "undeliverable":
        return ApiError(503, message, type=SERVER, code="no_backend_available", retry=False)
    return ApiError(502, message, type=SERVER, code="backend_error", retry=False)


def from_error(  # noqa: PLR0911 - one answer per kind of error, in one place
    exc: BaseException, *, route_param: str = "model"
) -> ApiError:
    """The answer for an exception met while submitting or following a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnknownRouteError):
        return ApiError(404, str(exc), code="model_not_found", param=route_param)
    if isinstance(exc, UnknownPriorityError):
        return ApiError(400, str(exc), code="unknown_priority", param="priority")
    if isinstance(exc, UnsupportedFeatureError):
        return _unsupported_feature(str(exc), exc.features)
    if isinstance(exc, MalformedRequestError):
        line = _first_line(str(exc))
        return ApiError(400, line, param=_param_of(str(exc)), code=validation_code(line))
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), code=exc.code)
    if isinstance(exc, StoreFullError):
        # The requests stream is at its max_bytes (discard new), or the server's
        # store is full: nothing was stored; it passes as room comes back.
        return ApiError(
            503,
            "the queue's store is full (nothing was stored); try again later",
            type=SERVER,
            code="store_full",
            retry_after=_STORE_FULL_RETRY,
        )
    if isinstance(exc, TenantBacklogFullError):
        # router.tenant_backlog: this tenant has that many requests waiting at
        # the level already; nothing was stored. Its own limit, as a rate limit is.
        return ApiError(
            429,
            "too many of your requests are waiting at this priority (router.tenant_backlog; "
            "nothing was stored); try again once some have started",
            code="tenant_backlog_full",
            retry_after=_STORE_FULL_RETRY,
        )
    if isinstance(exc, NatsPayloadTooLargeError):
        return ApiError(
            413,
            "the request is larger than the queue's largest message (its images, most "
            "likely: send them by https URL, or smaller)",
            code="request_too_large",
            retry=False,
        )
    if isinstance(exc, NatsUnavailableError | TimeoutError):
        return ApiError(
            503,
            "the queue is not reachable right now; try again shortly",
            type=SERVER,
            code="unavailable",
            retry_after=1.0,
        )
    if isinstance(exc, RenQueueError):
        return ApiError(500, "internal error", type=SERVER, code="internal_error")
    return ApiError(500, "internal error", type=SERVER, code="internal_error")


def _unsupported_feature(message: str, features: list[str]) -> ApiError:
    """A request needing what no backend of its route can do: a 400 whose
    ``param`` is the field asking for the first such feature."""
    param = _FEATURE_PARAMS.get(features[0]) if features else None
    return ApiError(400, message, code=UnsupportedFeatureError.code, param=param, retry=False)


def features_named(reason: str) -> list[str]:
    """The features an ``unsupported_feature`` rejection's reason names
    (:class:`UnsupportedFeatureError`'s message: ``... supports tools, vision (...)``)."""
    _, _, tail = reason.partition(" supports ")
    listed = tail.partition(" (")[0]
    return [name for name in listed.split(", ") if name in ALL_FEATURES]


#: Seconds a ``store_full`` answer asks a client to wait (room comes back as
#: waiting work is done or old data ages out, not within a second).
_STORE_FULL_RETRY: Final = 5.0


#: msgspec's validation messages, by how they start, and the OpenAI code of each.
_VALIDATION: Final = (
    ("Object missing required field", "missing_required_parameter"),
    ("Object contains unknown field", "unknown_parameter"),
    ("Expected `str` of length <=", "string_above_max_length"),
    ("Expected `str` of length >=", "string_below_min_length"),
    ("Expected `array` of length <=", "array_above_max_length"),
    ("Expected `array` of length >=", "array_below_min_length"),
    ("Expected `object` of length <=", "object_above_max_size"),
    ("Expected `int` <=", "integer_above_max_value"),
    ("Expected `int` <", "integer_above_max_value"),
    ("Expected `int` >=", "integer_below_min_value"),
    ("Expected `int` >", "integer_below_min_value"),
    ("Expected `float` <", "decimal_above_max_value"),
    ("Expected `float` >", "decimal_below_min_value"),
)


def validation_code(message: str) -> str:
    """The OpenAI-style ``code`` of a msgspec validation message
    (``Expected `str` of length <= 1000000 - at `$.messages[0].content```)."""
    for start, code in _VALIDATION:
        if message.startswith(start):
            return code
    if message.startswith("Expected `") and ", got `" in message:
        return "invalid_type"
    return "invalid_value"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else "invalid request"


def _param_of(text: str) -> str | None:
    """The field a msgspec validation message names (``... - at `$.params.top_p```)."""
    _, sep, where = text.partition(" - at `$.")
    if not sep:
        return None
    path = where.rstrip("`")
    # The wire's nesting, as the chat API names its fields.
    for wire, api in (("params.", ""), ("metadata", "metadata")):
        if path.startswith(wire):
            path = api + path[len(wire) :]
    return path or None
