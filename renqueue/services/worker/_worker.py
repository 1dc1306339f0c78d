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
run leads to is the failure policy's decision (:func:`renqueue.policy.after_failure`):
transient failures (rate-limited, server errors, worker errors) are retried
with a delayed ``nak`` (the provider's ``retry-after``, else a capped, jittered
backoff) and a ``retrying`` event; a provider that says its quota is spent
(hours away) gets a ``retrying`` event that says ``requeued``, and the request
goes back to routing for another candidate, keeping its wait (as after a
preemption), instead of waiting for the reset here; the budget, ``worker.max_deliver``
failed runs per dispatch, is counted from those events, so redeliveries for
other reasons (a worker killed or shut down, a broker that does not answer:
handed back after the same backoff by delivery count) do not use it up. The broker's
own limit (the consumer's ``max_deliver`` = ``worker.delivery_limit``) is a
backstop far above it; a message that reaches it ends ``failed`` as
``undeliverable`` (:mod:`renqueue.services._advisories`). Cancellation (shutdown) is not
failure: the request is nak'ed back to the queue at once.

The fetch loop and the work-stealing loop run under the process's
:class:`~renqueue.tasks.Supervisor`.

Its parts: the backend call and its token stream (``_call``), work stealing
between replicas of a pool (``_stealing``) and its side of the preemption
protocol (``_yielding``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

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
from ...coordination import CancelWatch, Coalescer, coalesce_key
from ...errors import BackendError, NatsPayloadTooLargeError, NatsUnavailableError, RateLimitedError
from ...lifecycle import Lifecycle
from ...logs import bound_request, get_logger
from ...policy import (
    INTERNAL,
    FallBack,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    after_failure,
    backoff,
    retry_after,
)
from ...schema import (
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    FETCH_TIMEOUT,
    MAX_REQUEUES,
    SHUTDOWN_NAK_DELAY,
    Cancelled,
    CancelRequested,
    Completed,
    Dispatch,
    Event,
    Expired,
    Failed,
    Fallback,
    FellBack,
    InferenceRequest,
    Preempted,
    Retrying,
    Started,
    Stolen,
    capacity_subject,
    is_terminal,
    kind_of,
    msg_id,
    preempt_subjects,
    worker_consumer,
)
from ...state import is_backend_fault
from ...tasks import Supervisor, cancel_and_wait
from ._call import Caller, Chunks, Expiry, reported_limits, settle
from ._probe import Prober
from ._stealing import STEAL_INTERVAL, Thief
from ._yielding import PREEMPT_GRACE, Preemptible, Run, put_back, requeue

__all__ = ["Worker"]

log = get_logger("worker")


#: ``error_type`` of a request that fails because its provider's quota is spent
#: and it cannot be put back to routing again (put back ``MAX_REQUEUES`` times).
QUOTA_EXHAUSTED: Final = "quota_exhausted"


def _broker_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker did not answer (no stream leader, a
    reconnect, a timeout), rather than that something is wrong with the run."""
    return isinstance(exc, NatsUnavailableError | TimeoutError)


class Worker(Lifecycle):
    """Serves one backend. ``start()``, then ``stop()`` to drain."""

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
        #: How a failed run is retried or ended (:func:`renqueue.policy.after_failure`).
        self._failure_policy = config.worker.failure_policy()
        self._drain_timeout = parse_duration(config.worker.drain_timeout)
        self._caller = Caller(js, backend_name, self._backend_config, backend, clock=clock)
        self._running: set[asyncio.Task[None]] = set()
        # Both keyed by msg_id(tenant, request id): ids are scoped by tenant.
        self._calls: dict[str, asyncio.Task[Completed]] = {}
        self._coalescer = Coalescer(js, clock=clock)
        self._policies = config.level_policies()
        self._preemptible = Preemptible(backend_name, self._policies)
        self._thief = Thief(
            js,
            self._log,
            backend_name,
            self.siblings,
            slots=self._slots,
            clock=clock,
            supports=self._backend_config.supports,
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
        self.completed = 0
        self.failed = 0
        #: Backend faults in a row in this worker's own calls (a completion resets
        #: it): past its circuit's ``failures`` it steals no work for its pool.
        self.faults_in_a_row = 0
        #: Its active probe, if the backend has one.
        self._prober: Prober | None = None

    @property
    def backend_name(self) -> str:
        return self._backend_name

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
        so :meth:`stop` cancels them at once instead of waiting up to
        ``worker.drain_timeout`` (the broker delivers them again)."""
        self._drain_timeout = 0.0

    async def _stop(self) -> None:
        """Stop fetching, let in-flight runs finish within the bound, nak the rest."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        await self._supervisor.stop(*self._loops)
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
        # A run handles its own failures (:meth:`_unexpected`); one that escapes
        # is a bug, logged here rather than lost with the task.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a run ended with an unhandled error", exc_info=exc)

    # ------------------------------------------------------------------ one run

    async def _handle(self, msg: Message) -> None:
        """One delivery, from fetch to ack or nak. Its lease is renewed for as
        long as this task is alive, whatever phase it is in."""
        keepalive = asyncio.create_task(self._keep_alive(msg, asyncio.current_task()))
        try:
            await self._handle_leased(msg)
        finally:
            keepalive.cancel()
            await asyncio.wait([keepalive])

    async def _handle_leased(self, msg: Message) -> None:
        try:
            dispatch = DISPATCH_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self._poison(msg, str(exc))
            return
        request = dispatch.request
        # Runs are numbered over the request's whole life: redeliveries of this
        # dispatch, and dispatches after a preemption (a higher attempt).
        run = (dispatch.attempt - 1) * self._stride + int(msg.metadata.num_delivered)
        chunks = Chunks()
        with bound_request(request.id, backend=self._backend_name):
            metrics.IN_FLIGHT.labels(self._backend_name).inc()
            try:
                await self._run(msg, dispatch, run, chunks)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=SHUTDOWN_NAK_DELAY)
                raise
            except Exception as exc:  # noqa: BLE001 - one request must never kill the worker
                await self._unexpected(msg, dispatch, run, chunks, exc)
            finally:
                metrics.IN_FLIGHT.labels(self._backend_name).dec()
                with contextlib.suppress(Exception):
                    await self._nc.publish(capacity_subject(self._backend_name), b"")

    async def _unexpected(
        self, msg: Message, dispatch: Dispatch, run: int, chunks: Chunks, exc: Exception
    ) -> None:
        """A bug mid-run: a failed run like any other, retried within the
        budget, then the request fails; if not even that can be recorded, the
        message is left for redelivery (the broker's delivery limit is the
        backstop). A broker that does not answer (a stream leader election, a
        reconnect) is not the request's failure: the run is handed back with a
        backoff that grows with its deliveries, and no retry is counted."""
        if _broker_unavailable(exc):
            delay = self._backoff(msg)
            log.warning("the broker did not answer mid-run; the request will run again",
                        error=repr(exc), retry_in=delay)  # fmt: skip
            with contextlib.suppress(Exception):
                await msg.nak(delay=delay)
            return
        try:
            await self._after_failure(msg, dispatch, run, chunks, exc)
        except Exception:
            log.exception("could not record the failed run; leaving the request for redelivery")
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._backoff(msg))

    def _backoff(self, msg: Message) -> float:
        """Delay before a message handed back for the broker's sake is delivered
        again: the failure policy's backoff (doubling from ``retry_delay``,
        capped at ``max_retry_delay``, jittered) by the delivery count, so the
        delivery limit spans minutes of broker trouble, not seconds."""
        delivered = max(1, int(msg.metadata.num_delivered))
        return backoff(delivered, self._failure_policy, random.random)

    async def _poison(self, msg: Message, reason: str) -> None:
        seq = msg.metadata.sequence.stream
        log.error("undecodable dispatch message sent to dead letters", seq=seq, reason=reason)
        await self._log.dead_letter(
            "dispatch",
            msg.data,
            reason=f"malformed: {reason}",
            source_subject=msg.subject,
            source_seq=msg.metadata.sequence.stream,
            tenant="unknown",
            request_id=f"dispatch-{seq}",
        )
        await msg.term()

    async def _run(self, msg: Message, dispatch: Dispatch, run: int, chunks: Chunks) -> None:
        request = dispatch.request
        delivery = int(msg.metadata.num_delivered)
        if await self._refused(msg, dispatch, delivery, run):
            return
        pending_acks = await self._start_run(msg, dispatch, run)
        if pending_acks is None:
            return
        # The call runs as a task of its own, so a cancellation or preemption
        # can stop it (closing the backend's HTTP stream) without stopping this run.
        rank = self._rank_of(dispatch)
        call = asyncio.create_task(
            self._caller.call(dispatch, run, pending_acks, chunks, rank=rank)
        )
        scoped = msg_id(request.tenant, request.id)
        self._calls[scoped] = call
        # A run is judged at the level it was bound at: one that aged to the top
        # is not preemptible, or aging could never get it through.
        self._preemptible.runs[scoped] = Run(
            rank=rank,
            started=time.monotonic(),
            call=call,
            may_requeue=dispatch.attempt <= MAX_REQUEUES,
        )
        # A cancellation read after _refused looked and before the call was
        # registered found nothing to stop: look again, now that it would.
        if self._cancels is not None and self._cancels.is_cancelled(request.tenant, request.id):
            call.cancel()
        try:
            outcome = await call
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not (call.cancelled() and this is not None and not this.cancelling()):
                raise  # shutdown: the message is nak'ed by _handle
            await settle(pending_acks, self._nc)
            preempted_by = self._preemptible.runs[scoped].preempted_by
            if preempted_by is not None:
                # The HTTP stream is closed; give the backend a moment to see
                # the disconnect before its slot goes to the urgent request.
                await asyncio.sleep(PREEMPT_GRACE)
                await self._requeue(msg, dispatch, run, preempted_by)
            else:
                cancelled = self._cancelled(request, "running")
                await self._finish(msg, request, cancelled, run, seq=chunks.seq)
            return
        except BackendError as exc:
            await self._backend_failed(msg, dispatch, run, chunks, exc, pending_acks=pending_acks)
            return
        except Expiry:
            await settle(pending_acks, self._nc)
            await self._finish(
                msg,
                request,
                Expired(
                    request_id=request.id,
                    tenant=request.tenant,
                    at=self._clock(),
                    stage="running",
                    reason="deadline passed during generation",
                ),
                run,
                seq=chunks.seq,
            )
            return
        finally:
            self._calls.pop(scoped, None)
            self._preemptible.runs.pop(scoped, None)
            call.cancel()
        await settle(pending_acks, self._nc)
        await self._finish(msg, request, outcome, run, seq=chunks.seq)

    async def _refused(self, msg: Message, dispatch: Dispatch, delivery: int, run: int) -> bool:
        """Settle, without calling the backend, a dispatch that must not run:
        already ended (checked on every delivery: a zombie's or a second
        dispatch's run finds the terminal claim), finished or moved by a worker
        that died before acking it, past its deadline, or cancelled."""
        request = dispatch.request
        claim = await self._log.claim_of(request.tenant, request.id)
        if claim is not None:
            log.info("request already ended; dropping this run", ended=kind_of(claim.event))
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
            # Whoever ended it may not have handed out to its followers (a crash
            # after the claim, an ender that skipped it): idempotent, so again.
            await self._hand_out(request, claim.event)
            await self._log.settle(claim)  # its event may not be in the log yet
            await msg.ack()
            return True
        pooled = self._backend_config.pool is not None
        if (delivery > 1 or pooled) and await self._settled_before(
            msg, dispatch, first=delivery == 1
        ):
            return True
        now = self._clock()
        if request.deadline is not None and now >= request.deadline:
            expired = Expired(
                request_id=request.id,
                tenant=request.tenant,
                at=now,
                stage="queued",
                reason="deadline passed before the backend call",
            )
            await self._finish(msg, request, expired, run)
            return True
        if self._cancels is not None and await self._cancels.was_cancelled(
            request.tenant, request.id, since=dispatch.routed_at
        ):
            await self._finish(msg, request, self._cancelled(request, "queued"), run)
            return True
        return False

    async def _start_run(
        self, msg: Message, dispatch: Dispatch, run: int
    ) -> list[asyncio.Future[PubAck]] | None:
        """Record ``started``; the pending acks to wait for, or ``None`` to step back."""
        request = dispatch.request
        # In a pool, a queued dispatch may be stolen by a sibling while it is
        # delivered here: both copies are then the same run of the same
        # attempt, and the claim on that run (a KV create only services can
        # make) decides which one calls the backend; the other steps back.
        if self._backend_config.pool is not None and not await self._log.claim_run(
            request.tenant, request.id, dispatch.attempt, run
        ):
            log.info("another replica runs this request; dropping it")
            await msg.ack()
            return None
        started = Started(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            backend=self._backend_name,
            attempt=dispatch.attempt,
            delivery=run,
            worker=self._name,
        )
        return [await self._log.append_async(started)]

    async def _settled_before(
        self, msg: Message, dispatch: Dispatch, *, first: bool = False
    ) -> bool:
        """On a redelivery: was this dispatch finished (before terminal claims
        existed), preempted, put back for a spent quota, or moved by a worker
        that died before acking it?
        Then complete that work and ack. ``first``: a first delivery in a pool,
        where only a move matters (a sibling stole this message while it was
        being delivered here: the copy runs, this one is handed over).

        A move is handed over only while its copy can still run (it is
        stored, or was moved on). A copy gone without an outcome stepped back
        for a run of this very message (the run claim, see ``_start_run``), and
        that run's worker died: this message is then the request's only
        lease, and it runs.
        """
        request = dispatch.request
        source_seq = int(msg.metadata.sequence.stream)
        if first:
            stolen = await self._log.history(request.tenant, request.id, kind="stolen")
            if not any(self._thief.stolen_here(event, dispatch, source_seq) for event in stolen):
                return False
        events = await self._log.history(request.tenant, request.id)
        ended = [event for event in events if is_terminal(event)]
        if ended:
            log.info("redelivered request already finished; dropping")
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
            await self._hand_out(request, ended[0])
            await msg.ack()
            return True
        for event in events:
            if isinstance(event, Preempted) and event.attempt == dispatch.attempt:
                await self._requeue(msg, dispatch, event.delivery, event.by)
                return True
            if isinstance(event, Retrying) and event.requeued and event.attempt == dispatch.attempt:
                log.info("request was put back to routing before; putting it back again")
                await self._put_back(msg, dispatch)
                return True
            if isinstance(event, FellBack) and event.attempt == dispatch.attempt:
                log.info("request fell back to routing before; putting it back again")
                await self._put_back(msg, dispatch, fallback=event.fallback)
                return True
        move = next((e for e in events if self._thief.stolen_here(e, dispatch, source_seq)), None)
        return isinstance(move, Stolen) and await self._thief.hand_over(msg, dispatch, move, events)

    def _rank_of(self, dispatch: Dispatch) -> int:
        """The priority passed down to the backend: the effective one when bound."""
        if dispatch.effective_rank is not None:
            return dispatch.effective_rank
        return self._config.priority_rank(dispatch.request.priority)

    async def _requeue(self, msg: Message, dispatch: Dispatch, run: int, by: str) -> None:
        """Send a preempted request back to wait (:func:`requeue`). If that
        fails, the dispatch is handed back (see :meth:`_put_back`)."""
        try:
            await requeue(
                self._js, self._log, msg, dispatch, run=run, by=by,
                backend=self._backend_name, at=self._clock(),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - not a failed run: handed back
            await self._put_back_failed(msg, exc)

    async def _put_back(
        self, msg: Message, dispatch: Dispatch, *, fallback: Fallback | None = None
    ) -> None:
        """Put a request back to routing (:func:`put_back`), its reason already
        logged. If that fails (the copy's publish, the ack), the dispatch is
        handed back with a backoff, not failed: the run did not fail, and the
        redelivery finds the logged reason and puts it back again
        (:meth:`_settled_before`, idempotent), without calling the backend."""
        try:
            await put_back(self._js, msg, dispatch, fallback=fallback)
        except Exception as exc:  # noqa: BLE001 - not a failed run: handed back
            await self._put_back_failed(msg, exc)

    async def _put_back_failed(self, msg: Message, exc: Exception) -> None:
        """Hand the dispatch back after the failure policy's backoff (by its
        delivery count), without :meth:`_after_failure`: no failed run counted."""
        delay = self._backoff(msg)
        log.warning(
            "could not put the request back to routing; handing the dispatch back",
            error=repr(exc),
            retry_in=delay,
        )
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)

    def _cancelled(self, request: InferenceRequest, stage: str) -> Cancelled:
        return Cancelled(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            stage=stage,
            reason="cancelled by request",
        )

    def _on_cancel_requested(self, event: CancelRequested) -> None:
        # The watch passes only events that agree with their subject's tenant.
        call = self._calls.get(msg_id(event.tenant, event.request_id))
        if call is not None:
            log.info("stopping a running request on cancellation", request_id=event.request_id)
            call.cancel()

    async def _backend_failed(
        self,
        msg: Message,
        dispatch: Dispatch,
        run: int,
        chunks: Chunks,
        exc: BackendError,
        *,
        pending_acks: list[asyncio.Future[PubAck]],
    ) -> None:
        metrics.BACKEND_CALLS.labels(self._backend_name, exc.code).inc()
        if is_backend_fault(exc.code, str(exc.failure)):
            self.faults_in_a_row += 1
        await settle(pending_acks, self._nc)
        await self._after_failure(msg, dispatch, run, chunks, exc)

    async def _after_failure(
        self, msg: Message, dispatch: Dispatch, run: int, chunks: Chunks, exc: Exception
    ) -> None:
        """Carry out what the failure policy decides for a failed run: retry it
        here after a delay, put it back to routing (a spent quota), or fail the
        request (:func:`renqueue.policy.after_failure`).

        A run whose answer, as the services write it, is over the broker's
        ``max_payload`` fails at once: running it again would pay the backend
        for the same answer, which would not fit either."""
        if isinstance(exc, NatsPayloadTooLargeError):
            log.error(
                "the answer is over the broker's largest message; request fails", error=str(exc)
            )
            await self._fail(
                msg,
                dispatch,
                run,
                chunks.seq,
                error_type="answer_too_large",
                reason=f"its answer was streamed, but is too big to record whole: {exc}",
                error_class=INTERNAL,
            )
            return
        action = after_failure(
            exc,
            failed_runs=await self._failed_runs(dispatch),
            policy=self._failure_policy,
            random=random.random,
            route=self._route_facts(dispatch),
        )
        internal = not isinstance(exc, BackendError)
        error_class = INTERNAL if not isinstance(exc, BackendError) else str(exc.failure)
        if isinstance(action, Retry) and dispatch.request.deadline is not None:
            # Never handed back past its deadline: it expires on time instead.
            left = max(0.0, dispatch.request.deadline - self._clock())
            action = msgspec.structs.replace(action, delay=min(action.delay, left))
        if isinstance(action, Retry):
            if internal:
                log.error("unexpected error; the request will run again",
                          exc_info=exc, delay=action.delay)  # fmt: skip
            else:
                log.warning("backend call failed; will retry", error=str(exc), delay=action.delay)
            await self._retry(
                msg,
                dispatch,
                run,
                error_type=action.error_type,
                reason=action.reason,
                delay=action.delay,
                exhausted_until=_exhausted_until(exc),
                error_class=error_class,
            )
            return
        if isinstance(action, RequeueElsewhere):
            await self._requeue_elsewhere(msg, dispatch, run, action, exc, seq=chunks.seq)
            return
        if isinstance(action, FallBack):
            await self._fall_back(msg, dispatch, run, action, exc, seq=chunks.seq)
            return
        if internal:
            log.error("unexpected error on the last allowed run; request fails", exc_info=exc)
        else:
            log.error("request failed", error=str(exc), run=run)
        await self._fail(
            msg,
            dispatch,
            run,
            chunks.seq,
            error_type=action.error_type,
            reason=action.reason,
            error_class=error_class,
        )

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

    async def _fall_back(
        self,
        msg: Message,
        dispatch: Dispatch,
        run: int,
        action: FallBack,
        exc: Exception,
        *,
        seq: int,
    ) -> None:
        """The backend failed the request in a way its route falls back on:
        record why (``fell_back``), then put it back to routing, keeping its
        wait, with where it may not go next (``InferenceRequest.fallback``).

        As for a spent quota (:meth:`_requeue_elsewhere`): the event is stored
        before the copy, a redelivery finds it and puts the request back
        again without a call, and a request put back :data:`MAX_REQUEUES`
        times already fails instead.
        """
        request = dispatch.request
        if dispatch.attempt > MAX_REQUEUES:
            log.error("the request fell back too often; it fails")
            await self._fail(
                msg,
                dispatch,
                run,
                seq,
                error_type=action.error_type,
                reason=(
                    f"put back {MAX_REQUEUES} times, the most a request may be: {action.reason}"
                )[:1000],
                error_class=action.error_class,
            )
            return
        log.warning(
            "backend failed the request; it falls back down its route",
            error=action.reason,
            error_class=action.error_class,
            excluded=list(action.fallback.excluded),
            probe=dispatch.probe,
        )
        await self._log.append(
            FellBack(
                request_id=request.id,
                tenant=request.tenant,
                at=self._clock(),
                backend=self._backend_name,
                attempt=dispatch.attempt,
                delivery=run,
                error_type=action.error_type,
                error_class=action.error_class,
                reason=action.reason,
                fallback=action.fallback,
                probe=dispatch.probe,
                limits=reported_limits(self._caller.backend),
                retry_after=self._cool_down_for(action, exc),
            )
        )
        metrics.FALLBACKS.labels(self._backend_name, action.error_class).inc()
        await self._put_back(msg, dispatch, fallback=action.fallback)

    def _cool_down_for(self, action: FallBack, exc: Exception) -> float:
        """How long the backend that answered 429 is left out, for everyone: its
        ``retry-after``, else the first backoff step (a 429 without one still
        says "not now")."""
        if action.error_class != "rate_limited":
            return 0.0
        given = retry_after(exc) or backoff(1, self._failure_policy, random.random)
        # A retry-after of days is a spent quota by another name: held as one
        # (quota_hold), never longer, so a hostile header cannot shut it out for a year.
        return min(given, self._failure_policy.quota_hold)

    async def _failed_runs(self, dispatch: Dispatch) -> int:
        """Runs of this dispatch (attempt) that failed and were retried, from the log."""
        request = dispatch.request
        retries = await self._log.history(request.tenant, request.id, kind="retrying")
        return sum(1 for e in retries if isinstance(e, Retrying) and e.attempt == dispatch.attempt)

    async def _retry(
        self,
        msg: Message,
        dispatch: Dispatch,
        run: int,
        *,
        error_type: str,
        reason: str,
        delay: float,
        exhausted_until: float | None = None,
        error_class: str = "",
    ) -> None:
        """Record the failed run (``retrying``: what the budget counts), then nak.

        What the provider said of its limits goes with it, for every router.
        """
        request = dispatch.request
        await self._log.append(
            Retrying(
                request_id=request.id,
                tenant=request.tenant,
                at=self._clock(),
                backend=self._backend_name,
                attempt=dispatch.attempt,
                delivery=run,
                error_type=error_type,
                reason=reason,
                retry_after=delay,
                limits=reported_limits(self._caller.backend),
                quota_exhausted_until=exhausted_until,
                error_class=error_class,
            )
        )
        await msg.nak(delay=delay)

    async def _requeue_elsewhere(
        self,
        msg: Message,
        dispatch: Dispatch,
        run: int,
        action: RequeueElsewhere,
        exc: Exception,
        *,
        seq: int,
    ) -> None:
        """The provider's quota is spent: record why, then put the request back
        to routing, keeping its wait, for another candidate of its route.

        The ``retrying`` event (``requeued``, with what the provider said of
        its quota and how long this backend is left out) is stored *before*
        the copy is published: the binder reads it when it fetches the copy
        and binds nothing to this backend until the time it names, whatever
        its view of the projection says (see the router's admission and
        ledger). It is a failed run of this attempt only: the next dispatch is
        a new attempt, with a budget of its own. A put-back that fails is
        handed back (:meth:`_put_back`); a redelivery of this dispatch finds
        the event and puts the request back again without calling the backend
        (:meth:`_settled_before`). A request put back :data:`MAX_REQUEUES`
        times already cannot be put back again: it fails (``quota_exhausted``).
        """
        request = dispatch.request
        until = _exhausted_until(exc)
        if dispatch.attempt > MAX_REQUEUES:
            # Its copy would carry more requeues than admission accepts.
            log.error("quota exhausted and the request was put back too often; it fails")
            await self._fail(
                msg,
                dispatch,
                run,
                seq,
                error_type=QUOTA_EXHAUSTED,
                reason=(
                    f"put back {MAX_REQUEUES} times, the most a request may be, "
                    f"and its backend's quota is spent: {action.reason}"
                )[:1000],
                exhausted_until=until,
            )
            return
        now = self._clock()
        # Until the provider's reset when it named one (or its retry-after, if
        # later), else the policy's hold.
        if action.hold is not None or until is None:
            hold = action.hold or 0.0
        else:
            hold = max(0.0, until - now, retry_after(exc) or 0.0)
        log.warning(
            "backend quota exhausted; the request goes back to routing",
            error=str(exc),
            quota_exhausted_until=until,
            backend_left_out_for=round(hold, 3),
        )
        await self._log.append(
            Retrying(
                request_id=request.id,
                tenant=request.tenant,
                at=now,
                backend=self._backend_name,
                attempt=dispatch.attempt,
                delivery=run,
                error_type=action.error_type,
                reason=action.reason,
                retry_after=hold,
                limits=reported_limits(self._caller.backend),
                quota_exhausted_until=until,
                requeued=True,
            )
        )
        await self._put_back(msg, dispatch)

    async def _fail(
        self,
        msg: Message,
        dispatch: Dispatch,
        run: int,
        seq: int,
        *,
        error_type: str,
        reason: str,
        exhausted_until: float | None = None,
        error_class: str = "",
    ) -> None:
        """Fail the request for good: a copy to the dead-letter stream, then ``failed``."""
        request = dispatch.request
        await self._log.dead_letter(
            "dispatch",
            msg.data,
            reason=f"{error_type}: {reason}",
            source_subject=msg.subject,
            source_seq=msg.metadata.sequence.stream,
            tenant=request.tenant,
            request_id=request.id,
        )
        failed = Failed(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            error_type=error_type,
            reason=reason,
            backend=self._backend_name,
            attempt=dispatch.attempt,
            limits=reported_limits(self._caller.backend),
            quota_exhausted_until=exhausted_until,
            error_class=error_class,
        )
        await self._finish(msg, request, failed, run, seq=seq)

    async def _finish(
        self, msg: Message, request: InferenceRequest, event: Event, run: int, *, seq: int = 0
    ) -> None:
        """Record the terminal event, its final chunk at ``(run, seq)`` (the run's
        next chunk), then ack: a crash in between means a redelivery that finds
        the terminal claim and drops the run. Followers sharing this request's
        call get their outcome first, so a crash cannot strand them."""
        await self._hand_out(request, event)
        first = await self._log.finish(event, delivery=run, seq=seq)
        kind = type(event).__name__.lower()
        if first:
            metrics.TERMINAL.labels(kind).inc()
            if isinstance(event, Completed):
                self.completed += 1
                if event.shared_with is None:
                    self.faults_in_a_row = 0
                metrics.COST.labels(self._backend_name).inc(event.cost)
            elif isinstance(event, Failed):
                self.failed += 1
        else:
            log.warning("duplicate terminal event dropped", kind=kind)
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
        await msg.ack()

    async def _hand_out(self, request: InferenceRequest, event: Event) -> None:
        """If ``request`` leads a coalescing group, give its followers their
        outcome from ``event`` (its terminal event). Idempotent."""
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(request.tenant, request.id, key, event)

    async def _keep_alive(self, msg: Message, run: asyncio.Task[Any] | None) -> None:
        """Renew ``msg``'s lease every third of ``ack_wait`` while ``run`` is alive."""
        interval = max(0.1, self._ack_wait / 3)
        while run is None or not run.done():
            await asyncio.sleep(interval)
            if run is not None and run.done():
                return
            try:
                await msg.in_progress()
            except Exception as exc:  # noqa: BLE001 - the next renewal may get through
                log.warning("could not renew a running request's lease", error=str(exc))


def _exhausted_until(exc: Exception) -> float | None:
    """When a provider whose quota is spent said it comes back (``None``: not that, or unknown)."""
    if isinstance(exc, RateLimitedError) and exc.quota_exhausted:
        return exc.quota_exhausted_until
    return None
