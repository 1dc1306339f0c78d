"""The intake: fetching requests from the level subjects and admitting them to the hold.

While a term runs, one long-poll fetch loop per level (:meth:`Intake.fetch_loop`)
feeds the hold, bounded per level so batch work can never crowd out a
critical fetch, and only while the dispatch loop runs to bind what it holds
and the lease is valid. Each request fetched is read (``_admission``:
validation, the wait measured in server time, the parent's priority) and
checked against its tenant's hard daily budget; a request whose id already
ended (its terminal claim is taken: a resubmit past the duplicate window, or
under another message id) is not admitted again (:meth:`Intake._ended`: the
one place this is decided; the worker's gate still drops a run of a request
that ended after it was routed); its ``submitted`` event, the log's first
word on it, is written (for a request read for the first time that cannot
coalesce, left to its first round: bound then, its binding carries it, one
stored event instead of two); then it is settled at once if it is
already past its deadline or cancelled, joins a coalescing group if it
follows another's call, or is placed (its A/B arm and tier, ``_placement``)
and held for the round.

A request the router fails on for a reason other than the broker (a bug it
triggers) is delivered again after a pause, and after
:data:`UNTAKEABLE_AFTER` failures rejected as ``unprocessable`` with a dead
letter, so it can never stop its level's loop, the process, or the process
after a restart.

It also takes the words about held requests: a cancellation drops one at once
(:meth:`Intake.on_cancel_requested`), and a boost lifts a coalescing leader
to its follower's level (:meth:`Intake.on_boost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, NamedTuple

import msgspec

from ... import metrics, schema
from ...broker import (
    Message,
    PubAck,
    PullSubscription,
    StoredClaim,
    next_hop,
    submitted_of,
    trace_of,
)
from ...coordination import CancelWatch, Coalescer, coalesce_key
from ...errors import (
    NatsError,
    NatsPayloadTooLargeError,
    UnprocessableRequestError,
)
from ...logs import get_logger, misdirected
from ...policy import over_budget, past_deadline
from ...schema import (
    FETCH_TIMEOUT,
    REQUEST_DECODER,
    SHUTDOWN_NAK_DELAY,
    CancelRequested,
    InferenceRequest,
    boost_subject,
    coalesced,
    is_requeue_subject,
    kind_of,
    request_limit,
    subject_matches,
)
from ...tasks import Supervisor
from ._admission import (
    Refused,
    admit,
    arrival,
    claimed_id,
    parent_of,
    rejection_id,
    subject_token,
)
from ._hold import BOOST_DECODER, Held, first_then, log_first, stored_at
from ._parts import Parts

__all__ = ["UNTAKEABLE_AFTER", "Intake"]

#: Failures to take a request (not for the broker's sake) before it is
#: rejected as ``unprocessable``; delivered again 2 s, then 4 s after each.
UNTAKEABLE_AFTER: Final = 3
#: Requests whose failures to take are counted, at most (the oldest forgotten).
_TAKE_FAILURES_KEPT: Final = 1024


class Claims(NamedTuple):
    """The terminal claims of a fetched batch's requests, looked up together."""

    #: ``(tenant, request id)`` -> the claim, or ``None`` when it had none.
    found: dict[tuple[str, str], StoredClaim | None]
    #: :meth:`Endings.mark` before the lookup: a request this router ended
    #: since (another copy in the batch, rejected or expired when read) is
    #: looked up again.
    mark: int


log = get_logger("router")


class Intake:
    """Fetches and admits requests into the hold (see the module docstring)."""

    def __init__(
        self,
        parts: Parts,
        *,
        name: str,
        supervisor: Supervisor,
        coalescer: Coalescer,
        cancels: CancelWatch | None,
    ) -> None:
        self._parts = parts
        self._nc = parts.nc
        self._js = parts.js
        self._config = parts.config
        self._clock = parts.clock
        self._log = parts.log
        self._hold = parts.hold
        self._endings = parts.endings
        self._supervisor = supervisor
        self._coalescer = coalescer
        self._cancels = cancels
        #: The prefix of the names of this router's one-off jobs (under the supervisor).
        self.job_prefix = f"{name}:job:"
        #: Timers that expire coalesced followers at their deadlines.
        self._follower_timers: set[asyncio.TimerHandle] = set()
        #: Failures to take each request (by stream sequence) so far: see _untakeable.
        self._take_failures: dict[int, int] = {}

    def stop_timers(self) -> None:
        """Cancel the followers' deadline timers (the router stops): one that
        fired later would spawn a job on a connection about to be left."""
        for timer in self._follower_timers:
            timer.cancel()
        self._follower_timers.clear()

    async def fetch_loop(self, level: str, psub: PullSubscription) -> None:
        """Fetch level ``level`` into the hold. A failed call (a pull, the
        ``submitted`` publish) ends the loop for the supervisor to restart;
        the rest of the batch is handed back first."""
        batch = self._config.router.fetch_batch
        rank = self._config.priority_rank(level)
        while True:
            # Nothing is taken while no dispatch loop runs to bind it, nor
            # while the lease may be another router's.
            await self._parts.dispatching.wait()
            await self._parts.lease.until_valid()
            room = self._hold.room(level)
            if room <= 0:
                await self._hold.wait_for_room(level)
                continue
            try:
                msgs = await psub.fetch(batch=min(room, batch), timeout=FETCH_TIMEOUT)
            except TimeoutError:
                continue
            now = self._clock()
            pending = deque(msgs)
            refused: list[tuple[Message, Refused]] = []
            try:
                claims = await self._claims_of(msgs)
                await self._take_all(pending, refused, level, rank=rank, now=now, claims=claims)
                await self._reject_all(refused)
            except BaseException:
                # Failed or stopped mid-batch: what was not taken goes back now,
                # not after a whole ack_wait (a nak of one acked since is ignored).
                for msg in (*pending, *(msg for msg, _ in refused)):
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=SHUTDOWN_NAK_DELAY)
                raise
            finally:
                self._parts.wake.set()

    async def _take_all(
        self,
        pending: deque[Message],
        refused: list[tuple[Message, Refused]],
        level: str,
        *,
        rank: int,
        now: float,
        claims: Claims,
    ) -> None:
        """Take a fetched batch's good requests, in order (each off ``pending``
        once taken), and gather its refusals into ``refused`` for
        :meth:`_reject_all`. A failure of the broker is raised (the loop
        restarts; ``pending`` goes back); any other is the request's own."""
        taken: list[Held] = []
        while pending:
            head = pending[0]
            held = self._hold.holds_message(head)
            read = None if held else self._read_safely(head, level)
            if isinstance(read, Refused):
                # Rejected after the batch's valid requests, all at once.
                refused.append((head, read))
                pending.popleft()
                continue
            try:
                item = await self._take(head, level, rank, now, claims, read=read)
            except NatsPayloadTooLargeError as exc:  # this request's, not the broker's
                await self._untakeable(head, exc)
            except NatsError:
                raise  # the broker's: the loop restarts (and the batch goes back)
            except Exception as exc:  # noqa: BLE001 - one request must never stop a level
                await self._untakeable(head, exc)
            else:
                self._take_failures.pop(head.metadata.sequence.stream, None)
                if item is not None:
                    taken.append(item)
            pending.popleft()
        if refused:
            # The batch's good requests are in the log before its rejections
            # (their first words, left for their binding to carry, on their own now).
            for item in taken:
                await log_first(item, self._log)

    def _read_safely(self, msg: Message, level: str) -> InferenceRequest | Refused | None:
        """:meth:`_read`, or ``None`` if it raises (a bug the request triggers):
        then :meth:`_take` reads it again, where a failure is the request's own
        (:meth:`_untakeable`), never the level loop's."""
        try:
            return self._read(msg, level)
        except Exception:  # noqa: BLE001 - raised again in _take, and handled there
            return None

    def _read(self, msg: Message, level: str) -> InferenceRequest | Refused:
        """``msg`` decoded and validated (pure: no I/O), or why it is refused."""
        return admit(msg, level, self._config, max_bytes=request_limit(self._nc.max_payload))

    async def _reject_all(self, refused: list[tuple[Message, Refused]]) -> None:
        """Reject a batch's refused requests all at once: their round trips (a
        lookup, the dead letter, the terminal claim, the terminal event and
        final chunk, one after another for each) overlap across the batch, and
        the client's writes of many share a flush,
        so a flood of bad requests costs a few round trips a batch, not a few
        a request. A failure of the broker is raised once all are done (the
        loop restarts; what was not recorded is delivered again); any other
        is the request's own (:meth:`_untakeable`)."""
        if not refused:
            return
        results = await asyncio.gather(
            *(self._reject_read(msg, why) for msg, why in refused), return_exceptions=True
        )
        broker: NatsError | None = None
        for (msg, _), result in zip(refused, results, strict=True):
            if isinstance(result, NatsError) and not isinstance(result, NatsPayloadTooLargeError):
                broker = broker or result
            elif isinstance(result, Exception):
                await self._untakeable(msg, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._take_failures.pop(msg.metadata.sequence.stream, None)
        if broker is not None:
            raise broker

    async def _reject_read(self, msg: Message, refused: Refused) -> None:
        """Reject one request refused when read: on its own if it is a copy of
        a request admitted from another message (:meth:`_admitted_elsewhere`),
        else under its id."""
        seen = await self._admitted_elsewhere(msg, refused)
        if seen == "copy":
            await self._endings.reject_copy(msg, *refused)
        else:
            await self._endings.reject(msg, *refused, unseen=seen == "unseen")

    async def _untakeable(self, msg: Message, exc: Exception) -> None:
        """Taking ``msg`` failed for a reason other than the broker (a bug the
        request triggers): it is delivered again after a pause, and after
        :data:`UNTAKEABLE_AFTER` failures (counted by this router, whatever
        its deliveries in between) ended, rejected as ``unprocessable`` with a
        dead letter, so it can never stop its level's loop, the process, or
        the process after a restart."""
        seq = msg.metadata.sequence.stream
        failures = self._take_failures.pop(seq, 0) + 1
        while len(self._take_failures) >= _TAKE_FAILURES_KEPT:
            del self._take_failures[next(iter(self._take_failures))]
        request_id, tenant = rejection_id(msg)
        request = None
        with contextlib.suppress(msgspec.DecodeError):
            request = REQUEST_DECODER.decode(msg.data)
            request_id = request.id
        bound = log.bind(request_id=request_id, tenant=tenant, failures=failures, error=repr(exc))
        if failures < UNTAKEABLE_AFTER:
            bound.exception("could not take a request; it will be delivered again")
            self._take_failures[seq] = failures
            with contextlib.suppress(Exception):
                await msg.nak(delay=2.0**failures)
            return
        bound.exception("could not take a request, again and again; rejecting it")
        error = UnprocessableRequestError(
            f"the router failed on it {failures} times ({type(exc).__name__}); "
            "ended so that it stops no one else's request",
            request_id=request_id,
        )
        valid = request is not None and request.tenant == tenant
        if not await self._endings.reject(
            msg, request_id, tenant, error, request=request if valid else None
        ):
            self._take_failures[seq] = failures  # not recorded: rejected at its next failure

    async def _claims_of(self, msgs: list[Message]) -> Claims:
        """The terminal claims of a batch's requests, all looked up at once (one
        direct get per request id, sent together: the batch waits for the
        slowest, not for each in turn), under the id their
        ``Nats-Msg-Id`` names: an admitted request's own (see :func:`claimed_id`)."""
        mark = self._endings.mark()
        keys = sorted({key for msg in msgs if (key := claimed_id(msg)) is not None})
        if len(keys) == 1:
            found = [await self._claim_of(*keys[0])]  # (no task to gather one lookup in)
        else:
            found = await asyncio.gather(*(self._claim_of(*key) for key in keys))
        return Claims(dict(zip(keys, found, strict=True)), mark)

    async def _claim_now(self, key: tuple[str, str], claims: Claims | None) -> StoredClaim | None:
        """The terminal claim of ``key``: the batch's lookup's, unless it found
        none and this router has ended the request since (then looked up again)."""
        if claims is not None and key in claims.found:
            found = claims.found[key]  # a claim, once made, stays
            if found is not None or not self._endings.ended_since(*key, claims.mark):
                return found
        return await self._claim_of(*key)

    async def _claim_of(self, tenant: str, request_id: str) -> StoredClaim | None:
        try:
            return await self._log.stored_claim(tenant, request_id)
        except msgspec.DecodeError:  # only the services write claims: a bug, not the request's
            log.exception("a terminal claim does not decode", request_id=request_id)
            return None

    async def _take(
        self,
        msg: Message,
        level: str,
        rank: int,
        now: float,
        claims: Claims | None = None,
        *,
        read: InferenceRequest | Refused | None = None,
    ) -> Held | None:
        """Admit one fetched request: log it, settle it, or hold it for dispatch
        (then it is returned). ``read``: what :meth:`_read` made of it already, if it was."""
        if self._hold.holds_message(msg):
            # Delivered again while held (a nak from a router that lost the
            # lease, an ack timer that ran out): the held one stands for it.
            return None
        request = await self._admit(msg, level, now, claims, read=read)
        if request is None:
            return None
        arrived = await arrival(self._js, msg, request)
        submitted = arrived.submitted
        if arrived.paused is not None:
            # Put back because that backend's quota is spent: nothing goes
            # there before it comes back, whatever the projection says.
            self._parts.ledger.pause(*arrived.paused)
        # The log's first word on a request, written by whoever reads it
        # first, so it always precedes its `routed` event or carries it (a
        # redelivery writes it again under the same message id: stored once).
        # Its trace: the one it was published in (a valid ``traceparent``
        # header), else the one logged when it was first read (a copy put
        # back without one), else a new one, begun here.
        trace = trace_of(msg.headers) or arrived.trace or next_hop(None)
        # A request read for the first time (no earlier bind can have logged
        # anything of it), new (a requeue's first word is in the log already)
        # and that coalesces with no other: its first word waits for its first
        # round, whose binding carries it (one stored event, not two); a round
        # that does not bind it logs it on its own (Held.logged). It says when
        # it was read, which its storing no longer does.
        key = coalesce_key(request)
        defer = request.requeues == 0 and msg.metadata.num_delivered == 1 and key is None
        first = schema.submitted(
            request, at=submitted, traceparent=trace.header, read=now if defer else None
        )
        logged = None if defer else await self._log.append_async(first)
        if await self._settle_on_read(msg, request, first, logged, now, since=submitted):
            return None
        if key is not None and await self._follows(msg, request, key, logged, now):
            return None
        request, estimate = self._parts.placement.place(request, self._parts.live())
        item = Held(
            msg=msg,
            request=request,
            rank=rank,
            submitted=submitted,
            touched=now,
            first=first,
            logged=logged,
            parent=await parent_of(self._js, request, self._config),
            estimate=estimate,
            trace=trace,
        )
        self._hold.add(level, item)
        return item

    async def _admit(
        self,
        msg: Message,
        level: str,
        now: float,
        claims: Claims | None,
        *,
        read: InferenceRequest | Refused | None = None,
    ) -> InferenceRequest | None:
        """Decode and validate one request (unless ``read`` is what that gave);
        reject it (terminally) if it is bad, or if it is new and its tenant's
        hard daily budget is spent; drop it if it already ended (:meth:`_ended`)."""
        admitted = self._read(msg, level) if read is None else read
        if isinstance(admitted, Refused):
            await self._reject_read(msg, admitted)
            return None
        if await self._ended(msg, admitted, level, claims):
            return None
        spending = self._parts.spending
        budget = spending.budget(admitted.tenant)
        projected = self._parts.live()
        if budget is None or projected is None or admitted.requeues > 0:
            return admitted
        spent = spending.spent(projected, admitted.tenant, now)
        route = self._config.routes[admitted.route].backends
        priced = [self._config.backends[name] for name in route]
        error = over_budget(admitted, priced, budget, spent, now)
        if error is None:
            return admitted
        # Only a new request: one admitted before (its `submitted` event is
        # logged) and handed back by a restart or a lease change is held to
        # what its budget allows. (Delivery counts do not tell: a consumer
        # made again counts from 1.)
        if await self._log.history(admitted.tenant, admitted.id, kind="submitted"):
            return admitted
        await self._endings.reject(msg, admitted.id, admitted.tenant, error)
        return None

    async def _admitted_elsewhere(
        self, msg: Message, refused: Refused
    ) -> Literal["copy", "own", "unseen"]:
        """Whether the request ``refused`` names was admitted from another
        message than ``msg`` (``"copy"``): then ``msg`` is a copy (the same body
        sent again without its header, say, or under another one), and its
        rejection must not end the request, which may be running
        (:meth:`Endings.reject_copy`). ``"unseen"``: the request was never
        admitted (so it never ran: it has no chunks); ``"own"``: admitted from
        ``msg`` itself, or a services' requeue of it.

        Admitted from another message: held here from another message, or a
        ``submitted`` event of it was logged at another time than ``msg`` was
        stored (a first submit's ``submitted`` is at its message's storing).
        A services' requeue is the request itself, never a copy. A copy read
        before the request itself (on another level's subject, say) finds
        neither, and is rejected under the id as before.
        """
        request_id, tenant, _ = refused
        seq = msg.metadata.sequence.stream
        if is_requeue_subject(msg.subject):
            return "own"
        if request_id == f"invalid-{seq}":
            return "unseen"
        if any(
            item.request.tenant == tenant
            and item.request.id == request_id
            and item.msg.metadata.sequence.stream != seq
            for item in self._hold
        ):
            return "copy"
        first = await submitted_of(self._js, tenant, request_id)
        if first is None:
            return "unseen"
        return "own" if first.at == stored_at(msg) else "copy"

    async def _ended(
        self, msg: Message, request: InferenceRequest, level: str, claims: Claims | None
    ) -> bool:
        """Whether ``request`` already ended: then it is not admitted (never
        logged, routed or run again) and its message is acked.

        A request id has one outcome. A copy read after it (a resubmit past
        the duplicate window, or under another ``Nats-Msg-Id``, say after a
        rejection for the header) would only be dropped by the worker (its
        gate), a routing decision and a backend slot spent on nothing. A
        client's copy sent after it ended is dead-lettered (``already_ended:
        ...``, beside the first outcome's own dead letter, if any), so it can
        be found and requeued under a new id; anything else is just dropped
        (:func:`_resubmitted`): a services' requeue of it, a copy sent while
        it was under way, the very message that ended it delivered again
        (its router stopped before acking it). The claim's
        event is made sure of in the log (its writer may have stopped
        between the claim and the event).
        """
        key = (request.tenant, request.id)
        stored = await self._claim_now(key, claims)
        if stored is None:
            return False
        claim = stored.claim
        ended = kind_of(claim.event)
        metrics.ENDED_RESUBMITS.labels(level).inc()
        log.warning(
            "request already ended; not admitting it again",
            request_id=request.id,
            tenant=request.tenant,
            ended=ended,
        )
        seq = msg.metadata.sequence.stream
        try:
            await self._log.settle(claim)
            if _resubmitted(msg, request, stored):
                await self._log.dead_letter(
                    "requests",
                    msg.data,
                    reason=(
                        f"already_ended: request {request.id} already ended ({ended}) before "
                        "this copy was read; a request id has one outcome, so this copy was "
                        "not run: submit it under a new id"
                    ),
                    source_subject=msg.subject,
                    source_seq=seq,
                    tenant=request.tenant,
                    request_id=request.id,
                    copy=f"again-{seq}",
                )
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - delivered again, and refused then
            log.warning("could not refuse an ended request; will retry", error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
        return True

    async def _settle_on_read(
        self,
        msg: Message,
        request: InferenceRequest,
        first: schema.Submitted,
        logged: asyncio.Future[PubAck] | None,
        now: float,
        *,
        since: float,
    ) -> bool:
        """End a request that is already past its deadline or cancelled when read.

        After its ``submitted`` event, ``first`` (published here if ``logged``
        is ``None``: not yet), so the log still starts with it.
        ``since``: when its wait began (server time); a cancellation older
        than what the watch holds is looked up in the log.
        """
        expired = past_deadline(request, now)
        cancelled = self._cancels is not None and await self._cancels.was_cancelled(
            request.tenant, request.id, since=since
        )
        if not (expired or cancelled):
            return False
        if logged is None:
            logged = await self._log.append_async(first)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(logged, 10.0)
        if expired:
            await self._endings.expire(msg, request, now)
        else:
            await self._endings.cancel(msg, request)
        return True

    async def _follows(
        self,
        msg: Message,
        request: InferenceRequest,
        key: str,
        logged: asyncio.Future[PubAck] | None,
        now: float,
    ) -> bool:
        """Join the request's coalescing group (``key``, its :func:`coalesce_key`);
        True if it follows another's call. (One that may coalesce has its
        ``submitted`` event ``logged`` already.)"""
        if logged is None:
            return False
        try:
            leader = await self._coalescer.join(request, key)
        except Exception as exc:  # noqa: BLE001 - coalescing is an optimisation
            log.warning("coalescing failed; the request runs alone", error=str(exc))
            return False
        if leader is None:
            return False
        try:
            await asyncio.wait_for(logged, 10.0)
            await self._log.append(coalesced(request.id, request.tenant, at=now, leader=leader))
            await msg.ack()
            # A cancellation read after _settle_on_read looked, and before the
            # `coalesced` event above was stored, found the request neither
            # held nor a follower: look again, now that it is one.
            if self._cancels is not None and self._cancels.is_cancelled(request.tenant, request.id):
                self._end_follower_cancelled(request.tenant, request.id)
            self._expire_follower_at_deadline(request, key)
            # Whichever router holds the leader lifts it to this follower's level.
            boost = {"leader": leader, "rank": self._config.priority_rank(request.priority)}
            await self._nc.publish(
                boost_subject(request.tenant),
                msgspec.json.encode({**boost, "submitted": stored_at(msg)}),
            )
        except Exception as exc:  # noqa: BLE001 - redelivered; join() knows it already
            log.warning("could not record coalescing; will retry", error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=0.5)
        return True

    def _expire_follower_at_deadline(self, request: InferenceRequest, key: str) -> None:
        """A follower waits on another request's call, held by no router: this
        router ends it at its deadline (if it dies, the hand-out does, late)."""
        if request.deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, request.deadline - self._clock())

        def fire() -> None:
            self._follower_timers.discard(handle)
            self._spawn_job(
                f"follower-expired-{request.tenant}:{request.id}",
                functools.partial(self._coalescer.follower_expired, request, key),
            )

        handle = loop.call_later(delay, fire)
        self._follower_timers.add(handle)

    async def on_boost(self, msg: Message) -> None:
        """A coalescing follower's word: lift its leader, if held here, to its level."""
        if not subject_matches(boost_subject("*"), msg.subject):
            misdirected("boost", msg.subject)  # delivered by a tenant's consumer
            return
        try:
            boost = BOOST_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self._hold.boost(subject_token(msg.subject, 2), boost):
            self._parts.wake.set()

    def on_cancel_requested(self, event: CancelRequested, *, followers: bool = True) -> None:
        """Drop a held request at once; later reads check the watch on admission.

        The watch passes only events whose tenant and id are their subject's,
        and the match is on both: a tenant never cancels another's request. A
        request held nowhere may be a coalesced follower: it ends on its own
        (``followers``: here; one binder of a router split in groups ends them).
        """
        item = self._hold.remove_request(event.tenant, event.request_id)
        if item is not None:
            cancel = functools.partial(self._endings.cancel, item.msg, item.request)
            self._parts.inflight.spawn(first_then(item, self._log, cancel))
            return
        if followers:
            self._end_follower_cancelled(event.tenant, event.request_id)

    def _end_follower_cancelled(self, tenant: str, request_id: str) -> None:
        """End a cancelled coalesced follower (if it is one), retried until done."""

        async def end() -> None:
            await self._coalescer.follower_cancelled(tenant, request_id)

        self._spawn_job(f"follower-cancelled-{tenant}:{request_id}", end)

    def _spawn_job(self, what: str, factory: Callable[[], Any]) -> None:
        """Run idempotent one-off work under the supervisor: retried with a
        capped backoff until it succeeds (see :meth:`Supervisor.spawn_job`)."""
        self._supervisor.spawn_job(f"{self.job_prefix}{what}", factory)


def _resubmitted(msg: Message, request: InferenceRequest, stored: StoredClaim) -> bool:
    """Whether ``msg``, a request whose terminal claim is ``stored``, is a
    client's copy sent after it ended (one to dead-letter), not the message
    that ended it delivered again nor a services' requeue of it.

    Stored after the claim (the server's clocks), whatever its delivery count:
    a router that ended a request when it read it and stopped before acking
    leaves its message to the next binder, which makes the consumers again
    (``renew_router_consumers``), so its delivery count starts at 1 again; its
    message was stored before the claim. And a copy whose dead letter could
    not be written is delivered again, and dead-lettered then (stored once
    within ``RQ_DLQ``'s duplicate window: its message id names the copy's
    sequence). A copy stored before the request ended (sent while it was
    under way) is dropped too: the id's outcome is the one its client waits for.
    """
    if request.requeues > 0 or is_requeue_subject(msg.subject):
        return False
    return stored.stored is None or stored_at(msg) > stored.stored
