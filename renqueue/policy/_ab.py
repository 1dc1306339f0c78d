"""A/B splits: which arm a request goes to, what each arm did, and when to roll back.

A route with an ``[routes.<name>.ab]`` section splits its traffic by weight
between *arms*, each the name of a route (its backends, cascade, fallback and
complexity rules), the split route itself among them if it names itself. Its
*control* arm is where all of its traffic goes when it is rolled back.

Assignment (:func:`assign`) is a stable hash, never Python's randomised
``hash``: ``(route, tenant, salt, key value)`` -> a point in [0, 1), laid
against the arms' cumulative weights in config order. The key value is the
tenant (``key = "tenant"``) or a field of the request's ``metadata``
(``key = "metadata.user"``); a request without that field falls back to its
own id, and so is not sticky. The tenant is always hashed in, so a user id
lands independently in each tenant: one tenant choosing user ids cannot
learn or steer where another tenant's users go. The same key keeps its arm as
long as the arms and weights stay the same; raising the last arm's weight
only moves keys into it.

What each arm did is a :class:`ArmStats`: one :class:`Tally` since the split
began and one per :data:`AB_BUCKET` seconds of event time over the last
:data:`AB_HORIZON` seconds (a histogram, not the samples, of each latency,
so the state stays small). Percentiles are read from the histogram
(:func:`percentile`): its bins are a quarter of a doubling wide, so a
percentile is within 9 % (a factor 2^(1/8)) of the value it estimates.

The rollback rule (:func:`breach`, over every arm but the control:
:func:`judge`) is applied by the binder, the one router that binds, every
second: an arm breaches when, over the last ``window`` seconds, at least
``min_requests`` of its calls ended (completed or failed) and their error rate
(``failed``: failures the backend is to blame for, never a request's own: a
bad request, a context too long, a content filter; over completed and
failed) is at least ``error_rate``, or at
least ``min_requests`` completed and their p95 latency or time to first token
is above its threshold. Latencies are what the client saw: from the request's
submission to its completion, and to its first token.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Final, Literal, Protocol

import msgspec
from msgspec import Meta, Struct

from ..schema import InferenceRequest

__all__ = [
    "AB_BUCKET",
    "AB_HORIZON",
    "HIST_BINS",
    "SPLIT_MODES",
    "ArmStats",
    "ArmTally",
    "Histogram",
    "RollbackRules",
    "SplitFacts",
    "SplitMode",
    "SplitPolicy",
    "SplitStatus",
    "Tally",
    "assign",
    "bin_of",
    "bin_value",
    "breach",
    "hash_point",
    "judge",
    "key_value",
    "moved_to",
    "percentile",
    "pick",
    "place",
    "record",
    "tally",
    "windowed",
]

#: Seconds of event time per bucket of :attr:`ArmStats.recent` (the shortest
#: rollback ``window``; 20 buckets over the horizon keep a split's view small).
AB_BUCKET: Final = 30
#: Seconds of buckets kept (the longest rollback ``window`` a config may set).
AB_HORIZON: Final = 600

#: Latency histogram: bin 0 holds values below :data:`_HIST_FLOOR` seconds;
#: bin ``b >= 1`` holds ``[floor * 2**((b-1)/4), floor * 2**(b/4))``; the last
#: bin also holds everything above (from about 2.4 hours).
_HIST_FLOOR: Final = 0.01
_STEPS_PER_DOUBLING: Final = 4
HIST_BINS: Final = 81

#: A split's state: all arms by weight, all traffic back to the control, or all
#: traffic to one arm an operator promoted.
SplitMode = Literal["live", "rolled_back", "promoted"]
#: The states, as logged in ``ab`` events.
SPLIT_MODES: Final = ("live", "rolled_back", "promoted")

#: A sparse histogram: ``(bin, count)`` pairs, by bin, counts above 0. Bounded
#: so that a damaged or forged view fails to decode (logged and ignored)
#: rather than reaching a percentile.
Histogram = tuple[
    tuple[Annotated[int, Meta(ge=0, le=HIST_BINS - 1)], Annotated[int, Meta(ge=0)]], ...
]


class RollbackRules(Struct, frozen=True, kw_only=True):
    """When an arm is rolled back (``[routes.<name>.ab.rollback]``); ``None``: not judged."""

    error_rate: float | None = None
    p95_latency: float | None = None
    p95_ttft: float | None = None
    min_requests: int = 20
    window: float = 300.0


class SplitPolicy(Struct, frozen=True, kw_only=True):
    """One route's A/B split, as the binder applies it (from ``[routes.<name>.ab]``)."""

    route: str
    #: ``(arm, weight)`` in config order; each arm is a route's name.
    arms: tuple[tuple[str, float], ...]
    control: str
    key: str = "tenant"
    salt: str = ""
    rollback: RollbackRules | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.arms)


class SplitFacts(Protocol):
    """Where a split's traffic goes as last logged (``ab`` events, folded:
    :class:`renqueue.state.SplitState` has it): ``live`` (by weight), or all
    of it to ``arm`` (``rolled_back``: the control; ``promoted``)."""

    @property
    def state(self) -> str: ...

    @property
    def arm(self) -> str: ...


class SplitStatus(Struct, frozen=True, kw_only=True):
    """A split's state and since when: :class:`SplitFacts` as one binder decided it."""

    state: SplitMode = "live"
    arm: str = ""
    since: float = 0.0


class Tally(Struct, frozen=True, array_like=True):
    """What an arm's requests did, over some stretch of event time.

    ``requests``: routed to the arm (or expired waiting on it); ``completed``,
    ``failed``, ``expired``: ended so; ``cost``: US dollars of its completed
    calls; ``latency`` and ``ttft``: histograms (:func:`bin_of`) of the seconds
    from submission to completion and to the first token, of completed requests.
    """

    requests: Annotated[int, Meta(ge=0)] = 0
    completed: Annotated[int, Meta(ge=0)] = 0
    failed: Annotated[int, Meta(ge=0)] = 0
    expired: Annotated[int, Meta(ge=0)] = 0
    cost: Annotated[float, Meta(ge=0)] = 0.0
    latency: Histogram = ()
    ttft: Histogram = ()

    @property
    def ended(self) -> int:
        """Requests that completed, failed or expired."""
        return self.completed + self.failed + self.expired

    @property
    def errors(self) -> int:
        return self.failed + self.expired


class ArmStats(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One arm's :class:`Tally` since the split began (``total``), and per
    :data:`AB_BUCKET` seconds over the last :data:`AB_HORIZON` (``recent``:
    ``(bucket start, tally)``, oldest first; emptied when the split goes live
    again, so a resumed split is judged afresh)."""

    total: Tally = Tally()
    recent: tuple[tuple[int, Tally], ...] = ()


_EMPTY: Final = Tally()


# ----------------------------------------------------------------- assignment


def key_value(request: InferenceRequest, key: str) -> str:
    """The value ``request`` is kept on its arm by: its tenant (``"tenant"``) or
    a ``metadata`` field (``"metadata.<field>"``); without that field, its own
    id (then it is not sticky)."""
    if key == "tenant":
        return request.tenant
    field = key.removeprefix("metadata.")
    value = request.metadata.get(field) if key.startswith("metadata.") else None
    return request.id if value is None else value


def hash_point(route: str, tenant: str, salt: str, value: str) -> float:
    """A stable point in [0, 1) for ``value`` in ``tenant`` on ``route``'s split.

    blake2b of an unambiguous encoding (a JSON array), the same on every
    process and every run, unlike Python's ``hash``.
    """
    data = msgspec.json.encode([route, tenant, salt, value])
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def pick(arms: Sequence[tuple[str, float]], point: float) -> str:
    """The arm whose share of [0, 1) (cumulative weights, in order) holds ``point``.

    Weights need not sum to 1; an arm of weight 0 never gets traffic. ``arms``
    must hold a weight above 0 (the config checks it).
    """
    total = sum(weight for _, weight in arms if weight > 0)
    reached = 0.0
    chosen = ""
    for name, weight in arms:
        if weight <= 0:
            continue
        reached += weight / total
        chosen = name
        if point < reached:
            return name
    return chosen  # rounding left the very top of [0, 1) uncovered


def assign(split: SplitPolicy, request: InferenceRequest) -> str:
    """The arm ``request`` belongs to while the split is live (see the module docstring)."""
    value = key_value(request, split.key)
    return pick(split.arms, hash_point(split.route, request.tenant, split.salt, value))


def moved_to(split: SplitPolicy, status: SplitFacts | None) -> str | None:
    """The arm all of the split's traffic goes to, or ``None`` while it is live.

    A logged rollback or promotion naming an arm the split no longer has (the
    config changed since) sends it to the control: a config change never
    resumes a split by itself (an operator does: ``renqueue ab resume``).
    """
    if status is None or status.state == "live":
        return None
    return status.arm if status.arm in split.names else split.control


def place(
    split: SplitPolicy,
    status: SplitFacts | None,
    request: InferenceRequest,
    serves: Callable[[str], bool],
    *,
    current: str | None = None,
) -> str | None:
    """The arm (a route) ``request`` goes to, or ``None``: it stays on the split
    route itself, outside the experiment.

    Where the split's traffic was moved (:func:`moved_to`), else ``current``
    (the arm a request put back to routing already had: it keeps it), else
    its own arm (:func:`assign`). An arm that cannot serve it (``serves``:
    its route is gone, or no backend of it meets the request's
    ``complexity`` or ``max_cost``) gives it to the control; a control that
    cannot either leaves it on the route it named, which admission found can.
    """
    arm = moved_to(split, status) or current or assign(split, request)
    if serves(arm):
        return arm
    return split.control if serves(split.control) else None


def on_arm(
    splits: Mapping[str, SplitPolicy],
    status: Callable[[str], SplitFacts | None],
    request: InferenceRequest,
    serves: Callable[[str], bool],
) -> InferenceRequest:
    """``request`` on the arm it goes to now (:func:`place`): ``route`` the
    arm's, ``split`` the route it named. The same request when its route has
    no split in ``splits`` (or one no longer there), or it is on that arm
    already; on the route it named (``split`` ``None``) when no arm can
    serve it. ``status``: where each split (by route) sends its traffic now.

    A request put back to routing on an arm keeps it, unless its split was
    moved since.
    """
    name = request.split if request.split is not None else request.route
    split = splits.get(name)
    if split is None:
        return request
    current = request.route if request.split is not None else None
    arm = place(
        split, status(name), request, serves, current=current if current in split.names else None
    )
    if arm is None:
        return msgspec.structs.replace(request, route=name, split=None)
    if request.split == name and request.route == arm:
        return request
    return msgspec.structs.replace(request, route=arm, split=name)


# ---------------------------------------------------------------- histograms


def bin_of(seconds: float) -> int:
    """The histogram bin of ``seconds`` (see :data:`HIST_BINS`)."""
    if not seconds >= _HIST_FLOOR:  # also NaN
        return 0
    if math.isinf(seconds):
        return HIST_BINS - 1
    step = math.floor(math.log2(seconds / _HIST_FLOOR) * _STEPS_PER_DOUBLING)
    return min(HIST_BINS - 1, 1 + step)


def bin_value(index: int) -> float:
    """What bin ``index`` stands for: its geometric middle (the last: its lower edge)."""
    if index <= 0:
        return _HIST_FLOOR / 2
    index = min(index, HIST_BINS - 1)  # a damaged view's bin is read as the last
    low: float = _HIST_FLOOR * math.pow(2.0, (index - 1) / _STEPS_PER_DOUBLING)
    if index >= HIST_BINS - 1:
        return low
    return low * math.pow(2.0, 0.5 / _STEPS_PER_DOUBLING)


def percentile(histogram: Histogram, q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``histogram``; ``None`` if empty."""
    count = sum(n for _, n in histogram)
    if count == 0:
        return None
    rank = max(1, math.ceil(q / 100 * count))
    seen = 0
    for index, n in histogram:
        seen += n
        if seen >= rank:
            return bin_value(index)
    return bin_value(histogram[-1][0])


def _merged(histograms: Iterable[Histogram]) -> Histogram:
    counts: dict[int, int] = {}
    for histogram in histograms:
        for index, n in histogram:
            counts[index] = counts.get(index, 0) + n
    return tuple(sorted((index, n) for index, n in counts.items() if n > 0))


def tally(tallies: Iterable[Tally]) -> Tally:
    """The sum of ``tallies``."""
    items = list(tallies)
    if len(items) == 1:
        return items[0]
    return Tally(
        requests=sum(t.requests for t in items),
        completed=sum(t.completed for t in items),
        failed=sum(t.failed for t in items),
        expired=sum(t.expired for t in items),
        cost=sum(t.cost for t in items),
        latency=_merged(t.latency for t in items),
        ttft=_merged(t.ttft for t in items),
    )


class _Sums:
    """A :class:`Tally` being added to."""

    __slots__ = ("completed", "cost", "expired", "failed", "latency", "requests", "ttft")

    def __init__(self, start: Tally = _EMPTY) -> None:
        self.requests = start.requests
        self.completed = start.completed
        self.failed = start.failed
        self.expired = start.expired
        self.cost = start.cost
        self.latency = dict(start.latency)
        self.ttft = dict(start.ttft)

    def add(self, delta: Tally) -> None:
        self.requests += delta.requests
        self.completed += delta.completed
        self.failed += delta.failed
        self.expired += delta.expired
        self.cost += delta.cost
        for index, n in delta.latency:
            self.latency[index] = self.latency.get(index, 0) + n
        for index, n in delta.ttft:
            self.ttft[index] = self.ttft.get(index, 0) + n

    def freeze(self) -> Tally:
        return Tally(
            requests=self.requests,
            completed=self.completed,
            failed=self.failed,
            expired=self.expired,
            cost=self.cost,
            latency=tuple(sorted((i, n) for i, n in self.latency.items() if n > 0)),
            ttft=tuple(sorted((i, n) for i, n in self.ttft.items() if n > 0)),
        )


class ArmTally:
    """An arm's :class:`ArmStats` being added to, event after event, without a
    copy per event (the fold's working copy within a batch): :meth:`add` is
    :func:`record`, :meth:`freeze` the :class:`ArmStats` it adds up to."""

    __slots__ = ("_newest", "_recent", "_total")

    def __init__(self, stats: ArmStats) -> None:
        self._total = _Sums(stats.total)
        self._recent = {start: _Sums(seen) for start, seen in stats.recent}
        self._newest: int | None = stats.recent[-1][0] if stats.recent else None

    def add(self, at: float, delta: Tally) -> None:
        """Add ``delta``, what happened at event time ``at`` (see :func:`record`)."""
        self._total.add(delta)
        start = int(at // AB_BUCKET) * AB_BUCKET if math.isfinite(at) else 0
        newest = start if self._newest is None else max(self._newest, start)
        self._newest = newest
        if start > newest - AB_HORIZON:
            sums = self._recent.get(start)
            if sums is None:
                sums = self._recent[start] = _Sums()
            sums.add(delta)

    def freeze(self) -> ArmStats:
        newest = self._newest
        recent: tuple[tuple[int, Tally], ...] = ()
        if newest is not None:
            recent = tuple(
                (start, sums.freeze())
                for start, sums in sorted(self._recent.items())
                if start > newest - AB_HORIZON
            )
        return ArmStats(total=self._total.freeze(), recent=recent)


def record(stats: ArmStats, at: float, delta: Tally) -> ArmStats:
    """``stats`` with ``delta`` (what happened at event time ``at``) added to
    its total and to its bucket; buckets :data:`AB_HORIZON` or more older
    than the newest are dropped (a late event that old counts in the total
    only). A late event goes into its own bucket, kept in order."""
    working = ArmTally(stats)
    working.add(at, delta)
    return working.freeze()


def windowed(stats: ArmStats, now: float, window: float) -> Tally:
    """What the arm's requests did in the buckets that end after ``now -
    window`` and begin by ``now`` (one stamped ahead, by a fast clock, is not
    "the last minutes")."""
    since = now - window
    return tally(
        [
            _EMPTY,
            *(t for start, t in stats.recent if start + AB_BUCKET > since and start <= now),
        ]
    )


# ----------------------------------------------------------------- rollback


def breach(rules: RollbackRules, stats: ArmStats, now: float) -> str | None:
    """Why an arm breaches ``rules`` at ``now`` (see the module docstring), or ``None``."""
    seen = windowed(stats, now, rules.window)
    window = f"in the last {rules.window:g} s"
    calls = seen.completed + seen.failed
    if calls >= rules.min_requests and rules.error_rate is not None:
        rate = seen.failed / calls
        if rate >= rules.error_rate:
            return (
                f"error rate {rate:.0%} ({seen.failed} of {calls} calls failed by the"
                f" backend's fault; {seen.expired} expired) {window},"
                f" at or above {rules.error_rate:.0%}"
            )
    if seen.completed < rules.min_requests:
        return None
    for name, limit, histogram in (
        ("latency", rules.p95_latency, seen.latency),
        ("time to first token", rules.p95_ttft, seen.ttft),
    ):
        p95 = percentile(histogram, 95)
        if limit is not None and p95 is not None and p95 > limit:
            return (
                f"p95 {name} {p95:.2f} s over {seen.completed} completed {window}, "
                f"above {limit:g} s"
            )
    return None


def judge(split: SplitPolicy, arms: Mapping[str, ArmStats], now: float) -> tuple[str, str] | None:
    """The first arm (config order) other than the control, with traffic, that
    breaches the split's rollback rules at ``now``, and why; ``None`` if none
    does or the split has no rules."""
    rules = split.rollback
    if rules is None:
        return None
    for name, weight in split.arms:
        if name == split.control or weight <= 0 or name not in arms:
            continue
        reason = breach(rules, arms[name], now)
        if reason is not None:
            return name, reason
    return None
