"""The router: binds waiting requests to backends, late, in priority order.

Requests wait in the priority subjects (``rq.req.<level>.<tenant>``), one
durable pull consumer per level. Exactly one router binds at a time: the
holder of the binder's lease (:mod:`renqueue.coordination._lease`, a key in the
``rq-leases`` KV bucket that the server expires ``router.lease_ttl`` after its
last renewal). It is the one place that decides what is committed to each
backend, so the binding order is global, whatever number of routers run; the
others stand by, seeking the lease every 100 ms. A new binder first deletes
and re-creates the router consumers, so everything its predecessor held
(dead or stopped) is delivered to it at once; a router binds only while its
lease is valid (renewed within ``ttl``, less a margin), so a binder whose
renewals stall stops binding before anyone else can start.

The binder runs one long-poll fetch task per level, feeding a small local hold
(bounded per level, so batch work can never crowd out a critical fetch). A
single dispatch loop then takes held requests highest level first, oldest
first, and binds each to the first candidate of its route that is healthy,
capable and has a free slot *now*. A request whose candidates are all full
stays held (its ack timer kept alive) until a slot frees: backends are never
given more work than their concurrency, so backend subjects stay short and
waiting happens where priority applies.

Its parts: the hold (``_hold``), the free slots it counts per backend
(``_capacity``: broker truth plus its own dispatches the broker may not have
counted yet), reading a fetched request (``_admission``: validation, the wait
measured in server time, the parent's priority), carrying out a bind
(``_dispatch``), its side of the preemption protocol (``_asking``), and
A/B splits (``_splitter``: a request of a split route is placed on an arm as it
is read, and a split whose arm breaches its thresholds is rolled back).

Every loop (one fetch loop per level, the dispatch loop, the keepalive, the
projection watch) runs under the process's :class:`~renqueue.tasks.Supervisor`:
a failed JetStream call is logged and the loop started again after a capped
backoff, and a loop that keeps failing takes the process down. Requests are
kept alive only for loops that run: when the dispatch loop fails, every held
request is handed back (nak'ed), and nothing is fetched until it runs again.

A request's dispatch is given up (``failed``, ``undeliverable``, with a
dead-letter copy) after ``router.max_deliver`` *failed dispatches* seen by a
router, not after that many deliveries: hand-backs (graceful restarts, a
failed dispatch loop) are deliveries too, and must not use up its budget. The
router consumers' own ``max_deliver`` is a backstop far above it
(:func:`renqueue.schema.router_max_deliveries`).

The decisions are plain functions in :mod:`renqueue.policy` (a round:
:func:`~renqueue.policy.plan`; admission: :func:`~renqueue.policy.validate`);
:class:`Router` is the loop around them that does the NATS work.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import msgspec

from ... import metrics
from ...broker import (
    Connection,
    EventLog,
    JetStream,
    Message,
    PubAck,
    PullSubscription,
    Subscription,
    renew_router_consumers,
    router_consumer_configs,
)
from ...config import Config, parse_duration
from ...coordination import CancelWatch, Coalescer, Lease, LiveState, StateView, coalesce_key
from ...errors import (
    BudgetExhaustedError,
    NatsError,
    NatsPayloadTooLargeError,
    RenQueueError,
    UnprocessableRequestError,
)
from ...lifecycle import Lifecycle
from ...logs import get_logger, misdirected
from ...policy import (
    AskPreemption,
    BackendView,
    Bind,
    Circuit,
    Cost,
    Expire,
    Inherit,
    PlanPolicy,
    Promote,
    Refuse,
    Wait,
    Waiting,
    affordable,
    budget_of,
    day_ends,
    estimate_complexity,
    plan,
    refused,
)
from ...schema import (
    BINDER_LEASE,
    EVENTS_STREAM,
    FETCH_TIMEOUT,
    LEASE_BUCKET,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    SHUTDOWN_NAK_DELAY,
    CancelRequested,
    CircuitChanged,
    Coalesced,
    ComplexityEstimate,
    Event,
    InferenceRequest,
    Promoted,
    SplitChanged,
    Submitted,
    boost_subject,
    cancelled,
    capacity_subject,
    expired,
    rejected,
    request_limit,
    router_consumer,
    subject_matches,
)
from ...state import utc_day
from ...tasks import Supervisor, cancel_and_wait
from ._admission import Refused, admit, arrival, parent_of, rejection_id, subject_token
from ._asking import ask_preemption
from ._capacity import Capacity
from ._circuits import Circuits, change_event
from ._dispatch import ACKS_TIMEOUT, Dispatcher
from ._hold import BOOST_DECODER, Held, Hold, stored_at
from ._ledger import Ledger
from ._splitter import Splitter

__all__ = ["UNTAKEABLE_AFTER", "Router"]

#: Failures to take a request (not for the broker's sake) before it is
#: rejected as ``unprocessable``; delivered again 2 s, then 4 s after each.
UNTAKEABLE_AFTER: Final = 3
#: Requests whose failures to take are counted, at most (the oldest forgotten).
_TAKE_FAILURES_KEPT: Final = 1024

log = get_logger("router")

#: Seconds between rounds while nothing waits: each backend's circuit is
#: judged (and a change logged) at least this often.
_IDLE_ROUND: Final = 1.0


#: How long a stop waits for decisions still being published (each is bounded
#: by ``ACKS_TIMEOUT`` already; this is the backstop).
_INFLIGHT_STOP_WAIT: Final = ACKS_TIMEOUT + 5.0
#: A binder one of whose binding loops failed this many times in a row gives the lease up.
_GIVE_UP_AFTER_FAILURES: Final = 3
#: Seconds without a move of a new binder's view of the projection, while it
#: lags the log as the term began, before the binder reads the stored progress
#: itself (the watch may be stale: StateView notices that only after up to two
#: of its ``check_every``); if that has not moved either, no projector is
#: writing: it binds on what it knows (logged).
_CATCH_UP_STALL: Final = 3.0
#: Seconds a new binder holds binds to the backends its ledger judges, at most,
#: waiting for its view to catch up (a projector refolding a long backlog):
#: past that it binds on what it knows (logged).
_CATCH_UP_LIMIT: Final = 10.0


class Router(Lifecycle):
    """One router process's loop. Stateless: any number may run side by side."""

    def __init__(
        self,
        nc: Connection,
        js: JetStream,
        config: Config,
        *,
        name: str = "router",
        clock: Callable[[], float] = time.time,
        cancels: CancelWatch | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._nc = nc
        self._cancels = cancels
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor if supervisor is not None else Supervisor(name)
        self._loops: list[str] = []
        self._job_prefix = f"{name}:job:"
        #: Set while the dispatch loop runs: nothing is fetched while it is down.
        self._dispatching = asyncio.Event()
        self._js = js
        self._config = config
        self._name = name
        self._clock = clock
        self._log = EventLog(js)
        self._levels = list(config.priorities)
        self._policies = config.level_policies()
        self._hold = Hold(self._levels, config.router.hold_limit)
        self._wake = asyncio.Event()
        self._state: StateView | None = None
        self._coalescer = Coalescer(js, clock=clock, ttl=parse_duration(config.router.coalesce_ttl))
        self._estimators = config.estimators()
        #: (when, tenant, estimated cost) of this router's paid binds, until
        #: the projection has folded them (:meth:`_spent`).
        self._recent_binds: collections.deque[tuple[float, str, float]] = collections.deque()
        #: Timers that expire coalesced followers at their deadlines.
        self._follower_timers: set[asyncio.TimerHandle] = set()
        #: Failures to take each request (by stream sequence) so far: see _untakeable.
        self._take_failures: dict[int, int] = {}
        self._ledger = Ledger(config)
        self._circuits = Circuits(config)
        #: A/B splits: each request's arm, and the automatic rollback (``_splitter``).
        self._splitter = Splitter(config)
        # Health is each backend's circuit (self._circuits), judged in the round.
        self._capacity = Capacity(js, config, parse_duration(config.router.capacity_refresh))
        self._ack_wait = parse_duration(config.router.ack_wait)
        self._inflight: set[asyncio.Task[None]] = set()
        self._capacity_sub: Subscription | None = None
        self._subs: list[Subscription] = []
        #: Removes this router's cancel listener (set while it is registered).
        self._unlisten: Callable[[], None] | None = None
        #: The binder's lease: only its holder fetches and binds (see module doc).
        self._lease = Lease(
            js,
            BINDER_LEASE,
            holder=f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            ttl=parse_duration(config.router.lease_ttl),
        )
        #: The lease term whose fetch and dispatch loops run (None: standing by).
        self._term: int | None = None
        self._binding_loops: list[str] = []
        self._pull_subs: list[PullSubscription] = []
        self._consumer_configs: list[dict[str, Any]] = []
        #: Until when (loop time) this router stays out of the race for the
        #: lease after giving it up.
        self._sit_out_until = -math.inf  # loop time; never sat out
        #: Terms that failed to begin in a row (reset when one begins).
        self._failed_beginnings = 0
        #: While a new term's view of the projection lags the log as it stood
        #: when the term began: (that log sequence, the view's sequence last
        #: seen, when it last moved, when the term began: loop time). Nothing
        #: is bound meanwhile to a backend the ledger judges.
        self._catch_up: tuple[int, int, float, float] | None = None
        #: Terms begin and end one at a time (the lease and renewal loops both end them).
        self._term_lock = asyncio.Lock()
        self._dispatcher = Dispatcher(
            js,
            self._log,
            config,
            holder=self._lease.holder,
            clock=clock,
            end_request=self._end,
        )
        self.rejected = 0

    @property
    def routed(self) -> int:
        """Requests this router bound (their decisions stored)."""
        return self._dispatcher.routed

    @property
    def projection(self) -> LiveState | None:
        """What this router knows of the projection (``None`` before it starts)."""
        return None if self._state is None else self._state.state

    @property
    def binding(self) -> bool:
        """Whether this router holds the binder's lease and its loops run."""
        return self._term is not None

    @property
    def lease_ttl(self) -> float:
        """The lease's ttl this router judges validity by (see :meth:`start`)."""
        return self._lease.ttl

    @property
    def holder(self) -> str:
        """This router's name in the binder's lease (unique per instance)."""
        return self._lease.holder

    async def _start(self) -> None:
        """Open the state, listen, and seek the binder's lease (bind if it is free)."""
        self._consumer_configs = router_consumer_configs(self._config)
        self._state = await StateView.open(
            self._js, supervisor=self._supervisor, name=f"{self._name}-state"
        )
        if self._cancels is not None:
            self._unlisten = self._cancels.listen(self._on_cancel_requested)
        self._capacity_sub = await self._nc.subscribe(capacity_subject("*"), cb=self._on_freed)
        self._subs.append(self._capacity_sub)
        self._subs.append(await self._nc.subscribe(boost_subject("*"), cb=self._on_boost))
        # The server expires the lease by the bucket's max_age, which the last
        # process to provision set: judge validity by the shorter. (Not
        # suppressed: a router that cannot read it must not guess.)
        info = await self._js.stream_info(f"KV_{LEASE_BUCKET}")
        if info.config.max_age:
            self._lease.ttl = min(self._lease.ttl, float(info.config.max_age))
        # One attempt now, so a lone router binds as soon as it has started.
        # A term that cannot begin yet is the lease loop's to retry (and, if
        # it never can, to give the lease up): not a reason to fail the start.
        if await self._lease.try_acquire():
            async with self._term_lock:
                try:
                    await self._begin_term_counted()
                except RenQueueError as exc:  # JetStream refused or did not answer
                    log.warning("the binder's term could not begin", error=str(exc))
        self._supervise("lease", self._lease_loop)
        self._supervise("renew", self._renew_loop)
        log.info(
            "router started",
            router=self._name,
            levels=self._levels,
            role="binder" if self.binding else "standby",
        )

    # ------------------------------------------------------------- the lease

    async def _lease_loop(self) -> None:
        """Seek the binder's lease while not holding it; begin a term once held.

        Renewals run in their own loop (:meth:`_renew_loop`), so a term that
        is slow to begin (re-creating consumers on a cluster) never lets the
        lease run out. A term begins only while the lease is valid, so a
        router whose lease expired meanwhile never re-creates the consumers
        of a binder that took over.
        """
        poll = min(0.1, self._lease.ttl / 5)
        loop = asyncio.get_running_loop()
        while True:
            if not self._lease.held and (
                loop.time() < self._sit_out_until or not await self._lease.try_acquire()
            ):
                await asyncio.sleep(poll)
                continue
            if self._term != self._lease.term and self._lease.valid():
                async with self._term_lock:
                    if self._term != self._lease.term and self._lease.valid():
                        await self._begin_term_counted()
            await asyncio.sleep(poll)

    async def _renew_loop(self) -> None:
        """Renew the lease every ``ttl / 5`` while held; end the term when it is lost.

        A renewal that raises (a timeout, a reconnect) ends the loop for the
        supervisor to restart: the lease stays held, and binding is fenced
        (:meth:`Lease.valid`) until a renewal succeeds again. A binder one of
        whose binding loops failed 3 times in a row, or whose term failed to
        begin 3 times in a row, gives the lease up and stays out of the race
        for ``5 * ttl``, so a healthy router binds.
        """
        ttl = self._lease.ttl
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ttl / 5)
            if not self._lease.held:
                continue
            if not await self._lease.renew():
                async with self._term_lock:
                    await self._end_term("the binder's lease was lost")
                continue
            failing = [
                name
                for name in self._binding_loops
                if self._supervisor.failures(self._loop_name(name)) >= _GIVE_UP_AFTER_FAILURES
            ]
            if failing and self._term is not None:
                why = f"a binding loop keeps failing: {', '.join(failing)}"
            elif self._term is None and self._failed_beginnings >= _GIVE_UP_AFTER_FAILURES:
                # Held, but the term cannot begin (its consumers cannot be
                # re-created): renewing on would keep every router from binding.
                why = "the binder's term cannot begin"
            else:
                continue
            self._sit_out_until = loop.time() + 5 * ttl
            self._failed_beginnings = 0
            async with self._term_lock:
                await self._end_term(why)
            await self._lease.release()
            log.warning("router gave the binder's lease up", router=self._name, reason=why)

    async def _begin_term_counted(self) -> None:
        """:meth:`_begin_term`, counting failed beginnings in a row (the give-up rule)."""
        try:
            await self._begin_term()
        except Exception:
            self._failed_beginnings += 1
            raise
        self._failed_beginnings = 0

    async def _begin_term(self) -> None:
        """This router holds the lease: take the router consumers over and bind.

        The consumers are re-created first, so every request the previous
        binder held (dead, or stopped) is delivered here at once instead of
        after ``router.ack_wait``.
        """
        await self._end_term(None)  # anything a failed earlier attempt left running
        term = self._lease.term
        # Read before the consumers are re-created: whatever they deliver from
        # here down may have been bound by the binder before (its last acts).
        info = await self._js.stream_info(REQUESTS_STREAM)
        self._dispatcher.term_first_seq = info.state.last_seq + 1
        # Quota: bind only on a view that has folded every decision logged so
        # far (the previous binder's last ones among them).
        logged = await self._js.stream_info(EVENTS_STREAM)
        began = asyncio.get_running_loop().time()
        self._catch_up = (logged.state.last_seq, -1, began, began)
        await renew_router_consumers(self._nc, self._consumer_configs)
        for level in self._levels:
            psub = await self._js.pull_subscribe_bind(
                durable=router_consumer(level), stream=REQUESTS_STREAM
            )
            self._pull_subs.append(psub)
            self._supervise_binding(
                f"fetch-{level}", functools.partial(self._fetch_loop, level, psub)
            )
        self._supervise_binding("dispatch", self._dispatch_loop)
        self._supervise_binding("keepalive", self._keepalive_loop)
        self._term = term
        metrics.BINDING.labels(self._name).set(1)
        log.info("router is binding", router=self._name, term=term)

    async def _end_term(self, why: str | None) -> None:
        """Stop fetching and binding; forget what was held (not nak'ed: the
        next binder's fresh consumers deliver it, and a nak from here would
        only deliver it to that binder twice)."""
        names, self._binding_loops = self._binding_loops, []
        await self._supervisor.stop(*(self._loop_name(name) for name in names))
        for psub in self._pull_subs:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        self._pull_subs.clear()
        self._dispatching.clear()
        self._catch_up = None
        self._circuits.forget()
        self._splitter.forget()
        dropped = self._hold.clear()
        was = self._term
        self._term = None
        metrics.BINDING.labels(self._name).set(0)
        if why is not None and was is not None:
            log.warning("router stands by", router=self._name, term=was, reason=why, held=dropped)

    def _supervise_binding(self, what: str, factory: Callable[[], Any]) -> None:
        self._binding_loops.append(what)
        self._supervisor.spawn(self._loop_name(what), factory)

    def _loop_name(self, what: str) -> str:
        return f"{self._name}-{what}"

    def _supervise(self, what: str, factory: Callable[[], Any]) -> None:
        name = self._loop_name(what)
        self._loops.append(name)
        self._supervisor.spawn(name, factory)

    async def _stop(self) -> None:
        """Stop taking work, let in-flight dispatches land, give the lease up."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        # Before any await: a timer that fired later would spawn a job on a
        # connection about to be left (a restart on a new one).
        for timer in self._follower_timers:
            timer.cancel()
        self._follower_timers.clear()
        # Jobs cut short leave their follower in its group: its leader's hand-out ends it.
        await self._supervisor.stop(*self._loops, *self._supervisor.jobs(self._job_prefix))
        self._loops.clear()
        async with self._term_lock:
            await self._end_term(None)
        # Unsubscribe, or a pull that expires after the fetch task is gone
        # leaves a status message no one reads, and draining NATS waits on it.
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._state is not None:
            await self._state.close()
        if self._own_supervisor:
            await self._supervisor.close()
        if self._inflight:
            # Each publish is bounded by its acks' timeout; this bounds the stop
            # even if one is not. A publish cut short leaves its request unacked:
            # redelivered, and its dispatch deduplicated by its message id.
            _done, pending = await asyncio.wait(self._inflight, timeout=_INFLIGHT_STOP_WAIT)
            await cancel_and_wait(pending)
        # Last: a standby takes over at once, and re-created consumers give
        # it what this router held (see _begin_term).
        try:
            await self._lease.release()
        except Exception as exc:  # noqa: BLE001 - then it expires within the ttl
            log.warning("could not release the binder's lease", error=str(exc))
        log.info("router stopped", router=self._name, routed=self.routed)

    async def _on_freed(self, msg: Message) -> None:
        # A tenant's push consumer can deliver here (its messages keep their
        # own subjects): only rq.capacity.<backend> is a worker's word.
        if not subject_matches(capacity_subject("*"), msg.subject):
            misdirected("capacity", msg.subject)
            return
        self._capacity.freed(msg.subject.rsplit(".", 1)[-1])
        self._wake.set()

    # ------------------------------------------------------------- fetching

    async def _fetch_loop(self, level: str, psub: PullSubscription) -> None:
        """Fetch level ``level`` into the hold. A failed call (a pull, the
        ``submitted`` publish) ends the loop for the supervisor to restart;
        the rest of the batch is handed back first."""
        batch = self._config.router.fetch_batch
        rank = self._config.priority_rank(level)
        while True:
            # Nothing is taken while no dispatch loop runs to bind it, nor
            # while the lease may be another router's.
            await self._dispatching.wait()
            await self._lease.until_valid()
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
            try:
                while pending:
                    head = pending[0]
                    try:
                        await self._take(head, level, rank, now)
                    except NatsPayloadTooLargeError as exc:  # this request's, not the broker's
                        await self._untakeable(head, exc)
                    except NatsError:
                        raise  # the broker's: the loop restarts (and the batch goes back)
                    except Exception as exc:  # noqa: BLE001 - one request must never stop a level
                        await self._untakeable(head, exc)
                    else:
                        self._take_failures.pop(head.metadata.sequence.stream, None)
                    pending.popleft()
            except BaseException:
                # Failed or stopped mid-batch: what was not taken goes back now,
                # not after a whole ack_wait.
                for msg in pending:
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=SHUTDOWN_NAK_DELAY)
                raise
            finally:
                self._wake.set()

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
        if not await self._reject(
            msg, request_id, tenant, error, request=request if valid else None
        ):
            self._take_failures[seq] = failures  # not recorded: rejected at its next failure

    async def _take(self, msg: Message, level: str, rank: int, now: float) -> None:
        """Admit one fetched request: log it, settle it, or hold it for dispatch."""
        if self._hold.holds_message(msg):
            # Delivered again while held (a nak from a router that lost the
            # lease, an ack timer that ran out): the held one stands for it.
            return
        request = await self._admit(msg, level, now)
        if request is None:
            return
        arrived = await arrival(self._js, msg, request)
        submitted = arrived.submitted
        if arrived.paused is not None:
            # Put back because that backend's quota is spent: nothing goes
            # there before it comes back, whatever the projection says.
            self._ledger.pause(*arrived.paused)
        # The log's first word on a request, written by whoever reads it
        # first, so it always precedes its `routed` event (a redelivery
        # writes it again under the same message id: stored once).
        logged = await self._log.append_async(
            Submitted(request_id=request.id, tenant=request.tenant, at=submitted, request=request)
        )
        if await self._settle_on_read(msg, request, logged, now, since=submitted):
            return
        if await self._follows(msg, request, logged, now):
            return
        request = self._splitter.place(request, self._live())
        request, estimate = self._estimated(request)
        self._hold.add(
            level,
            Held(
                msg=msg,
                request=request,
                rank=rank,
                submitted=submitted,
                touched=now,
                logged=logged,
                parent=await parent_of(self._js, request, self._config),
                estimate=estimate,
            ),
        )

    def _estimated(
        self, request: InferenceRequest
    ) -> tuple[InferenceRequest, ComplexityEstimate | None]:
        """``request`` with the tier its route's estimator gives it, if the route
        has one and the request named none (its ``submitted`` event keeps its own word)."""
        rules = self._config.routes[request.route].complexity
        if rules is None or request.complexity is not None:
            return request, None
        highest = max(1, self._config.highest_tier(request.route))
        estimate = estimate_complexity(
            request,
            rules.thresholds,
            highest=highest,
            estimator=self._estimators.get(request.route),
        )
        return msgspec.structs.replace(request, complexity=estimate.tier), estimate

    async def _admit(self, msg: Message, level: str, now: float) -> InferenceRequest | None:
        """Decode and validate one request; reject it (terminally) if it is bad,
        or if it is new and its tenant's hard daily budget is spent."""
        admitted = admit(msg, level, self._config, max_bytes=request_limit(self._nc.max_payload))
        if isinstance(admitted, Refused):
            await self._reject(msg, *admitted)
            return None
        budget = budget_of(admitted.tenant, self._plan_policy.budgets)
        projected = None if self._state is None else self._state.state
        if budget is None or projected is None or admitted.requeues > 0:
            return admitted
        spent = self._spent(projected, admitted.tenant, now)
        route = self._config.routes[admitted.route].backends
        priced = [self._config.backends[name] for name in route]
        if not refused(budget, spent) and affordable(admitted, priced, budget, spent):
            return admitted
        # Only a new request: one admitted before (its `submitted` event is
        # logged) and handed back by a restart or a lease change is held to
        # what its budget allows. (Delivery counts do not tell: a consumer
        # made again counts from 1.)
        if await self._log.history(admitted.tenant, admitted.id, kind="submitted"):
            return admitted
        error = BudgetExhaustedError(
            admitted.tenant, budget.daily, spent, day_ends(now), request_id=admitted.id
        )
        await self._reject(msg, admitted.id, admitted.tenant, error)
        return None

    async def _settle_on_read(
        self,
        msg: Message,
        request: InferenceRequest,
        logged: asyncio.Future[PubAck],
        now: float,
        *,
        since: float,
    ) -> bool:
        """End a request that is already past its deadline or cancelled when read.

        After its ``submitted`` event, so the log still starts with it.
        ``since``: when its wait began (server time); a cancellation older
        than what the watch holds is looked up in the log.
        """
        expired = request.deadline is not None and now >= request.deadline
        cancelled = self._cancels is not None and await self._cancels.was_cancelled(
            request.tenant, request.id, since=since
        )
        if not (expired or cancelled):
            return False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(logged, 10.0)
        if expired:
            await self._expire(msg, request, now)
        else:
            await self._cancel(msg, request)
        return True

    async def _follows(
        self, msg: Message, request: InferenceRequest, logged: asyncio.Future[PubAck], now: float
    ) -> bool:
        """Join the request's coalescing group; True if it follows another's call."""
        key = coalesce_key(request)
        if key is None:
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
            await self._log.append(
                Coalesced(request_id=request.id, tenant=request.tenant, at=now, leader=leader)
            )
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

    async def _on_boost(self, msg: Message) -> None:
        if not subject_matches(boost_subject("*"), msg.subject):
            misdirected("boost", msg.subject)  # delivered by a tenant's consumer
            return
        try:
            boost = BOOST_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self._hold.boost(subject_token(msg.subject, 2), boost):
            self._wake.set()

    def _on_cancel_requested(self, event: CancelRequested) -> None:
        """Drop a held request at once; later reads check the watch on admission.

        The watch passes only events whose tenant and id are their subject's,
        and the match is on both: a tenant never cancels another's request. A
        request held nowhere may be a coalesced follower: it ends on its own.
        """
        item = self._hold.remove_request(event.tenant, event.request_id)
        if item is not None:
            self._spawn_publish(self._cancel(item.msg, item.request))
            return
        self._end_follower_cancelled(event.tenant, event.request_id)

    def _end_follower_cancelled(self, tenant: str, request_id: str) -> None:
        """End a cancelled coalesced follower (if it is one), retried until done."""

        async def end() -> None:
            await self._coalescer.follower_cancelled(tenant, request_id)

        self._spawn_job(f"follower-cancelled-{tenant}:{request_id}", end)

    def _spawn_job(self, what: str, factory: Callable[[], Any]) -> None:
        """Run idempotent one-off work under the supervisor: retried with a
        capped backoff until it succeeds (see :meth:`Supervisor.spawn_job`)."""
        self._supervisor.spawn_job(f"{self._job_prefix}{what}", factory)

    async def _end(self, request: InferenceRequest, event: Event) -> None:
        """Record a request's terminal event; a coalescing leader's followers
        get their outcome first (so a crash in between cannot strand them)."""
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(request.tenant, request.id, key, event)
        await self._log.finish(event)

    async def _cancel(self, msg: Message, request: InferenceRequest) -> None:
        event = cancelled(
            request.id,
            request.tenant,
            at=self._clock(),
            stage="queued",
            reason="cancelled by request before it was routed",
        )
        metrics.TERMINAL.labels("cancelled").inc()
        try:
            await self._end(request, event)
            await msg.ack()
        except Exception:
            log.exception("could not record cancellation", request_id=request.id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    async def _reject(
        self,
        msg: Message,
        request_id: str,
        tenant: str,
        error: Exception,
        *,
        request: InferenceRequest | None = None,
    ) -> bool:
        """Dead-letter ``msg`` and end its request ``rejected``; False when that
        could not be recorded (``msg`` is delivered again). Given the decoded
        ``request`` (one taken before, that may lead a coalescing group), its
        followers get their outcome first, as :meth:`_end` does; if that
        raises for a reason other than the broker (the request's own bug), the
        request is ended all the same and the followers are left to their
        deadlines or the advisory reader."""
        code = getattr(error, "code", "malformed")
        self.rejected += 1
        metrics.REJECTED.labels(code).inc()
        metrics.TERMINAL.labels("rejected").inc()
        log.warning("request rejected", request_id=request_id, error_type=code, reason=str(error))
        try:
            await self._log.dead_letter(
                "requests",
                msg.data,
                reason=f"{code}: {error}",
                source_subject=msg.subject,
                source_seq=msg.metadata.sequence.stream,
                tenant=tenant,
                request_id=request_id,
            )
            event = rejected(
                request_id,
                tenant,
                at=self._clock(),
                error_type=code,
                reason=str(error)[:1000],
            )
            if request is None:
                await self._log.finish(event)
            else:
                try:
                    await self._end(request, event)
                except NatsError:
                    raise
                except Exception:
                    log.exception(
                        "could not hand the rejection to followers", request_id=request_id
                    )
                    await self._log.finish(event)
            await msg.ack()
        except Exception as exc:
            log.exception("could not record rejection", request_id=request_id, error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return False
        return True

    async def _expire(
        self,
        msg: Message,
        request: InferenceRequest,
        now: float,
        *,
        reason: str = "deadline passed while waiting to be routed",
    ) -> None:
        event = expired(
            request.id,
            request.tenant,
            at=now,
            stage="queued",
            reason=reason,
            split=request.split or "",
            arm=request.route if request.split is not None else "",
        )
        metrics.TERMINAL.labels("expired").inc()
        try:
            await self._end(request, event)
            await msg.ack()
        except Exception as exc:
            log.exception("could not record expiry", request_id=request.id, error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    # ------------------------------------------------------------- dispatching

    async def _dispatch_loop(self) -> None:
        """Dispatch rounds, each when woken. A failed round (a JetStream call
        that timed out, had no responders, or found a consumer gone) hands
        every held request back for another router and ends the loop: the
        supervisor logs it and starts it again after a backoff, and nothing
        is fetched meanwhile."""
        refresh = parse_duration(self._config.router.capacity_refresh)
        self._dispatching.set()
        try:
            while True:
                await self._lease.until_valid()
                waiting = await self._dispatch_round()
                # With requests waiting for room, look again after the refresh
                # interval even if no worker announces a freed slot; with none,
                # every second all the same (circuits move with time).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), refresh if waiting else _IDLE_ROUND)
                self._wake.clear()
        except Exception as exc:
            self._dispatching.clear()
            await self._hold.hand_back(self._levels, f"dispatch failed: {exc!r}")
            raise

    async def _dispatch_round(self) -> list[str]:
        """Bind every held request that can be bound now, most urgent first.

        The decisions are :func:`renqueue.policy.plan`'s, over a snapshot of
        the hold (plain data) and of backend load; this carries them out (the
        publishes, the acks) and keeps the bookkeeping they name. Returns the
        backends that held requests are waiting on.

        Backend load is read once, before the plan, and carrying it out never
        awaits: a slot that frees meanwhile cannot go to whichever request the
        round happens to be at; it goes to the head of the order next round.
        """
        now = self._clock()
        self._follow_splits()
        held = list(self._hold)
        demand: dict[str, int] = {}
        for item in held:
            for name in self._config.routes[item.request.route].backends:
                demand[name] = demand.get(name, 0) + 1
        wanted = set(demand)
        await self._capacity.refresh(sorted(wanted), demand=demand)
        state = self._state
        # While a new term's view lags the log, binds to backends the ledger
        # judges are held (may await a read of the stored projection).
        catching_up = await self._catching_up(state)
        if not self._lease.valid():
            # The lease may have passed on while the load was read: decide nothing.
            return sorted(wanted)
        projected = None if state is None else state.state
        # Requests dropped while the refresh was awaited (cancelled, handed
        # back) are no longer this router's to bind.
        present = {id(item) for item in self._hold}
        items = {id(item): item for item in held if id(item) in present}
        snapshot = [
            Waiting(
                ref=ref,
                request=item.request,
                rank=item.rank,
                submitted=item.submitted,
                parent=item.parent,
                boost=item.boost,
                promoted=item.promoted,
                inherited=item.inherited,
                preempt_asked=item.preempt_asked,
                preempted_one=item.preempted_one,
                waiting_for=item.waiting_for,
            )
            for ref, item in items.items()
        ]
        self._ledger.prune(projected)
        self._judge_splits(projected, now)
        views, judged = self._views(state, now)
        waiting: set[str] = set()
        gone: set[int] = set()
        spent = self._spent_today(projected, snapshot, now)
        for action in plan(snapshot, views, now, self._plan_policy, spent):
            item = items[action.ref]
            if isinstance(action, Promote | Inherit):
                self._announce_promotion(item, action)
            elif isinstance(action, Expire):
                gone.add(action.ref)
                self._spawn_publish(self._expire(item.msg, item.request, now, reason=action.reason))
            elif isinstance(action, Refuse):
                gone.add(action.ref)
                request = item.request
                error = BudgetExhaustedError(
                    request.tenant, action.daily, action.spent, day_ends(now), request_id=request.id
                )
                self._spawn_publish(
                    self._reject(item.msg, request.id, request.tenant, error, request=request)
                )
            elif isinstance(action, Bind) and catching_up and action.backend in judged:
                # Its quota is judged on a view that may not know yet what the
                # previous binder spent: it waits (held) for the view.
                waiting.add(action.backend)
            elif isinstance(action, Bind):
                gone.add(action.ref)
                self._bind(item, action, now)
            elif isinstance(action, AskPreemption):
                self._maybe_preempt(item, action, now)
            elif isinstance(action, Wait):
                waiting.update(action.backends)
                if action.wait_for is not None and (
                    item.waiting_for is None or item.waiting_for[0] != action.wait_for
                ):
                    item.waiting_for = (action.wait_for, action.wait_start)
        self._hold.prune(gone)
        return sorted(waiting)

    def _bind(self, item: Held, action: Bind, now: float) -> None:
        """Carry out a binding: the slot, the probe, the quota reservation, and
        the dispatch and decision published in a task."""
        slot = self._capacity.dispatching(action.backend)
        if action.probe:
            self._circuits.probe_bound(action.backend, now)
        tenant = item.request.tenant
        if action.estimated_cost > 0 and budget_of(tenant, self._plan_policy.budgets) is not None:
            self._recent_binds.append((now, tenant, action.estimated_cost))
        reserved = self._ledger.reserving(
            action.backend, Cost(requests=1, tokens=action.reserved_tokens), now
        )
        # The term is the deciding round's, not whichever is current when it runs.
        self._spawn_publish(
            self._dispatcher.bind(
                item,
                slot,
                self._levels[item.rank],
                now,
                action.reason,
                term=self._term or 0,
                reserved=reserved,
                probe=action.probe,
                predicted=action.predicted,
                estimated_cost=action.estimated_cost,
            )
        )

    def _views(
        self, state: StateView | None, now: float
    ) -> tuple[dict[str, BackendView], set[str]]:
        """What the round knows of each backend (load, duration, quota, circuit),
        and the backends the ledger judges (limits declared or reported, a pause)."""
        projected = None if state is None else state.state
        views = {}
        judged: set[str] = set()
        for name, view in self._capacity.views().items():
            quota, limits = self._ledger.quota(name, projected, now=now)
            if quota is not None:
                judged.add(name)
            circuit = self._circuit(name, projected, now)
            views[name] = msgspec.structs.replace(
                view,
                expected_duration=None if state is None else state.expected_duration(name),
                perf=None if projected is None else projected.backend(name).perf,
                quota=quota,
                limits=limits,
                healthy=circuit.state != "open"
                and not (circuit.state == "half_open" and self._circuits.probe_pending(name, now)),
                half_open=circuit.state == "half_open",
            )
        return views, judged

    async def _catching_up(self, state: StateView | None) -> bool:
        """Whether this term still waits for its view of the projection to
        cover the log as it stood when the term began: a binder that takes
        over (or starts after a restart) binds nothing to a backend its ledger
        judges (limits declared or reported, a pause) before it knows what its
        predecessor spent there. Binds to other backends go on meanwhile.

        It waits while the view moves. When it has not moved for
        ``_CATCH_UP_STALL`` seconds, the stored projection is read directly
        (its progress, then each backend's view: the watch may be stale), and
        if that has not moved either, no projector is writing: it binds on
        what it knows (logged). It waits ``_CATCH_UP_LIMIT`` seconds at most
        in all (logged). A view that never had a projection written (no
        progress mark read: a new deployment, or routers that have never
        had a projector) is not waited for.
        """
        if self._catch_up is not None and await self._caught_up(state, *self._catch_up):
            self._catch_up = None
        return self._catch_up is not None

    async def _caught_up(
        self, state: StateView | None, target: int, seen: int, moved: float, began: float
    ) -> bool:
        """One look at the catch-up (see :meth:`_catching_up`): True once it is over."""
        if state is None or state.revision == 0 or state.state.last_seq >= target:
            return True
        loop = asyncio.get_running_loop()
        now = loop.time()
        folded = state.state.last_seq
        if now - began >= _CATCH_UP_LIMIT:
            log.warning(
                "the projection did not catch up with the log in time; binding on what it knows",
                folded=folded,
                logged=target,
                waited=round(now - began, 1),
            )
            return True
        if folded == seen and now - moved >= _CATCH_UP_STALL:
            try:
                await state.refresh(self._config.backends)
            except RenQueueError as exc:  # read again next round
                log.warning("could not read the stored projection", error=str(exc))
                return False
            folded = state.state.last_seq
            if folded == seen:
                log.warning(
                    "the projection lags the log and does not move; binding on what it knows",
                    folded=folded,
                    logged=target,
                )
                return True
        if folded != seen:
            self._catch_up = (target, folded, loop.time(), began)
        return folded >= target

    @functools.cached_property
    def _plan_policy(self) -> PlanPolicy:
        return self._config.plan_policy()

    def _spent_today(
        self, projected: LiveState | None, snapshot: list[Waiting], now: float
    ) -> dict[str, float]:
        """What each tenant with a waiting request and a budget has spent
        today, for its budget (:meth:`_spent`)."""
        budgets = self._plan_policy.budgets
        if not budgets or projected is None:
            return {}
        tenants = {item.request.tenant for item in snapshot}
        return {
            tenant: self._spent(projected, tenant, now)
            for tenant in tenants
            if budget_of(tenant, budgets) is not None
        }

    def _spent(self, projected: LiveState, tenant: str, now: float) -> float:
        """What a budget judges ``tenant`` by: the projection's spend today,
        the estimated cost of its calls bound and not ended (``committed``),
        and of this router's paid binds the projection has not folded yet
        (decided after its log time)."""
        folded = projected.log_time
        while self._recent_binds and self._recent_binds[0][0] <= folded:
            self._recent_binds.popleft()
        unfolded = sum(cost for at, who, cost in self._recent_binds if who == tenant)
        return projected.spent(tenant, utc_day(now)) + projected.committed(tenant) + unfolded

    def _announce_promotion(self, item: Held, action: Promote | Inherit) -> None:
        """Record a promotion the planner announced: earned by aging (``at`` is
        when it was earned; message ids dedupe repeats) or inherited from the
        request's parent."""
        event = Promoted(
            request_id=item.request.id,
            tenant=item.request.tenant,
            at=action.at,
            from_level=action.from_level,
            to_level=action.to_level,
            waited=action.waited,
            reason=action.reason,
        )
        if isinstance(action, Promote):
            item.promoted = action.promoted
        else:
            item.inherited = action.rank
        self._spawn_publish(self._log.append(event))

    def _maybe_preempt(self, item: Held, action: AskPreemption, now: float) -> None:
        """An urgent request finds every capable slot taken: ask for a
        preemptible one (the planner decided it may, and that it is time:
        :func:`renqueue.policy.plan`). The freed slot then goes to the most
        urgent waiting request, which is this one unless something more
        urgent arrived meanwhile."""
        item.preempt_asked = now
        self._spawn_publish(self._ask_preemption(item, action.rank, list(action.backends)))

    async def _ask_preemption(self, item: Held, rank: int, backends: list[str]) -> None:
        """Free one slot for ``item`` (:func:`ask_preemption`), while it still waits here."""
        if await ask_preemption(
            self._nc, item.request, rank, backends, waiting=lambda: self._hold.holds(item)
        ):
            item.preempted_one = True

    def _circuit(self, name: str, projected: LiveState | None, now: float) -> Circuit:
        """Backend ``name``'s circuit this round (:class:`Circuits`); a change is logged."""
        facts = None if projected is None else projected.backends.get(name)
        circuit, previous = self._circuits.judge(name, facts, now, term=self._term or 0)
        if previous is not None:
            event = change_event(
                name, circuit, previous, router=self._lease.holder, term=self._term or 0
            )
            self._spawn_publish(self._log_circuit(event, circuit))
        return circuit

    async def _log_circuit(self, event: CircuitChanged, circuit: Circuit) -> None:
        """Log a circuit change; if that fails, it is decided (and logged) again next round."""
        try:
            await self._log.append(event)
        except Exception as exc:  # noqa: BLE001 - the next round decides it again
            log.warning("could not log a circuit change", backend=event.backend, error=str(exc))
            self._circuits.retract(event.backend, circuit)

    def _live(self) -> LiveState | None:
        """This router's view of the projection, if it has one open."""
        return None if self._state is None else self._state.state

    def _follow_splits(self) -> None:
        """Move each held request whose A/B split was rolled back or promoted
        since it was placed to where the split's traffic goes now (its tier
        estimated again, by that arm's rules, if it named none)."""
        if not self._splitter:
            return
        live = self._live()
        for item in self._hold:
            if not self._splitter.moved(item.request, live):
                continue
            request = item.request
            if item.estimate is not None:
                request = msgspec.structs.replace(request, complexity=None)
            item.request, item.estimate = self._estimated(self._splitter.place(request, live))

    def _judge_splits(self, projected: LiveState | None, now: float) -> None:
        """Roll back each live A/B split one of whose arms breaches its rules (logged)."""
        for event in self._splitter.judge(
            projected, now, router=self._lease.holder, term=self._term or 0
        ):
            self._spawn_publish(self._log_split(event))

    async def _log_split(self, event: SplitChanged) -> None:
        """Log a rollback; if that fails, it is decided (and logged) again next round."""
        try:
            await self._log.append(event)
        except Exception as exc:  # noqa: BLE001 - the next round decides it again
            log.warning("could not log an A/B rollback", route=event.route, error=str(exc))
            self._splitter.retract(event)

    def _spawn_publish(self, coro: Any) -> None:
        """Carry out one decision's publishes in a task of its own, tracked until
        it ends: :meth:`_stop` waits for it (within ``_INFLIGHT_STOP_WAIT``), and
        an error it did not handle itself is logged with its traceback."""
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._publish_done)

    def _publish_done(self, task: asyncio.Task[Any]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a decision's publish failed", exc_info=exc)

    # ------------------------------------------------------------- keepalive

    async def _keepalive_loop(self) -> None:
        """Held requests wait for room: keep their ack timers from running out,
        but only while the loops that would bind them run. A level whose
        fetch loop, or a router whose dispatch loop, is down (failed, in its
        backoff) hands its held requests back instead, for another router."""
        interval = max(0.1, self._ack_wait / 3)
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            dispatching = self._supervisor.healthy(self._loop_name("dispatch"))
            for level, held in self._hold.queues.items():
                if not (
                    dispatching and self._supervisor.healthy(self._loop_name(f"fetch-{level}"))
                ):
                    await self._hold.hand_back([level], "a loop that would bind them is down")
                    continue
                for item in list(held):
                    if now - item.touched >= interval:
                        with contextlib.suppress(Exception):
                            await item.msg.in_progress()
                        item.touched = now
