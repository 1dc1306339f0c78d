"""One backend call, its answer streamed to the request's token subject.

Each chunk carries the run that produced it (``delivery``) and its place in
that run (``seq``); the first chunk of a run after the first is marked
``restart``: what an earlier run streamed is void. One chunk per network
read, published as soon as the read is done; except the read that also
brought the stream's end (the adapter's :attr:`~renqueue.backends.base.Delta.end`):
its text goes out in the final chunk, with the ``completed`` event (a
:class:`~renqueue.schema.ChunkTail` in the terminal claim), one publish fewer.
A request submitted with ``stream`` false gets no chunk at all. The chunks are
published without awaiting their acks one by one: the run awaits them all
(:func:`settle`) before its terminal event, so the log never records an
outcome whose tokens are not stored.

That wait is bounded by the connection, not by a fixed time: an ack of a
publish sent before the connection dropped never comes (the server that
would send it is gone, or answered a connection that is), so the run gives
up at once while the connection is down, and after :data:`ACK_WAIT` while it
is up; either way the run is handed back and runs again. It used to wait
30 s, and a server killed with ``kill -9`` mid-run cost every running
request that long (issue #29).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final

import msgspec

from ... import metrics
from ...backends import MAX_TOOL_CALLS, LearnedLimits, reported
from ...backends.base import Backend, Delta
from ...broker import Connection, JetStream, PubAck, hop
from ...config import BaseBackendConfig
from ...errors import FailureClass, NatsTimeoutError, NatsUnavailableError, RetryableBackendError
from ...logs import get_logger
from ...schema import (
    ChunkTail,
    Completed,
    Dispatch,
    InferenceRequest,
    ReportedLimit,
    Run,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    TraceParent,
    Usage,
    encode,
    token_subject,
    tool_call_deltas,
)

__all__ = ["ACK_WAIT", "CallStop", "CallStopped", "Caller", "Chunks", "Expiry", "settle"]

log = get_logger("worker")


class Expiry(Exception):
    """The request's deadline passed during the backend call."""


class CallStopped(Exception):
    """The backend call was stopped (:meth:`CallStop.cancel`), or never made."""


class CallStop:
    """Stops a backend call that runs in its run's own task: a cancellation or
    a preemption stops the call (closing the backend's HTTP stream), never
    the run, which goes on to record why.

    The call is made inside ``with stop:``. :meth:`cancel` cancels the task
    once while the call is under way; the block then raises
    :class:`CallStopped` in place of that cancellation, the task's own
    cancellation count as it was. A cancellation of the task for any other
    reason (shutdown) goes through as it came, stopped or not. Stopped before
    the block, the call is never made (:class:`CallStopped` on entry).
    :meth:`cancel` is called from other tasks and callbacks only (a
    cancellation watch, a preemption's confirm), never from the call itself.
    """

    __slots__ = ("_cancelling", "_ended", "_live", "_task", "stopped")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self._cancelling = 0
        self._live = False
        self._ended = False
        #: Whether :meth:`cancel` was called.
        self.stopped = False

    def cancel(self) -> None:
        """Stop the call (idempotent; a no-op once it has ended)."""
        if self.stopped or self._ended:
            return
        self.stopped = True
        if self._live:
            self._task.cancel()

    def done(self) -> bool:
        """Whether there is nothing left to stop: the call has ended, or is
        being stopped (closing its stream). A preemption offers only a call
        not done: one stopped for a cancellation is recorded as cancelled."""
        return self._ended or self.stopped

    def __enter__(self) -> None:
        if self.stopped:
            self._ended = True
            raise CallStopped
        self._cancelling = self._task.cancelling()
        self._live = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._live = False
        self._ended = True
        if not self.stopped:
            return
        # The task was cancelled once for the stop: that cancellation is taken back.
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise CallStopped from None
        # Else the call ended its own way, or the task is cancelled for another reason too.


class Chunks(msgspec.Struct):
    """The token chunks a run has streamed so far: the next chunk's ``seq``;
    and, once its call completed, what of the answer its final chunk carries
    (the last read's, when it also brought the stream's end)."""

    seq: int = 0
    tail: ChunkTail | None = None


#: Longest a run waits for the acks of what it published while the connection
#: is up (nats-py's own wait for a JetStream answer): a broker that stores
#: and acks answers within milliseconds, so an ack this late is lost.
ACK_WAIT: Final = 5.0
#: How often that wait looks at the connection's state.
ACK_POLL: Final = 0.1


async def settle(
    pending_acks: list[asyncio.Future[PubAck]], nc: Connection, *, within: float = ACK_WAIT
) -> None:
    """Wait until every token chunk and event published so far is stored.

    Raises :class:`~renqueue.errors.NatsUnavailableError` at once if the
    connection is (or goes) down with acks pending, and
    :class:`~renqueue.errors.NatsTimeoutError` if they are not all in within
    ``within`` seconds; a failed publish raises its own error. The acks still
    pending are then cancelled: the run is handed back, not finished.
    """
    for ack in pending_acks:
        if not ack.done():
            await _acked(pending_acks, nc, within)
            break
    for ack in pending_acks:
        ack.result()  # the first failed publish's error, if any
    pending_acks.clear()


async def _acked(pending_acks: list[asyncio.Future[PubAck]], nc: Connection, within: float) -> None:
    """Wait until every ack in ``pending_acks`` is in (:func:`settle`, the acks not
    all in yet); the pending ones are cancelled when it gives up."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    acks = asyncio.gather(*pending_acks)
    try:
        while True:
            left = give_up - loop.time()
            done, _ = await asyncio.wait({acks}, timeout=max(0.0, min(ACK_POLL, left)))
            if done:
                acks.result()  # the first failed publish's error, if any
                break
            missing = sum(not ack.done() for ack in pending_acks)
            if not nc.is_connected:
                raise NatsUnavailableError(
                    f"the connection to the broker is down with {missing} of "
                    f"{len(pending_acks)} publishes unacknowledged"
                )
            if left <= 0:
                raise NatsTimeoutError(
                    f"{missing} of {len(pending_acks)} publishes unacknowledged after {within:g} s"
                )
    finally:
        acks.cancel()  # a no-op once done; else the pending acks are given up


#: The scope of a call whose request has no deadline (:meth:`Caller.call`).
_UNBOUNDED: Final = contextlib.nullcontext()


class Caller:
    """Calls one backend, within its declared request rates, and streams the answer."""

    def __init__(
        self,
        js: JetStream,
        backend_name: str,
        backend_config: BaseBackendConfig,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._backend_name = backend_name
        self._backend_config = backend_config
        self._backend = backend
        self._clock = clock
        # This backend's series, looked up once (``labels()`` locks and checks on each call).
        self._completed = metrics.BACKEND_CALLS.labels(backend_name, "completed")
        self._latency = metrics.BACKEND_LATENCY.labels(backend_name)
        self._input_tokens = metrics.TOKENS.labels(backend_name, "input")
        self._output_tokens = metrics.TOKENS.labels(backend_name, "output")

    def _checked_calls(
        self, request: InferenceRequest, calls: Sequence[ToolCall], before: int
    ) -> tuple[ToolCall, ...]:
        """``calls`` as the wire can carry them, each without an id given a
        unique one (``call_<request id>_<index>``: Ollama's and Gemini's have
        none, and a later turn answers a call by its id); a backend's answer
        past the wire's bounds fails as malformed, never as an event no
        reader can decode."""
        if before + len(calls) > MAX_TOOL_CALLS:
            raise self._malformed(request, f"more than {MAX_TOOL_CALLS} tool calls")
        out = []
        for index, call in enumerate(calls, start=before):
            if not call.name or len(call.name) > 256 or len(call.id) > 256:
                raise self._malformed(request, "a tool call without a name, or too long a name")
            if len(call.arguments) > 1_000_000:
                raise self._malformed(request, "a tool call's arguments over 1,000,000 characters")
            named = call.id or f"call_{request.id}_{index}"
            out.append(call if named == call.id else msgspec.structs.replace(call, id=named))
        return tuple(out)

    def _malformed(self, request: InferenceRequest, what: str) -> RetryableBackendError:
        return RetryableBackendError(
            f"malformed answer: {what}",
            backend=self._backend_name,
            request_id=request.id,
            failure=FailureClass.MALFORMED,
        )

    @property
    def backend(self) -> Backend:
        """The adapter this calls."""
        return self._backend

    async def call(
        self,
        dispatch: Dispatch,
        run: int,
        pending_acks: list[asyncio.Future[PubAck]],
        chunks: Chunks,
        *,
        rank: int,
        trace: TraceParent | None = None,
    ) -> Completed:
        """Stream the backend's answer to the token subject (counting in ``chunks``).

        ``rank`` is the priority passed down to backends that schedule by it;
        the call goes out in ``trace`` (a new one if ``None``), under a span
        of its own (its ``traceparent`` header).
        Raises :class:`Expiry` when the request's deadline passes first, and
        the backend's :class:`~renqueue.BackendError` when the call fails.
        """
        request = dispatch.request
        answer = _Answer(started=time.monotonic())
        timeout = None if request.deadline is None else max(0.0, request.deadline - self._clock())
        attributes: dict[str, str | int] = {
            "renqueue.request_id": request.id,
            "renqueue.tenant": request.tenant,
            "renqueue.backend": self._backend_name,
            "renqueue.attempt": dispatch.attempt,
            "renqueue.run": run,
        }
        with hop("renqueue.backend_call", trace, kind="client", attributes=attributes) as sent:
            try:
                async with _UNBOUNDED if timeout is None else asyncio.timeout(timeout):
                    await self._stream(
                        request, run, pending_acks, chunks, answer, rank=rank, trace=sent
                    )
            except TimeoutError as exc:
                raise Expiry from exc
        if answer.held is not None:
            chunks.tail = answer.held.tail
        duration = time.monotonic() - answer.started
        usage = answer.usage or Usage()
        cost = self._backend_config.cost(usage.prompt_tokens, usage.completion_tokens)
        if request.max_cost is not None and cost > request.max_cost:
            # Bound within its cap by the estimate; the real count says more
            # (a prompt longer in tokens than its characters / 4). Said, counted.
            metrics.COST_CAP_OVERRUNS.labels(self._backend_name).inc()
            log.warning(
                "a call cost more than its request's max_cost",
                cost=cost,
                max_cost=request.max_cost,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
            )
        self._completed.inc()
        self._latency.observe(duration)
        self._input_tokens.inc(usage.prompt_tokens)
        self._output_tokens.inc(usage.completion_tokens)
        return Run.of(dispatch, run, backend=self._backend_name).completed(
            at=self._clock(),
            text="".join(answer.parts),
            usage=usage,
            cost=cost,
            finish_reason=answer.finish_reason,
            ttft=answer.ttft,
            duration=duration,
            limits=reported_limits(self._backend),
            reserved_tokens=dispatch.reserved_tokens,
            tool_calls=tuple(answer.calls),
            logprobs=tuple(answer.logprobs),
        )

    async def _stream(
        self,
        request: InferenceRequest,
        run: int,
        pending_acks: list[asyncio.Future[PubAck]],
        chunks: Chunks,
        answer: _Answer,
        *,
        rank: int,
        trace: TraceParent,
    ) -> None:
        """Read the backend's stream into ``answer``, each delta with text,
        tool calls or log probabilities published as the run's next chunk;
        except those that came with the stream's end (``Delta.end``), held
        for the final chunk (``answer.held``) when the request says its client
        reads a final chunk's text (``stream`` true), and all of them for a
        request submitted with ``stream`` false."""
        subject = token_subject(request.tenant, request.id)
        stream = self._backend.stream(request, priority=rank, traceparent=trace.header)
        try:
            async for delta in stream:
                if delta.text or delta.tool_calls or delta.logprobs:
                    if answer.ttft is None:
                        answer.ttft = time.monotonic() - answer.started
                    new_calls = (
                        self._checked_calls(request, delta.tool_calls, len(answer.calls))
                        if delta.tool_calls
                        else ()
                    )
                    if request.stream is not False:
                        if delta.end and answer.held is None and request.stream:
                            # With the stream's end: sent in the final chunk.
                            answer.held = _Held(
                                tail=ChunkTail(
                                    text=answer.text_length,
                                    tool_calls=len(answer.calls),
                                    logprobs=len(answer.logprobs),
                                )
                            )
                        if answer.held is not None and not delta.end:
                            # Text after the end (a server that went on): as it comes.
                            await self._flush(request, run, pending_acks, chunks, answer)
                        if answer.held is not None:
                            answer.held.add(delta, new_calls)
                        else:
                            await self._publish(
                                subject,
                                TokenChunk(
                                    request_id=request.id,
                                    delivery=run,
                                    seq=chunks.seq,
                                    text=delta.text,
                                    restart=run > 1 and chunks.seq == 0,
                                    tool_calls=tool_call_deltas(new_calls, len(answer.calls)),
                                    logprobs=delta.logprobs,
                                ),
                                pending_acks,
                                chunks,
                            )
                    answer.parts.append(delta.text)
                    answer.text_length += len(delta.text)
                    answer.calls.extend(new_calls)
                    kept = len(answer.logprobs)
                    answer.kept_logprobs = _keep_logprobs(
                        answer.logprobs, delta.logprobs, answer.kept_logprobs
                    )
                    if (
                        len(answer.logprobs) - kept < len(delta.logprobs)
                        and answer.held is not None
                    ):
                        # The event keeps them within a budget: the final
                        # chunk could not carry them all from it.
                        await self._flush(request, run, pending_acks, chunks, answer)
                if delta.usage is not None:
                    answer.usage = delta.usage
                if delta.finish_reason is not None:
                    answer.finish_reason = delta.finish_reason
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _publish(
        self,
        subject: str,
        chunk: TokenChunk,
        pending_acks: list[asyncio.Future[PubAck]],
        chunks: Chunks,
    ) -> None:
        """Publish ``chunk`` (its ack awaited by :func:`settle`), the run's next."""
        pending_acks.append(await self._js.publish_async(subject, encode(chunk)))
        chunks.seq += 1

    async def _flush(
        self,
        request: InferenceRequest,
        run: int,
        pending_acks: list[asyncio.Future[PubAck]],
        chunks: Chunks,
        answer: _Answer,
    ) -> None:
        """Publish what was held for the final chunk as a chunk of its own."""
        held, answer.held = answer.held, None
        if held is None or held.empty:
            return
        chunk = TokenChunk(
            request_id=request.id,
            delivery=run,
            seq=chunks.seq,
            text="".join(held.parts),
            restart=run > 1 and chunks.seq == 0,
            tool_calls=tool_call_deltas(held.calls, held.tail.tool_calls),
            logprobs=tuple(held.logprobs),
        )
        await self._publish(token_subject(request.tenant, request.id), chunk, pending_acks, chunks)


class _Held(msgspec.Struct, kw_only=True):
    """What a run holds for its final chunk: what came with the stream's end."""

    #: Where it starts in the answer.
    tail: ChunkTail
    parts: list[str] = msgspec.field(default_factory=list)
    calls: list[ToolCall] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.parts or self.calls or self.logprobs)

    def add(self, delta: Delta, calls: Sequence[ToolCall]) -> None:
        if delta.text:
            self.parts.append(delta.text)
        self.calls.extend(calls)
        self.logprobs.extend(delta.logprobs)


class _Answer(msgspec.Struct, kw_only=True):
    """What a call has answered so far, for its ``completed`` event."""

    #: When the call started (``time.monotonic()``).
    started: float
    ttft: float | None = None
    parts: list[str] = msgspec.field(default_factory=list)
    calls: list[ToolCall] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    #: Characters of text so far (of ``parts``).
    text_length: int = 0
    #: Bytes of ``logprobs`` (the completed event carries them within a budget).
    kept_logprobs: int = 0
    #: What came with the stream's end, for the final chunk.
    held: _Held | None = None
    usage: Usage | None = None
    finish_reason: str | None = None


#: Bytes of log probabilities the ``completed`` event carries at most (the
#: token chunks carry them all): the event, and the terminal claim holding
#: it, must stay well within the broker's largest message (1 MB by default).
LOGPROBS_BUDGET: Final = 256 * 1024


def _keep_logprobs(kept: list[TokenLogprob], new: Sequence[TokenLogprob], size: int) -> int:
    """Add ``new`` to ``kept`` while their size (about their JSON's) stays
    within :data:`LOGPROBS_BUDGET`; the size of ``kept`` after."""
    for item in new:
        grown = size + 48 + len(item.token) + sum(48 + len(top.token) for top in item.top_logprobs)
        if grown > LOGPROBS_BUDGET:
            return size
        kept.append(item)
        size = grown
    return size


def reported_limits(backend: Backend) -> tuple[ReportedLimit, ...]:
    """What ``backend``'s provider last said of its rate limits (adapters that read them)."""
    learned = getattr(backend, "last_rate_limit", None)
    return reported(learned) if isinstance(learned, LearnedLimits) else ()
