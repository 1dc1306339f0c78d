"""The fold: the event log folded into health, spend and load state.

:func:`fold` (and :func:`fold_many`) turns a :class:`ProjectionState` and an
event into the next state. It reads nothing but its arguments: no clock, no
network. Time comes only from the events' own ``at`` stamps, and only from
events written by the services (a tenant-written ``cancel_requested`` never
moves the clock), so folding the log from its first event always rebuilds
exactly the state that is live (design property 4). The health rule is
:func:`renqueue.policy.is_healthy`, a pure function of one backend's state and
a caller-supplied ``now``, so a router applies the cooldown with its own clock.

The state is bounded: counters per backend, per tenant and in total, each
backend's quota (a spend log of a few hundred slots at most, and what its
provider last said of its limits), plus one small entry per request that has
started and not yet ended and one per request whose ``routed`` decision
reserved quota, both keyed ``<tenant>:<request id>`` (dropped at its terminal
event, and swept after :data:`STALE_IN_FLIGHT` seconds of event time so a lost
terminal event cannot leak an entry forever), and one per request that ended
while its decision was not folded yet (below), swept the same way.

A binder that may have bound a request before logs its decision only once the
dispatch is stored, so a fast worker's ``started`` and even its terminal event
can be stored before that ``routed``. The fold gives the same state in either
order: a terminal of a call whose decision is not folded (a ``completed``
or ``failed`` run, a worker's ``expired`` or ``cancelled``, which name their
run even before its call began, or any end of a call that started) leaves an
:class:`Ended` mark (the call's backend, attempt, time and the tokens it
spent), and the late ``routed`` of that attempt consumes it instead of
reserving: it spends what its decision would have (one request, and the token
estimate reconciled with the tokens used), and nothing stays reserved or
committed for a request that is over. Older attempts' decisions logged after
the end are counted the same way (``Reservation.decided``, ``Ended.older``).
The same holds for a half-open circuit's probe call, whose outcome alone
moves the circuit: an outcome logged there for a call whose decision is not
folded is kept on its backend (``unrouted``: the latest few, cleared by the
next ``circuit`` event), and the probe's late ``routed`` counts it.

Quota, in event time: a ``routed`` decision spends one request and the token
estimate it reserved; another call for the same decision (a retry, a run on a
pool sibling that stole it) spends one more request; a ``completed`` call
reconciles the reservation with the usage reported; a 429 (``rate_limited``)
starts a cooldown of its ``retry_after``; a failure that says the provider's
quota is spent takes the backend out until then; and every limit the
provider reported with an answer or a failure is learned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final

import msgspec
from msgspec import Struct

from ..policy import (
    OUTCOME_BUCKET,
    OUTCOME_HORIZON,
    Cost,
    Perf,
    Quota,
    cool_down,
    learn,
    learn_call,
    learn_fault,
    reconcile,
    reserve,
)
from ..schema import (
    Cancelled,
    CancelRequested,
    CircuitChanged,
    Completed,
    Event,
    Expired,
    Failed,
    FellBack,
    Preempted,
    Probed,
    Rejected,
    ReportedLimit,
    Retrying,
    Routed,
    Started,
    Submitted,
    facts,
    kind_of,
    msg_id,
)
from ._faults import BACKEND_FAULT_CLASSES, BACKEND_FAULTS, is_backend_fault
from ._splits import Splits, SplitsBuilder

__all__ = [
    "BACKEND_FAULTS",
    "BACKEND_FAULT_CLASSES",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "UNROUTED_KEPT",
    "UPGRADED_IN_PLACE",
    "BackendState",
    "Ended",
    "InFlight",
    "ProjectionState",
    "Reservation",
    "TenantState",
    "decode_state",
    "encode_state",
    "fold",
    "fold_many",
    "is_backend_fault",
    "utc_day",
]

#: Version of the stored state's schema (the ``v`` field of the KV value).
#: 2: ``in_flight`` is keyed ``<tenant>:<request id>`` (1: by request id alone);
#: 3: backends carry their ``quota`` and the state its open ``reserved`` quota;
#: 4: tenants carry their spend of the latest UTC day (``day``, ``day_spend``);
#: 5: reservations and in-flight entries name their attempt (a call is the
#: reserved one only for its own decision, whichever of the two is logged first).
#: A projector that finds an older state folds the log again from the start.
#: 6: backends carry their circuit (state, since, reason), the outcomes of
#: recent calls and the latest active probe.
#: 7: backends carry their performance model (``perf``: renqueue.policy._perf).
#: 8: the state carries its A/B splits (``splits``: renqueue.state._splits).
#: 9: reservations carry the decision's estimated cost, tenants the sum of
#: theirs (``committed``: what calls bound and not ended may still spend).
#: 10: backends count every failure that blamed them (``faults``).
#: 11: the state marks requests that ended before their decision was folded
#: (``ended``), so a late ``routed`` reserves nothing.
#: 12: an ``ended`` mark says whether its request completed (``completed``: a
#: completion that used no tokens still reconciles its late decision's estimate),
#: and backends keep the outcomes of calls logged in a half-open circuit before
#: their decision (``unrouted``), so a probe's late ``routed`` still counts its outcome.
#: 13: reservations count their request's decisions folded (``decided``), and an
#: ``ended`` mark the older attempts' decisions still to come (``older``) and whether
#: its own came (``decided``): an older attempt's late ``routed`` reserves nothing;
#: the A/B splits keep an end folded before its decision (``splits.ended``) for it.
STATE_VERSION: Final = 13

#: Older versions a projector takes as they are stored, only marking them
#: current: every version since added fields with defaults and changed no
#: meaning (10's ``faults`` count from the upgrade on; 11's ``ended`` marks
#: only requests that end after it, and a mark stored by 11 reads as not
#: ``completed``: as 11 folded it; ``unrouted`` keeps only outcomes logged
#: after the upgrade; 12's reservations and marks read as counting no older
#: decisions, and its splits as keeping no end: as 12 folded them). Older than
#: these, it folds the log again (what is past the log's ``max_age`` is then lost).
UPGRADED_IN_PLACE: Final = frozenset({9, 10, 11, 12})

#: Event kinds a tenant may publish itself (``nats/auth.conf``: only
#: ``rq.evt.<tenant>.*.cancel_requested``). Their payloads are the tenant's
#: word: they are counted, and never move the projection's clock.
TENANT_WRITTEN_KINDS: Final = frozenset({"cancel_requested"})

#: The KV key (in bucket ``rq-state``) the projector writes the state to.
STATE_KEY: Final = "projection"

#: A started request with no event for this long (event time) is dropped from
#: the in-flight map and counted in ``in_flight_dropped``. Property 1 says every
#: request ends; this only bounds the damage if a terminal event never lands.
STALE_IN_FLIGHT: Final = 6 * 3600.0
#: How often (event time) the in-flight map is swept for stale entries.
_SWEEP_EVERY: Final = 60.0
#: Outcomes of calls not routed yet a backend keeps while half-open
#: (``BackendState.unrouted``): the binder binds one call there, its probe.
UNROUTED_KEPT: Final = 4


# ---------------------------------------------------------------------- state


class BackendState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the log says about one backend.

    ``calls_failed`` counts every call that ended in a ``retrying`` or
    ``failed`` event naming this backend, whatever the error type;
    ``rate_limited`` is the part of those that were 429s. The health fields
    count only :data:`BACKEND_FAULTS`: ``faults`` counts them all,
    ``consecutive_failures`` is the streak since the last completion and
    ``last_fault_at`` the event time of its latest member, from which the
    cooldown runs. ``last_failure_at`` and
    ``last_error_type`` describe the latest failure of any type, for operators.
    ``in_flight`` counts requests whose latest start was on this backend and
    that have not ended.
    """

    calls_started: int = 0
    calls_completed: int = 0
    calls_failed: int = 0
    rate_limited: int = 0
    consecutive_failures: int = 0
    #: Every failure that blamed the backend (:data:`BACKEND_FAULTS`), ever.
    faults: int = 0
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
    #: Its learned speed (time to first token, token rate, output length, with
    #: their spread) and how often its calls fail: what the planner predicts by.
    perf: Perf | None = None
    #: What was sent to it over time, and what its provider said of its
    #: limits (:class:`renqueue.policy.Quota`): what its rate limits leave.
    quota: Quota | None = None
    #: Its circuit breaker as last logged (``circuit`` events): ``closed``,
    #: ``open`` or ``half_open``, since when (event time) and why.
    circuit: str = "closed"
    circuit_at: float = 0.0
    circuit_reason: str = ""
    #: The lease term of the binder that logged it: a change logged by a binder
    #: from an older term than the latest is not folded (it had lost its lease).
    circuit_term: int = 0
    #: ``(bucket start, calls completed, backend faults)`` per 10 s of event
    #: time, oldest first, over the last 10 minutes and since its circuit
    #: last closed: the error rate its circuit is judged by.
    outcomes: tuple[tuple[int, int, int], ...] = ()
    #: The latest answer of an active health probe (``probed`` events) and when.
    probe_ok: bool | None = None
    probe_at: float | None = None
    #: Logged after its latest ``circuit`` event: completed calls, backend
    #: faults, and the latest probe answer (what a half-open circuit and an
    #: open one waiting for its probe are judged by, in log order).
    ok_since_circuit: int = 0
    faults_since_circuit: int = 0
    probe_since_circuit: bool | None = None
    #: The probe call of its half-open circuit (``<tenant>:<id>:<attempt>`` of
    #: a ``routed`` event that says ``probe``): only its outcome is counted in
    #: ``ok_since_circuit`` / ``faults_since_circuit`` (a call that began
    #: before the circuit opened decides nothing).
    probe_call: str = ""
    #: Outcomes of calls whose decision was not folded yet, logged after its
    #: latest ``circuit`` event while that is ``half_open``: ``(call, completed,
    #: faults)``, ``call`` as in ``probe_call``, the latest
    #: :data:`UNROUTED_KEPT`. A probe's ``routed`` logged after its outcome (a
    #: rebind logs its decision once the dispatch is stored) counts its entry
    #: then, as if it had come first; a ``circuit`` event clears them all.
    unrouted: tuple[tuple[str, int, int], ...] = ()


class TenantState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tenant's submitted requests, spend (USD) and outcomes by terminal kind.

    ``day_spend`` is its spend on UTC day ``day`` (days since 1970-01-01, of
    event time), the latest day it spent anything: :meth:`spend_on` gives a
    day's spend, 0 for any later day.
    """

    submitted: int = 0
    spend: float = 0.0
    terminal: dict[str, int] = {}
    day: int = 0
    day_spend: float = 0.0
    #: The estimated cost (USD) of its calls bound and not ended: what its
    #: budget counts beside the day's spend.
    committed: float = 0.0

    def spend_on(self, day: int) -> float:
        """Its spend on UTC day ``day`` (see :func:`utc_day`); 0 unless it is the latest."""
        return self.day_spend if day == self.day else 0.0


def utc_day(at: float) -> int:
    """The UTC day of Unix time ``at``: days since 1970-01-01."""
    return math.floor(at / 86400.0)


class InFlight(Struct, frozen=True, array_like=True):
    """A request that started and has not ended: the backend of its latest start,
    when, and the attempt (decision) it ran for."""

    backend: str
    since: float
    attempt: int = 0


class Reservation(Struct, frozen=True, array_like=True):
    """Quota a ``routed`` decision (of ``attempt``) reserved and no end has reconciled yet.

    ``started``: its call (the first start of its attempt on its backend) has
    begun, before or after the decision was logged; any other start of the
    request is another call, spending one more request.
    """

    backend: str
    at: float
    tokens: int
    started: bool = False
    attempt: int = 0
    #: The decision's estimated cost (``routed.estimated_cost``), in its tenant's ``committed``.
    cost: float = 0.0
    #: How many of its request's decisions (attempts up to ``attempt``) are
    #: folded: fewer than ``attempt``, an older one is still to come when the
    #: request ends (0: not counted, a state stored before version 13).
    decided: int = 0


class Ended(Struct, frozen=True, array_like=True):
    """A request that ended (at ``at``) while the decision of its call (of
    ``attempt``, on ``backend``) was not folded: its late ``routed`` reserves nothing.

    ``tokens``: what its completion spent at ``at`` with no reservation to
    reconcile (0 for any other end), which that decision's estimate is
    reconciled with when it comes; ``completed``: it ended with that
    completion (so even 0 tokens used reconciles the estimate away).
    """

    backend: str
    at: float
    attempt: int
    tokens: int = 0
    completed: bool = False
    #: Older attempts' decisions still to come (each reserves nothing either),
    #: and whether its own attempt's came already (the mark waits for the older).
    older: int = 0
    decided: bool = False


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
    #: Quota reserved by ``routed`` decisions whose requests have not ended,
    #: by ``<tenant>:<request id>``.
    reserved: dict[str, Reservation] = {}
    in_flight_dropped: int = 0
    last_sweep_at: float = 0.0
    mismatched: int = 0
    #: Requests that ended before their decision was folded (a binder's late
    #: ``routed``), by ``<tenant>:<request id>``, until it comes.
    ended: dict[str, Ended] = {}
    #: A/B splits: each one's state and per-arm figures (:mod:`renqueue.state._splits`).
    splits: Splits = Splits()

    @property
    def in_flight_count(self) -> int:
        """Requests started and not yet ended."""
        return len(self.in_flight)

    def backend(self, name: str) -> BackendState:
        """The state of ``name``; a backend the log never mentioned has an empty one."""
        return self.backends.get(name, EMPTY_BACKEND)


EMPTY_BACKEND: Final = BackendState()
_EMPTY_QUOTA: Final = Quota()
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
    builder = Folding(state)
    builder.apply(event, seq)
    return builder.freeze()


def fold_many(state: ProjectionState, events: Iterable[Event]) -> ProjectionState:
    """Fold ``events`` in order; equal to folding them one by one, but copies once."""
    builder = Folding(state)
    for event in events:
        builder.apply(event, None)
    return builder.freeze()


def _ewma(previous: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


def _finite(value: float) -> float:
    # JSON has no inf/nan: a non-finite value would not survive the KV round
    # trip, and a resumed projector would diverge from a replay. (Compared
    # rather than math.isfinite: no call, and nan compares false.)
    return value if -math.inf < value < math.inf else 0.0


#: Event types, as tuples: ``isinstance`` with ``A | B`` builds the union on
#: every call (the fold runs for every event of the log).
_TERMINAL: Final = (Completed, Failed, Rejected, Expired, Cancelled)
_CALL_OUTCOMES: Final = (Completed, FellBack, Retrying, Failed)
#: Terminal events that name the run they ended at when a worker (or the
#: dead-letter of a dispatch) ended it: ``backend`` and ``attempt``.
_RUN_ENDS: Final = (Failed, Expired, Cancelled)


def _bump(counts: dict[str, int], key: str) -> dict[str, int]:
    return {**counts, key: counts.get(key, 0) + 1}


class Folding:
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
        self._reserved = state.reserved
        self._ended = state.ended
        self._copied: set[str] = set()
        self._splits = SplitsBuilder(state.splits)

    def _own(self, name: str) -> None:
        if name in self._copied:
            return
        self._copied.add(name)
        if name == "backends":
            self._backends = dict(self._backends)
        elif name == "tenants":
            self._tenants = dict(self._tenants)
        elif name == "reserved":
            self._reserved = dict(self._reserved)
        elif name == "ended":
            self._ended = dict(self._ended)
        else:
            self._in_flight = dict(self._in_flight)

    def _set_backend(self, name: str, **changes: Any) -> None:
        self._own("backends")
        current = self._backends.get(name, EMPTY_BACKEND)
        self._backends[name] = msgspec.structs.replace(current, **changes)

    def _release(self, key: str) -> None:
        """Drop the request's reservation, and its cost from its tenant's ``committed``."""
        reservation = self._reserved.get(key)
        if reservation is None:
            return
        self._own("reserved")
        del self._reserved[key]
        if reservation.cost:
            self._commit(key.partition(":")[0], -reservation.cost)

    def _commit(self, tenant: str, cost: float) -> None:
        current = self._tenants.get(tenant, _EMPTY_TENANT)
        committed = current.committed + cost
        # Sums of floats drift: what is left of nothing is nothing.
        self._set_tenant(tenant, committed=committed if committed > 1e-12 else 0.0)

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
        if isinstance(event, Submitted) and event.routed is not None:
            # A request bound at once: its submit and its binding, folded
            # as the two events they were before they were stored as one.
            for fact in facts(event):
                self.apply(fact, seq)
            return
        at = _finite(event.at)
        self.events += 1
        if seq is not None and seq > self.last_seq:
            self.last_seq = seq
        if isinstance(event, CancelRequested):
            return  # the tenant's word: counted, never a fact, never the clock
        self.log_time = max(self.log_time, at)
        self._splits.apply(event, at, self.log_time)
        if isinstance(event, Submitted):
            self.submitted += 1
            tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
            self._set_tenant(event.tenant, submitted=tenant.submitted + 1)
        else:
            self._on_backend(event, at)
        if isinstance(event, _TERMINAL):
            kind = kind_of(event)
            tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
            self.terminal = _bump(self.terminal, kind)
            self._set_tenant(event.tenant, terminal=_bump(tenant.terminal, kind))
            key = msg_id(event.tenant, event.request_id)
            self._mark_ended(event, key, at)
            self._end(key)
            self._release(key)
        if self.log_time - self.last_sweep_at >= _SWEEP_EVERY:
            self._sweep()

    def _probe_outcome(self, event: Event) -> None:
        """Count the outcome of a half-open circuit's probe call (only that call's).

        An outcome of a call whose decision is not folded yet may be the
        probe's (its ``routed`` may land later): it is kept until that comes
        (:meth:`_probe_routed`)."""
        if not isinstance(event, _CALL_OUTCOMES) or not event.backend:
            return
        backend = self._backends.get(event.backend, EMPTY_BACKEND)
        if backend.circuit != "half_open":
            return
        if isinstance(event, Completed):
            ok, fault = int(event.shared_with is None), 0
        else:
            ok, fault = 0, int(is_backend_fault(event.error_type, event.error_class))
        if not ok and not fault:
            return
        key = msg_id(event.tenant, event.request_id)
        call = f"{key}:{event.attempt}"
        if backend.probe_call == call:
            self._set_backend(
                event.backend,
                ok_since_circuit=backend.ok_since_circuit + ok,
                faults_since_circuit=backend.faults_since_circuit + fault,
            )
            return
        reservation = self._reserved.get(key)
        if reservation is not None and reservation.attempt >= event.attempt:
            return  # its decision is folded, and was not the probe
        kept = [entry for entry in backend.unrouted if entry[0] != call]
        before = next((entry for entry in backend.unrouted if entry[0] == call), (call, 0, 0))
        kept.append((call, before[1] + ok, before[2] + fault))
        self._set_backend(event.backend, unrouted=tuple(kept[-UNROUTED_KEPT:]))

    def _probe_routed(self, event: Routed, key: str) -> None:
        """A decision: a probe's names its backend's probe call, and counts the
        outcome that call logged before it; any other's call is not the probe."""
        backend = self._backends.get(event.backend, EMPTY_BACKEND)
        if not event.probe and not backend.unrouted:
            return
        call = f"{key}:{event.attempt}"
        kept = tuple(entry for entry in backend.unrouted if entry[0] != call)
        if not event.probe:
            if len(kept) != len(backend.unrouted):
                self._set_backend(event.backend, unrouted=kept)
            return
        changes: dict[str, Any] = {"probe_call": call}
        if len(kept) != len(backend.unrouted):  # its outcome came first (half-open since)
            _, ok, fault = next(entry for entry in backend.unrouted if entry[0] == call)
            changes.update(
                unrouted=kept,
                ok_since_circuit=backend.ok_since_circuit + ok,
                faults_since_circuit=backend.faults_since_circuit + fault,
            )
        self._set_backend(event.backend, **changes)

    def _on_backend(self, event: Event, at: float) -> None:
        """An event about a backend call: a decision, a start, a failed run, an end."""
        self._probe_outcome(event)
        if isinstance(event, Routed):
            self._route(event, at)
        elif isinstance(event, Started):
            self._start(event, at)
        elif isinstance(event, Retrying):
            self._retrying(event, at)
        elif isinstance(event, FellBack):  # put back to be bound elsewhere: it left this backend
            self._end(msg_id(event.tenant, event.request_id))
            self._failure(event.backend, event.error_type, at, event.error_class)
            self._provider_said(event.backend, event.limits, at, None)
            if event.error_type == "rate_limited":  # the provider's retry-after, for everyone
                self._cool_down(event.backend, at + _finite(event.retry_after))
        elif isinstance(event, Preempted):  # put back to wait again: it left this backend
            self._end(msg_id(event.tenant, event.request_id))
        elif isinstance(event, Completed):
            self._complete(event, at)
        elif isinstance(event, Failed) and event.backend is not None:
            self._failure(event.backend, event.error_type, at, event.error_class)
            self._provider_said(event.backend, event.limits, at, event.quota_exhausted_until)
        elif isinstance(event, CircuitChanged):
            self._circuit(event, at)
        elif isinstance(event, Probed):
            self._set_backend(
                event.backend, probe_ok=event.ok, probe_at=at, probe_since_circuit=event.ok
            )

    def _circuit(self, event: CircuitChanged, at: float) -> None:
        """The binder moved a backend's circuit: its counts start afresh."""
        if event.term < self._backends.get(event.backend, EMPTY_BACKEND).circuit_term:
            return  # a binder whose term had ended (a newer one decides)
        changes: dict[str, Any] = {
            "circuit_term": event.term,
            "circuit": event.state,
            "circuit_at": at,
            "circuit_reason": event.reason[:500],
            "ok_since_circuit": 0,
            "faults_since_circuit": 0,
            "probe_since_circuit": None,
            "unrouted": (),
        }
        if event.state == "closed":  # counted afresh from here
            changes.update(consecutive_failures=0, outcomes=())
        if event.state != "half_open":  # (a probe's routed may be logged first)
            changes["probe_call"] = ""
        self._set_backend(event.backend, **changes)

    def _outcome(self, name: str, at: float, *, fault: bool) -> tuple[tuple[int, int, int], ...]:
        """The backend's recent outcomes with one more call (ok or a fault) at ``at``."""
        outcomes = self._backends.get(name, EMPTY_BACKEND).outcomes
        start = int(at // OUTCOME_BUCKET) * OUTCOME_BUCKET
        kept = [entry for entry in outcomes if entry[0] > start - OUTCOME_HORIZON]
        if kept and kept[-1][0] == start:
            _, ok, bad = kept[-1]
            kept[-1] = (start, ok + (not fault), bad + fault)
        elif not kept or kept[-1][0] < start:
            kept.append((start, int(not fault), int(fault)))
        else:  # a late event: into its own bucket, kept in order
            kept.append((start, int(not fault), int(fault)))
            kept.sort()
            merged: list[tuple[int, int, int]] = []
            for entry in kept:
                if merged and merged[-1][0] == entry[0]:
                    merged[-1] = (entry[0], merged[-1][1] + entry[1], merged[-1][2] + entry[2])
                else:
                    merged.append(entry)
            kept = merged
        return tuple(kept)

    def _start(self, event: Started, at: float) -> None:
        backend = self._backends.get(event.backend, EMPTY_BACKEND)
        key = msg_id(event.tenant, event.request_id)
        ended = self._ended.get(key)
        if ended is not None and ended.attempt >= event.attempt:
            # A start logged after its request ended, its decision not folded
            # yet (a run another worker took over, its start stored late): a
            # call, never in flight (nothing would end it).
            self._set_backend(event.backend, calls_started=backend.calls_started + 1)
            return
        previous = self._in_flight.get(key)
        self._own("in_flight")
        self._in_flight[key] = InFlight(event.backend, at, event.attempt)
        reservation = self._reserved.get(key)
        this_attempt = reservation is not None and reservation.attempt == event.attempt
        if (
            reservation is not None
            and this_attempt
            and reservation.backend == event.backend
            and not reservation.started
        ):
            # The call its decision reserved (and spent at the decision).
            self._own("reserved")
            self._reserved[key] = msgspec.structs.replace(reservation, started=True)
        elif previous is not None or this_attempt:
            # Another call than the one its decision reserved: a retry, a
            # redelivery, or a run on a pool sibling that stole it.
            self._spend(event.backend, Cost(requests=1), at)
        # Else the first call of a decision not folded yet (a binder logs a
        # decision after its dispatch was stored when the request may have
        # been bound before): the decision spends when it comes, and knows
        # its call has begun.
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

    def _retrying(self, event: Retrying, at: float) -> None:
        if event.requeued:  # put back to be bound again: it left this backend
            self._end(msg_id(event.tenant, event.request_id))
        self._failure(event.backend, event.error_type, at, event.error_class)
        self._provider_said(event.backend, event.limits, at, event.quota_exhausted_until)
        if event.error_type == "rate_limited":
            # Put back for a spent quota: the backend is out (exhausted) for the
            # hold its worker logged, whether or not the provider named a reset.
            self._cool_down(
                event.backend, at + _finite(event.retry_after), exhausted=event.requeued
            )

    def _leave(self, name: str) -> None:
        backend = self._backends.get(name, EMPTY_BACKEND)
        self._set_backend(name, in_flight=max(0, backend.in_flight - 1))

    def _end(self, key: str) -> None:
        if key in self._in_flight:
            self._own("in_flight")
            self._leave(self._in_flight.pop(key).backend)

    def _failure(self, name: str, error_type: str, at: float, error_class: str = "") -> None:
        backend = self._backends.get(name, EMPTY_BACKEND)
        changes: dict[str, Any] = {
            "calls_failed": backend.calls_failed + 1,
            "last_failure_at": at,
            "last_error_type": error_type,
        }
        if error_type == "rate_limited":
            changes["rate_limited"] = backend.rate_limited + 1
        changes["perf"] = learn_fault(
            backend.perf,
            fault=is_backend_fault(error_type, error_class),
            rate_limited=error_type == "rate_limited",
        )
        if is_backend_fault(error_type, error_class):
            changes["consecutive_failures"] = backend.consecutive_failures + 1
            changes["faults"] = backend.faults + 1
            changes["last_fault_at"] = at
            changes["outcomes"] = self._outcome(name, at, fault=True)
        self._set_backend(name, **changes)

    def _quota(self, name: str) -> Quota:
        return self._backends.get(name, EMPTY_BACKEND).quota or _EMPTY_QUOTA

    def _spend(self, name: str, cost: Cost, at: float) -> None:
        self._set_backend(name, quota=reserve(self._quota(name), cost, at))

    def _cool_down(self, name: str, until: float, *, exhausted: bool = False) -> None:
        self._set_backend(name, quota=cool_down(self._quota(name), until, exhausted=exhausted))

    def _provider_said(
        self,
        name: str,
        limits: tuple[ReportedLimit, ...],
        at: float,
        exhausted_until: float | None,
    ) -> None:
        if limits:
            self._set_backend(name, quota=learn(self._quota(name), limits, at))
        if exhausted_until is not None:
            self._cool_down(name, _finite(exhausted_until), exhausted=True)

    def _mark_ended(
        self, event: Completed | Failed | Rejected | Expired | Cancelled, key: str, at: float
    ) -> None:
        """Mark a request ending while the decision of its call is not folded
        (none reserved for its attempt): its ``routed`` is yet to come."""
        running = self._in_flight.get(key)
        attempt, backend, tokens, completed = 0, "", 0, False
        if isinstance(event, Completed):
            if event.shared_with is None:  # a follower made no call of its own
                attempt, backend, completed = event.attempt, event.backend, True
                tokens = event.usage.prompt_tokens + event.usage.completion_tokens
        elif isinstance(event, _RUN_ENDS) and event.backend is not None:
            # Ended at its run (a worker's end, even before the call began: a
            # deadline passed or a cancel read before the call), or dead-lettered
            # out of deliveries: that dispatch's decision may be yet to come.
            attempt, backend = event.attempt, event.backend
        if not attempt and running is not None:  # ended while its call ran
            attempt, backend, tokens = running.attempt, running.backend, 0
        if attempt <= 0:
            return  # no call of its own: nothing was or will be decided for one
        reservation = self._reserved.get(key)
        if reservation is not None and reservation.attempt > attempt:
            return  # a newer decision is folded: the reservation ends with it
        # Older attempts' decisions not folded yet: each is logged late too (0
        # for a reservation stored before version 13, which counted none).
        if reservation is None:
            older = attempt - 1
        elif reservation.decided:
            folded = reservation.decided - (reservation.attempt == attempt)
            older = max(0, attempt - 1 - folded)
        else:
            older = 0
        self._own("ended")
        if reservation is not None and reservation.attempt == attempt:
            # Its decision is folded: the reservation ends with it, the mark
            # waits only for the older ones.
            if older:
                self._ended[key] = Ended(backend, at, attempt, older=older, decided=True)
                self._splits.ended_after_decision(key, at, attempt, older)
            return
        self._ended[key] = Ended(backend, at, attempt, max(0, tokens), completed, older)
        self._splits.ended_before_decision(event, key, at, attempt, older)

    def _late_route(self, event: Routed, ended: Ended, key: str, at: float) -> None:
        """The decision of a request already over: it spends what it would
        have, had it come first, and reserves nothing."""
        tokens = max(0, event.reserved_tokens)
        if event.attempt != ended.attempt or ended.decided:  # another attempt's decision
            self._spend(event.backend, Cost(requests=1, tokens=tokens), at)
            if event.attempt < ended.attempt and ended.older:
                self._own("ended")
                if ended.older == 1 and ended.decided:
                    del self._ended[key]  # the last decision to come
                else:
                    self._ended[key] = msgspec.structs.replace(ended, older=ended.older - 1)
            return
        self._own("ended")
        if ended.older:  # older decisions still to come
            self._ended[key] = msgspec.structs.replace(ended, decided=True)
        else:
            del self._ended[key]
        if not (ended.completed or ended.tokens) or ended.backend != event.backend:
            # Nothing to reconcile: an end that reconciles none leaves the estimate spent.
            self._spend(event.backend, Cost(requests=1, tokens=tokens), at)
            return
        # Its completion spent the tokens used at its end: as if the decision had
        # come first, the part of them the estimate covered moves to the decision
        # (reconciled: the estimate down to what was used, the excess at the end).
        moved = min(tokens, ended.tokens)
        quota = reconcile(
            self._quota(event.backend), reserved=moved, used=0, reserved_at=ended.at, at=ended.at
        )
        self._set_backend(event.backend, quota=reserve(quota, Cost(requests=1, tokens=moved), at))

    def _route(self, event: Routed, at: float) -> None:
        """A decision reserves one request and its token estimate of the backend's quota."""
        key = msg_id(event.tenant, event.request_id)
        # Whichever way the decision is folded below (even an older attempt's,
        # logged after a newer one's or after the request's end): its call is
        # or is not its backend's probe, as if it had come first.
        self._probe_routed(event, key)
        tokens = max(0, event.reserved_tokens)
        ended = self._ended.get(key)
        if ended is not None:
            self._late_route(event, ended, key, at)
            return
        self._spend(event.backend, Cost(requests=1, tokens=tokens), at)
        current = self._reserved.get(key)
        if current is not None and current.attempt > event.attempt:
            # An older decision logged late: a newer one reserves (and counts it).
            if current.decided:
                self._own("reserved")
                self._reserved[key] = msgspec.structs.replace(current, decided=current.decided + 1)
            return
        # Counted on from the request's previous reservation (not counted: not from one
        # stored before version 13).
        decided = 1 if current is None else current.decided and current.decided + 1
        running = self._in_flight.get(key)
        begun = (
            running is not None
            and running.backend == event.backend
            and running.attempt == event.attempt
        )
        cost = max(0.0, _finite(event.estimated_cost))
        self._release(key)
        self._own("reserved")
        self._reserved[key] = Reservation(
            event.backend,
            at,
            tokens,
            started=begun,
            attempt=event.attempt,
            cost=cost,
            decided=decided,
        )
        if cost:
            self._commit(event.tenant, cost)

    def _complete(self, event: Completed, at: float) -> None:
        self._provider_said(event.backend, event.limits, at, None)
        # Its quota's change goes in with the rest (one replace of the backend).
        quota: dict[str, Quota] = {}
        if event.shared_with is None:  # a coalesced follower made no call of its own
            key = msg_id(event.tenant, event.request_id)
            reservation = self._reserved.get(key)
            used = event.usage.prompt_tokens + event.usage.completion_tokens
            if (
                reservation is not None
                and reservation.backend == event.backend
                and reservation.attempt == event.attempt
            ):
                quota["quota"] = reconcile(
                    self._quota(event.backend),
                    reserved=reservation.tokens,
                    used=used,
                    reserved_at=reservation.at,
                    at=at,
                )
            else:  # as _spend does
                spent = Cost(requests=0, tokens=used)
                quota["quota"] = reserve(self._quota(event.backend), spent, at)
        backend = self._backends.get(event.backend, EMPTY_BACKEND)
        cost = _finite(event.cost)
        self._set_backend(
            event.backend,
            **quota,
            calls_completed=backend.calls_completed + 1,
            consecutive_failures=0,
            outcomes=self._outcome(event.backend, at, fault=False),
            last_completed_at=at,
            tokens_in=backend.tokens_in + event.usage.prompt_tokens,
            tokens_out=backend.tokens_out + event.usage.completion_tokens,
            spend=backend.spend + cost,
            duration_ewma=_ewma(backend.duration_ewma, _finite(event.duration)),
            perf=backend.perf
            if event.shared_with is not None  # a follower's call was its leader's
            else learn_call(
                backend.perf,
                ttft=event.ttft,
                duration=event.duration,
                output_tokens=event.usage.completion_tokens,
            ),
        )
        tenant = self._tenants.get(event.tenant, _EMPTY_TENANT)
        day = utc_day(at)
        self._set_tenant(
            event.tenant,
            spend=tenant.spend + cost,
            day=max(day, tenant.day),
            # A completion stamped before the tenant's latest day (a late
            # event) counts in the total only: that day is over.
            day_spend=cost
            if day > tenant.day
            else tenant.day_spend + (cost if day == tenant.day else 0.0),
        )
        self.spend += cost

    def _sweep(self) -> None:
        self.last_sweep_at = self.log_time
        horizon = self.log_time - STALE_IN_FLIGHT
        stale = [key for key, entry in self._in_flight.items() if entry.since < horizon]
        for key in stale:
            self._end(key)
        self.in_flight_dropped += len(stale)
        for key in [key for key, entry in self._reserved.items() if entry.at < horizon]:
            self._release(key)
        old = [key for key, entry in self._ended.items() if entry.at < horizon]
        if old:
            self._own("ended")
            for key in old:
                del self._ended[key]

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
            reserved=self._reserved,
            in_flight_dropped=self.in_flight_dropped,
            last_sweep_at=self.last_sweep_at,
            mismatched=self.mismatched,
            ended=self._ended,
            splits=self._splits.freeze(),
        )
