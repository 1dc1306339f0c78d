"""Requests published without their route, when binding is split in groups.

With several binding groups (docs/scaling.md) each group's binder reads only
its routes' subjects (``rq.req.<level>.<tenant>.<route>[.requeue]``). A
client written from the unsharded docs publishes to ``rq.req.<level>.<tenant>``,
and services of an older version requeue to ``...<tenant>.requeue``: those
are read by one consumer (:data:`~renqueue.schema.FORWARD_CONSUMER`) that every
router reads, and each is published again under the route its payload names,
then acked. Forwarding decides nothing that is shared: the request is then
admitted (validated, rejected or held) by its group's binder, the one place,
exactly as if the client had named the route. A payload that does not decode,
or names no configured route, is forwarded to the first group's first route,
where admission rejects it (malformed, or unknown_route as unsplit: a
forwarded copy whose route the config does not have is told so).

Each copy carries its original's headers but the server's (``Nats-*``: an
expectation such as ``Nats-Expected-Last-Sequence`` held for the original's
storing, and would refuse the copy for ever), and its original's
``Nats-Msg-Id`` followed by ``:forwarded``:
the stream's duplicate window would drop a copy under the same id, and a
forward tried again after a lost ack is stored once. Admission accepts that id
on a subject naming a route only (a tenant gains nothing by using it itself:
it is another id for the window, as the same id after the window would be).
Deduplication is stream-wide, and another tenant may take that id first on
its own subject: a duplicate ack counts only if the message it names is this
copy, still there; else the copy is published again under the id and a random
suffix, which admission accepts too (:func:`~renqueue.broker.surely_stored`,
as the services' put-backs are). Read as stored, the original would be acked
with no copy anywhere: the request lost.

A copy not stored: its original is acked only once something of it is
stored (the copy, else a rejection's dead letter and event). What the
forwarder hands back (``nak``, delivered again a second later) it holds
meanwhile in the consumer's ``max_ack_pending``, which every tenant's
requests share: so only what is no tenant's doing (the stream or the
server's store full, no ack in time: every tenant's copies alike) and the
services' put-backs (bounded by their tenant's requeue subject). A copy
refused because its *tenant's* route subject is at ``router.tenant_backlog``
ends its request ``rejected``, ``tenant_backlog_full``, as the broker refuses
a submit to that subject: held and tried again, enough of them stopped every
other tenant's forwarding (review finding F11; docs/scaling.md).

What it costs: one more stored message, publish and ack per such request, and
its wait is counted from the copy's storing (the server's time of it).

What it did is counted in the router's per-process series (docs/metrics.md):
``renqueue_forwarded_total``, ``renqueue_forward_rejected_total``,
``renqueue_forward_retries_total`` and ``renqueue_forward_duplicates_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec

from ... import metrics
from ...broker import (
    Connection,
    EventLog,
    JetStream,
    Message,
    PubAck,
    PullSubscription,
    submitted_of,
    surely_stored,
)
from ...config import Config
from ...errors import (
    MalformedRequestError,
    NatsError,
    NatsPayloadTooLargeError,
    NatsTimeoutError,
    TenantBacklogFullError,
)
from ...logs import get_logger
from ...schema import (
    FETCH_TIMEOUT,
    FORWARD_CONSUMER,
    REQUESTS_STREAM,
    SHUTDOWN_NAK_DELAY,
    is_requeue_subject,
    request_limit,
    request_subject,
    route_of_subject,
)
from ._admission import claimed_id, rejection_id
from ._endings import Endings
from ._hold import stored_at

__all__ = ["FORWARDED_SUFFIX", "Forwarder"]

log = get_logger("router")

#: The last part of a forwarded copy's ``Nats-Msg-Id``.
FORWARDED_SUFFIX: Final = "forwarded"

#: The ``reason`` of a retry whose refusal (its dead letter, its ``rejected``
#: event) could not be stored: the request is delivered again.
REJECTION_NOT_RECORDED: Final = "rejection_not_recorded"
#: Requests forwarded per fetch.
_BATCH: Final = 64
#: How long a request whose copy could not be stored waits before it is tried again.
_RETRY_DELAY: Final = 1.0
#: How long the copies' acks are waited for: an ack that never comes (lost
#: across a broker restart; nats-py tells a refused ``publish_async`` only to
#: its error callback) must not stop forwarding. Under the forwarding
#: consumer's own ack wait (5 s), so the original is handed back by this
#: router before the broker gives it to another.
ACKS_WAIT: Final = 4.0


class _Route(msgspec.Struct):
    """The one field of a request forwarding reads."""

    route: str = ""


_ROUTE_DECODER: Final = msgspec.json.Decoder(_Route)


class Forwarder:
    """Re-publishes requests sent without their route under it (see the module docstring)."""

    def __init__(self, nc: Connection, js: JetStream, config: Config, endings: Endings) -> None:
        self._nc = nc
        self._js = js
        #: Ends a request whose copy cannot be sent (too big for the broker).
        self._endings = endings
        self._routes = frozenset(config.routes)
        groups = config.binding_groups()
        #: Where a request naming no configured route goes, to be rejected.
        self._fallback = groups[0].routes[0]
        #: Requests forwarded by this router.
        self.forwarded = 0

    def subject_of(self, msg: Message) -> str:
        """The routed subject ``msg`` is forwarded to. Pure."""
        _rq, _req, level, tenant, *_rest = msg.subject.split(".")
        try:
            route = _ROUTE_DECODER.decode(msg.data).route
        except msgspec.DecodeError:
            route = ""
        if route not in self._routes:
            route = self._fallback
        return request_subject(level, tenant, requeue=is_requeue_subject(msg.subject), route=route)

    async def loop(self, psub: PullSubscription) -> None:
        """Forward what the consumer delivers; a failed pull ends the loop (restarted)."""
        while True:
            try:
                msgs = await psub.fetch(batch=_BATCH, timeout=FETCH_TIMEOUT)
            except TimeoutError:
                continue
            try:
                await self._forward(msgs)
            except BaseException:
                for msg in msgs:
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=SHUTDOWN_NAK_DELAY)
                raise

    async def _forward(self, msgs: list[Message]) -> None:
        copies: list[asyncio.Future[PubAck]] = []
        subjects = [self.subject_of(msg) for msg in msgs]
        ids: list[str | None] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACKS_WAIT
        for msg, subject in zip(msgs, subjects, strict=True):
            headers = _carried(msg.headers)
            claimed = (msg.headers or {}).get("Nats-Msg-Id")
            copy_id = f"{claimed}:{FORWARDED_SUFFIX}" if claimed else None
            ids.append(copy_id)
            if copy_id is not None:
                headers["Nats-Msg-Id"] = copy_id
            try:
                copies.append(await self._js.publish_async(subject, msg.data, headers))
            except NatsPayloadTooLargeError as exc:
                # Its id made longer, the copy is over the broker's max_payload:
                # one request's, told below (a loop failing on it would fail on
                # every router, each in turn, for ever).
                refused: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
                refused.set_exception(exc)
                copies.append(refused)
        results = await _answered(copies, ACKS_WAIT)
        await self._confirm(msgs, subjects, ids, results, deadline - loop.time())
        over: list[tuple[Message, str, TenantBacklogFullError]] = []
        for msg, subject, result in zip(msgs, subjects, results, strict=True):
            if isinstance(result, NatsPayloadTooLargeError):
                await self._too_big(msg)
            elif isinstance(result, TenantBacklogFullError) and not is_requeue_subject(subject):
                # The tenant's own route subject is full: handed back, it
                # would hold a place of this consumer's max_ack_pending, which
                # every tenant's requests share, for as long as that tenant
                # keeps its backlog (F11). Ended together, below: one at a
                # time, a flood's rejections would keep the batch behind it.
                over.append((msg, subject, result))
            elif isinstance(result, NatsError):
                # Not the tenant's doing (the stream or the server's store
                # full, the broker not answering: every tenant's copies alike),
                # or a put-back (the services' own, bounded by its tenant's
                # requeue subject): the original waits, and is tried again.
                log.warning(
                    "a request could not be forwarded to its route",
                    subject=msg.subject,
                    error=str(result),
                )
                _retried(subject, result.code)
                await msg.nak(delay=_RETRY_DELAY)
            elif isinstance(result, BaseException):
                raise result
            else:
                await msg.ack()
                self.forwarded += 1
                metrics.FORWARDED.labels(route_of_subject(subject), subject.split(".")[2]).inc()
        if over:
            # Up to ACKS_WAIT of the consumer's ack wait is spent: its timer starts
            # again, so no other router forwards (and runs) what is being ended here.
            await asyncio.gather(*(m.in_progress() for m, _, _ in over), return_exceptions=True)
        await asyncio.gather(*(self._over_backlog(*one) for one in over))

    async def _confirm(
        self,
        msgs: list[Message],
        subjects: list[str],
        ids: list[str | None],
        results: list[PubAck | BaseException],
        within: float,
    ) -> None:
        """Replace, in ``results``, each duplicate ack whose message is not
        this copy (another tenant took its id first, on its own subject) by
        the ack of the copy published again under a suffixed id, or its error
        (:func:`~renqueue.broker.surely_stored`), all at once and within
        ``within`` seconds (what is left of :data:`ACKS_WAIT`): read as stored,
        its original would be acked with no copy anywhere, the request lost."""
        checks: dict[int, asyncio.Future[PubAck]] = {}
        #: The duplicates found read since (their copy ours, consumed: not published again).
        read: set[int] = set()
        for index, (msg, subject, message_id, result) in enumerate(
            zip(msgs, subjects, ids, results, strict=True)
        ):
            if isinstance(result, PubAck) and result.duplicate and message_id is not None:
                headers = _carried(msg.headers)
                checks[index] = asyncio.ensure_future(
                    surely_stored(
                        self._js,
                        result,
                        subject,
                        msg.data,
                        message_id,
                        headers=headers,
                        consumed=_noted(self._read_since(msg, subject), read, index),
                    )
                )
        if checks:
            confirmed = await _answered(list(checks.values()), max(within, 0.0))
            for index, result in zip(checks, confirmed, strict=True):
                metrics.FORWARD_DUPLICATES.labels(
                    _checked(results[index], result, index in read)
                ).inc()
                results[index] = result

    def _read_since(self, msg: Message, subject: str) -> Callable[[], Awaitable[bool]] | None:
        """For a request (not a put-back) whose copy's id names a message gone:
        whether its request was admitted or ended since (its ``submitted`` event
        or terminal claim, which only the services write), so that copy was
        ours, stored by a try whose ack was lost (a killed router) and read by
        its binder. Then it is not stored again: a second copy would be
        dead-lettered as a copy by its binder. Another tenant that took the id
        cannot make the request admitted. A put-back's request was admitted
        before, so it cannot tell: ``None`` (published again, as
        :func:`~renqueue.broker.publish_stored` does)."""
        claimed = claimed_id(msg)
        if claimed is None or is_requeue_subject(subject):
            return None
        tenant, request_id = claimed

        async def read_since() -> bool:
            if await submitted_of(self._js, tenant, request_id, direct=False) is not None:
                return True
            return await EventLog(self._js).stored_claim(tenant, request_id) is not None

        return read_since

    async def _over_backlog(
        self, msg: Message, subject: str, refusal: TenantBacklogFullError
    ) -> None:
        """Reject a request whose route's subject is at ``router.tenant_backlog``,
        as the broker refuses a submit to it: the tenant is over its cap there.
        Its original is acked once the rejection (its dead letter, then its
        ``rejected`` event) is stored, else delivered again (:meth:`Endings.reject`).

        A request admitted from another message (its ``submitted`` event is
        logged, at another time than ``msg`` was stored: a copy an earlier try
        stored, whose ack was lost, since bound; the request sent again by its
        tenant under another header) may be running: this copy of it is
        dead-lettered as a copy and ends nothing (:meth:`Endings.reject_copy`,
        as its binder would)."""
        request_id, tenant = rejection_id(msg)
        level = msg.subject.split(".")[2]
        # Its text is the event's reason, which the gateway and the client show
        # the user: what happened and what to do, not the broker's codes (kept
        # in the error's fields; the error type says which refusal it was).
        error = TenantBacklogFullError(
            f"Tenant {tenant}'s backlog for route {route_of_subject(subject)} at level "
            f"{level} is full: it already has as many requests waiting there as "
            "router.tenant_backlog allows, so this request was not queued. Retry later, "
            "under a new request id, once some of them have started.",
            status=refusal.status,
            err_code=refusal.err_code,
            plain=True,
        )
        try:
            first = None
            if claimed_id(msg) is not None:
                first = await submitted_of(self._js, tenant, request_id)
        except NatsError as exc:
            log.warning(
                "could not tell whether a request over its backlog was admitted; "
                "it is delivered again",
                subject=msg.subject,
                error=str(exc),
            )
            _retried(subject, exc.code)
            with contextlib.suppress(Exception):
                await msg.nak(delay=_RETRY_DELAY)
            return
        # Admitted from this very message (held by an unsplit binder before
        # binding was split, say): its own, ended as any request over it.
        if first is not None and first.at != stored_at(msg):
            recorded = await self._endings.reject_copy(msg, request_id, tenant, error)
        else:
            recorded = await self._endings.reject(msg, request_id, tenant, error, unseen=True)
        _refused(subject, error.code, recorded=recorded)

    async def _too_big(self, msg: Message) -> None:
        """Reject a request whose copy cannot be sent, as its binder would
        (admission refuses a request this close to ``max_payload``: the
        services' messages carrying it would not fit)."""
        with contextlib.suppress(NatsError):
            await msg.in_progress()  # its ack timer starts again, as for one over its backlog
        request_id, tenant = rejection_id(msg)
        error = MalformedRequestError(
            f"the request is {len(msg.data)} bytes, over the "
            f"{request_limit(self._nc.max_payload)} the broker's largest message leaves "
            "for it (send images by https URL, or smaller)",
            request_id=request_id,
        )
        recorded = await self._endings.reject(msg, request_id, tenant, error, unseen=True)
        _refused(msg.subject, error.code, recorded=recorded)


def _retried(subject: str, reason: str) -> None:
    """Count a request (or put-back) handed back because its copy was not stored."""
    kind = "put_back" if is_requeue_subject(subject) else "request"
    metrics.FORWARD_RETRIES.labels(kind, reason).inc()


def _refused(subject: str, error_type: str, *, recorded: bool) -> None:
    """Count a request refused instead of forwarded, once its refusal is
    recorded; else it is delivered again: a retry, for that reason."""
    if recorded:
        metrics.FORWARD_REJECTED.labels(error_type).inc()
    else:
        _retried(subject, REJECTION_NOT_RECORDED)


def _noted(
    consumed: Callable[[], Awaitable[bool]] | None, read: set[int], index: int
) -> Callable[[], Awaitable[bool]] | None:
    """``consumed``, noting in ``read`` that copy ``index`` was found read since."""
    if consumed is None:
        return None

    async def noting() -> bool:
        if answer := await consumed():
            read.add(index)
        return answer

    return noting


def _checked(duplicate: PubAck | BaseException, result: PubAck | BaseException, read: bool) -> str:
    """What checking a duplicate ack found, as ``renqueue_forward_duplicates_total``
    says it: the copy itself, still waiting (``stored``) or read since (``read``);
    another's message under its id, so published again under a suffixed one
    (``republished``); or the check or that publish failed (``failed``: handed back)."""
    if isinstance(result, BaseException):
        return "failed"
    if result is not duplicate:
        return "republished"
    return "read" if read else "stored"


async def _answered(
    copies: list[asyncio.Future[PubAck]], within: float
) -> list[PubAck | BaseException]:
    """Each copy's ack, or its error; a copy not answered ``within`` seconds is
    a :class:`NatsTimeoutError` (its original is handed back and forwarded
    again: a copy that was stored after all is dropped by its message id)."""
    if copies:
        await asyncio.wait(copies, timeout=within)
    results: list[PubAck | BaseException] = []
    for copy in copies:
        if not copy.done():
            copy.cancel()
            results.append(NatsTimeoutError(f"no ack for the forwarded copy within {within:g} s"))
        elif copy.cancelled():
            results.append(NatsTimeoutError("the forwarded copy's publish was cancelled"))
        elif (exc := copy.exception()) is not None:
            results.append(exc)
        else:
            results.append(copy.result())
    return results


def _carried(headers: dict[str, str] | None) -> dict[str, str]:
    """The headers a forwarded copy carries: the publisher's own (the trace),
    not the server's ``Nats-*`` ones. Those were conditions of the original's
    storing (``Nats-Expected-Last-Sequence``, ...): on the copy they could
    refuse it for ever. Its ``Nats-Msg-Id`` is set by the caller."""
    return {k: v for k, v in (headers or {}).items() if not k.lower().startswith("nats-")}


async def open_forwarding(js: JetStream) -> PullSubscription:
    """Bind to the forwarding consumer (provisioned with the groups' consumers)."""
    return await js.pull_subscribe_bind(durable=FORWARD_CONSUMER, stream=REQUESTS_STREAM)
