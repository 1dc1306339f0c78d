"""The fold: the event log folded into health, spend and load state.

:func:`fold` (and :func:`fold_many`) turns a :class:`ProjectionState` and an
event into the next state. It reads nothing but its arguments: no clock, no
network. Time comes only from the events' own ``at`` stamps, and only from
events written by the services (a tenant-written ``cancel_requested`` never
moves the clock), so folding the log from its first event always rebuilds
exactly the state that is live (design property 4). The health rule is
:func:`renqueue.policy.is_healthy`, a pure function of one backend's state and
a caller-supplied ``now``, so a router applies the cooldown with its own clock.

The state is bounded: counters per backend, per tenant and in total, plus one
small entry per request that has started and not yet ended, keyed
``<tenant>:<request id>`` (dropped at its terminal event, and swept after
:data:`STALE_IN_FLIGHT` seconds of event time so a lost terminal event cannot
leak an entry forever).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final

import msgspec
from msgspec import Struct

from ..wire._messages import (
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
from ..wire._subjects import msg_id

__all__ = [
    "BACKEND_FAULTS",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "BackendState",
    "InFlight",
    "ProjectionState",
    "TenantState",
    "decode_state",
    "encode_state",
    "fold",
    "fold_many",
]

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
