"""The projector: the fold of ``RQ_EVENTS``, kept in the ``rq-state`` KV bucket.

:class:`Projector` is the service around :func:`~renqueue.state.fold`: it reads
``RQ_EVENTS`` in order, folds in batches, and writes the state to the KV bucket
``rq-state`` under the key :data:`~renqueue.state.STATE_KEY` with
compare-and-set, at most every ``flush_interval``, and after each write the
views that changed (:class:`~._view_publisher.ViewPublisher`: one small entry
per backend, tenant and A/B split, which routers read). :func:`rebuild`
replays the stream into a fresh state, for audits and to check the live state
against the log.

Where stream messages are decoded (``_fold_messages``, shared by the projector
and :func:`rebuild`), the subject is the authority: a message whose payload
disagrees with its subject ``rq.evt.<tenant>.<id>.<kind>`` (kind, tenant or
request id) is skipped and counted in ``mismatched``, never folded. Tenants may
publish only on ``rq.evt.<tenant>.*.cancel_requested``, so a service fact
(``failed``, ``completed``, ...) can only come from a subject that only the
services can publish to.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Final

import msgspec

from .. import metrics
from ..broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    KeyValue,
    Message,
    PullSubscription,
    delete_consumer,
    subject_agrees,
)
from ..errors import (
    NatsError,
    NatsNotFoundError,
    NatsPayloadTooLargeError,
    ProjectionVersionError,
    WrongLastSequenceError,
)
from ..lifecycle import Lifecycle, State
from ..logs import get_logger
from ..schema import EVENT_DECODER, EVENTS_STREAM, STATE_BUCKET, kind_of
from ..state import (
    STATE_KEY,
    STATE_VERSION,
    UPGRADED_IN_PLACE,
    Folding,
    ProjectionState,
    decode_state,
    encode_state,
)
from ..tasks import Supervisor
from ._view_publisher import ViewPublisher

__all__ = ["Projector", "rebuild"]

log = get_logger("projection")

# Fetch sizes for the projector and rebuild: one pull returns up to this many.
_BATCH: Final = 512
#: Seconds between tries of a checkpoint over the broker's ``max_payload``.
_OVERSIZED_PAUSE: Final = 30.0
#: Seconds between looks, while the log is idle, at whether the fold's consumer
#: is still there (a server restart loses it).
_CHECK_IDLE_EVERY: Final = 5.0


def _fold_messages(builder: Folding, msgs: Iterable[Message]) -> None:
    """Fold stream messages into ``builder``.

    Undecodable messages are skipped and counted in ``skipped``; messages
    whose payload disagrees with their subject (:func:`subject_agrees`) are
    skipped and counted in ``mismatched``. Messages at or below the builder's
    ``last_seq`` were folded already (a consumer restarted behind the state)
    and are ignored. The projector and :func:`rebuild` both fold through
    here, so a replay skips exactly what the live projection skipped.
    """
    for msg in msgs:
        seq = int(msg.metadata.sequence.stream)
        if seq <= builder.last_seq:
            continue
        if seq > builder.last_seq + 1 and builder.last_seq > 0:
            log.warning("events missing from the log", after=builder.last_seq, next=seq)
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable event skipped", seq=seq, subject=msg.subject, error=str(exc))
            builder.skip(seq)
            continue
        if not subject_agrees(msg.subject, event):
            log.warning(
                "event whose payload disagrees with its subject skipped",
                seq=seq,
                subject=msg.subject,
                kind=kind_of(event),
            )
            builder.mismatch(seq)
            continue
        builder.apply(event, seq)


async def _events_consumer(
    js: JetStream, after: int, *, inactive: float = 30.0
) -> PullSubscription:
    """An ephemeral, unacknowledged pull consumer on ``RQ_EVENTS`` from ``after + 1``."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL if after <= 0 else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if after <= 0 else after + 1,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=inactive,
        mem_storage=True,
        num_replicas=1,
    )
    return await js.pull_subscribe("rq.evt.>", stream=EVENTS_STREAM, config=config)


async def _drop_consumer(js: JetStream, psub: PullSubscription) -> None:
    """Unsubscribe and delete an ephemeral consumer; best effort (it expires anyway)."""
    with contextlib.suppress(NatsError):
        await psub.unsubscribe()
    await delete_consumer(js, EVENTS_STREAM, psub.consumer)


async def _stream_last_seq(js: JetStream) -> int:
    info = await js.stream_info(EVENTS_STREAM)
    return int(info.state.last_seq)


async def rebuild(js: JetStream, *, upto: int | None = None) -> ProjectionState:
    """Replay ``RQ_EVENTS`` from its first message into a fresh state.

    Folds up to ``upto`` (default: the stream's last sequence when called), so
    the result is comparable with a stored state of the same ``last_seq``.
    Events past the stream's retention (``max_age``) are gone: on a log older
    than that, the live state holds counts a replay cannot see.
    """
    target = await _stream_last_seq(js) if upto is None else upto
    builder = Folding(ProjectionState())
    if target <= 0:
        return builder.freeze()
    psub = await _events_consumer(js, 0)
    try:
        while builder.last_seq < target:
            try:
                msgs = await psub.fetch(_BATCH, timeout=2.0)
            except TimeoutError:
                # Nothing more to read: the tail up to ``target`` was deleted.
                break
            _fold_messages(builder, (m for m in msgs if m.metadata.sequence.stream <= target))
            if msgs and msgs[-1].metadata.sequence.stream >= target:
                break
    finally:
        await _drop_consumer(js, psub)
    return builder.freeze()


# ------------------------------------------------------------------ projector


#: A projector's lifecycle state: the one of every component (:mod:`renqueue.lifecycle`).
ProjectorStatus = State


class _Restart(Exception):
    """The state was replaced by the stored one: read the log again after it."""


class Projector(Lifecycle):
    """Folds ``RQ_EVENTS`` into the KV key ``rq-state/projection``, continuously.

    Why an ephemeral ordered-by-sequence consumer started after the stored
    ``last_seq``, and not a shared durable consumer: a fold needs *every*
    event, in order. A durable consumer shared by two projectors would split
    the events between them, and its ack floor would be a second record of
    progress that can disagree with the state (ack then crash = events lost
    from the fold; write then crash = events folded twice). Here the KV value
    is the only record: it holds the state *and* the sequence it reflects, in
    one atomic write, so a projector (re)starts exactly where the stored state
    ends and any number of projectors can run, each reading the whole log.
    The consumer is acknowledgement-free and in memory; if it disappears
    (server restart, inactivity) it is made again from the state's sequence.

    Writes are coalesced (at most one per ``flush_interval``) and made with
    ``kv.update(..., last=revision)``. On a conflict another projector wrote
    first: this one adopts the stored state and its revision and stands by
    while the stored state keeps moving; once it has not moved for
    ``stand_by`` seconds, it adopts it again and folds the log on from its
    sequence (:meth:`_stand_by`). A write is only ever based on the latest
    stored value, so the stored ``last_seq`` never goes backwards.

    Messages that do not decode as events are skipped and counted in the
    state's ``skipped``, those whose payload disagrees with their subject in
    ``mismatched`` (a replay skips and counts the same ones).

    The fold loop runs under ``supervisor`` (the process's, from
    :class:`renqueue.services.Services`; a private one if not given): a failed
    read is logged and the loop started again, from the state's sequence,
    after a capped backoff.
    """

    def __init__(
        self,
        js: JetStream,
        *,
        name: str = "projector",
        flush_interval: float = 0.1,
        fetch_timeout: float = 5.0,
        batch: int = _BATCH,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
        republish_every: float = 30.0,
        stand_by: float = 2.0,
    ) -> None:
        self._js = js
        self._name = name
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor if supervisor is not None else Supervisor(name)
        self._loop = f"{name}-fold"
        self._flush_interval = flush_interval
        self._fetch_timeout = fetch_timeout
        self._batch = batch
        self._clock = clock
        self._stand_by_for = stand_by
        self._kv: KeyValue | None = None
        self._state = ProjectionState()
        self._revision = 0
        self._stored_seq = 0
        self._last_write = -math.inf  # ``clock`` time of the last checkpoint write; never
        self._psub: PullSubscription | None = None
        #: The views, published after each checkpoint write.
        self._views = ViewPublisher(clock=clock, republish_every=republish_every)
        self.writes = 0
        self.conflicts = 0
        #: Times this projector stood by for another that writes (see :meth:`_stand_by`).
        self.stood_by = 0
        #: Checkpoint writes refused as over the broker's ``max_payload``; while
        #: the state is that big, the checkpoint is tried every
        #: ``_OVERSIZED_PAUSE`` seconds and the views are kept up meanwhile.
        self.oversized = 0
        self._oversized_until: float | None = None

    @property
    def _bucket(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("the projector is not started")
        return self._kv

    @property
    def views_skipped(self) -> int:
        """Backends and tenants whose name cannot be a KV key: folded, never published."""
        return self._views.views_skipped

    @property
    def state(self) -> ProjectionState:
        """The state folded so far (may be ahead of the stored one by one flush)."""
        return self._state

    async def _start(self) -> None:
        """Load the stored state and start folding after its sequence.

        Raises ``nats.js.errors.BucketNotFoundError`` if ``rq-state`` was not
        provisioned.
        """
        self._kv = await self._js.key_value(STATE_BUCKET)
        created = (await self._js.stream_info(EVENTS_STREAM)).created
        self._views.open(self._kv, "" if created is None else created.isoformat())
        await self._load()
        self._supervisor.spawn(self._loop, self._run)
        log.info("projector started", projector=self._name, after=self._state.last_seq)

    async def _close(self) -> None:
        """Stop reading, write what was folded (best effort), drop the consumer."""
        # The loop also checks the status; close() repeats the cancel, which
        # nats-py's fetch can swallow (see renqueue.tasks).
        await self._supervisor.cancel(self._loop)
        if self._own_supervisor:
            await self._supervisor.close()
        if self._state.last_seq > self._stored_seq:
            try:
                await self._flush()
            except Exception as exc:  # noqa: BLE001 - the next projector refolds from the log
                log.warning("final projection write failed", error=str(exc))
        await self._release()
        log.info("projector stopped", projector=self._name, seq=self._stored_seq)

    async def sync(self) -> ProjectionState:
        """Wait until the *stored* state covers the stream as it is now; return it.

        Whichever projector wrote it: this reads KV, not this instance's memory.
        Bound the wait with ``asyncio.timeout``.
        """
        target = await _stream_last_seq(self._js)
        while True:
            # Nothing stored yet, or a value this version cannot read (not yet
            # overwritten): wait for the next write.
            with contextlib.suppress(NatsNotFoundError, msgspec.DecodeError):
                entry = await self._bucket.get(STATE_KEY)
                state = decode_state(entry.value)
                if state.last_seq >= target:
                    return state
            await asyncio.sleep(self._flush_interval / 2)

    async def _load(self) -> None:
        """Adopt the stored state and its revision (a fresh state if there is none).

        Its views are all published anew at the next flush (the bucket may
        have been made again under this projector), but none while this fold
        is behind the views already stored for this log: readers keep the
        newer ones.
        """
        await self._views.reset()
        entry = await self._bucket.latest(STATE_KEY)
        if entry is None or entry.operation is not None:
            # Never written (revision 0), or deleted: then the delete marker's
            # revision is the one a compare-and-set must name.
            self._revision = 0 if entry is None else entry.revision
            self._state, self._stored_seq = ProjectionState(), 0
            return
        self._revision = entry.revision
        try:
            self._state = decode_state(entry.value)
        except msgspec.DecodeError as exc:
            # Written by an incompatible version, or damaged: the log is the
            # truth, so fold it again from the start and overwrite (by CAS).
            log.exception("stored projection undecodable; rebuilding from the log", error=str(exc))
            self._state = ProjectionState()
        if self._state.v > STATE_VERSION:
            # A newer version's projector runs: overwriting its state with this
            # schema would make it refold from the start, and so on in turn.
            raise ProjectionVersionError(self._state.v, STATE_VERSION)
        if self._state.v in UPGRADED_IN_PLACE:
            # Only fields with defaults were added since: keep what was folded
            # (the log past its max_age is not there to fold again).
            log.info(
                "stored projection upgraded in place",
                stored=self._state.v,
                current=STATE_VERSION,
            )
            self._state = msgspec.structs.replace(self._state, v=STATE_VERSION)
        elif self._state.v < STATE_VERSION:
            # An older schema (v1 keyed in-flight requests by id alone, across
            # tenants): fold the log again rather than guess what it meant.
            log.warning(
                "stored projection has an older schema; rebuilding from the log",
                stored=self._state.v,
                current=STATE_VERSION,
            )
            self._state = ProjectionState()
        self._stored_seq = self._state.last_seq

    async def _release(self) -> None:
        if self._psub is not None:
            await _drop_consumer(self._js, self._psub)
            self._psub = None

    async def _run(self) -> None:
        """The fold loop. Any other error than a restart ends it: the supervisor
        logs it and runs it again after a backoff, from the state's sequence."""
        while self.status is ProjectorStatus.RUNNING:
            try:
                await self._release()
                self._psub = await _events_consumer(self._js, self._state.last_seq)
                await self._consume(self._psub)
            except _Restart:
                continue

    async def _consume(self, psub: PullSubscription) -> None:
        # An idle log is waited on in long pulls (events end them at once),
        # each no longer than until the views are due to be written again, or
        # the consumer to be looked at: a pull lost with a server restart is
        # silent, and a pull that ran past the look kept the fold blind for
        # its whole length.
        checked = self._clock()
        while self.status is ProjectorStatus.RUNNING:
            now = self._clock()
            if self._dirty():
                due = self._last_write + self._flush_interval - now
            else:
                due = self._views.due_in()
            look_in = checked + _CHECK_IDLE_EVERY - now
            timeout = min(self._fetch_timeout, max(0.01, due), max(0.01, look_in))
            # An empty pull that lasted until the look is due ends in it (the
            # server ends a pull a little before the client's timeout).
            looks = look_in <= timeout
            try:
                msgs = await psub.fetch(self._batch, timeout=timeout)
            except TimeoutError:
                msgs = []
            if msgs:
                checked = self._clock()
                builder = Folding(self._state)
                _fold_messages(builder, msgs)
                dropped = (builder.skipped - self._state.skipped) + (
                    builder.mismatched - self._state.mismatched
                )
                if dropped > 0:  # a tenant's cancel_requested subjects carry any payload
                    metrics.MISDIRECTED.labels("projection").inc(dropped)
                self._state = builder.freeze()
            elif looks or self._clock() - checked >= _CHECK_IDLE_EVERY:
                checked = self._clock()
                await self._check_consumer(psub)
            if self._dirty() and self._clock() - self._last_write >= self._flush_interval:
                oversized = (
                    self._oversized_until is not None and self._clock() < self._oversized_until
                )
                if self._state.last_seq > self._stored_seq and not oversized:
                    if not await self._flush():
                        await self._stand_by()
                else:  # the checkpoint is written (or too big for now); the views are behind
                    await self._views.publish(self._state)
                    self._last_write = self._clock()

    async def _stand_by(self) -> None:
        """Another projector wrote first: it is alive and folds the same log.
        Fold nothing while it keeps writing (both folding every event, each
        write by one making the other refold, cost each process its CPU and
        the broker a consumer made again per conflict: ~3 a second in the
        soak); take over once the stored state has not moved for ``stand_by``
        seconds (that projector stopped, or the log is idle), from the state
        stored then. Raises :class:`_Restart` (the log is read again from there)."""
        self.stood_by += 1
        await self._release()
        revision = self._revision
        quiet_since = self._clock()
        pause = max(0.01, min(0.5, self._stand_by_for / 4))
        while self.status is ProjectorStatus.RUNNING:
            await asyncio.sleep(pause)
            entry = await self._bucket.latest(STATE_KEY)
            if entry is not None and entry.revision != revision:
                revision, quiet_since = entry.revision, self._clock()
            elif self._clock() - quiet_since >= self._stand_by_for:
                break
        await self._load()
        raise _Restart

    def _dirty(self) -> bool:
        """Folded past the checkpoint, or the views are behind it (a view write
        failed, or this projector has not published since it loaded the state),
        or every view is due to be written again."""
        return self._state.last_seq > self._stored_seq or self._views.behind(self._stored_seq)

    async def _check_consumer(self, psub: PullSubscription) -> None:
        """An idle consumer may have been lost (server restart): make it again if so."""
        try:
            await psub.consumer_info()
        except NatsNotFoundError as exc:
            raise _Restart from exc

    async def _flush(self) -> bool:
        """Write the state by compare-and-set. False if another projector wrote first
        (the stored state has then been adopted)."""
        state = self._state
        try:
            self._revision = await self._bucket.update(
                STATE_KEY, encode_state(state), last=self._revision
            )
        except WrongLastSequenceError:
            self.conflicts += 1
            log.info("projection written by another projector; adopting it", projector=self._name)
            await self._load()
            self._last_write = self._clock()
            return False
        except NatsPayloadTooLargeError as exc:
            # The state outgrew the broker's largest message (more tenants or
            # requests in flight than it holds): the views, each small, are kept
            # up (a restarted projector refolds from the last checkpoint and
            # publishes nothing older than them), the checkpoint is tried again
            # later. Failing the loop would stop the process, and again after
            # every restart.
            self.oversized += 1
            self._oversized_until = self._clock() + _OVERSIZED_PAUSE
            log.error(  # noqa: TRY400 - a known condition: its traceback says nothing more
                "the projection is too big to store as one checkpoint; keeping its views up",
                projector=self._name,
                error=str(exc),
                retry_in=_OVERSIZED_PAUSE,
            )
            await self._views.publish(state)
            self._last_write = self._clock()
            return True
        self._oversized_until = None
        self._stored_seq = state.last_seq
        self._last_write = self._clock()
        self.writes += 1
        await self._views.publish(state)
        return True
