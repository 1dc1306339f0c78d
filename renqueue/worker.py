"""The backend worker: serves one backend from its durable consumer.

Any number of worker processes may serve the same backend: they share the
durable pull consumer ``worker-<backend>``, whose ``max_ack_pending`` equals
the backend's concurrency, so the broker itself caps concurrent calls across
all of them.

A dispatched request is acked only once it reached a terminal state
(completed, failed, expired) and that state is in the log. While the backend
generates, the message is kept alive with ``in_progress()``. If the worker
dies, the request is redelivered after ``ack_wait`` and run again; the new run
streams a ``restart`` chunk first, and the terminal event's shared message id
makes sure only one completion is ever recorded. Transient failures
(rate-limited, server errors) are retried with a delayed ``nak`` up to
``worker.max_deliver`` runs; then, or on a fatal error, the request fails into
the dead-letter stream. Cancellation (shutdown) is not failure: the request is
nak'ed back to the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiolimiter import AsyncLimiter
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError

from . import metrics
from .backends import Backend
from .cancellation import CancelWatch
from .coalescing import Groups, coalesce_key
from .config import BackendConfig, Config, parse_duration
from .errors import BackendError, RetryableBackendError
from .eventlog import EventLog
from .logs import bound_request, get_logger
from .messages import (
    DISPATCH_DECODER,
    Cancelled,
    CancelRequested,
    Completed,
    Dispatch,
    Expired,
    Failed,
    InferenceRequest,
    Preempted,
    Retrying,
    Started,
    Stolen,
    TokenChunk,
    Usage,
    encode,
)
from .preemption import ASK_DECODER, CONFIRM_DECODER, Answer, Offer
from .scheduling import choose_victim
from .subjects import (
    DISPATCH_STREAM,
    FETCH_TIMEOUT,
    PREEMPT_ASK,
    SHUTDOWN_NAK_DELAY,
    capacity_subject,
    dispatch_subject,
    msg_id,
    preempt_subject,
    preempt_subjects,
    request_subject,
    token_subject,
    worker_consumer,
)
from .tasks import cancel_and_wait

__all__ = ["Worker"]

log = get_logger("worker")


class _Expiry(Exception):
    """The request's deadline passed during the backend call."""


class _Run(msgspec.Struct, kw_only=True):
    """A backend call in progress, as preemption sees it."""

    rank: int
    started: float
    call: asyncio.Task[Any]
    preempted_by: str | None = None

    def is_live(self) -> bool:
        return self.preempted_by is None and not self.call.done()


#: Seconds between closing a preempted call and releasing its slot.
_PREEMPT_GRACE = 0.1

#: Seconds between looks at pool siblings' queues while this worker has room.
_STEAL_INTERVAL = 0.1


class Worker:
    """Serves one backend. ``start()``, then ``stop()`` to drain."""

    def __init__(
        self,
        nc: Any,
        js: Any,
        config: Config,
        backend_name: str,
        backend: Backend,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.time,
        cancels: CancelWatch | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._backend_name = backend_name
        self._backend_config: BackendConfig = config.backends[backend_name]
        self._backend = backend
        self._name = name or f"{socket.gethostname()}-{os.getpid()}-{backend_name}"
        self._clock = clock
        self._log = EventLog(js)
        self._slots = self._backend_config.limits.concurrency
        self._ack_wait = parse_duration(config.worker.ack_wait)
        self._retry_delay = parse_duration(config.worker.retry_delay)
        self._drain_timeout = parse_duration(config.worker.drain_timeout)
        # Declared request rates, held in this process (a later issue shares
        # them across processes through the projection).
        self._limiters = [
            AsyncLimiter(rate.count, rate.window)
            for rate in self._backend_config.limits.request_rates
        ]
        self._running: set[asyncio.Task[None]] = set()
        self._calls: dict[str, asyncio.Task[tuple[Completed, int]]] = {}
        self._runs: dict[str, _Run] = {}
        self._groups = Groups(js)
        self._policies = config.level_policies()
        self._preempt_sub: Any = None
        self._stealer: asyncio.Task[None] | None = None
        self._cancels = cancels
        self._slot_freed = asyncio.Event()
        self._fetcher: asyncio.Task[None] | None = None
        self._sub: Any = None
        self.completed = 0
        self.failed = 0

    @property
    def backend_name(self) -> str:
        return self._backend_name

    async def start(self) -> None:
        if self._cancels is not None:
            self._cancels.listen(self._on_cancel_requested)
        # Every worker of the backend hears each preemption ask (no queue
        # group: the run to preempt may be in any of them) and offers; the
        # router confirms one, on this worker's own subject (renqueue.preemption).
        self._preempt_token = uuid.uuid4().hex
        self._preempt_sub = await self._nc.subscribe(
            preempt_subjects(self._backend_name), cb=self._on_preempt
        )
        self._sub = await self._js.pull_subscribe_bind(
            durable=worker_consumer(self._backend_name), stream=DISPATCH_STREAM
        )
        self._fetcher = asyncio.create_task(self._fetch_loop(self._sub), name=f"{self._name}-fetch")
        pool = self._backend_config.pool
        siblings = [
            name
            for name, backend in self._config.backends.items()
            if pool is not None and backend.pool == pool and name != self._backend_name
        ]
        if siblings:
            self._stealer = asyncio.create_task(
                self._steal_loop(siblings), name=f"{self._name}-steal"
            )
        log.info("worker started", worker=self._name, backend=self._backend_name)

    async def stop(self) -> None:
        """Stop fetching, let in-flight runs finish within the bound, nak the rest."""
        await cancel_and_wait([t for t in (self._stealer, self._fetcher) if t is not None])
        self._stealer = self._fetcher = None
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
            _done, pending = await asyncio.wait(self._running, timeout=self._drain_timeout)
            for task in pending:
                task.cancel()  # each run naks its message when cancelled
            await asyncio.gather(*pending, return_exceptions=True)
        log.info("worker stopped", worker=self._name, completed=self.completed)

    async def _fetch_loop(self, psub: Any) -> None:
        while True:
            free = self._slots - len(self._running)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                msgs = await psub.fetch(batch=free, timeout=FETCH_TIMEOUT)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception as exc:  # noqa: BLE001 - a broker hiccup must not kill the loop
                log.warning("fetch failed", backend=self._backend_name, error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self._running.add(task)
                task.add_done_callback(self._run_done)

    # ----------------------------------------------------------- work stealing

    async def _steal_loop(self, siblings: list[str]) -> None:
        """While this worker has free slots and nothing of its own queued, move
        work queued on busy siblings of its pool to its own subject.

        The queued dispatches are read from the stream directly: a sibling's
        consumer will not hand them to anyone while its slots are full
        (``max_ack_pending``), which is exactly when they should be stolen.
        """
        own = worker_consumer(self._backend_name)
        while True:
            await asyncio.sleep(_STEAL_INTERVAL)
            try:
                mine = await self._js.consumer_info(DISPATCH_STREAM, own)
                free = self._slots - mine.num_ack_pending - mine.num_pending
                for sibling in siblings:
                    if free <= 0:
                        break
                    info = await self._js.consumer_info(DISPATCH_STREAM, worker_consumer(sibling))
                    seq = info.delivered.stream_seq + 1
                    for _ in range(min(free, info.num_pending)):
                        try:
                            raw = await self._js.get_msg(
                                DISPATCH_STREAM,
                                seq=seq,
                                subject=dispatch_subject(sibling),
                                next=True,
                            )
                        except NotFoundError:
                            break
                        seq = raw.seq + 1
                        if await self._steal(raw, sibling):
                            free -= 1
            except Exception as exc:  # noqa: BLE001 - stealing is an optimisation: never fatal
                log.warning("work stealing failed; will retry", error=str(exc))

    async def _steal(self, raw: Any, sibling: str) -> bool:
        """Move one queued dispatch from ``sibling`` to this backend.

        In this order: the ``stolen`` event, the dispatch on this backend's
        subject, the original deleted from the stream. If the sibling's worker
        got the original first anyway, both runs publish the same ``started``
        message id and the later one steps back (see ``_run``): one call, ever.
        """
        try:
            dispatch = DISPATCH_DECODER.decode(raw.data)
        except msgspec.DecodeError:
            return False  # the sibling's worker dead-letters it
        request = dispatch.request
        await self._log.append(
            Stolen(
                request_id=request.id,
                tenant=request.tenant,
                at=self._clock(),
                from_backend=sibling,
                to_backend=self._backend_name,
                attempt=dispatch.attempt,
            )
        )
        await self._move(dispatch, self._backend_name)
        with contextlib.suppress(NotFoundError):
            await self._js.delete_msg(DISPATCH_STREAM, raw.seq)
        log.info("stole a queued request", request_id=request.id, sibling=sibling)
        return True

    async def _move(self, dispatch: Dispatch, to_backend: str) -> None:
        moved = msgspec.structs.replace(dispatch, backend=to_backend)
        await self._js.publish(
            dispatch_subject(to_backend),
            encode(moved),
            headers={
                "Nats-Msg-Id": msg_id(
                    dispatch.request.tenant, dispatch.request.id, "stolen", dispatch.attempt
                )
            },
        )

    def _run_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slot_freed.set()

    # ------------------------------------------------------------------ one run

    async def _handle(self, msg: Any) -> None:
        try:
            dispatch = DISPATCH_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            await self._poison(msg, str(exc))
            return
        request = dispatch.request
        with bound_request(request.id, backend=self._backend_name):
            metrics.IN_FLIGHT.labels(self._backend_name).inc()
            try:
                await self._run(msg, dispatch)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=SHUTDOWN_NAK_DELAY)
                raise
            except Exception as exc:  # noqa: BLE001 - one request must never kill the worker
                await self._unexpected(msg, dispatch, exc)
            finally:
                metrics.IN_FLIGHT.labels(self._backend_name).dec()
                with contextlib.suppress(Exception):
                    await self._nc.publish(capacity_subject(self._backend_name), b"")

    async def _unexpected(self, msg: Any, dispatch: Dispatch, exc: Exception) -> None:
        """A bug or a broker failure mid-run: retry, and on the last delivery fail
        terminally, or the request would sit in the stream past ``max_deliver``."""
        delivery = int(msg.metadata.num_delivered)
        if delivery < self._config.worker.max_deliver:
            log.exception("unexpected error; request will be redelivered")
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._retry_delay)
            return
        log.exception("unexpected error on the last delivery; request fails")
        try:
            await self._fail(
                msg,
                dispatch,
                delivery,
                error_type="internal",
                reason=f"worker error on the last delivery: {type(exc).__name__}",
            )
        except Exception:
            log.exception("could not record the failure; leaving the request for redelivery")
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._retry_delay)

    async def _poison(self, msg: Any, reason: str) -> None:
        seq = msg.metadata.sequence.stream
        log.error("undecodable dispatch message sent to dead letters", seq=seq, reason=reason)
        await self._log.dead_letter(
            "dispatch",
            msg.data,
            reason=f"malformed: {reason}",
            source_subject=msg.subject,
            tenant="unknown",
            request_id=f"dispatch-{seq}",
        )
        await msg.term()

    async def _run(self, msg: Any, dispatch: Dispatch) -> None:
        request = dispatch.request
        delivery = int(msg.metadata.num_delivered)
        # Runs are numbered over the request's whole life: redeliveries of this
        # dispatch, and dispatches after a preemption (a higher attempt).
        run = (dispatch.attempt - 1) * self._config.worker.max_deliver + delivery
        if await self._refused(msg, dispatch, delivery, run):
            return
        pending_acks = await self._start(msg, dispatch, run)
        if pending_acks is None:
            return
        keepalive = asyncio.create_task(self._keep_alive(msg))
        # The call runs as a task of its own, so a cancellation or preemption
        # can stop it (closing the backend's HTTP stream) without stopping this run.
        call = asyncio.create_task(self._call(request, dispatch, run, pending_acks))
        self._calls[request.id] = call
        # A run is judged at the level it was bound at: one that aged to the top
        # is not preemptible, or aging could never get it through.
        self._runs[request.id] = _Run(
            rank=self._rank_of(dispatch), started=time.monotonic(), call=call
        )
        try:
            outcome, chunks = await call
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not (call.cancelled() and this is not None and not this.cancelling()):
                raise  # shutdown: the message is nak'ed by _handle
            await self._settle(pending_acks)
            preempted_by = self._runs[request.id].preempted_by
            if preempted_by is not None:
                # The HTTP stream is closed; give the backend a moment to see
                # the disconnect before its slot goes to the urgent request.
                await asyncio.sleep(_PREEMPT_GRACE)
                await self._requeue(msg, dispatch, run, preempted_by)
            else:
                await self._finish(msg, request, self._cancelled(request, "running"), run)
            return
        except BackendError as exc:
            await self._backend_failed(msg, dispatch, delivery, exc, pending_acks)
            return
        except _Expiry:
            await self._settle(pending_acks)
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
            )
            return
        finally:
            self._calls.pop(request.id, None)
            self._runs.pop(request.id, None)
            call.cancel()
            keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive
        await self._settle(pending_acks)
        await self._finish(msg, request, outcome, run, seq=chunks)

    async def _refused(self, msg: Any, dispatch: Dispatch, delivery: int, run: int) -> bool:
        """Settle, without calling the backend, a dispatch that must not run:
        already finished or moved by a worker that died before acking it,
        past its deadline, or cancelled."""
        request = dispatch.request
        if delivery > 1 and await self._settled_before(msg, dispatch):
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
        if self._cancels is not None and self._cancels.is_cancelled(request.id):
            await self._finish(msg, request, self._cancelled(request, "queued"), run)
            return True
        return False

    async def _start(
        self, msg: Any, dispatch: Dispatch, run: int
    ) -> list[asyncio.Future[Any]] | None:
        """Record ``started``; the pending acks to wait for, or ``None`` to step back."""
        request = dispatch.request
        started = Started(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            backend=self._backend_name,
            attempt=dispatch.attempt,
            delivery=run,
            worker=self._name,
        )
        if self._backend_config.pool is None:
            return [await self._log.append_async(started)]
        # In a pool, a queued dispatch may be stolen by a sibling while it is
        # delivered here: both runs have the same `started` message id, which
        # makes it the claim: the second to publish it steps back.
        if not await self._log.append(started):
            log.info("another replica runs this request; dropping it")
            await msg.ack()
            return None
        return []

    async def _settled_before(self, msg: Any, dispatch: Dispatch) -> bool:
        """On a redelivery: was this dispatch already finished or preempted by a
        worker that died before acking it? Then complete that work and ack."""
        request = dispatch.request
        if await self._log.terminal_of(request.tenant, request.id) is not None:
            log.info("redelivered request already finished; dropping")
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
            await msg.ack()
            return True
        for event in await self._log.history(request.tenant, request.id):
            if isinstance(event, Preempted) and event.attempt == dispatch.attempt:
                await self._requeue(msg, dispatch, event.delivery, event.by)
                return True
            if (
                isinstance(event, Stolen)
                and event.attempt == dispatch.attempt
                and event.from_backend == self._backend_name
            ):
                await self._move(dispatch, event.to_backend)  # finish the thief's move
                await msg.ack()
                return True
        return False

    def _rank_of(self, dispatch: Dispatch) -> int:
        """The priority passed down to the backend: the effective one when bound."""
        if dispatch.effective_rank is not None:
            return dispatch.effective_rank
        return self._config.priority_rank(dispatch.request.priority)

    async def _on_preempt(self, msg: Any) -> None:
        """A router needs a slot for an urgent request (two phases, see
        :mod:`renqueue.preemption`): on an ask, offer this worker's best victim
        (or stay silent); on a confirm addressed to this worker, preempt it."""
        token = msg.subject.rsplit(".", 1)[-1]
        if token == PREEMPT_ASK:
            try:
                ask = ASK_DECODER.decode(msg.data)
            except msgspec.DecodeError:
                return
            victim = self._preemption_victim(ask.rank)
            if victim is None or not msg.reply:
                return
            run = self._runs[victim]
            offer = Offer(
                backend=self._backend_name,
                confirm=preempt_subject(self._backend_name, self._preempt_token),
                rank=run.rank,
                running=max(0.0, time.monotonic() - run.started),
            )
            await msg.respond(encode(offer))
            return
        if token != self._preempt_token:
            return  # a confirm for another worker of this backend
        try:
            confirm = CONFIRM_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            await msg.respond(encode(Answer()))
            return
        victim = self._preemption_victim(confirm.rank)
        if victim is not None:
            run = self._runs[victim]
            run.preempted_by = confirm.by
            run.call.cancel()
            log.info("preempting a run", request_id=str(victim), by=confirm.by)
        await msg.respond(encode(Answer(preempted=None if victim is None else str(victim))))

    def _preemption_victim(self, rank: int) -> Any:
        """The key of the run to give up for a request at ``rank``; ``None`` if none may be."""
        return choose_victim(
            {key: (run.rank, run.started) for key, run in self._runs.items() if run.is_live()},
            rank,
            self._policies,
        )

    async def _requeue(self, msg: Any, dispatch: Dispatch, run: int, by: str) -> None:
        """Send a preempted request back to wait, keeping its submit time (aging credit).

        In this order, each step idempotent: the ``preempted`` event (so a
        redelivery knows), the request back on its priority subject, the ack.
        """
        request = dispatch.request
        await self._log.append(
            Preempted(
                request_id=request.id,
                tenant=request.tenant,
                at=self._clock(),
                backend=self._backend_name,
                attempt=dispatch.attempt,
                delivery=run,
                by=by,
            )
        )
        again = msgspec.structs.replace(request, requeues=dispatch.attempt)
        await self._js.publish(
            request_subject(request.priority, request.tenant),
            encode(again),
            headers={
                "Nats-Msg-Id": msg_id(request.tenant, request.id, "requeue", dispatch.attempt)
            },
        )
        await msg.ack()
        metrics.TERMINAL.labels("preempted").inc()

    def _cancelled(self, request: InferenceRequest, stage: str) -> Cancelled:
        return Cancelled(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            stage=stage,
            reason="cancelled by request",
        )

    def _on_cancel_requested(self, event: CancelRequested) -> None:
        call = self._calls.get(event.request_id)
        if call is not None:
            log.info("stopping a running request on cancellation", request_id=event.request_id)
            call.cancel()

    async def _call(
        self,
        request: Any,
        dispatch: Dispatch,
        delivery: int,
        pending_acks: list[asyncio.Future[Any]],
    ) -> tuple[Completed, int]:
        """Stream the backend's answer to the token subject.

        Returns the completion and the number of chunks streamed.
        """
        subject = token_subject(request.tenant, request.id)
        started = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        usage: Usage | None = None
        finish_reason: str | None = None
        seq = 0
        rank = self._rank_of(dispatch)
        timeout = None if request.deadline is None else max(0.0, request.deadline - self._clock())
        try:
            async with asyncio.timeout(timeout):
                for limiter in self._limiters:
                    await limiter.acquire()
                stream = self._backend.stream(request, priority=rank)
                try:
                    async for delta in stream:
                        if delta.text:
                            if ttft is None:
                                ttft = time.monotonic() - started
                            chunk = TokenChunk(
                                request_id=request.id,
                                delivery=delivery,
                                seq=seq,
                                text=delta.text,
                                restart=delivery > 1 and seq == 0,
                            )
                            pending_acks.append(
                                await self._js.publish_async(subject, encode(chunk))
                            )
                            seq += 1
                            parts.append(delta.text)
                        if delta.usage is not None:
                            usage = delta.usage
                        if delta.finish_reason is not None:
                            finish_reason = delta.finish_reason
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
        except TimeoutError as exc:
            raise _Expiry from exc
        duration = time.monotonic() - started
        usage = usage or Usage()
        cost = self._backend_config.cost(usage.prompt_tokens, usage.completion_tokens)
        metrics.BACKEND_CALLS.labels(self._backend_name, "completed").inc()
        metrics.BACKEND_LATENCY.labels(self._backend_name).observe(duration)
        metrics.TOKENS.labels(self._backend_name, "input").inc(usage.prompt_tokens)
        metrics.TOKENS.labels(self._backend_name, "output").inc(usage.completion_tokens)
        completed = Completed(
            request_id=request.id,
            tenant=request.tenant,
            at=self._clock(),
            backend=self._backend_name,
            attempt=dispatch.attempt,
            delivery=delivery,
            text="".join(parts),
            usage=usage,
            cost=cost,
            finish_reason=finish_reason,
            ttft=ttft,
            duration=duration,
        )
        return completed, seq

    async def _backend_failed(
        self,
        msg: Any,
        dispatch: Dispatch,
        delivery: int,
        exc: BackendError,
        pending_acks: list[asyncio.Future[Any]],
    ) -> None:
        request = dispatch.request
        metrics.BACKEND_CALLS.labels(self._backend_name, exc.code).inc()
        await self._settle(pending_acks)
        if exc.retryable and delivery < self._config.worker.max_deliver:
            delay = getattr(exc, "retry_after", None) or self._retry_delay * 2 ** (delivery - 1)
            log.warning("backend call failed; will retry", error=str(exc), delay=delay)
            await self._log.append(
                Retrying(
                    request_id=request.id,
                    tenant=request.tenant,
                    at=self._clock(),
                    backend=self._backend_name,
                    attempt=dispatch.attempt,
                    delivery=delivery,
                    error_type=exc.code,
                    reason=str(exc)[:1000],
                    retry_after=delay,
                )
            )
            await msg.nak(delay=delay)
            return
        log.error("request failed", error=str(exc), delivery=delivery)
        exhausted = " (retries exhausted)" if isinstance(exc, RetryableBackendError) else ""
        await self._fail(
            msg, dispatch, delivery, error_type=exc.code, reason=str(exc)[:1000] + exhausted
        )

    async def _fail(
        self, msg: Any, dispatch: Dispatch, delivery: int, *, error_type: str, reason: str
    ) -> None:
        """Fail the request for good: a copy to the dead-letter stream, then ``failed``."""
        request = dispatch.request
        await self._log.dead_letter(
            "dispatch",
            msg.data,
            reason=f"{error_type}: {reason}",
            source_subject=msg.subject,
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
        )
        await self._finish(msg, request, failed, delivery)

    async def _finish(
        self, msg: Any, request: InferenceRequest, event: Any, delivery: int, *, seq: int = 0
    ) -> None:
        """Record the terminal event, then ack: a crash in between means a redelivery
        that finds the terminal event and drops the run. Followers sharing this
        request's call get their outcome first, so a crash cannot strand them."""
        key = coalesce_key(request)
        if key is not None:
            await self._hand_out(request, key, event)
        first = await self._log.finish(event, delivery=delivery, seq=seq)
        kind = type(event).__name__.lower()
        if first:
            metrics.TERMINAL.labels(kind).inc()
            if isinstance(event, Completed):
                self.completed += 1
                metrics.COST.labels(self._backend_name).inc(event.cost)
            elif isinstance(event, Failed):
                self.failed += 1
        else:
            log.warning("duplicate terminal event dropped", kind=kind)
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
        await msg.ack()

    async def _hand_out(self, request: InferenceRequest, key: str, event: Any) -> None:
        """Give each follower of this (leading) request a copy of its outcome."""
        followers = await self._groups.close(request, key)
        for follower in followers:
            if isinstance(event, Completed):
                copy: Any = msgspec.structs.replace(
                    event, request_id=follower, cost=0.0, shared_with=request.id
                )
                chunk = TokenChunk(request_id=follower, seq=0, text=event.text)
                if event.text:
                    await self._js.publish(
                        token_subject(request.tenant, follower),
                        encode(chunk),
                        headers={"Nats-Msg-Id": msg_id(request.tenant, follower, "shared")},
                    )
                await self._log.finish(copy, seq=1 if event.text else 0)
            else:
                outcome = type(event).__name__.lower()
                failed = Failed(
                    request_id=follower,
                    tenant=request.tenant,
                    at=self._clock(),
                    error_type=f"shared_call_{outcome}",
                    reason=f"the call shared with {request.id} ended {outcome}",
                    backend=self._backend_name,
                )
                await self._log.finish(failed)
        await self._groups.forget(request, key)

    async def _settle(self, pending_acks: list[asyncio.Future[Any]]) -> None:
        """Wait until every token chunk and event published so far is stored."""
        if pending_acks:
            await asyncio.wait_for(asyncio.gather(*pending_acks), timeout=30.0)
            pending_acks.clear()

    async def _keep_alive(self, msg: Any) -> None:
        interval = max(0.1, self._ack_wait / 3)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await msg.in_progress()
