"""How the client rides out a broker that does not answer for a while.

A read a caller waits on anyway (a stream's next chunk, a result) is retried
with a capped backoff while it fails transiently (:func:`retrying`). A
submit's publish is sent again under the same message id while the broker
does not answer, for :attr:`Client.submit_patience
<renqueue.client.Client.submit_patience>` seconds or until the request's
deadline (:func:`publish`): the broker's duplicate window makes that safe.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from ..broker import Connection, JetStreamApi, reply_error, trace_headers
from ..errors import (
    NatsClosedError,
    NatsNoRespondersError,
    NatsPayloadTooLargeError,
    NatsUnavailableError,
    StoreFullError,
    TenantBacklogFullError,
    UnknownPriorityError,
)
from ..logs import get_logger
from ..schema import (
    REQUESTS_STREAM,
    InferenceRequest,
    TraceParent,
    encode,
    msg_id,
    request_limit,
    request_subject,
    subject_matches,
)

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["TRANSIENT", "Published", "publish", "retrying"]

T = TypeVar("T")

log = get_logger("client")

#: Failures of a read that pass by themselves: a timeout (nats-py's is a
#: TimeoutError too), no responders or a 503 while a stream leader is elected,
#: a connection that is reconnecting. A closed connection is not one of them.
TRANSIENT: Final = (TimeoutError, NatsUnavailableError)
#: A transient failure of a read is retried after this, doubling up to _RETRY_MAX.
_RETRY_FIRST: Final = 0.1
_RETRY_MAX: Final = 2.0
#: Longest one try of a submit's publish waits for its ack (nats-py's default
#: for a JetStream request); a retry waits no longer than the time left.
_PUBLISH_WAIT: Final = 5.0
#: A publish that found no stream is tried again after 50 ms, doubling up to this.
_NO_STREAM_DELAY_MAX: Final = 0.5


class Published(enum.Enum):
    """What a submit's publish found (:func:`publish`)."""

    #: This submit stored the request.
    STORED = "stored"
    #: The request was stored before this submit (a resubmit of its id).
    DUPLICATE = "duplicate"
    #: A retry found the request stored after a try whose answer was lost:
    #: stored by that try, all but surely (the broker took it and its ack
    #: went missing), or by a resubmit of the same id at the same moment,
    #: which nothing on the wire tells apart.
    FOUND_ON_RETRY = "found_on_retry"


async def retrying(nc: Connection, what: str, read: Callable[[], Awaitable[T]], **fields: Any) -> T:
    """``await read()``, retried with a capped backoff while it fails transiently.

    For reads a caller waits on anyway (a stream's next chunk, a result): a
    broker that does not answer for a while (a reconnect, a node down) delays
    them, it does not end them. The caller's own timeout bounds the wait; a
    closed connection, or any other error, is raised.
    """
    delay = _RETRY_FIRST
    while True:
        try:
            return await read()
        except TRANSIENT as exc:
            if nc.is_closed or isinstance(exc, NatsClosedError):
                raise
            log.warning(f"{what} failed; retrying", error=repr(exc), retry_in=delay, **fields)
            await asyncio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)


async def publish(
    client: Client, request: InferenceRequest, *, trace: TraceParent | None = None
) -> Published:
    """Publish ``request``: stored now, stored before (a resubmit), or
    found stored by a retry. ``trace``: the ``traceparent`` header it carries.

    "No responders" means no stream listens on the subject: the level is
    not configured, or, for a few seconds, a cluster is electing the
    stream's leader. So it is retried with the same message id (a publish
    is idempotent) for :attr:`Client.no_stream_grace` seconds; then JetStream
    is asked for the requests stream's subjects. Only a stream that answers
    without this level means an unknown level; a stream that lists it (no
    leader yet), is not found, or does not answer (a whole cluster starting
    again: longer than the grace) is a broker that does not answer, retried as
    below.

    A publish the broker does not answer (no ack in time, a reconnect, a
    full outbound buffer, a 503) is retried with the same message id,
    after a capped backoff, for :attr:`Client.submit_patience` seconds or until
    the request's deadline if sooner (never past the broker's duplicate
    window, which would store a second copy); then the last error is
    raised. A closed connection, a full store (:class:`StoreFullError`:
    the requests stream at its ``max_bytes``, or the server's store full;
    nothing was stored), and every other error (a request over the
    broker's limit, a refusal), is raised at once. A try that timed
    out may have been stored (its ack lost): a retry the broker reports
    as a duplicate then found that try, not someone else's request.
    """
    data = _encoded(client, request)
    loop = asyncio.get_running_loop()
    route = request.route if client.route_subjects else None
    subject = request_subject(request.priority, request.tenant, route=route)
    headers = {"Nats-Msg-Id": msg_id(request.tenant, request.id)}
    if trace is not None:
        headers.update(trace_headers(trace))
    patience = client.submit_patience
    if request.deadline is not None:
        patience = min(patience, request.deadline - time.time())
    give_up = loop.time() + patience
    no_stream_until: float | None = None
    no_stream_delay = 0.05
    delay = _RETRY_FIRST
    wait: float | None = None  # the first try waits as long as nats-py does
    maybe_stored = False  # an earlier try may be stored, its ack lost
    while True:
        try:
            ack = await client.js.publish(subject, data, headers=headers, timeout=wait)
        except NatsNoRespondersError as exc:
            now = loop.time()
            if no_stream_until is None:
                no_stream_until = now + client.no_stream_grace
            if now + no_stream_delay > no_stream_until:
                await _no_stream(client, request, subject, exc, left=give_up - now)
                no_stream_until = loop.time() + client.no_stream_grace
            await asyncio.sleep(no_stream_delay)
            no_stream_delay = min(_NO_STREAM_DELAY_MAX, no_stream_delay * 2)
            continue
        except NatsClosedError:
            raise
        except (StoreFullError, TenantBacklogFullError) as exc:
            # Refused, nothing stored; neither passes within a submit's patience.
            raise _not_stored(request, exc) from exc
        except TRANSIENT as exc:
            if client.nc.is_closed:
                raise
            maybe_stored = maybe_stored or isinstance(exc, TimeoutError)
            left = give_up - loop.time()
            if left <= delay:
                raise  # the deadline (or the patience) allows no other try
            log.warning(
                "the broker did not answer a submit; publishing it again under the same id",
                request_id=request.id,
                error=repr(exc),
                retry_in=delay,
            )
            await asyncio.sleep(delay)
            wait = min(_PUBLISH_WAIT, left - delay)
            delay = min(_RETRY_MAX, delay * 2)
            no_stream_until = None
            continue
        if not ack.duplicate:
            return Published.STORED
        return Published.FOUND_ON_RETRY if maybe_stored else Published.DUPLICATE


def _encoded(client: Client, request: InferenceRequest) -> bytes:
    """``request`` as it is published, refused here over the broker's limit:
    the server would close this connection, and every request on it would wait."""
    data = encode(request)
    limit = request_limit(client.nc.max_payload)
    if len(data) > limit:
        raise NatsPayloadTooLargeError(
            f"request {request.id} is {len(data)} bytes, over the {limit} the broker "
            "takes (its max_payload less the services' headroom)"
        )
    return data


def _not_stored(
    request: InferenceRequest, refusal: StoreFullError | TenantBacklogFullError
) -> StoreFullError | TenantBacklogFullError:
    """``refusal`` as a submitter reads it: which request, and what to do."""
    if isinstance(refusal, TenantBacklogFullError):
        return TenantBacklogFullError(
            f"request {request.id} was not stored: tenant {request.tenant} already has "
            f"router.tenant_backlog requests waiting at level {request.priority}; "
            "submit it again once some of them are routed",
            status=refusal.status,
            err_code=refusal.err_code,
            plain=True,
        )
    return StoreFullError(
        f"request {request.id} was not stored: the queue's store is full ({refusal}); send it "
        "again once there is room (`renqueue status` shows each store against its limit)",
        err_code=refusal.err_code,
    )


async def _no_stream(
    client: Client,
    request: InferenceRequest,
    subject: str,
    exc: NatsNoRespondersError,
    *,
    left: float,
) -> None:
    """A submit found no stream for longer than the grace: raise
    :class:`UnknownPriorityError` if JetStream says no stream takes the level,
    :class:`NatsUnavailableError` if the time is up; else (a stream without a
    leader, or a JetStream that cannot answer yet) return, to publish again."""
    if await _no_stream_takes(client, subject, within=left):
        raise UnknownPriorityError(request.priority, request_id=request.id) from exc
    if left <= _NO_STREAM_DELAY_MAX:
        raise NatsUnavailableError(
            f"no stream took request {request.id} on {subject} in time: the broker is not"
            f" answering (is a cluster starting again?), or {REQUESTS_STREAM} is not"
            " provisioned"
        ) from exc
    log.warning(
        "a stream takes this level but does not answer yet; publishing again",
        request_id=request.id,
        subject=subject,
    )


async def _no_stream_takes(client: Client, subject: str, *, within: float) -> bool:
    """Whether JetStream says that no stream takes ``subject``: the requests stream
    answers with its configuration and none of its subjects matches. ``False`` when one
    does (its leader is being elected), when the stream is not found or JetStream
    cannot answer within ``within`` seconds: a cluster starting again answers that
    way for a while (its stream list comes back empty too, so that list is not asked)."""
    api = JetStreamApi(client.js)
    try:
        async with asyncio.timeout(max(0.1, within)):
            response = await api.call(f"STREAM.INFO.{REQUESTS_STREAM}")
    except NatsClosedError:
        raise
    except TRANSIENT:
        return False
    if reply_error(response) is not None:
        return False
    config = response.get("config") if isinstance(response, dict) else None
    patterns = config.get("subjects") if isinstance(config, dict) else None
    if not isinstance(patterns, list):
        return False
    return not any(isinstance(p, str) and subject_matches(p, subject) for p in patterns)
