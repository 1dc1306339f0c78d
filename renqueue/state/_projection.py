"""The projection: the event log folded into health, spend and load state.

Three layers, from pure to I/O:

- :func:`fold` (and :func:`fold_many`) turns a :class:`ProjectionState` and
  an event into the next state. It reads nothing but its arguments: no clock,
  no network. Time comes only from the events' own ``at`` stamps, and only
  from events written by the services (a tenant-written ``cancel_requested``
  never moves the clock), so folding the log from its first event always
  rebuilds exactly the state that is live (design property 4).
  The health rule is :func:`renqueue.policy.is_healthy`, a pure function of
  one backend's state and a caller-supplied ``now``, so a router applies the
  cooldown with its own clock.
- Where stream messages are decoded (``_fold_messages``, shared by the
  projector and :func:`rebuild`), the subject is the authority: a message
  whose payload disagrees with its subject ``rq.evt.<tenant>.<id>.<kind>``
  (kind, tenant or request id) is skipped and counted in ``mismatched``, never
  folded. Tenants may publish only on ``rq.evt.<tenant>.*.cancel_requested``,
  so a service fact (``failed``, ``completed``, ...) can only come from a
  subject that only the services can publish to.
- :class:`Projector` is the service around the fold: it reads ``RQ_EVENTS`` in
  order, folds in batches, and writes the state to the KV bucket ``rq-state``
  under the key ``projection`` with compare-and-set, at most every
  ``flush_interval``. :func:`rebuild` replays the stream into a fresh state,
  for audits and to check the live state against the log.
- :class:`StateView` is what readers (routers, workers) hold: it watches the
  KV key and keeps the latest decoded state in memory. A watch that ends or
  goes quiet while the stored value moved on is re-opened from the current
  value; one that cannot be re-opened fails its loop (and, persisting, its
  process: see :mod:`renqueue._tasks`).

The state is bounded: counters per backend, per tenant and in total, plus one
small entry per request that has started and not yet ended, keyed
``<tenant>:<request id>`` (dropped at its terminal event, and swept after
:data:`STALE_IN_FLIGHT` seconds of event time so a lost terminal event cannot
leak an entry forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Final, Self

import msgspec
from msgspec import Struct
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from .._tasks import Supervisor
from ..logs import get_logger
from ..policy import DEFAULT_COOLDOWN, DEFAULT_FAILURE_THRESHOLD, is_healthy
from ..wire._eventlog import subject_agrees
from ..wire._messages import (
    EVENT_DECODER,
    Cancelled,
    CancelRequested,
    Completed,
    Event,
    Expired,
    Failed,
    Rejected,
    Retrying,
    Started,
    Submitted,
    kind_of,
)
from ..wire._subjects import EVENTS_STREAM, STATE_BUCKET, msg_id

__all__ = [
    "BACKEND_FAULTS",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "BackendState",
    "InFlight",
    "ProjectionState",
    "Projector",
    "StateView",
    "TenantState",
    "decode_state",
    "encode_state",
    "fold",
    "fold_many",
    "rebuild",
    "subject_agrees",
]

log = get_logger("projection")

#: Version of the stored state's schema (the ``v`` field of the KV value).
#: 2: ``in_flight`` is keyed ``<tenant>:<request id>`` (1: by request id alone);
#: a projector that finds an older state folds the log again from the start.
STATE_VERSION: Final = 2

#: Event kinds a tenant may publish itself (``nats/auth.conf``: only
#: ``rq.evt.<tenant>.*.cancel_requested``). Their payloads are the tenant's
#: word: they are counted, and never move the projection's clock.
TENANT_WRITTEN_KINDS: Final = frozenset({"cancel_requested"})

#: The KV key (in bucket ``rq-state``) the projector writes the state to.
STATE_KEY: Final = "projection"

#: Error types that say the backend, not the request, is at fault. Only these
#: count towards the failure streak that makes a backend unhealthy. A 429
#: (``rate_limited``) means the backend is up and busy: the rate limiter's
#: business, not health's. ``backend_bad_request`` blames the request.
BACKEND_FAULTS: Final = frozenset({"backend_unavailable", "backend_fatal"})

#: A started request with no event for this long (event time) is dropped from
#: the in-flight map and counted in ``in_flight_dropped``. Property 1 says every
#: request ends; this only bounds the damage if a terminal event never lands.
STALE_IN_FLIGHT: Final = 6 * 3600.0
#: How often (event time) the in-flight map is swept for stale entries.
_SWEEP_EVERY: Final = 60.0

# Fetch sizes for the projector and rebuild: one pull returns up to this many.
_BATCH: Final = 512


# ---------------------------------------------------------------------- state


class BackendState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the log says about one backend.

    ``calls_failed`` counts every call that ended in a ``retrying`` or
    ``failed`` event naming this backend, whatever the error type;
    ``rate_limited`` is the part of those that were 429s. The health fields
    count only :data:`BACKEND_FAULTS`: ``consecutive_failures`` is the streak
    since the last completion and ``last_fault_at`` the event time of its
    latest member, from which the cooldown runs. ``last_failure_at`` and
    ``last_error_type`` describe the latest failure of any type, for operators.
    ``in_flight`` counts requests whose latest start was on this backend and
    that have not ended.
    """

    calls_started: int = 0
    calls_completed: int = 0
    calls_failed: int = 0
    rate_limited: int = 0
    consecutive_failures: int = 0
    last_fault_at: float | None = None
    last_failure_at: float | None = None
    last_error_type: str | None = None
    last_completed_at: float | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    spend: float = 0.0
    in_flight: int = 0
    #: Moving average of completed calls' durations (seconds, weight 0.2 on
    #: the newest): what a deadline check expects a call here to take.
    duration_ewma: float | None = None


class TenantState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tenant's submitted requests, spend (USD) and outcomes by terminal kind."""

    submitted: int = 0
    spend: float = 0.0
    terminal: dict[str, int] = {}


class InFlight(Struct, frozen=True, array_like=True):
    """A request that started and has not ended: the backend of its latest start, and when."""

    backend: str
    since: float


class ProjectionState(Struct, frozen=True, kw_only=True):
    """The whole projection, as stored in KV under :data:`STATE_KEY`.

    ``last_seq`` is the ``RQ_EVENTS`` sequence of the last message folded
    (or skipped); a projector resumes after it. ``log_time`` is the latest
    event time seen in events the services wrote, the projection's own clock.
    ``skipped`` counts messages that did not decode as events, ``mismatched``
    those whose payload disagreed with their subject (kind, tenant or request
    id: forged or misfiled, never folded). ``in_flight`` is keyed
    ``<tenant>:<request id>``. Treat every value as immutable: :func:`fold`
    never changes its input, it returns a new state.
    """

    v: int = STATE_VERSION
    last_seq: int = 0
    events: int = 0
    skipped: int = 0
    log_time: float = 0.0
    submitted: int = 0
    terminal: dict[str, int] = {}
    spend: float = 0.0
    backends: dict[str, BackendState] = {}
    tenants: dict[str, TenantState] = {}
    in_flight: dict[str, InFlight] = {}
    in_flight_dropped: int = 0
    last_sweep_at: float = 0.0
    mismatched: int = 0

    @property
    def in_flight_count(self) -> int:
        """Requests started and not yet ended."""
        return len(self.in_flight)

    def backend(self, name: str) -> BackendState:
        """The state of ``name``; a backend the log never mentioned has an empty one."""
        return self.backends.get(name, _EMPTY_BACKEND)


_EMPTY_BACKEND: Final = BackendState()
_EMPTY_TENANT: Final = TenantState()

_ENCODER: Final = msgspec.json.Encoder()
_STATE_DECODER: Final = msgspec.json.Decoder(ProjectionState)


def encode_state(state: ProjectionState) -> bytes:
    """The KV value for ``state`` (JSON)."""
    return _ENCODER.encode(state)


def decode_state(data: bytes) -> ProjectionState:
    """Decode a KV value; raises ``msgspec.DecodeError`` if it is not a state."""
    return _STATE_DECODER.decode(data)


# ----------------------------------------------------------------------- fold


def fold(state: ProjectionState, event: Event, *, seq: int | None = None) -> ProjectionState:
    """The state after ``event``. Pure: same inputs, same output, input untouched.

    ``seq`` is the event's stream sequence, recorded as ``last_seq``; leave it
    out when folding events that are not read from the stream (tests, tools).
    """
    builder = _Builder(state)
    builder.apply(event, seq)
    return builder.freeze()


def fold_many(state: ProjectionState, events: Iterable[Event]) -> ProjectionState:
    """Fold ``events`` in order; equal to folding them one by one, but copies once."""
    builder = _Builder(state)
    for event in events:
        builder.apply(event, None)
    return builder.freeze()


def _ewma(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


def _finite(value: float) -> float:
    # JSON has no inf/nan: a non-finite value would not survive the KV round
    # trip, and a resumed projector would diverge from a replay.
    return value if math.isfinite(value) else 0.0


def _bump(counts: dict[str, int], key: str) -> dict[str, int]:
    return {**counts, key: counts.get(key, 0) + 1}


class _Builder:
    """A state being folded: copies what it changes once, then mutates the copies.

    Folding a batch with it costs one copy of each touched map per batch, not
    per event, which keeps the projector fast with many requests in flight.
    The input state is never mutated: every map is copied before its first
    write and every nested struct is replaced, not changed.
    """

    def __init__(self, state: ProjectionState) -> None:
        self.last_seq = state.last_seq
        self.events = state.events
        self.skipped = state.skipped
        self.log_time = state.log_time
        self.submitted = state.submitted
        self.spend = state.spend
        self.in_flight_dropped = state.in_flight_dropped
        self.last_sweep_at = state.last_sweep_at
        self.mismatched = state.mismatched
        self.terminal = state.terminal
        self._backends = state.backends
        self._tenants = state.tenants
        self._in_flight = state.in_flight
        self._copied: set[str] = set()

    def _own(self, name: str) -> None:
        if name in self._copied:
            return
        self._copied.add(name)
        if name == "backends":
            self._backends = dict(self._backends)
        elif name == "tenants":
            self._tenants = dict(self._tenants)
        else:
            self._in_flight = dict(self._in_flight)

    def _set_backend(self, name: str, **changes: Any) -> None:
        self._own("backends")
        current = self._backends.get(name, _EMPTY_BACKEND)
        self._backends[name] = msgspec.structs.replace(current, **changes)

    def _set_tenant(self, name: str, **changes: Any) -> None:
        self._own("tenants")
        current = self._tenants.get(name, _EMPTY_TENANT)
        self._tenants[name] = msgspec.structs.replace(current, **changes)

    def skip(self, seq: int) -> None:
        """A message at ``seq`` that is not an event: count it and move past it."""
        self.skipped += 1
        self.last_seq = max(self.last_seq, seq)

    def mismatch(self, seq: int) -> None:
        """A message at ``seq`` whose payload disagrees with its subject: count it, skip it."""
        self.mismatched += 1
        self.last_seq = max(self.last_seq, seq)

    def apply(self, event: Event, seq: int | None) -> None:
        at = _finite(event.at)
        self.events += 1
        if seq is not None:
            self.last_seq = max(self.last_seq, seq)
        if isinstance(event, CancelRequested):
            return  # the tenant's word: counted, never a fact, never the clock
        self.log_time = max(self.log_time, at)
        if isinstance(event, Submitted):
            self.submitted += 1
            tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
            self._set_tenant(event.tenant, submitted=tenant.submitted + 1)
        elif isinstance(event, Started):
            self._start(event, at)
        elif isinstance(event, Retrying):
            self._failure(event.backend, event.error_type, at)
        elif isinstance(event, Completed):
            self._complete(event, at)
        elif isinstance(event, Failed) and event.backend is not None:
            self._failure(event.backend, event.error_type, at)
        if isinstance(event, Completed | Failed | Rejected | Expired | Cancelled):
            kind = kind_of(event)
            tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
            self.terminal = _bump(self.terminal, kind)
            self._set_tenant(event.tenant, terminal=_bump(tenant.terminal, kind))
            self._end(msg_id(event.tenant, event.request_id))
        if self.log_time - self.last_sweep_at >= _SWEEP_EVERY:
            self._sweep()

    def _start(self, event: Started, at: float) -> None:
        backend = self._backends.get(event.backend, _EMPTY_BACKEND)
        key = msg_id(event.tenant, event.request_id)
        previous = self._in_flight.get(key)
        self._own("in_flight")
        self._in_flight[key] = InFlight(event.backend, at)
        if previous is None or previous.backend != event.backend:
            if previous is not None:
                self._leave(previous.backend)
            self._set_backend(
                event.backend,
                calls_started=backend.calls_started + 1,
                in_flight=backend.in_flight + 1,
            )
        else:  # a retry or redelivery on the same backend: still one request in flight
            self._set_backend(event.backend, calls_started=backend.calls_started + 1)

    def _leave(self, name: str) -> None:
        backend = self._backends.get(name, _EMPTY_BACKEND)
        self._set_backend(name, in_flight=max(0, backend.in_flight - 1))

    def _end(self, key: str) -> None:
        if key in self._in_flight:
            self._own("in_flight")
            self._leave(self._in_flight.pop(key).backend)

    def _failure(self, name: str, error_type: str, at: float) -> None:
        backend = self._backends.get(name, _EMPTY_BACKEND)
        changes: dict[str, Any] = {
            "calls_failed": backend.calls_failed + 1,
            "last_failure_at": at,
            "last_error_type": error_type,
        }
        if error_type == "rate_limited":
            changes["rate_limited"] = backend.rate_limited + 1
        if error_type in BACKEND_FAULTS:
            changes["consecutive_failures"] = backend.consecutive_failures + 1
            changes["last_fault_at"] = at
        self._set_backend(name, **changes)

    def _complete(self, event: Completed, at: float) -> None:
        backend = self._backends.get(event.backend, _EMPTY_BACKEND)
        cost = _finite(event.cost)
        self._set_backend(
            event.backend,
            calls_completed=backend.calls_completed + 1,
            consecutive_failures=0,
            last_completed_at=at,
            tokens_in=backend.tokens_in + event.usage.prompt_tokens,
            tokens_out=backend.tokens_out + event.usage.completion_tokens,
            spend=backend.spend + cost,
            duration_ewma=_ewma(backend.duration_ewma, _finite(event.duration)),
        )
        tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
        self._set_tenant(event.tenant, spend=tenant.spend + cost)
        self.spend += cost

    def _sweep(self) -> None:
        self.last_sweep_at = self.log_time
        horizon = self.log_time - STALE_IN_FLIGHT
        stale = [key for key, entry in self._in_flight.items() if entry.since < horizon]
        for key in stale:
            self._end(key)
        self.in_flight_dropped += len(stale)

    def freeze(self) -> ProjectionState:
        return ProjectionState(
            v=STATE_VERSION,
            last_seq=self.last_seq,
            events=self.events,
            skipped=self.skipped,
            log_time=self.log_time,
            submitted=self.submitted,
            terminal=self.terminal,
            spend=self.spend,
            backends=self._backends,
            tenants=self._tenants,
            in_flight=self._in_flight,
            in_flight_dropped=self.in_flight_dropped,
            last_sweep_at=self.last_sweep_at,
            mismatched=self.mismatched,
        )


def _fold_messages(builder: _Builder, msgs: Iterable[Any]) -> None:
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


async def _events_consumer(js: Any, after: int, *, inactive: float = 30.0) -> Any:
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


async def _drop_consumer(js: Any, psub: Any) -> None:
    """Unsubscribe and delete an ephemeral consumer; best effort (it expires anyway)."""
    with contextlib.suppress(Exception):
        name = psub._consumer  # nats-py keeps the consumer name only here
        await psub.unsubscribe()
        await js.delete_consumer(EVENTS_STREAM, name)


async def _stream_last_seq(js: Any) -> int:
    info = await js.stream_info(EVENTS_STREAM)
    return int(info.state.last_seq)


async def rebuild(js: Any, *, upto: int | None = None) -> ProjectionState:
    """Replay ``RQ_EVENTS`` from its first message into a fresh state.

    Folds up to ``upto`` (default: the stream's last sequence when called), so
    the result is comparable with a stored state of the same ``last_seq``.
    Events past the stream's retention (``max_age``) are gone: on a log older
    than that, the live state holds counts a replay cannot see.
    """
    target = await _stream_last_seq(js) if upto is None else upto
    builder = _Builder(ProjectionState())
    if target <= 0:
        return builder.freeze()
    psub = await _events_consumer(js, 0)
    try:
        while builder.last_seq < target:
            try:
                msgs = await psub.fetch(_BATCH, timeout=2.0)
            except (TimeoutError, NatsTimeoutError):
                # Nothing more to read: the tail up to ``target`` was deleted.
                break
            _fold_messages(builder, (m for m in msgs if m.metadata.sequence.stream <= target))
            if msgs and msgs[-1].metadata.sequence.stream >= target:
                break
    finally:
        await _drop_consumer(js, psub)
    return builder.freeze()


# ------------------------------------------------------------------ projector


class ProjectorStatus(enum.Enum):
    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


class _Restart(Exception):
    """The state was replaced by the stored one: read the log again after it."""


class Projector:
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
    first: this one adopts the stored state and its revision, and refolds the
    log from the stored sequence. A write is only ever based on the latest
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
        js: Any,
        *,
        name: str = "projector",
        flush_interval: float = 0.1,
        fetch_timeout: float = 1.0,
        batch: int = _BATCH,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
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
        self.status = ProjectorStatus.UNOPENED
        self._kv: Any = None
        self._state = ProjectionState()
        self._revision = 0
        self._stored_seq = 0
        self._last_write = 0.0
        self._psub: Any = None
        self.writes = 0
        self.conflicts = 0

    @property
    def state(self) -> ProjectionState:
        """The state folded so far (may be ahead of the stored one by one flush)."""
        return self._state

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Load the stored state and start folding after its sequence.

        Raises ``nats.js.errors.BucketNotFoundError`` if ``rq-state`` was not
        provisioned.
        """
        if self.status is not ProjectorStatus.UNOPENED:
            raise RuntimeError(f"cannot start a projector in state {self.status.value}")
        self._kv = await self._js.key_value(STATE_BUCKET)
        await self._load()
        self.status = ProjectorStatus.RUNNING
        self._supervisor.spawn(self._loop, self._run)
        log.info("projector started", projector=self._name, after=self._state.last_seq)

    async def stop(self) -> None:
        """Stop reading, write what was folded (best effort), drop the consumer. Idempotent."""
        if self.status is not ProjectorStatus.RUNNING:
            self.status = ProjectorStatus.CLOSED
            return
        self.status = ProjectorStatus.CLOSED
        # The loop also checks the status; stop() repeats the cancel, which
        # nats-py's fetch can swallow (see renqueue._tasks).
        await self._supervisor.stop(self._loop)
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
            with contextlib.suppress(KeyNotFoundError, msgspec.DecodeError):
                entry = await self._kv.get(STATE_KEY)
                state = decode_state(entry.value)
                if state.last_seq >= target:
                    return state
            await asyncio.sleep(self._flush_interval / 2)

    async def _load(self) -> None:
        """Adopt the stored state and its revision (a fresh state if there is none)."""
        try:
            entry = await self._kv.get(STATE_KEY)
        except KeyNotFoundError as exc:
            # Never written (revision 0), or deleted: then the delete marker's
            # revision is the one a compare-and-set must name.
            marker = getattr(exc, "entry", None)
            self._revision = int(marker.revision) if marker is not None else 0
            self._state, self._stored_seq = ProjectionState(), 0
            return
        self._revision = int(entry.revision)
        try:
            self._state = decode_state(entry.value)
        except msgspec.DecodeError as exc:
            # Written by an incompatible version, or damaged: the log is the
            # truth, so fold it again from the start and overwrite (by CAS).
            log.exception("stored projection undecodable; rebuilding from the log", error=str(exc))
            self._state = ProjectionState()
        if self._state.v < STATE_VERSION:
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

    async def _consume(self, psub: Any) -> None:
        idle = 0
        while self.status is ProjectorStatus.RUNNING:
            dirty = self._state.last_seq > self._stored_seq
            timeout = self._fetch_timeout
            if dirty:
                due = self._last_write + self._flush_interval - self._clock()
                timeout = min(timeout, max(0.01, due))
            try:
                msgs = await psub.fetch(self._batch, timeout=timeout)
            except (TimeoutError, NatsTimeoutError):
                msgs = []
            if msgs:
                idle = 0
                builder = _Builder(self._state)
                _fold_messages(builder, msgs)
                self._state = builder.freeze()
            else:
                idle += 1
                if idle % 5 == 0:
                    await self._check_consumer(psub)
            if (
                self._state.last_seq > self._stored_seq
                and self._clock() - self._last_write >= self._flush_interval
                and not await self._flush()
            ):
                raise _Restart

    async def _check_consumer(self, psub: Any) -> None:
        """An idle consumer may have been lost (server restart): make it again if so."""
        try:
            await psub.consumer_info()
        except NotFoundError as exc:
            raise _Restart from exc

    async def _flush(self) -> bool:
        """Write the state by compare-and-set. False if another projector wrote first
        (the stored state has then been adopted)."""
        state = self._state
        try:
            self._revision = await self._kv.update(
                STATE_KEY, encode_state(state), last=self._revision
            )
        except KeyWrongLastSequenceError:
            self.conflicts += 1
            log.info("projection written by another projector; adopting it", projector=self._name)
            await self._load()
            self._last_write = self._clock()
            return False
        self._stored_seq = state.last_seq
        self._last_write = self._clock()
        self.writes += 1
        return True


# ----------------------------------------------------------------- state view


class StateView:
    """The latest stored projection, kept current by a KV watch.

    Open with ``await StateView.open(js)``; close with :meth:`close` (or use it
    as an async context manager). Until a projector has written anything the
    state is empty, and every backend is healthy.

    The watch is followed by a loop under ``supervisor`` (the process's; a
    private one if not given). A watch can end or go quiet while the stored
    value moves on (its consumer lost with a server restart, the bucket
    re-created with sequences starting over): whenever the watch has been
    silent for ``check_every`` seconds, the view reads the stored revision,
    and if the watch has still not delivered it at the next check, the watch
    is re-opened from the current value (logged). A watch that cannot be
    re-opened fails the loop: the supervisor logs it and retries with
    backoff, and a view that stays blind takes its process down.
    """

    def __init__(
        self,
        js: Any,
        *,
        threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown: float = DEFAULT_COOLDOWN,
        supervisor: Supervisor | None = None,
        name: str = "state-view",
        check_every: float = 5.0,
    ) -> None:
        self._js = js
        self.threshold = threshold
        self.cooldown = cooldown
        self.state = ProjectionState()
        self.revision = 0
        #: Times the watch was found ended or stale and re-opened.
        self.reopened = 0
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor if supervisor is not None else Supervisor(name)
        self._loop = f"{name}-watch"
        self._check_every = check_every
        self._kv: Any = None
        self._watcher: Any = None
        #: The last entry the watch delivered: (revision, value).
        self._watch_rev = 0
        self._watch_value = b""
        self._behind = False
        self._broken = False
        self._changed = asyncio.Event()

    @classmethod
    async def open(
        cls,
        js: Any,
        *,
        threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown: float = DEFAULT_COOLDOWN,
        supervisor: Supervisor | None = None,
        name: str = "state-view",
        check_every: float = 5.0,
    ) -> StateView:
        """Watch the stored state; returns once the current value (if any) is loaded."""
        view = cls(
            js,
            threshold=threshold,
            cooldown=cooldown,
            supervisor=supervisor,
            name=name,
            check_every=check_every,
        )
        await view._open_watch()
        view._supervisor.spawn(view._loop, view._follow)
        return view

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def expected_duration(self, name: str, *, min_samples: int = 5) -> float | None:
        """What a call to ``name`` is expected to take; ``None`` until it has
        ``min_samples`` completions (an estimate from fewer is noise)."""
        backend = self.state.backends.get(name)
        if backend is None or backend.calls_completed < min_samples:
            return None
        return backend.duration_ewma

    def backend_healthy(self, name: str, now: float) -> bool:
        """:func:`is_healthy` for ``name`` at Unix time ``now``; unknown backends are healthy."""
        backend = self.state.backends.get(name)
        if backend is None:
            return True
        return is_healthy(backend, now, threshold=self.threshold, cooldown=self.cooldown)

    async def wait_for(self, seq: int) -> ProjectionState:
        """Wait until the view reflects stream sequence ``seq`` or later.

        Bound the wait with ``asyncio.timeout``.
        """
        while self.state.last_seq < seq:
            self._changed.clear()
            await self._changed.wait()
        return self.state

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        await self._supervisor.stop(self._loop)
        if self._own_supervisor:
            await self._supervisor.close()
        await self._close_watch()

    def _take(self, entry: Any) -> None:
        if entry.value is None or entry.operation is not None:
            return  # a delete or purge marker: keep what we had
        try:
            state = decode_state(entry.value)
        except msgspec.DecodeError as exc:
            log.warning("undecodable projection in KV ignored", error=str(exc))
            return
        self.state, self.revision = state, int(entry.revision)
        self._changed.set()

    def _seen(self, entry: Any) -> None:
        """An entry (value or marker) the watch delivered."""
        self._watch_rev = int(entry.revision)
        self._watch_value = bytes(entry.value or b"")
        self._behind = False
        self._take(entry)

    async def _open_watch(self) -> None:
        """Open a watch and load the current value (the watch delivers it, then None)."""
        self._kv = await self._js.key_value(STATE_BUCKET)
        self._watcher = await self._kv.watch(STATE_KEY)
        while (entry := await self._watcher.updates(timeout=5.0)) is not None:
            self._seen(entry)
        self._behind = False
        self._broken = False

    async def _close_watch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _reopen(self, why: str) -> None:
        log.warning("projection watch re-opened", reason=why, revision=self._watch_rev)
        self.reopened += 1
        await self._close_watch()
        await self._open_watch()

    async def _stored(self) -> tuple[int, bytes]:
        """The stored entry (or its delete marker): (revision, value); (0, b"") if none."""
        try:
            entry = await self._kv.get(STATE_KEY)
        except KeyNotFoundError as exc:
            marker = getattr(exc, "entry", None)
            if marker is None:
                return 0, b""
            return int(marker.revision), bytes(marker.value or b"")
        return int(entry.revision), bytes(entry.value or b"")

    async def _stale(self) -> bool:
        """The watch was quiet for a while: has the stored value moved on without it?

        The stored entry is compared by revision *and* value: a bucket
        re-created (after a store was lost) counts revisions from 1 again, so
        a revision alone could match the watch's last one by chance. Stale
        only when an entry stored at the previous check has still not
        arrived, so a value on its way when the check ran is no false alarm.
        """
        if await self._stored() == (self._watch_rev, self._watch_value):
            self._behind = False
            return False
        was_behind, self._behind = self._behind, True
        return was_behind

    async def _follow(self) -> None:
        """Take each update; re-open the watch when it ended or went stale.

        An error (the bucket gone, the server unreachable) ends this run: the
        supervisor logs it and starts the loop again, which re-opens the watch.
        """
        try:
            if self._broken or self._watcher is None:
                await self._reopen("the previous watch failed")
            while True:
                try:
                    entry = await self._watcher.updates(timeout=self._check_every)
                except NatsTimeoutError:
                    if await self._stale():
                        await self._reopen("silent while the stored value changed")
                    continue
                if entry is None:
                    continue
                if entry is self._watcher.STOP_ITER:
                    await self._reopen("the watch ended")
                    continue
                self._seen(entry)
        except Exception:
            self._broken = True
            raise
