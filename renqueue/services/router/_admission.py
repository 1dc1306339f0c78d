"""Reading a fetched request: what it is, whose it is, and when its wait began.

The subject is the authority: the tenant is the subject's, and a rejection is
recorded under the payload's id, else the message id's, always in the
subject's tenant. Waiting is measured in server time: a request's wait begins
at the timestamp the broker gave its message when it was stored (a requeue
after a preemption or a spent quota keeps the one logged in its ``submitted``
event), never at a time a client wrote into the payload.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Final, NamedTuple

import msgspec

from ...broker import JetStream, Message, submitted_of
from ...config import Config
from ...errors import InvalidRequestError, MalformedRequestError, NatsNotFoundError
from ...logs import get_logger
from ...policy import validate
from ...schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUEST_DECODER,
    Coalesced,
    Event,
    FellBack,
    InferenceRequest,
    Preempted,
    Retrying,
    Submitted,
    TraceParent,
    encode,
    event_subject,
    is_requeue_subject,
    parse_traceparent,
    route_of_subject,
)
from ._hold import stored_at

__all__ = [
    "Arrival",
    "Pause",
    "Refused",
    "admit",
    "arrival",
    "claimed_id",
    "parent_of",
    "pause_of",
    "rejection_id",
    "subject_token",
]

log = get_logger("router")

#: An id (a tenant, a request id): 1 to 128 of ``A-Z a-z 0-9 - _``.
_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


#: The most a request's JSON grows when the services encode it again (a
#: 3-byte number such as ``9e9`` takes at most ~24): requests smaller than
#: ``max_bytes`` over this are not encoded again to check.
_MOST_GROWTH: Final = 8


class Refused(NamedTuple):
    """A request that must be rejected: the id and tenant to record it under, and why."""

    request_id: str
    tenant: str
    error: InvalidRequestError


def admit(
    msg: Message, level: str, config: Config, *, max_bytes: int | None = None
) -> InferenceRequest | Refused:
    """Decode and validate one request fetched from ``level``'s subject; one
    over ``max_bytes`` (:func:`~renqueue.schema.request_limit` of the broker's
    ``max_payload``) is refused: the services' own messages carrying it
    would be over the broker's limit."""
    subject, data = msg.subject, msg.data
    tenant = subject_token(subject, 3)
    header = str((msg.headers or {}).get("Nats-Msg-Id", ""))
    if max_bytes is not None and len(data) > max_bytes:
        too_big = MalformedRequestError(
            f"the request is {len(data)} bytes, over the {max_bytes} the broker's "
            "largest message leaves for it (send images by https URL, or smaller)"
        )
        return Refused(rejection_id(msg)[0], tenant, too_big)
    request: InferenceRequest | None = None
    try:
        request = REQUEST_DECODER.decode(data)
        if max_bytes is not None and len(data) > max_bytes // _MOST_GROWTH:
            # Numbers re-encode longer than a client may write them (``9e15``:
            # ``9000000000000000.0``): what the services write must fit too.
            size = len(encode(request))
            if size > max_bytes:
                raise MalformedRequestError(
                    f"the request is {size} bytes as the services write it, over the "
                    f"{max_bytes} the broker's largest message leaves for it (write "
                    "numbers out in full, send images by https URL, or send less)"
                )
        validate(
            request,
            level=level,
            tenant=tenant,
            config=config,
            message_id=header,
            requeue=is_requeue_subject(subject),
            now=stored_at(msg),
            route=route_of_subject(subject),
        )
    except (msgspec.DecodeError, InvalidRequestError) as exc:
        error = exc if isinstance(exc, InvalidRequestError) else MalformedRequestError(str(exc))
        # Under the payload's id once it decodes (see rejection_id).
        request_id = rejection_id(msg)[0] if request is None else request.id
        return Refused(request_id, tenant, error)
    return request


def rejection_id(msg: Message) -> tuple[str, str]:
    """``(request id, tenant)`` to record a rejection of ``msg`` under before
    its payload is read: the tenant is the subject's, the id the
    ``Nats-Msg-Id`` header's (``<tenant>:<id>``), else ``invalid-<stream seq>``.
    A payload that decodes names the id instead (see :func:`admit`)."""
    tenant = subject_token(msg.subject, 3)
    claimed = claimed_id(msg)
    request_id = f"invalid-{msg.metadata.sequence.stream}" if claimed is None else claimed[1]
    return request_id, tenant


def claimed_id(msg: Message) -> tuple[str, str] | None:
    """``(tenant, request id)`` that ``msg``'s ``Nats-Msg-Id`` names, if it names
    one in the subject's tenant (``<tenant>:<id>``, or a requeue's
    ``<tenant>:<id>:requeue:...``): an admitted request's own, since admission
    requires it. ``None`` when it names none (such a request is rejected)."""
    tenant = subject_token(msg.subject, 3)
    header = str((msg.headers or {}).get("Nats-Msg-Id", ""))
    scope, _, rest = header.partition(":")
    request_id = rest.partition(":")[0]
    return (tenant, request_id) if scope == tenant and _is_id(request_id) else None


class Pause(NamedTuple):
    """A backend whose provider said its quota is spent (or, not ``exhausted``,
    answered 429: "not now"), and until when (Unix time)."""

    backend: str
    until: float
    exhausted: bool = True


class Arrival(NamedTuple):
    """When a fetched request's wait began, and what its putting back says of
    the backend it was put back from."""

    #: When its wait began, in server time.
    submitted: float
    #: Put back because that backend's quota is spent (a ``retrying`` event of
    #: its attempt that says ``requeued``): the backend is out until then, and
    #: the binder binds nothing there before (:meth:`Ledger.pause`). ``None``:
    #: not put back for a spent quota.
    paused: Pause | None = None
    #: A request put back: the trace its first ``submitted`` event logged
    #: (for a copy that came back without a ``traceparent`` header).
    trace: TraceParent | None = None


def pause_of(event: Retrying) -> Pause:
    """Until when the backend that put a request back for a spent quota is out:
    the reset the provider named (``quota_exhausted_until``), or, if later (or
    when it named none), the time the worker left it out for (``at +
    retry_after``: the provider's ``retry-after``, or ``worker.quota_hold``)."""
    until = event.at + event.retry_after
    if event.quota_exhausted_until is not None:
        until = max(until, event.quota_exhausted_until)
    return Pause(event.backend, until)


async def arrival(js: JetStream, msg: Message, request: InferenceRequest) -> Arrival:
    """When the request's wait began, in server time (never the payload's clock).

    A first submit: when the broker stored it. A request the services put
    back (``requeues > 0``) keeps its original time, the one logged in its
    ``submitted`` event, when the log shows why it was put back: a
    preemption (a ``preempted`` event of that attempt), a fallback (the
    last ``fell_back`` event is of that attempt), a spent quota (a
    ``retrying`` event of that attempt that says ``requeued``, among all of
    that attempt's ``retrying`` events: its backend and until when it is out
    are ``paused``), or a coalescing group whose leader ended on its own (a
    ``coalesced`` event: it was a follower). Only the services write those
    subjects. Anything else counts from its own storing.
    """
    stored = stored_at(msg)
    if request.requeues == 0:
        return Arrival(stored)

    async def logged(kind: str) -> tuple[Event | None, int]:
        subject = event_subject(request.tenant, request.id, kind)
        try:
            raw = await js.get_last_msg(EVENTS_STREAM, subject)
            return EVENT_DECODER.decode(raw.data), raw.seq
        except (NatsNotFoundError, msgspec.DecodeError):
            return None, 0

    first, _ = await logged("submitted")
    if not isinstance(first, Submitted):
        return Arrival(stored)
    trace = parse_traceparent(first.traceparent)
    kept = await _why_put_back(js, request, logged)
    if kept is None:
        return Arrival(stored, trace=trace)
    paused = kept if isinstance(kept, Pause) else None
    return Arrival(min(stored, first.at), paused=paused, trace=trace)


async def _why_put_back(
    js: JetStream,
    request: InferenceRequest,
    logged: Callable[[str], Awaitable[tuple[Event | None, int]]],
) -> Pause | bool | None:
    """Why the log says ``request`` was put back (see :func:`arrival`): the
    pause of a spent quota or of a 429 it fell back from, ``True`` for a
    preemption, another fallback or a coalescing group, ``None`` when it
    says nothing."""
    preempted, _ = await logged("preempted")
    if isinstance(preempted, Preempted) and preempted.attempt == request.requeues:
        return True
    if request.fallback is not None:
        fell, _ = await logged("fell_back")
        if isinstance(fell, FellBack) and fell.attempt == request.requeues:
            if fell.error_type == "rate_limited" and fell.retry_after > 0:
                # A 429: its backend cools down for everyone, from now on,
                # whether or not the projection has folded it yet.
                return Pause(fell.backend, fell.at + fell.retry_after, exhausted=False)
            return True
    requeued = await _requeued(js, request, logged)
    if requeued is not None:
        return pause_of(requeued)
    coalesced, _ = await logged("coalesced")
    return True if isinstance(coalesced, Coalesced) else None


async def _requeued(
    js: JetStream,
    request: InferenceRequest,
    logged: Callable[[str], Awaitable[tuple[Event | None, int]]],
) -> Retrying | None:
    """The ``retrying`` event that put ``request`` back for a spent quota, of
    the attempt it was put back from (``requeues``), if the log has one.

    Every ``retrying`` event of that attempt is looked at, not only the last:
    another may follow the one that says ``requeued``. The last one is read
    first (one direct get: the usual case); only if it is not that one are
    the request's ``retrying`` events read in order, up to it.
    """
    last, seq = await logged("retrying")
    if not isinstance(last, Retrying):
        return None
    if last.attempt == request.requeues and last.requeued:
        return last
    subject = event_subject(request.tenant, request.id, "retrying")
    start = 1
    while start <= seq:
        try:
            raw = await js.get_msg(EVENTS_STREAM, seq=start, subject=subject, next=True)
        except NatsNotFoundError:
            return None
        start = raw.seq + 1
        try:
            event = EVENT_DECODER.decode(raw.data or b"")
        except msgspec.DecodeError:
            continue
        if isinstance(event, Retrying) and event.attempt == request.requeues and event.requeued:
            return event
    return None


async def parent_of(
    js: JetStream, request: InferenceRequest, config: Config
) -> tuple[int, float] | None:
    """The parent's level and submit time, from its ``submitted`` event.

    Looked up under the request's own tenant only: a tenant cannot borrow
    another tenant's priority. An unknown parent means no inheritance.
    """
    if request.parent_id is None:
        return None
    try:
        parent = await submitted_of(js, request.tenant, request.parent_id, direct=False)
    except Exception as exc:  # noqa: BLE001 - inheritance is best effort, routing is not
        log.warning("parent lookup failed", parent_id=request.parent_id, error=str(exc))
        return None
    if parent is None or parent.request.priority not in config.priorities:
        return None
    return (config.priority_rank(parent.request.priority), parent.at)


def subject_token(subject: str, index: int) -> str:
    """Token ``index`` of ``subject`` if it is a valid id (tenant, ...), else ``"unknown"``."""
    parts = subject.split(".")
    token = parts[index] if len(parts) > index else ""
    return token if _is_id(token) else "unknown"


def _is_id(text: str) -> bool:
    return _ID.fullmatch(text) is not None
