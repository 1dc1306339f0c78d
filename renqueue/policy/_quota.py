"""Quotas: what a backend's rate limits leave for one more request, as pure functions.

A backend has *limits* (:class:`Limit`): a count of requests or tokens per
window, declared in its config or learned from what the provider reported.
Its :class:`Quota` is what was sent to it, as of event times, in one
:class:`~renqueue.policy._spend.SpendLog` (requests and tokens in time slots:
seconds, then minutes, then hours, for 49 hours), and every limit is judged
against that same log. The log needs no configuration: folding the event
log gives the same quota whatever limits are declared, and a limit changed
or learned later is judged against what was already spent.

- a **rolling** window is never more than ``count`` in any stretch of
  ``window`` seconds. That is the strictest reading of a limit, so it holds
  whatever the provider counts by (a token bucket as OpenAI, Groq and our
  mock do, fixed minutes, or a sliding log). A slot counts as a whole until
  a whole window has passed since its end, so a spend is counted no shorter
  than it should be;
- a **calendar** window (``"utc"`` or ``"us-pacific"``: daily quotas that
  reset at a midnight) counts every slot that overlaps it. Slots are whole
  seconds, minutes and hours of Unix time, and both midnights are whole hours
  of it, so no slot straddles a day's start.

Beside the spend, a quota carries what the provider said last: a
cooldown after a 429 (``retry-after``), a quota exhausted until its reset
(``insufficient_quota``, a per-day quota id), and learned windows whose
``remaining`` it reported. :func:`check` answers whether a cost fits now, and
if not, from when and why (``quota:requests/min 29/30, resets in 12 s``);
:func:`limit_usage` says, per limit, what is used and left and when it
resets, counted the same way (what ``renqueue status`` shows);
:func:`reserve` spends it; :func:`reconcile` corrects a token reservation
with the usage the provider reported. Nothing here reads a clock: every
``now`` and ``at`` is the caller's (the binder's clock to decide, event times
to fold), so folding the same events always gives the same quota.

A window longer than the log keeps (:data:`~renqueue.policy._spend.KEPT_FOR`,
49 hours; a calendar window of more than two days) cannot be judged: spend
older than that is forgotten.
"""

from __future__ import annotations

import bisect
import datetime
import math
from collections.abc import Iterable, Iterator
from typing import Final, Literal
from zoneinfo import ZoneInfo

import msgspec
from msgspec import Struct

from ..schema import ReportedLimit
from ._spend import Slot, SpendLog, record, refund_tokens

__all__ = [
    "Calendar",
    "Cost",
    "Learned",
    "Limit",
    "LimitUsage",
    "Quota",
    "QuotaVerdict",
    "check",
    "cool_down",
    "effective_limits",
    "learn",
    "limit_usage",
    "limits_of",
    "reconcile",
    "reserve",
    "used",
]

#: How a window resets: a rolling bucket, or at a midnight (UTC or US Pacific).
Calendar = Literal["rolling", "utc", "us-pacific"]
#: What a limit counts.
Kind = Literal["requests", "tokens"]

_DAY: Final = 86_400.0
#: The longest slot of a spend log: no slot starts more than this before its end.
_LONGEST_SLOT: Final = 3600.0
#: Calendar windows tried one after another before jumping past the whole log.
_CALENDAR_TRIES: Final = 8
_PACIFIC: Final = ZoneInfo("America/Los_Angeles")
_EPOCH_DATE: Final = datetime.date(1970, 1, 1)
_WINDOW_NAMES: Final = {1.0: "s", 60.0: "min", 3600.0: "h", _DAY: "day"}


class Limit(Struct, frozen=True, kw_only=True):
    """``count`` requests (or tokens) per ``window`` seconds, reset as ``calendar`` says."""

    kind: Kind
    count: int
    window: float
    calendar: Calendar = "rolling"

    @property
    def key(self) -> str:
        """The limit's name in reasons and learned windows: ``requests/min``, ``tokens/10s``."""
        name = _WINDOW_NAMES.get(self.window)
        if name is None:
            short = f"{self.window:g}"  # 6 significant digits: only if that is the window
            name = f"{short if float(short) == self.window else repr(self.window)}s"
        return f"{self.kind}/{name}"


class Cost(Struct, frozen=True):
    """What one request spends: one request and an estimate of its tokens."""

    requests: int = 1
    tokens: int = 0

    def of(self, kind: Kind) -> int:
        return self.requests if kind == "requests" else self.tokens


class Learned(Struct, frozen=True, kw_only=True):
    """One window the provider reported: ``limit`` and ``remaining`` as of ``at``,
    full again at ``reset_at`` (absolute, event time)."""

    kind: Kind
    window: float | None
    limit: int | None = None
    remaining: int | None = None
    reset_at: float | None = None
    at: float = 0.0


class Quota(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One backend's spend (any limit is judged against it), and what its provider said last."""

    spend: SpendLog = SpendLog()
    #: No call before this (a 429's ``retry-after``).
    cooldown_until: float | None = None
    #: The provider's quota is spent until this (a daily quota, ``insufficient_quota``).
    exhausted_until: float | None = None
    #: Learned windows by limit key (``requests/day``), the latest report of each.
    learned: dict[str, Learned] = {}


class QuotaVerdict(Struct, frozen=True):
    """Whether a cost fits now; if not, the earliest time it may (``until``) and why."""

    ok: bool
    until: float = 0.0
    reason: str = ""


_OK: Final = QuotaVerdict(True)


class LimitUsage(Struct, frozen=True, kw_only=True):
    """One limit a backend is judged by, and what is spent of it at a moment
    (:func:`limit_usage`). Times are absolute (Unix seconds)."""

    #: The limit's name: ``requests/min``, ``tokens/day``.
    key: str
    kind: Kind
    window: float
    calendar: Calendar
    #: The count judged by: the declared one, tightened to what the provider reported.
    count: int
    #: The declared count (the tightest declared under this key); ``None`` for a
    #: window only the provider reported.
    declared: int | None
    #: Spent in the window now, counted as :func:`check` counts it.
    used: int
    #: The largest cost that fits now (``count - used``, never below 0).
    left: int
    #: When one more request (or token) fits again, if none fits now; ``None``
    #: while there is room.
    room_at: float | None
    #: When nothing spent so far counts any more (the window is full again);
    #: ``None`` when nothing counts.
    resets_at: float | None
    #: What the provider last reported as remaining in this window, while its
    #: report holds (its reset is still ahead, or unknown); ``None`` otherwise.
    reported_left: int | None = None
    #: When the provider said this window resets (with ``reported_left``).
    reported_reset_at: float | None = None


# --------------------------------------------------------------- the windows


def _aligned(at: float, length: float) -> tuple[float, float]:
    """The window of ``length`` seconds from the epoch holding ``at``: ``(start, end)``.

    Its index is corrected for the rounding of ``at / length``, so that
    ``start <= at < end`` always holds and ``end`` is the next window's start.
    """
    index = math.floor(at / length)
    if index * length > at:
        index -= 1
    elif (index + 1) * length <= at:
        index += 1
    return index * length, (index + 1) * length


def _pacific_midnight(date: datetime.date) -> float:
    return datetime.datetime.combine(date, datetime.time(), _PACIFIC).timestamp()


def _calendar_window(limit: Limit, at: float) -> tuple[float, float]:
    """The calendar window holding ``at`` (Unix seconds): ``(start, end)``.

    A window of a day or more is whole days (its length rounded to days),
    counted from 1970-01-01 and beginning at a midnight in ``limit.calendar``'s
    zone: a US Pacific day is 23 or 25 hours around a clock change. A shorter
    one is a fixed window aligned to the epoch.
    """
    if limit.window < _DAY:
        return _aligned(at, limit.window)
    days = max(1, round(limit.window / _DAY))
    if limit.calendar == "utc":
        return _aligned(at, days * _DAY)
    # US Pacific midnights are whole seconds, so the day of ``floor(at)`` is the
    # day of ``at`` (``fromtimestamp`` would round a moment before midnight up to it).
    try:
        date = datetime.datetime.fromtimestamp(math.floor(at), _PACIFIC).date()
        first = date - datetime.timedelta(days=(date - _EPOCH_DATE).days % days)
        return _pacific_midnight(first), _pacific_midnight(first + datetime.timedelta(days=days))
    except (OverflowError, ValueError, OSError):
        # A time past the calendar's range (only a forged or broken event
        # stamps one): whole UTC days there, rather than a binder that raises.
        return _aligned(at, days * _DAY)


def _is_calendar(limit: Limit) -> bool:
    return limit.calendar != "rolling"


def _expiry(end: float, window: float) -> float:
    """When a slot ending at ``end`` stops counting for a rolling ``window``: the first
    float at or after the exact ``end + window``, so that it never stops early by a
    rounding."""
    total = end + window
    # The sum's rounding error, exactly (Knuth's two-sum): positive when ``total`` fell short.
    back = total - end
    error = (end - (total - back)) + (window - back)
    return math.nextafter(total, math.inf) if error > 0 else total


def _slot_start(slot: Slot) -> float:
    return slot.start


def _from(log: SpendLog, earliest_end: float) -> Iterator[Slot]:
    """The log's slots, skipping (by their sorted starts) only ones ending well
    before ``earliest_end``."""
    first = bisect.bisect_left(
        log.slots, earliest_end - _LONGEST_SLOT - 1.0, key=_slot_start
    )  # a second to spare for the subtraction's rounding
    return iter(log.slots[first:])


def _rolling(log: SpendLog, limit: Limit, now: float) -> Iterator[tuple[float, int]]:
    """``(expiry, amount)`` of each slot still counting for a rolling ``limit`` at ``now``:
    every slot ending less than a window before it (one recorded later than
    ``now``, by another clock, counts too)."""
    for slot in _from(log, now - limit.window):
        amount = slot.of(limit.kind)
        if amount:
            expiry = _expiry(slot.end, limit.window)
            if expiry > now:
                yield expiry, amount


def _calendar_used(log: SpendLog, limit: Limit, start: float, end: float) -> int:
    """What the slots overlapping the calendar window ``[start, end)`` hold."""
    total = 0
    for slot in _from(log, start):
        if slot.start >= end:
            break
        if slot.end > start:
            total += slot.of(limit.kind)
    return total


def used(quota: Quota, limit: Limit, now: float) -> int:
    """What is spent of ``limit`` at ``now`` (0 up to ``count``, or beyond after a reconcile)."""
    if _is_calendar(limit):
        return _calendar_used(quota.spend, limit, *_calendar_window(limit, now))
    return _live(quota.spend, limit, now)[1]


#: :func:`_live` answers by (log, limit, time): a planning round asks for
#: every waiting request's cost against the same few logs. Each entry keeps
#: its log, so the log's id cannot be reused while it is here.
_LIVE: Final[dict[tuple[int, Limit, float], tuple[SpendLog, list[tuple[float, int]], int]]] = {}
_LIVE_MAX: Final = 1024


def _live(log: SpendLog, limit: Limit, now: float) -> tuple[list[tuple[float, int]], int]:
    """The slots still counting for a rolling ``limit`` at ``now`` (oldest
    expiry first) and their total. Pure (a log never changes: it is frozen);
    remembered for the next cost asked of the same log at the same time."""
    key = (id(log), limit, now)
    known = _LIVE.get(key)
    if known is not None and known[0] is log:
        return known[1], known[2]
    live = sorted(_rolling(log, limit, now))
    total = sum(amount for _expiry, amount in live)
    if len(_LIVE) >= _LIVE_MAX:
        _LIVE.clear()
    _LIVE[key] = (log, live, total)
    return live, total


def _fits_at(log: SpendLog, limit: Limit, cost: int, now: float) -> float:
    """The earliest time from ``now`` at which ``cost`` fits in ``limit``'s window."""
    if cost <= 0:
        return now
    if cost > limit.count:
        return math.inf  # never: larger than the whole window
    if _is_calendar(limit):
        return _calendar_fits_at(log, limit, cost, now)
    live, total = _live(log, limit, now)
    excess = total + cost - limit.count
    for expiry, amount in live:  # oldest first: wait until enough of it has stopped counting
        if excess <= 0:
            break
        excess -= amount
        now = max(now, expiry)
    return now


def _calendar_fits_at(log: SpendLog, limit: Limit, cost: int, now: float) -> float:
    """Now if ``cost`` fits the calendar window holding ``now``, else the start of
    the first later window it fits (the next, unless a slot overlaps it too)."""
    start, end = _calendar_window(limit, now)
    if _calendar_used(log, limit, start, end) + cost <= limit.count:
        return now
    for _ in range(_CALENDAR_TRIES):
        start, end = _calendar_window(limit, end)
        if _calendar_used(log, limit, start, end) + cost <= limit.count:
            return start
    # Windows much shorter than a slot: the first one past every slot is empty.
    last = max((slot.end for slot in log.slots), default=end)
    start, end = _calendar_window(limit, last)
    return start if start >= last else end


# ------------------------------------------------------------------ deciding


def effective_limits(declared: Iterable[Limit], quota: Quota) -> tuple[Limit, ...]:
    """The declared limits, each tightened to what the provider reported for the
    same kind and window, and the learned windows no declared limit covers."""
    limits: dict[str, Limit] = {}
    for limit in declared:  # of two declared under one key, the tighter
        known = limits.get(limit.key)
        if known is None or limit.count < known.count:
            limits[limit.key] = limit
    for learned in quota.learned.values():
        if learned.limit is None or learned.limit < 1 or not learned.window or learned.window < 0:
            continue  # no limit, or a window of no known length
        reported = Limit(kind=learned.kind, count=learned.limit, window=learned.window)
        known = limits.get(reported.key)
        if known is None:
            limits[reported.key] = reported
        elif reported.count < known.count:
            limits[reported.key] = msgspec.structs.replace(known, count=reported.count)
    return tuple(limits.values())


def says_anything(quota: Quota) -> bool:
    """Whether a provider's word is in ``quota``: a learned window or a pause."""
    return (
        bool(quota.learned) or quota.cooldown_until is not None or quota.exhausted_until is not None
    )


def check(quota: Quota, limits: Iterable[Limit], cost: Cost, now: float) -> QuotaVerdict:
    """Whether ``cost`` fits every limit at ``now``; if not, when it will and why.

    A cooldown or an exhausted quota holds until it ends. A learned window
    whose ``remaining`` is 0 holds until its reset. Each window has room from
    some time on. The cost fits at the latest of all these (``until``, with
    no spend in between; ``inf`` when a single request costs more than a
    whole window), and not a moment before; the reason names what holds it
    that long (the first of them on a tie).
    """
    worst: QuotaVerdict = _OK

    def hold(until: float, reason: str) -> None:
        nonlocal worst
        if until > now and (worst.ok or until > worst.until):
            worst = QuotaVerdict(False, until, reason)

    if quota.exhausted_until is not None:
        hold(
            quota.exhausted_until,
            f"quota exhausted, resets in {_seconds(quota.exhausted_until - now)}",
        )
    if quota.cooldown_until is not None:
        hold(
            quota.cooldown_until,
            f"rate limited by the provider, retry in {_seconds(quota.cooldown_until - now)}",
        )
    for key, learned in quota.learned.items():
        if (
            learned.remaining is not None
            and learned.remaining <= 0
            and learned.reset_at is not None
            and cost.of(learned.kind) > 0
        ):
            hold(
                learned.reset_at,
                f"quota:{key} 0 left (reported), resets in {_seconds(learned.reset_at - now)}",
            )
    for limit in limits:
        at = _fits_at(quota.spend, limit, cost.of(limit.kind), now)
        if at > now and (worst.ok or at > worst.until):
            spent = used(quota, limit, now)
            when = "never fits" if math.isinf(at) else f"resets in {_seconds(at - now)}"
            hold(at, f"quota:{limit.key} {spent}/{limit.count}, {when}")
    return worst


def limit_usage(quota: Quota, declared: Iterable[Limit], now: float) -> tuple[LimitUsage, ...]:
    """Each limit ``quota`` is judged by (:func:`effective_limits` of ``declared``),
    with what is spent of it at ``now``, as :func:`check` counts.

    ``left`` is exactly the largest cost that :func:`check` finds room for in
    that window now (a cooldown, an exhausted quota or a reported window at 0
    still hold a request back: they are the quota's own fields and
    ``reported_left``); ``room_at`` is when a cost of one fits again once none
    does, and ``resets_at`` when a cost of the whole count would, that is when
    the window is empty again. Pure, like :func:`check`: ``now`` is the caller's.
    """
    declared = tuple(declared)
    declared_counts: dict[str, int] = {}
    for limit in declared:
        known = declared_counts.get(limit.key)
        declared_counts[limit.key] = limit.count if known is None else min(known, limit.count)
    usages: list[LimitUsage] = []
    for limit in effective_limits(declared, quota):
        spent = used(quota, limit, now)
        left = max(0, limit.count - spent)
        room_at = None if left > 0 else _fits_at(quota.spend, limit, 1, now)
        resets_at = _fits_at(quota.spend, limit, limit.count, now) if spent > 0 else None
        learned = quota.learned.get(limit.key)
        holds = (
            learned is not None
            and learned.remaining is not None
            and (learned.reset_at is None or learned.reset_at > now)
        )
        usages.append(
            LimitUsage(
                key=limit.key,
                kind=limit.kind,
                window=limit.window,
                calendar=limit.calendar,
                count=limit.count,
                declared=declared_counts.get(limit.key),
                used=spent,
                left=left,
                room_at=_finite(room_at),
                resets_at=_finite(resets_at),
                reported_left=learned.remaining if holds and learned is not None else None,
                reported_reset_at=learned.reset_at if holds and learned is not None else None,
            )
        )
    return tuple(usages)


def reserve(quota: Quota, cost: Cost, at: float) -> Quota:
    """``quota`` with ``cost`` (its requests and tokens) spent at ``at``; a cost of
    nothing leaves it as it was."""
    if cost.requests <= 0 and cost.tokens <= 0:
        return quota
    spend = record(quota.spend, at, requests=cost.requests, tokens=cost.tokens)
    return msgspec.structs.replace(quota, spend=spend)


def reconcile(quota: Quota, *, reserved: int, used: int, reserved_at: float, at: float) -> Quota:
    """``quota`` with a reservation of ``reserved`` tokens at ``reserved_at`` corrected
    to the ``used`` the provider reported at ``at``.

    Fewer used: the difference is taken back from the slot that holds
    ``reserved_at``, never from another one and never below zero (nothing,
    once that slot has left the log). More used: the extra is spent at ``at``.
    """
    reserved, used = max(reserved, 0), max(used, 0)
    if used < reserved:
        spend = refund_tokens(quota.spend, reserved - used, reserved_at)
    elif used > reserved:
        spend = record(quota.spend, at, tokens=used - reserved)
    else:
        return quota
    return msgspec.structs.replace(quota, spend=spend)


def cool_down(quota: Quota, until: float, *, exhausted: bool = False) -> Quota:
    """``quota`` after a 429: no call before ``until`` (later of this and any earlier one).

    ``exhausted``: the provider's quota is spent (not a momentary rate limit).
    """
    if exhausted:
        return msgspec.structs.replace(
            quota, exhausted_until=max(until, quota.exhausted_until or until)
        )
    return msgspec.structs.replace(quota, cooldown_until=max(until, quota.cooldown_until or until))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def learn(quota: Quota, reported: Iterable[ReportedLimit], at: float) -> Quota:
    """``quota`` with the provider's word, as of ``at``, on each window it reported.

    Only request and token windows are learned (not yet ``input_tokens`` and
    ``output_tokens``). A window is named by its kind and length; one of
    unknown length (or of none: 0 s) is kept under ``<kind>/reported``. An
    older report never replaces a newer one; of two as of the same time, the
    later one stands. A time that is not finite is no time: nothing is learned
    (as a length or a reset, it is unknown).
    """
    if not math.isfinite(at):
        return quota
    learned: dict[str, Learned] = dict(quota.learned)
    for window in reported:
        if window.kind == "requests":
            kind: Kind = "requests"
        elif window.kind == "tokens":
            kind = "tokens"
        else:
            continue
        length = _finite(window.window)
        key = (
            Limit(kind=kind, count=1, window=length).key
            if length and length > 0
            else f"{kind}/reported"
        )
        previous = learned.get(key)
        if previous is None or previous.at <= at:
            learned[key] = Learned(
                kind=kind,
                window=length,
                limit=window.limit,
                remaining=window.remaining,
                reset_at=_finite(window.reset_at),
                at=at,
            )
    if learned == quota.learned:
        return quota
    return msgspec.structs.replace(quota, learned=learned)


def limits_of(
    requests: Iterable[tuple[int, float]],
    tokens: Iterable[tuple[int, float]],
    calendar: Calendar = "rolling",
) -> tuple[Limit, ...]:
    """Limits from ``(count, window)`` pairs; windows of a day or more reset by ``calendar``."""

    def one(kind: Kind, count: int, window: float) -> Limit:
        reset: Calendar = calendar if window >= _DAY else "rolling"
        return Limit(kind=kind, count=count, window=window, calendar=reset)

    return (
        *(one("requests", count, window) for count, window in requests),
        *(one("tokens", count, window) for count, window in tokens),
    )


def _seconds(delta: float) -> str:
    if math.isinf(delta):
        return "never"
    if delta < 10:
        return f"{max(delta, 0):.1f} s"
    if delta < 3600:
        return f"{round(delta)} s"
    return f"{delta / 3600:.1f} h"
