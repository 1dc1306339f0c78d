"""The A/B part of the fold: each split's state and what each of its arms did.

Folded from the log like the rest of the projection (:func:`renqueue.state.fold`
calls :class:`SplitsBuilder` for every event the services wrote), in event
time, so a replay rebuilds it exactly:

- a ``routed`` event that names a split (``split``, ``arm``) counts one request
  for that arm and remembers the request's arm and when its wait began (its
  ``at`` less its ``queue_wait``) until it ends; a later decision on another
  arm (put back, then moved by a rollback) moves it there;
- the request's terminal event counts its outcome for that arm: ``completed``
  (its cost, and the seconds from its submission to its completion and to its
  first token), ``failed``, ``expired``; a ``cancelled`` or ``rejected`` one is
  the client's doing and counts nothing. An ``expired`` event that names an
  arm (a request that waited on it and was never routed) counts as a request
  and an expiry of that arm;
- a terminal event folded before the request's decision (the fold's ``Ended``
  mark: a binder logs a decision once its dispatch is stored) is kept
  (``ended``) until that decision comes: one that names an arm then counts the
  request and that outcome, as if it had come first;
- an ``ab`` event (``rq.evt._system.<route>.ab`` only) moves the split's
  state: an operator's always, the binder's automatic rollback only while the
  split is live. Going ``live`` again empties every arm's recent buckets, so
  the resumed split is judged afresh.

Bounded: per split, per arm, one total and at most ``AB_HORIZON / AB_BUCKET``
(20) buckets (:class:`~renqueue.policy.ArmStats`), plus one small entry per request
routed on an arm and not yet ended, dropped at its end, and one per request ended
before its decision (or its older attempts'), dropped at the last to come,
both swept after
:data:`STALE_ASSIGNED` seconds of event time.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec
from msgspec import Struct

from ..policy import SPLIT_MODES, ArmStats, ArmTally, Tally, bin_of
from ..schema import (
    SYSTEM_TENANT,
    Cancelled,
    Completed,
    Event,
    Expired,
    Failed,
    Rejected,
    Routed,
    SplitChanged,
    msg_id,
)
from ._faults import is_backend_fault

__all__ = ["STALE_ASSIGNED", "ArmEnd", "ArmRequest", "SplitState", "Splits", "SplitsBuilder"]

#: A request on an arm with no terminal event for this long (event time) is
#: forgotten (as the fold's in-flight entries are): its outcome is never counted.
STALE_ASSIGNED: Final = 6 * 3600.0
_SWEEP_EVERY: Final = 60.0
#: The terminal event types, as a tuple (``isinstance`` with ``A | B`` builds the union per call).
_ENDED: Final = (Completed, Failed, Expired, Cancelled, Rejected)
#: The longest reason kept.
_REASON_CHARS: Final = 500


class ArmRequest(Struct, frozen=True, array_like=True):
    """A request routed on an arm of a split and not yet ended: the split,
    the arm, and when its wait began (event time)."""

    split: str
    arm: str
    since: float


class ArmEnd(Struct, frozen=True, array_like=True):
    """A request's end folded before its decision: when, and what its arm
    counts if the decision names one (``outcome``: ``completed``, ``failed``,
    ``expired``, or ``""`` for none; a completion's cost, call duration and
    time to first token; whether a failure blamed the backend), or ``counted``: an
    older attempt's decision had put it on an arm, which counted it; ``done``:
    its decision came, only older attempts' are still to come (they count nothing).
    ``attempt`` is the end's (0: not known), ``older`` its older attempts'
    decisions still to come (as the fold's ``Ended`` mark counts them), and
    ``since`` the earliest wait one of them began (0.0: none came)."""

    at: float
    outcome: str
    cost: float = 0.0
    duration: float = 0.0
    ttft: float | None = None
    fault: bool = False
    attempt: int = 0
    older: int = 0
    since: float = 0.0


class SplitState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One split as the log tells it: where its traffic goes (``live``: by
    weight; ``rolled_back``/``promoted``: all of it to ``arm``), since when,
    why and by whom (a router's lease holder, or an operator), and what each
    arm did (:class:`~renqueue.policy.ArmStats`, by arm name)."""

    state: str = "live"
    arm: str = ""
    since: float = 0.0
    reason: str = ""
    by: str = ""
    arms: dict[str, ArmStats] = {}


class Splits(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Every split the log has named (by route), and the requests on an arm
    that have not ended (by ``<tenant>:<request id>``)."""

    routes: dict[str, SplitState] = {}
    requests: dict[str, ArmRequest] = {}
    last_sweep_at: float = 0.0
    #: Requests that ended before their decision was folded, by ``<tenant>:<request id>``.
    ended: dict[str, ArmEnd] = {}


_EMPTY_SPLIT: Final = SplitState()
_EMPTY_ARM: Final = ArmStats()


def _finite(value: float) -> float:
    return value if -math.inf < value < math.inf else 0.0  # no call; nan compares false


class SplitsBuilder:
    """:class:`Splits` being folded: copies each map once, then changes the copy
    (as the fold's own builder does), and adds each arm's figures up in a
    working copy (:class:`~renqueue.policy.ArmTally`) frozen once, at
    :meth:`freeze`; the input is never changed."""

    def __init__(self, splits: Splits) -> None:
        self._routes = splits.routes
        self._requests = splits.requests
        self._last_sweep_at = splits.last_sweep_at
        self._pending = splits.ended
        self._routes_own = False
        self._requests_own = False
        self._pending_own = False
        #: The request whose end the event being folded counted on its arm.
        self._counted = ""
        #: Arms whose figures changed, by (split, arm): frozen into ``_routes`` at freeze.
        self._working: dict[tuple[str, str], ArmTally] = {}

    def apply(self, event: Event, at: float, log_time: float) -> None:
        """Fold one event the services wrote (stamped ``at``; the log's clock is ``log_time``)."""
        self._counted = ""
        if isinstance(event, Routed):
            if (event.split and event.arm) or self._pending:
                self._routed(event, at)
        elif isinstance(event, _ENDED):
            if self._requests or (isinstance(event, Expired) and event.split):
                self._ended(event, at)
        elif isinstance(event, SplitChanged):
            self._changed(event, at)
        if log_time - self._last_sweep_at >= _SWEEP_EVERY:
            self._sweep(log_time)

    def freeze(self) -> Splits:
        self._settle()
        return Splits(
            routes=self._routes,
            requests=self._requests,
            last_sweep_at=self._last_sweep_at,
            ended=self._pending,
        )

    def _settle(self, route: str | None = None) -> None:
        """Freeze the working figures (of ``route``'s arms only, if given) into the splits."""
        done = [key for key in self._working if route is None or key[0] == route]
        by_split: dict[str, dict[str, ArmStats]] = {}
        for split, arm in done:
            by_split.setdefault(split, {})[arm] = self._working.pop((split, arm)).freeze()
        for split, arms in by_split.items():
            current = self._routes.get(split, _EMPTY_SPLIT)
            self._own_routes()[split] = msgspec.structs.replace(
                current, arms={**current.arms, **arms}
            )

    def _own_routes(self) -> dict[str, SplitState]:
        if not self._routes_own:
            self._routes, self._routes_own = dict(self._routes), True
        return self._routes

    def _own_requests(self) -> dict[str, ArmRequest]:
        if not self._requests_own:
            self._requests, self._requests_own = dict(self._requests), True
        return self._requests

    def _own_pending(self) -> dict[str, ArmEnd]:
        if not self._pending_own:
            self._pending, self._pending_own = dict(self._pending), True
        return self._pending

    def ended_before_decision(
        self,
        event: Completed | Failed | Expired | Cancelled | Rejected,
        key: str,
        at: float,
        attempt: int,
        older: int,
    ) -> None:
        """The fold marked ``event`` (the end of request ``key`` at ``attempt``) as
        come before its decision, with ``older`` older attempts' decisions to
        come too: kept for that decision, which may name an arm, and for them."""
        if key in self._requests:
            return  # on an arm: its end is counted there
        if key == self._counted:  # counted on the arm an older decision named
            end = ArmEnd(at, "counted")
        elif isinstance(event, Completed):
            end = (
                ArmEnd(at, "")  # a coalesced follower: its leader's call is counted
                if event.shared_with is not None
                else ArmEnd(at, "completed", _finite(event.cost), event.duration, event.ttft)
            )
        elif isinstance(event, Failed):
            end = ArmEnd(at, "failed", fault=is_backend_fault(event.error_type, event.error_class))
        elif isinstance(event, Expired):
            end = ArmEnd(at, "expired")
        else:
            end = ArmEnd(at, "")
        self._own_pending()[key] = msgspec.structs.replace(end, attempt=attempt, older=older)

    def ended_after_decision(self, key: str, at: float, attempt: int, older: int) -> None:
        """The fold marked request ``key``'s end (at ``attempt``, its decision
        folded) as waiting for ``older`` older attempts' decisions: if its arm
        counted the end, they count nothing more there."""
        if key == self._counted:
            self._own_pending()[key] = ArmEnd(at, "done", attempt=attempt, older=older)

    def _count(self, split: str, arm: str, at: float, delta: Tally) -> None:
        working = self._working.get((split, arm))
        if working is None:
            current = self._routes.get(split, _EMPTY_SPLIT).arms.get(arm, _EMPTY_ARM)
            working = self._working[(split, arm)] = ArmTally(current)
        working.add(at, delta)

    def _routed(self, event: Routed, at: float) -> None:
        key = msg_id(event.tenant, event.request_id)
        end = self._pending.get(key)
        if end is not None:  # a decision of a request already over
            since = at - max(0.0, _finite(event.queue_wait))
            if end.since:
                since = min(since, end.since)
            if end.outcome == "done" or (end.attempt and event.attempt != end.attempt):
                # Another attempt's decision (as the fold's ``_late_route``): it
                # counts nothing; an older one is one fewer to come.
                if event.attempt < end.attempt and end.older:
                    if end.older == 1 and end.outcome == "done":
                        del self._own_pending()[key]
                    else:
                        self._own_pending()[key] = msgspec.structs.replace(
                            end, older=end.older - 1, since=since
                        )
                return
            if end.older:  # its own decision: the older ones still to come count nothing
                self._own_pending()[key] = ArmEnd(
                    end.at, "done", attempt=end.attempt, older=end.older
                )
            else:
                del self._own_pending()[key]
            if event.split and event.arm and end.outcome != "counted":
                self._count(event.split, event.arm, at, Tally(requests=1))
                delta = _outcome(end, since)
                if delta is not None:
                    self._count(event.split, event.arm, end.at, delta)
            return
        if not (event.split and event.arm):
            return
        entry = self._requests.get(key)
        if entry is not None and (entry.split, entry.arm) == (event.split, event.arm):
            return  # another attempt on the same arm: the same request
        since = entry.since if entry is not None else at - max(0.0, _finite(event.queue_wait))
        self._own_requests()[key] = ArmRequest(event.split, event.arm, since)
        self._count(event.split, event.arm, at, Tally(requests=1))

    def _ended(self, event: Completed | Failed | Expired | Cancelled | Rejected, at: float) -> None:
        key = msg_id(event.tenant, event.request_id)
        entry = self._requests.get(key)
        if entry is not None:
            del self._own_requests()[key]
            self._counted = key
            requests = 0
        elif isinstance(event, Expired) and event.split and event.arm:
            entry, requests = ArmRequest(event.split, event.arm, at), 1
        else:
            return
        if isinstance(event, Completed):
            if event.shared_with is not None:
                return  # a coalesced follower: its leader's call is counted
            latency = max(0.0, at - entry.since)
            delta = Tally(
                requests=requests,
                completed=1,
                cost=_finite(event.cost),
                latency=((bin_of(latency), 1),),
                ttft=()
                if event.ttft is None
                else ((bin_of(_first_token(latency, event.duration, event.ttft)), 1),),
            )
        elif isinstance(event, Failed):
            # Only a failure the backend is to blame for counts against the
            # arm: a request's own (bad request, context too long, content
            # filter) would let one tenant roll a split back for everyone.
            fault = is_backend_fault(event.error_type, event.error_class)
            delta = Tally(requests=requests, failed=1 if fault else 0)
        elif isinstance(event, Expired):
            delta = Tally(requests=requests, expired=1)
        else:
            return  # cancelled or rejected: the client's doing
        self._count(entry.split, entry.arm, at, delta)

    def _changed(self, event: SplitChanged, at: float) -> None:
        """An ``ab`` event: only the services' (tenant ``_system``), about its own route."""
        if (
            event.tenant != SYSTEM_TENANT
            or event.request_id != event.route
            or event.state not in SPLIT_MODES
            or (event.state != "live" and not event.arm)
        ):
            return
        self._settle(event.route)
        current = self._routes.get(event.route, _EMPTY_SPLIT)
        if not event.operator and current.state != "live":
            return  # the binder's rollback of a split an operator moved meanwhile
        arms = current.arms
        if event.state == "live":  # judged afresh from here
            arms = {name: ArmStats(total=stats.total) for name, stats in arms.items()}
        self._own_routes()[event.route] = msgspec.structs.replace(
            current,
            state=event.state,
            arm="" if event.state == "live" else event.arm,
            since=at,
            reason=event.reason[:_REASON_CHARS],
            by=(event.operator or event.router)[:_REASON_CHARS],
            arms=arms,
        )

    def _sweep(self, log_time: float) -> None:
        self._last_sweep_at = log_time
        horizon = log_time - STALE_ASSIGNED
        stale = [key for key, entry in self._requests.items() if entry.since < horizon]
        if stale:
            requests = self._own_requests()
            for key in stale:
                del requests[key]
        old = [key for key, end in self._pending.items() if end.at < horizon]
        if old:
            pending = self._own_pending()
            for key in old:
                del pending[key]


def _outcome(end: ArmEnd, since: float) -> Tally | None:
    """What an arm counts for ``end`` (a request whose wait began at ``since``), as
    :meth:`SplitsBuilder._ended` counts an end that came after its decision."""
    if end.outcome == "completed":
        latency = max(0.0, end.at - since)
        return Tally(
            completed=1,
            cost=end.cost,
            latency=((bin_of(latency), 1),),
            ttft=()
            if end.ttft is None
            else ((bin_of(_first_token(latency, end.duration, end.ttft)), 1),),
        )
    if end.outcome == "failed":
        return Tally(failed=1 if end.fault else 0)
    if end.outcome == "expired":
        return Tally(expired=1)
    return None


def _first_token(latency: float, duration: float, ttft: float) -> float:
    """Seconds from submission to the first token: the completing call began
    ``duration`` before the end, and its first token came ``ttft`` into it."""
    return max(0.0, latency - max(0.0, _finite(duration)) + max(0.0, _finite(ttft)))
