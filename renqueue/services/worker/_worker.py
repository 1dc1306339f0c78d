"""The backend worker: serves one backend from its durable consumer.

Any number of worker processes may serve the same backend: they share the
durable pull consumer ``worker-<backend>``, whose ``max_ack_pending`` equals
the backend's concurrency, so the broker itself caps concurrent calls across
all of them.

A dispatched request is acked only once it reached a terminal state
(completed, failed, expired) and that state is in the log. The message is a
short lease (``worker.ack_wait``, a few seconds) renewed with ``in_progress()``
every third of it for as long as its run is alive, in every phase of the run;
if the worker dies, the lease runs out and the request is redelivered within
``ack_wait`` and run again. The new run streams a ``restart`` chunk first.
Every run checks the request's terminal claim (:mod:`renqueue.broker._eventlog`)
before it calls the backend, and the terminal event is written only by whoever
creates the claim, so a request ends once however often it is delivered.

Runs are numbered over the request's life (the ``delivery`` of ``started``,
``retrying``, ``preempted``, ``completed`` and of token chunks). What a failed
run leads to is the failure policy's decision, carried out by ``_failures``:
retried here, put back to routing for another candidate, or failed, within a
budget of failed runs per dispatch that redeliveries for other reasons (a
worker killed or shut down, a broker that does not answer) do not use up. The
broker's own limit (the consumer's ``max_deliver`` = ``worker.delivery_limit``)
is a backstop far above it; a message that reaches it ends ``failed`` as
``undeliverable`` (:mod:`renqueue.services._advisories`). Cancellation (shutdown)
is not failure: the request is handed back to the queue at once.

The fetch loop and the work-stealing loop run under the process's
:class:`~renqueue.tasks.Supervisor`.

Its parts: :class:`Worker` is the loop that composes them. One delivered
message and every answer the broker gets for it (ack, nak, term, in-progress)
is a :class:`~._delivery.Delivery` (``_delivery``); what it must pass before
its backend call is the ``_gate``; how it ends, recorded then answered, is
``_outcomes``; what a failed run leads to is ``_failures``; the backend call
and its token stream is ``_call``; work stealing between replicas of a pool
is ``_stealing``; its side of the preemption protocol is ``_yielding``; the
backend's health probe is ``_probe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping

import msgspec

from ... import metrics
from ...backends import HTTPBackend
from ...backends.base import Backend
from ...broker import (
    Connection,
    EventLog,
    JetStream,
    Message,
    PubAck,
    PullSubscription,
    StoredMessage,
    Subscription,
)
from ...config import BaseBackendConfig, Config, parse_duration
from ...coordination import CancelWatch
from ...errors import BackendError
from ...lifecycle import Lifecycle
from ...logs import bound_request, get_logger
from ...policy import RouteFacts, expired_running
from ...schema import (
    DISPATCH_STREAM,
    FETCH_TIMEOUT,
    MAX_REQUEUES,
    SHUTDOWN_NAK_DELAY,
    CancelRequested,
    Dispatch,
    Started,
    capacity_subject,
    msg_id,
    preempt_subjects,
    worker_consumer,
)
from ...state import is_backend_fault
from ...tasks import Supervisor, cancel_and_wait
from ._call import Caller, CallStop, CallStopped, Expiry, settle
from ._delivery import Delivery
from ._failures import Failures
from ._gate import Gate
from ._outcomes import Outcomes
from ._probe import Prober
from ._stealing import STEAL_INTERVAL, Thief
from ._yielding import Preemptible, Run

__all__ = ["Worker"]

log = get_logger("worker")


class Worker(Lifecycle):
    """Serves one backend. ``start()``, then ``close()`` to drain."""

    def __init__(
        self,
        nc: Connection,
        js: JetStream,
        config: Config,
        backend_name: str,
        backend: Backend,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.time,
        cancels: CancelWatch | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._backend_name = backend_name
        self._backend_config: BaseBackendConfig = config.backends[backend_name]
        self._name = name or f"{socket.gethostname()}-{os.getpid()}-{backend_name}"
        self._clock = clock
        self._log = EventLog(js)
        self._slots = self._backend_config.limits.concurrency
        self._ack_wait = parse_duration(config.worker.ack_wait)
        #: Run numbers of one attempt stay below this: the broker's delivery limit.
        self._stride = config.worker.deliveries
        self._drain_timeout = parse_duration(config.worker.drain_timeout)
        #: Seconds a preempted call's slot stays taken after its stream is closed.
        self._preempt_grace = parse_duration(self._backend_config.preempt_grace)
        self._caller = Caller(js, backend_name, self._backend_config, backend, clock=clock)
        #: How a failed run is retried or ended (:func:`renqueue.policy.after_failure`).
        policy = config.worker.failure_policy()
        #: How a delivery ends, recorded then answered; what it counts.
        self._outcomes = Outcomes(
            js, self._log, backend_name, backend=backend, policy=policy, clock=clock
        )
        #: What a failed run leads to.
        self._failures = Failures(
            self._log,
            self._outcomes,
            backend_name,
            backend=backend,
            policy=policy,
            route=self._route_facts,
            clock=clock,
        )
        self._running: set[asyncio.Task[None]] = set()
        # This backend's series, looked up once (``labels()`` locks and checks on each call).
        self._in_flight = metrics.IN_FLIGHT.labels(backend_name)
        #: Where a freed slot is announced.
        self._capacity_subject = capacity_subject(backend_name)
        # Keyed by msg_id(tenant, request id): ids are scoped by tenant.
        self._calls: dict[str, CallStop] = {}
        self._preemptible = Preemptible(backend_name, config.level_policies())
        self._thief = Thief(
            js,
            self._log,
            backend_name,
            self.siblings,
            slots=self._slots,
            clock=clock,
            supports=self._backend_config.supports,
        )
        #: Ends, without a call, a delivery that must not run.
        self._gate = Gate(
            self._log,
            self._outcomes,
            self._thief,
            backend_name,
            pooled=self._backend_config.pool is not None,
            cancels=cancels,
            clock=clock,
        )
        self._preempt_sub: Subscription | None = None
        self._cancels = cancels
        self._slot_freed = asyncio.Event()
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor(self._name)
        #: Names of this worker's loops under the supervisor.
        self._loops: list[str] = []
        self._sub: PullSubscription | None = None
        #: Removes this worker's cancel listener (set while it is registered).
        self._unlisten: Callable[[], None] | None = None
        #: Its active probe, if the backend has one.
        self._prober: Prober | None = None

    @property
    def backend_name(self) -> str:
        return self._backend_name

    @property
    def completed(self) -> int:
        """Requests this worker completed."""
        return self._outcomes.completed

    @property
    def failed(self) -> int:
        """Requests this worker failed for good."""
        return self._outcomes.failed

    @property
    def faults_in_a_row(self) -> int:
        """Backend faults in a row in this worker's own calls (a completion resets
        it): past its circuit's ``failures`` it steals no work for its pool."""
        return self._outcomes.faults_in_a_row

    async def _start(self) -> None:
        if self._cancels is not None:
            self._unlisten = self._cancels.listen(self._on_cancel_requested)
        # Every worker of the backend hears each preemption ask (no queue
        # group: the run to preempt may be in any of them) and offers; the
        # router confirms one, on this worker's own subject (renqueue.schema._offers).
        self._preempt_sub = await self._nc.subscribe(
            preempt_subjects(self._backend_name), cb=self._preemptible.on_message
        )
        self._sub = await self._js.pull_subscribe_bind(
            durable=worker_consumer(self._backend_name), stream=DISPATCH_STREAM
        )
        self._loops.append(f"{self._name}-fetch")
        self._supervisor.spawn(self._loops[-1], self._fetch_loop)
        if self.siblings:
            self._loops.append(f"{self._name}-steal")
            self._supervisor.spawn(self._loops[-1], self._steal_loop)
        if self._backend_config.probe is not None:
            prober = self._prober = Prober(
                self._backend_name,
                self._backend_config,
                self._log,
                worker=self._name,
                clock=self._clock,
                headers=self._auth_headers(),
            )
            self._loops.append(f"{self._name}-probe")
            self._supervisor.spawn(self._loops[-1], prober.run)
        log.info("worker started", worker=self._name, backend=self._backend_name)

    @property
    def siblings(self) -> list[str]:
        """The other backends of this backend's pool (replicas work can be stolen from)."""
        pool = self._backend_config.pool
        return [
            name
            for name, backend in self._config.backends.items()
            if pool is not None and backend.pool == pool and name != self._backend_name
        ]

    def abandon_runs(self) -> None:
        """Its connection is gone: no run in flight can be acked or stream on,
        so :meth:`close` cancels them at once instead of waiting up to
        ``worker.drain_timeout`` (the broker delivers them again)."""
        self._drain_timeout = 0.0

    async def _close(self) -> None:
        """Stop fetching, let in-flight runs finish within the bound, nak the rest."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        await self._supervisor.cancel(*self._loops)
        self._loops.clear()
        if self._preempt_sub is not None:
            with contextlib.suppress(Exception):
                await self._preempt_sub.unsubscribe()
            self._preempt_sub = None
        if self._sub is not None:
            # An expiring pull must not leave an unread message that stalls drain().
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._running:
            try:
                _done, pending = await asyncio.wait(self._running, timeout=self._drain_timeout)
            finally:
                # A stop cut short (cancelled) leaves no run calling its backend.
                for run in self._running:
                    run.cancel()
            # Each run naks its message when cancelled. A run can swallow a
            # cancellation (see renqueue.tasks): cancel until every one has ended.
            await cancel_and_wait(pending)
        if self._own_supervisor:
            await self._supervisor.close()
        log.info("worker stopped", worker=self._name, completed=self.completed)

    async def _fetch_loop(self) -> None:
        """Fetch at most the free slots; each message runs in a task of its own.

        A failed fetch (other than the timeout of an empty poll) raises: the
        supervisor logs it and starts the loop again after a backoff.
        """
        psub = self._sub
        if psub is None:
            raise RuntimeError("the worker is not started")
        while True:
            free = self._slots - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                msgs = await psub.fetch(batch=free, timeout=FETCH_TIMEOUT)
            except TimeoutError:
                continue
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self._running.add(task)
                task.add_done_callback(self._run_done)

    # ----------------------------------------------------------- work stealing

    async def _steal_loop(self) -> None:
        """Every ``STEAL_INTERVAL`` seconds, one :meth:`steal` round. An error raises:
        the supervisor logs it and starts the loop again after a backoff."""
        while True:
            await asyncio.sleep(STEAL_INTERVAL)
            await self.steal()

    async def steal(self) -> int:
        """One round of work stealing (:meth:`Thief.steal`): how many dispatches
        moved here; none while this backend looks down from here (its own calls
        failed ``circuit.failures`` times in a row, or its probe says so): its
        free slots are free because its circuit is open, and a stolen request
        would only fail here."""
        if not self.may_steal():
            return 0
        return await self._thief.steal()

    def may_steal(self) -> bool:
        """Whether this worker's backend looks well enough to take a sibling's work."""
        down = self._prober is not None and self._prober.last is False
        return not down and self.faults_in_a_row < self._backend_config.circuit.failures

    async def _steal(self, raw: StoredMessage, sibling: str) -> bool:
        """Move one queued dispatch from ``sibling`` here (:meth:`Thief.steal_one`)."""
        return await self._thief.steal_one(raw, sibling)

    def _run_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slot_freed.set()
        # A run handles its own failures (:meth:`Failures.unexpected`); one that escapes
        # is a bug, logged here rather than lost with the task.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a run ended with an unhandled error", exc_info=exc)

    # ------------------------------------------------------------------ one run

    async def _handle(self, msg: Message) -> None:
        """One delivery, from fetch to its answer. Its lease is renewed for as
        long as this task is alive, whatever phase it is in."""
        delivery = Delivery(msg, ack_wait=self._ack_wait)
        delivery.keep_alive()
        try:
            await self._handle_leased(delivery)
        finally:
            delivery.stop_renewing()

    async def _handle_leased(self, delivery: Delivery) -> None:
        try:
            request = delivery.open(backend=self._backend_name, stride=self._stride).request
        except msgspec.DecodeError as exc:
            await self._outcomes.poison(delivery, str(exc))
            return
        trace_id = delivery.trace.trace_id  # its log lines join the request's trace
        with bound_request(request.id, backend=self._backend_name, trace_id=trace_id):
            self._in_flight.inc()
            try:
                await self._run(delivery)
            except asyncio.CancelledError:
                await self._outcomes.hand_back(delivery, after=SHUTDOWN_NAK_DELAY)
                raise
            except Exception as exc:  # noqa: BLE001 - one request must never kill the worker
                await self._failures.unexpected(delivery, exc)
            finally:
                self._in_flight.dec()
                with contextlib.suppress(Exception):
                    await self._nc.publish(self._capacity_subject, b"")

    async def _run(self, delivery: Delivery) -> None:
        dispatch = delivery.dispatch
        request = dispatch.request
        if await self._gate.refuses(delivery):
            return
        begun = await self._start_run(delivery)
        if begun is None:
            return
        started, pending_acks = begun
        # The call runs in this task: a cancellation or preemption stops it
        # (closing the backend's HTTP stream) through its CallStop, not this run.
        this = asyncio.current_task()
        assert this is not None  # a run is a task of its own (_fetch_loop)
        stop = CallStop(this)
        rank = self._rank_of(dispatch)
        scoped = msg_id(request.tenant, request.id)
        self._calls[scoped] = stop
        # A run is judged at the level it was bound at: one that aged to the top
        # is not preemptible, or aging could never get it through.
        self._preemptible.runs[scoped] = Run(
            rank=rank,
            started=time.monotonic(),
            call=stop,
            may_requeue=dispatch.attempt <= MAX_REQUEUES,
        )
        # A cancellation read after the gate looked and before the call was
        # registered found nothing to stop: look again, now that it would.
        if self._cancels is not None and self._cancels.is_cancelled(request.tenant, request.id):
            stop.cancel()
        try:
            with stop:
                outcome = await self._caller.call(
                    dispatch,
                    delivery.number,
                    pending_acks,
                    delivery.chunks,
                    rank=rank,
                    trace=delivery.trace,
                )
        except CallStopped:
            await settle(pending_acks, self._nc)
            await self._call_stopped(delivery, self._preemptible.runs[scoped].preempted_by)
            return
        except BackendError as exc:
            await self._backend_failed(delivery, exc, pending_acks=pending_acks)
            return
        except Expiry:
            await self._outcomes.settle_held(pending_acks, started)
            await self._outcomes.finish(delivery, expired_running(delivery.run, self._clock()))
            return
        finally:
            self._calls.pop(scoped, None)
            self._preemptible.runs.pop(scoped, None)
        await self._outcomes.settle_held(pending_acks, started)
        await self._outcomes.finish(delivery, outcome)

    async def _call_stopped(self, delivery: Delivery, preempted_by: str | None) -> None:
        """Its call was stopped: preempted for the request ``preempted_by``,
        else cancelled by request."""
        if preempted_by is not None:
            # The HTTP stream is closed: the slot goes to the urgent request
            # now, or after the backend's grace (one that refuses calls past
            # its concurrency may not have seen the disconnect yet).
            if self._preempt_grace > 0:
                await asyncio.sleep(self._preempt_grace)
            await self._outcomes.requeue(delivery, delivery.number, preempted_by)
        else:
            await self._outcomes.cancel(delivery, stage="running")

    async def _start_run(
        self, delivery: Delivery
    ) -> tuple[Started, list[asyncio.Future[PubAck]]] | None:
        """Record ``started``: it and the pending acks to wait for (its ack is
        not awaited before the call), or ``None`` to step back."""
        dispatch = delivery.dispatch
        request = dispatch.request
        # In a pool, a queued dispatch may be stolen by a sibling while it is
        # delivered here: both copies are then the same run of the same
        # attempt, and the claim on that run (a KV create only services can
        # make) decides which one calls the backend; the other steps back.
        if self._backend_config.pool is not None and not await self._log.claim_run(
            request.tenant, request.id, dispatch.attempt, delivery.number
        ):
            log.info("another replica runs this request; dropping it")
            await delivery.done()
            return None
        started = delivery.run.started(at=self._clock(), worker=self._name)
        return started, [await self._log.append_async(started)]

    def _rank_of(self, dispatch: Dispatch) -> int:
        """The priority passed down to the backend: the effective one when bound."""
        if dispatch.effective_rank is not None:
            return dispatch.effective_rank
        return self._config.priority_rank(dispatch.request.priority)

    def _on_cancel_requested(self, event: CancelRequested) -> None:
        # The watch passes only events that agree with their subject's tenant.
        call = self._calls.get(msg_id(event.tenant, event.request_id))
        if call is not None:
            log.info("stopping a running request on cancellation", request_id=event.request_id)
            call.cancel()

    async def _backend_failed(
        self,
        delivery: Delivery,
        exc: BackendError,
        *,
        pending_acks: list[asyncio.Future[PubAck]],
    ) -> None:
        """The backend failed the call: count it, wait for what the run
        published to be stored, then let the failure handler decide."""
        metrics.BACKEND_CALLS.labels(self._backend_name, exc.code).inc()
        if is_backend_fault(exc.code, str(exc.failure)):
            self._outcomes.faults_in_a_row += 1
        await settle(pending_acks, self._nc)
        await self._failures.after(delivery, exc)

    def _auth_headers(self) -> Mapping[str, str] | None:
        """The headers carrying its backend's key, for a health probe of it."""
        backend = self._caller.backend
        return backend.auth_headers() if isinstance(backend, HTTPBackend) else None

    def _route_facts(self, dispatch: Dispatch) -> RouteFacts | None:
        """The request's route and cascade state for the failure policy
        (``None``: its route is not in this worker's config: no fallback)."""
        return self._config.route_facts(
            dispatch.request, self._backend_name, probe=dispatch.probe, now=self._clock()
        )
