"""A recorded workload, as the event log tells it: what a what-if replays.

:func:`trace_of` turns the events of a stretch of the log into a
:class:`Trace`:

- the **arrivals**: every request first submitted in ``[since, until)``
  (its ``submitted`` event: the full request, stamped with the server time it
  was stored), each with what really became of it (:class:`Recorded`: how and
  when it ended, on which backend, at what cost, its real token counts), when
  a cancellation ended it, and the failures that were its own doing on a
  backend (a context too long, a bad request, a content filter);
- the **calls** every backend completed (:class:`CallRecord`: time to first
  token, the time after it, output tokens, and the time from the routing
  decision to the call's start), the **failures** of their calls
  (:class:`FailureRecord`), and how long a freed slot took to be taken by a
  request already waiting for it (:class:`Release`: the router noticing the
  end, its next round): what backend models are fitted from (:mod:`._models`);
- the **prior** state: the projection folded (:func:`renqueue.state.fold_many`,
  the live fold) from the events of the warm-up before ``since``
  (:data:`WARMUP`), so that the simulation starts with the speed model, the
  quota spend and the tenants' spend the router had then; and the calls
  **busy** at ``since``, with when they really ended.

Events are taken as they are: the reader (:mod:`._log`) has already dropped
what does not decode or disagrees with its subject. Values no call could have
(times not finite or negative, token counts past any model's) are left out
of the fit, never trusted.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec
from msgspec import Struct

from ..errors import FailureClass
from ..schema import (
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    FellBack,
    InferenceRequest,
    Preempted,
    Rejected,
    Retrying,
    Routed,
    Started,
    Submitted,
    facts,
    is_terminal,
    kind_of,
    msg_id,
)
from ..state import ProjectionState, fold_many

__all__ = [
    "UNFINISHED",
    "WARMUP",
    "Arrival",
    "Busy",
    "CallRecord",
    "FailureRecord",
    "Recorded",
    "Release",
    "Trace",
    "trace_of",
]

#: Seconds of log before ``since`` folded into the simulation's starting state.
WARMUP: Final = 3600.0
#: The kind of a request that had not ended when the log (or a simulation) did.
UNFINISHED: Final = "unfinished"
#: Failure classes that are the request's doing, not the backend's: replayed
#: for the same request on the same backend, never drawn for others.
OWN_FAULTS: Final = frozenset(
    {FailureClass.BAD_REQUEST, FailureClass.CONTEXT_LENGTH, FailureClass.CONTENT_FILTER}
)
#: No call is longer than this (seconds), nor any output longer (tokens):
#: values past them are forged or broken, and left out of the fit.
_LONGEST_CALL: Final = 86_400.0
_MOST_TOKENS: Final = 1_000_000


class Recorded(Struct, frozen=True, kw_only=True):
    """What really became of a request: its terminal event's kind (or
    :data:`UNFINISHED`), when, and for a completion, where, at what cost and
    with what token counts; ``leader``: the request whose call it shared."""

    kind: str = UNFINISHED
    at: float | None = None
    backend: str | None = None
    cost: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    leader: str | None = None


class FailureRecord(Struct, frozen=True, kw_only=True):
    """One failed run of a backend's, as its event recorded it."""

    backend: str
    error_type: str
    #: When its run started (or, not known, when it failed).
    at: float = 0.0
    #: Its :class:`~renqueue.errors.FailureClass` value (empty in old events).
    error_class: str = ""
    #: Seconds from the run's start to the failure (0 when the start is not known).
    after: float = 0.0
    #: The provider's ``retry-after`` (seconds; 0: none given).
    retry_after: float = 0.0
    #: The provider's quota was spent, for this many seconds from the failure.
    exhausted_for: float | None = None


class Arrival(Struct, frozen=True, kw_only=True):
    """A request as it arrived, and what really became of it."""

    #: Server time it was stored (its ``submitted`` event's ``at``).
    at: float
    request: InferenceRequest
    recorded: Recorded = Recorded()
    #: When a cancellation ended it (its ``cancelled`` event), if one did.
    cancelled_at: float | None = None
    #: Failures of its own doing (:data:`OWN_FAULTS`), by the backend that answered them.
    refused: dict[str, FailureRecord] = {}
    #: When a router first read it (its ``submitted`` event's store time);
    #: ``None``: not known.
    read_at: float | None = None

    @property
    def key(self) -> str:
        return msg_id(self.request.tenant, self.request.id)


class CallRecord(Struct, frozen=True, kw_only=True):
    """One completed call of a backend's: what a drawn call is made of."""

    backend: str
    #: When it started (its end less its duration).
    at: float = 0.0
    #: Seconds to the first token (the whole call when it was not streamed).
    ttft: float
    #: Seconds after the first token.
    generating: float
    #: Output tokens.
    tokens: int
    #: Seconds from its routing decision to its start (dispatch, a worker
    #: taking it): ``None`` when not known (a retried run, no decision seen).
    overhead: float | None = None


class Release(Struct, frozen=True, kw_only=True):
    """A slot of ``backend`` freed by a call's end and taken ``after`` seconds
    later by a request that was already waiting; ``busy``: the calls bound to
    the backend just before it freed (it was full if that is its slots)."""

    backend: str
    after: float
    busy: int
    #: When the slot freed.
    at: float = 0.0


class Busy(Struct, frozen=True, kw_only=True):
    """A call running on ``backend`` at the trace's start, until it really left
    it (``None``: not before the log ends)."""

    backend: str
    until: float | None


class Trace(Struct, frozen=True, kw_only=True):
    """A stretch of the log, as :func:`trace_of` reads it (module docstring)."""

    since: float
    until: float
    arrivals: tuple[Arrival, ...] = ()
    calls: tuple[CallRecord, ...] = ()
    failures: tuple[FailureRecord, ...] = ()
    releases: tuple[Release, ...] = ()
    prior: ProjectionState = ProjectionState()
    busy: tuple[Busy, ...] = ()
    #: Events read (warm-up included), and those the reader dropped
    #: (undecodable, disagreeing with their subject, or with a time that is no time).
    events: int = 0
    dropped: int = 0


def _time(value: float | None) -> float | None:
    """A duration a call could have taken, else ``None``."""
    if value is None or not math.isfinite(value) or not 0 <= value <= _LONGEST_CALL:
        return None
    return value


class _Reader:
    """One pass over the events, in log order (see :func:`trace_of`)."""

    def __init__(self, since: float, until: float) -> None:
        self.since = since
        self.until = until
        self.submitted: dict[str, tuple[float, InferenceRequest]] = {}
        self.recorded: dict[str, Recorded] = {}
        self.leaders: dict[str, str] = {}
        self.cancelled: dict[str, float] = {}
        self.refused: dict[str, dict[str, FailureRecord]] = {}
        #: (request key, attempt) -> (decided at, backend).
        self.routed: dict[tuple[str, int], tuple[float, str]] = {}
        #: Attempts that had a failed run (their completion's overhead is unknown).
        self.retried: set[tuple[str, int]] = set()
        #: request key -> (backend, started at) of its latest run.
        self.started: dict[str, tuple[str, float]] = {}
        #: request key -> when it first left its backend at or after ``since``.
        self.left: dict[str, float] = {}
        self.calls: list[CallRecord] = []
        self.failures: list[FailureRecord] = []
        #: request key -> the backend it is bound to now; calls bound per backend;
        #: per backend, the slots freed (when, calls bound just before) not taken yet.
        self.bound: dict[str, str] = {}
        self.busy: dict[str, int] = {}
        self.freed: dict[str, collections.deque[tuple[float, int]]] = {}
        self.releases: list[Release] = []

    def read(self, event: Event) -> None:
        key = msg_id(event.tenant, event.request_id)
        at = event.at
        if (
            is_terminal(event)
            or isinstance(event, FellBack | Preempted)
            or (isinstance(event, Retrying) and event.requeued)
        ):
            self._leave(key, at)
        if isinstance(event, Submitted):
            if self.since <= at < self.until and event.request.requeues == 0:
                self.submitted.setdefault(key, (at, event.request))
        elif isinstance(event, Routed):
            self._bind(key, event)
        elif isinstance(event, Started):
            self.started[key] = (event.backend, at)
        elif isinstance(event, Completed):
            self._completed(key, event)
        elif isinstance(event, Retrying | FellBack | Failed):
            self._failed(key, event)
        elif isinstance(event, Coalesced):
            # The last join stands: a follower put back (its leader ended on
            # its own) may join another, whose call it then shares.
            self.leaders[key] = event.leader
        if is_terminal(event) and key not in self.recorded:
            self.recorded[key] = self._outcome(event)
            if isinstance(event, Cancelled):
                self.cancelled[key] = at

    def _leave(self, key: str, at: float) -> None:
        """Request ``key`` left the backend it was bound to: a slot frees there."""
        if at >= self.since:
            self.left.setdefault(key, at)
        backend = self.bound.pop(key, None)
        if backend is None:
            return
        busy = self.busy.get(backend, 0)
        self.busy[backend] = max(0, busy - 1)
        self.freed.setdefault(backend, collections.deque()).append((at, busy))

    def _bind(self, key: str, event: Routed) -> None:
        """A decision: it takes a slot, perhaps one freed while it waited."""
        backend, at = event.backend, event.at
        self.routed[(key, event.attempt)] = (at, backend)
        wait = event.queue_wait if math.isfinite(event.queue_wait) else 0.0
        freed = self.freed.get(backend)
        while freed and freed[0][0] < at - max(0.0, wait):
            freed.popleft()  # freed before it began to wait: not a slot it waited for
        if freed:
            when, busy = freed.popleft()
            after = _time(at - when)
            if after is not None:
                self.releases.append(Release(backend=backend, after=after, busy=busy, at=when))
        if self.bound.get(key) is not None:
            self._leave(key, at)
        self.bound[key] = backend
        self.busy[backend] = self.busy.get(backend, 0) + 1

    def _outcome(self, event: Event) -> Recorded:
        if isinstance(event, Completed):
            return Recorded(
                kind="completed",
                at=event.at,
                backend=event.backend,
                cost=event.cost if math.isfinite(event.cost) and event.cost >= 0 else 0.0,
                prompt_tokens=min(event.usage.prompt_tokens, _MOST_TOKENS),
                output_tokens=min(event.usage.completion_tokens, _MOST_TOKENS),
            )
        if isinstance(event, Failed | Expired | Cancelled | Rejected):
            backend = event.backend if isinstance(event, Failed) else None
            return Recorded(kind=kind_of(event), at=event.at, backend=backend)
        return Recorded()

    def _completed(self, key: str, event: Completed) -> None:
        if event.shared_with is not None:
            return  # a coalesced follower's call was its leader's
        duration = _time(event.duration)
        ttft = _time(event.ttft) if event.ttft is not None else duration
        tokens = event.usage.completion_tokens
        if duration is None or ttft is None or ttft > duration or tokens > _MOST_TOKENS:
            return
        overhead = None
        decided = self.routed.get((key, event.attempt))
        if (
            decided is not None
            and decided[1] == event.backend
            and ((key, event.attempt) not in self.retried)
        ):
            overhead = _time(event.at - decided[0] - duration)
        self.calls.append(
            CallRecord(
                backend=event.backend,
                at=event.at - duration,
                ttft=ttft,
                generating=duration - ttft,
                tokens=tokens,
                overhead=overhead,
            )
        )

    def _failed(self, key: str, event: Retrying | FellBack | Failed) -> None:
        if isinstance(event, Retrying | FellBack):
            self.retried.add((key, event.attempt))
        backend = event.backend
        if backend is None:
            return  # not a call's failure (undeliverable, a requeue refused)
        run = self.started.get(key)
        after = _time(event.at - run[1]) if run is not None and run[0] == backend else None
        exhausted: float | None = None
        if isinstance(event, Retrying | Failed) and event.quota_exhausted_until is not None:
            exhausted = _time(event.quota_exhausted_until - event.at)
        elif isinstance(event, Retrying) and event.requeued:
            exhausted = _time(event.retry_after)
        retry_after = _time(event.retry_after) if isinstance(event, Retrying | FellBack) else None
        record = FailureRecord(
            backend=backend,
            error_type=event.error_type[:64],
            at=event.at - (after or 0.0),
            error_class=event.error_class[:64],
            after=after or 0.0,
            retry_after=retry_after or 0.0,
            exhausted_for=exhausted,
        )
        if record.error_class in OWN_FAULTS:
            self.refused.setdefault(key, {}).setdefault(backend, record)
        else:
            self.failures.append(record)

    def _recorded(self, key: str) -> Recorded:
        recorded = self.recorded.get(key, Recorded())
        leader = self.leaders.get(key)
        return recorded if leader is None else msgspec.structs.replace(recorded, leader=leader)

    def arrivals(self) -> tuple[Arrival, ...]:
        arrivals = [
            Arrival(
                at=at,
                request=request,
                recorded=self._recorded(key),
                cancelled_at=self.cancelled.get(key),
                refused=self.refused.get(key, {}),
            )
            for key, (at, request) in self.submitted.items()
        ]
        arrivals.sort(key=lambda arrival: arrival.at)  # stable: log order on a tie
        return tuple(arrivals)


def _read(arrivals: tuple[Arrival, ...], read_at: Mapping[str, float]) -> tuple[Arrival, ...]:
    """``arrivals`` with when a router read each, where that is a delay it could have had."""

    def read(arrival: Arrival) -> Arrival:
        at = read_at.get(arrival.key)
        if at is None or _time(at - arrival.at) is None:
            return arrival
        return msgspec.structs.replace(arrival, read_at=at)

    return tuple(read(arrival) for arrival in arrivals)


def trace_of(
    events: Iterable[Event],
    *,
    since: float,
    until: float,
    dropped: int = 0,
    read_at: Mapping[str, float] | None = None,
) -> Trace:
    """The :class:`Trace` of ``events`` (in log order, the warm-up before
    ``since`` included) for the requests submitted in ``[since, until)``.

    ``dropped``: messages the reader left out, reported with the trace.
    ``read_at``: when a router first read each request (by ``<tenant>:<id>``),
    kept where it is a time after its arrival and within a day of it.
    """
    warm: list[Event] = []
    reader = _Reader(since, until)
    count = 0
    for event in (fact for stored in events for fact in facts(stored)):
        if not math.isfinite(event.at):
            dropped += 1
            continue
        count += 1
        if event.at < since:
            warm.append(event)
        reader.read(event)
    prior = fold_many(ProjectionState(), warm)
    busy = tuple(
        Busy(backend=running.backend, until=reader.left.get(key))
        for key, running in prior.in_flight.items()
    )
    return Trace(
        since=since,
        until=until,
        arrivals=_read(reader.arrivals(), read_at or {}),
        calls=tuple(reader.calls),
        failures=tuple(reader.failures),
        releases=tuple(reader.releases),
        prior=prior,
        busy=busy,
        events=count,
        dropped=dropped,
    )
