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
    UnknownPriorityError,
    UnknownRouteError,
    UnsupportedFeatureError,
)
from ..policy import ALL_FEATURES, day_ends, nothing_could_serve
from ..schema import Cancelled, Event, Expired, Failed, Rejected

__all__ = ["ApiError", "from_error", "from_terminal"]

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


class ApiError(Exception):
    """A failure as the HTTP answer it becomes."""

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
        self.code = code
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
        return ApiError(400, _first_line(str(exc)), param=_param_of(str(exc)))
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
