"""Ending requests whose message ran out of deliveries.

JetStream stops delivering a message once its consumer has delivered it
``max_deliver`` times without an ack: the message stays in its work-queue
stream, and the server announces it once, with the core NATS advisory
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``.
``RQ_ADVISORIES`` captures those advisories, so none is missed while no
process listens, and :class:`AdvisoryReader` acts on them through the durable
pull consumer ``advisories`` (``streams/consumers/advisories.json``), which
only takes advisories of ``RQ_REQUESTS`` (the routers' consumers:
``router.max_deliver``) and ``RQ_DISPATCH`` (the workers' consumers: the
backstop ``worker.delivery_limit``). For each exhausted message, every step
idempotent, so an advisory handled twice (a reader that died midway) changes
nothing:

1. the message is read by its stream sequence (gone already: nothing to do);
2. unless the request already ended (its terminal claim), a copy goes to the
   dead-letter stream (``rq.dlq.requests`` / ``rq.dlq.dispatch``, the reason
   in ``Rq-Reason``) and the request ends ``failed``, ``error_type``
   ``undeliverable``, through :meth:`EventLog.finish`: exactly once, whoever
   else tries to end it. A coalescing leader's followers get their outcome
   first (:meth:`Coalescer.leader_ended`: they run on their own), and again
   when the request had already ended (its ender may have skipped that);
3. the message is deleted from its stream (nothing would ever deliver it again);
4. the advisory is acked.

Who runs it: every service process that runs routers or workers (``renqueue
up``, ``renqueue router``, ``renqueue worker``), under its supervisor. The
consumer is shared, so each advisory goes to one of them; running it in every
such process means any deployment, however its routers and workers are split
across processes, ends every exhausted request, and as long as one process
runs, none is left waiting.
"""

from __future__ import annotations

import contextlib
import time
from typing import Final

import msgspec

from ..broker import EventLog, JetStream, Message, StoredMessage
from ..coordination import Coalescer, coalesce_key
from ..errors import NatsNotFoundError
from ..lifecycle import Lifecycle
from ..logs import bound_request, get_logger
from ..schema import (
    ADVISORIES_CONSUMER,
    ADVISORIES_STREAM,
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    Event,
    InferenceRequest,
    msg_id,
)
from ..schema import failed as failed_for_good
from ..tasks import Supervisor

__all__ = ["AdvisoryReader", "MaxDeliveries"]

log = get_logger("advisories")

#: Advisories handled per fetch.
_BATCH: Final = 16
#: Seconds one pull waits at the server (an advisory ends it at once): longer
#: than the services' ``FETCH_TIMEOUT``, so an idle reader pulls less often.
#: What that costs: a pull lost with a server restart or a consumer leader's
#: move is silent until it expires, so advisories stored meanwhile are read up
#: to this much later; and one left by a process that hangs (still connected,
#: not reading) takes the advisory that comes meanwhile, for the consumer's
#: ``ack_wait``. A reader that stops unsubscribes, and the server gives nothing
#: to a pull no one listens to. Nothing here is nak'ed at a stop, so
#: ``SHUTDOWN_NAK_DELAY`` need not outlast it.
_FETCH_TIMEOUT: Final = 5.0
#: Longest wait before an advisory whose handling failed is tried again.
_MAX_RETRY: Final = 30.0
_ID_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class MaxDeliveries(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of ``io.nats.jetstream.advisory.v1.max_deliver`` this reader uses."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int = 0


_ADVISORY_DECODER: Final = msgspec.json.Decoder(MaxDeliveries)


class _Subject(msgspec.Struct, frozen=True, kw_only=True):
    """The request a stored message is about, and how to record its failure."""

    tenant: str
    request_id: str
    stage: str
    backend: str | None = None
    attempt: int = 0
    #: The request itself, when the stored message holds one that agrees with the above.
    request: InferenceRequest | None = None


class AdvisoryReader(Lifecycle):
    """Ends every request whose message ran out of deliveries (see the module docstring)."""

    def __init__(self, js: JetStream, *, supervisor: Supervisor | None = None) -> None:
        self._js = js
        self._log = EventLog(js)
        self._coalescer = Coalescer(js, clock=time.time)
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor("advisories")
        self._loop = "advisories"
        self._name = "advisories"
        #: Requests this reader ended (for logs and tests).
        self.ended = 0

    async def _start(self) -> None:
        self._supervisor.spawn(self._loop, self._read)

    async def _close(self) -> None:
        await self._supervisor.cancel(self._loop)
        if self._own_supervisor:
            await self._supervisor.close()

    async def _read(self) -> None:
        """Fetch and handle advisories. A failed fetch raises: the supervisor
        logs it and starts the loop again after a backoff."""
        psub = await self._js.pull_subscribe_bind(
            durable=ADVISORIES_CONSUMER, stream=ADVISORIES_STREAM
        )
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch=_BATCH, timeout=_FETCH_TIMEOUT)
                except TimeoutError:
                    continue
                for msg in msgs:
                    await self._on_advisory(msg)
        finally:
            try:
                await psub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - shutting the loop down regardless
                log.debug("unsubscribe failed", error=str(exc))

    async def _on_advisory(self, msg: Message) -> None:
        try:
            advisory = _ADVISORY_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            log.exception("undecodable max-deliveries advisory; skipped")
            await msg.ack()
            return
        try:
            # When the server gave up, by its clock: when the advisory was stored.
            await self.handle(advisory, at=msg.metadata.timestamp.timestamp())
        except Exception:
            delivered = int(msg.metadata.num_delivered)
            delay = min(_MAX_RETRY, 0.5 * 2 ** (delivered - 1))
            log.exception(
                "could not end an undeliverable request; will retry",
                stream=advisory.stream,
                seq=advisory.stream_seq,
                retry_in=delay,
            )
            await msg.nak(delay=delay)
            return
        await msg.ack()

    async def handle(self, advisory: MaxDeliveries, *, at: float) -> None:
        """Steps 1-3 of the module docstring for one advisory; ``at``: when the
        server gave up on the message (the ``failed`` event's time)."""
        if advisory.stream not in (REQUESTS_STREAM, DISPATCH_STREAM):
            return
        try:
            stored = await self._js.get_msg(advisory.stream, seq=advisory.stream_seq)
        except NatsNotFoundError:
            return  # acked or removed meanwhile: nothing is stranded
        about = _about(advisory, stored)
        with bound_request(about.request_id, tenant=about.tenant):
            claim = await self._log.claim_of(about.tenant, about.request_id)
            if claim is not None:
                # Its ender may not have handed out to its followers: again (idempotent).
                await self._hand_out(about, claim.event)
                await self._log.settle(claim)
            else:
                reason = (
                    f"delivered {advisory.deliveries} times to {advisory.consumer} "
                    "without being acknowledged"
                )
                await self._log.dead_letter(
                    about.stage,
                    stored.data or b"",
                    reason=f"undeliverable: {reason}",
                    source_subject=stored.subject,
                    source_seq=stored.seq,
                    tenant=about.tenant,
                    request_id=about.request_id,
                )
                failed = failed_for_good(
                    about.request_id,
                    about.tenant,
                    at=at,
                    error_type="undeliverable",
                    reason=f"the request ran out of deliveries: {reason}",
                    backend=about.backend,
                    attempt=about.attempt,
                )
                # A coalescing leader's followers get their outcome first, so a
                # crash in between cannot strand them (the advisory is redelivered).
                await self._hand_out(about, failed)
                if await self._log.finish(failed):
                    self.ended += 1
                    log.warning("request ran out of deliveries; failed", reason=reason)
            with contextlib.suppress(NatsNotFoundError):
                await self._js.delete_msg(advisory.stream, advisory.stream_seq)

    async def _hand_out(self, about: _Subject, outcome: Event) -> None:
        """If the request leads a coalescing group, give its followers their
        outcome (:meth:`Coalescer.leader_ended`, idempotent)."""
        request = about.request
        if request is None or (request.tenant, request.id) != (about.tenant, about.request_id):
            return
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(about.tenant, about.request_id, key, outcome)


def _about(advisory: MaxDeliveries, stored: StoredMessage) -> _Subject:
    """Whose request a stored message is. On ``RQ_REQUESTS`` the subject names the
    tenant (tenants publish there: the subject is the authority); on
    ``RQ_DISPATCH`` the payload is the services' own."""
    seq = advisory.stream_seq
    data = stored.data or b""
    if advisory.stream == DISPATCH_STREAM:
        backend = stored.subject.rsplit(".", 1)[-1]
        try:
            dispatch = DISPATCH_DECODER.decode(data)
        except msgspec.DecodeError:
            return _Subject(
                tenant="unknown", request_id=f"dispatch-{seq}", stage="dispatch", backend=backend
            )
        request = dispatch.request
        return _Subject(
            tenant=request.tenant,
            request_id=request.id,
            stage="dispatch",
            backend=backend,
            attempt=dispatch.attempt,
            request=request,
        )
    parts = stored.subject.split(".")
    # rq.req.<level>.<tenant>[.<route>][.requeue] (a route: binding split in groups)
    tenant = parts[3] if len(parts) in (4, 5, 6) and _is_id(parts[3]) else "unknown"
    # The id the publish vouched for (``Nats-Msg-Id: <tenant>:<id>``), as the router reads it.
    header = str((stored.headers or {}).get("Nats-Msg-Id", ""))
    scope, _, rest = header.partition(":")
    named = rest.partition(":")[0]
    request_id = named if scope == tenant and _is_id(named) else f"invalid-{seq}"
    try:
        payload: InferenceRequest | None = REQUEST_DECODER.decode(data)
    except msgspec.DecodeError:
        payload = None
    if payload is not None and (
        header == msg_id(tenant, payload.id)
        or header.startswith(msg_id(tenant, payload.id, "requeue") + ":")
    ):
        request_id = payload.id
    return _Subject(
        tenant=tenant,
        request_id=request_id,
        stage="requests",
        request=payload if payload is not None and payload.tenant == tenant else None,
    )


def _is_id(text: str) -> bool:
    return 0 < len(text) <= 128 and all(ch in _ID_OK for ch in text)
