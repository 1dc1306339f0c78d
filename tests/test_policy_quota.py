"""Backend quotas (renqueue.policy._quota): tables of limits and spends judged
against one spend log, then properties of a client that spends only what
``check`` allows, against an exact brute force over the raw history of its spends."""

from __future__ import annotations

import bisect
import copy
import datetime
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction
from zoneinfo import ZoneInfo

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.policy._quota import (
    Calendar,
    Cost,
    Learned,
    Limit,
    Quota,
    QuotaVerdict,
    check,
    cool_down,
    effective_limits,
    learn,
    limit_usage,
    limits_of,
    reconcile,
    reserve,
    used,
)
from renqueue.policy._spend import KEPT_FOR, MAX_SLOTS, Slot, SpendLog
from renqueue.schema._messages import ReportedLimit

DAY = 86_400.0
UTC = datetime.UTC
PACIFIC = ZoneInfo("America/Los_Angeles")
#: A moment on a whole minute (a slot boundary of the log's seconds and minutes).
T = 1_780_000_020.0


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return datetime.datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def pacific(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> float:
    return datetime.datetime(year, month, day, hour, minute, tzinfo=PACIFIC).timestamp()


def spent(spends: Sequence[tuple[float, Cost]]) -> Quota:
    """A quota after ``spends`` (time, cost) reserved in order."""
    quota = Quota()
    for at, cost in spends:
        quota = reserve(quota, cost, at)
    return quota


def reported(
    kind: str,
    window: float | None,
    *,
    limit: int | None = None,
    remaining: int | None = None,
    reset_at: float | None = None,
) -> ReportedLimit:
    return ReportedLimit(
        kind=kind, window=window, limit=limit, remaining=remaining, reset_at=reset_at
    )


def requests(count: int, window: float, calendar: Calendar = "rolling") -> Limit:
    return Limit(kind="requests", count=count, window=window, calendar=calendar)


def tokens(count: int, window: float, calendar: Calendar = "rolling") -> Limit:
    return Limit(kind="tokens", count=count, window=window, calendar=calendar)


def times(n: int, at: float, cost: Cost | None = None) -> list[tuple[float, Cost]]:
    return [(at, cost or Cost())] * n


PER_MIN = (requests(30, 60.0),)
TPM = (tokens(1000, 60.0),)

# ------------------------------------------------------------------ tables


CHECKS = [
    # --- rolling requests/min
    pytest.param(PER_MIN, [], Cost(), T, None, "", id="empty-fits"),
    pytest.param(PER_MIN, times(29, T), Cost(), T, None, "", id="30th-fits-at-once"),
    pytest.param(
        PER_MIN,
        times(30, T),
        Cost(),
        T,
        T + 61,  # the spend's second [T, T + 1) counts until a minute after its end
        "quota:requests/min 30/30, resets in 61 s",
        id="31st-waits-for-the-first-slot",
    ),
    pytest.param(
        PER_MIN,
        times(30, T + 0.25),
        Cost(),
        T + 0.5,
        T + 1 + 60,  # the spend's slot ends at T + 1
        "quota:requests/min 30/30, resets in 60 s",
        id="31st-waits-until-slot-end-plus-window",
    ),
    pytest.param(PER_MIN, times(30, T), Cost(), T + 61, None, "", id="31st-fits-once-expired"),
    pytest.param(
        PER_MIN,
        times(30, T),
        Cost(),
        T + 60.5,
        T + 61,
        "quota:requests/min 30/30, resets in 0.5 s",
        id="31st-half-a-second-early",
    ),
    pytest.param(
        PER_MIN,
        times(10, T) + times(10, T + 10) + times(10, T + 20),
        Cost(),
        T + 30,
        T + 61,
        "quota:requests/min 30/30, resets in 31 s",
        id="spread-waits-for-the-oldest-only",
    ),
    pytest.param(
        (requests(30, 60.0),),
        times(10, T) + times(10, T + 10) + times(10, T + 20),
        Cost(requests=11),
        T + 30,
        T + 71,  # needs the two oldest slots gone
        "quota:requests/min 30/30, resets in 41 s",
        id="a-bigger-cost-waits-for-more-slots",
    ),
    pytest.param(
        PER_MIN,
        times(30, T),
        Cost(requests=0, tokens=50),
        T,
        None,
        "",
        id="no-requests-no-request-limit",
    ),
    # --- tokens
    pytest.param(TPM, [(T, Cost(tokens=600))], Cost(tokens=400), T, None, "", id="tokens-fill"),
    pytest.param(
        TPM,
        [(T, Cost(tokens=600))],
        Cost(tokens=401),
        T + 5,
        T + 61,
        "quota:tokens/min 600/1000, resets in 56 s",
        id="tokens-one-over",
    ),
    pytest.param(
        TPM,
        [(T, Cost(tokens=600)), (T + 10, Cost(tokens=300))],
        Cost(tokens=500),
        T + 20,
        T + 61,
        "quota:tokens/min 900/1000, resets in 41 s",
        id="tokens-oldest-entry-enough",
    ),
    pytest.param(
        TPM,
        [(T, Cost(tokens=600)), (T + 10, Cost(tokens=300))],
        Cost(tokens=1000),
        T + 20,
        T + 71,
        "quota:tokens/min 900/1000, resets in 51 s",
        id="tokens-needs-both-entries",
    ),
    pytest.param(
        TPM,
        [],
        Cost(tokens=1001),
        T,
        math.inf,
        "quota:tokens/min 0/1000, never fits",
        id="bigger-than-the-window-never-fits",
    ),
    pytest.param(
        (tokens(100, 10.0),),
        [(T, Cost(tokens=100))],
        Cost(tokens=1),
        T + 1,
        T + 11,
        "quota:tokens/10s 100/100, resets in 10 s",
        id="tokens-per-10s",
    ),
    pytest.param(
        (*PER_MIN, *TPM),
        [(T, Cost(requests=0, tokens=1000)), *times(30, T + 30)],
        Cost(tokens=10),
        T + 40,
        T + 91,  # the later of tokens (T + 61) and requests (T + 91)
        "quota:requests/min 30/30, resets in 51 s",
        id="the-latest-window-decides",
    ),
    # --- calendar days
    pytest.param(
        (requests(3, DAY, "utc"),),
        times(3, utc(2026, 5, 1, 13)),
        Cost(),
        utc(2026, 5, 1, 23, 59, 59),
        utc(2026, 5, 2),
        "quota:requests/day 3/3, resets in 1.0 s",
        id="utc-day-resets-at-utc-midnight",
    ),
    pytest.param(
        (requests(3, DAY, "utc"),),
        times(3, utc(2026, 5, 1, 13)),
        Cost(),
        utc(2026, 5, 2),
        None,
        "",
        id="utc-day-fits-after-midnight",
    ),
    pytest.param(
        (requests(3, DAY, "utc"),),
        times(3, math.nextafter(utc(2026, 5, 2), 0)),
        Cost(),
        utc(2026, 5, 2),
        None,
        "",
        id="utc-spend-a-hair-before-midnight-is-yesterdays",
    ),
    pytest.param(
        (tokens(5000, DAY, "utc"),),
        [(utc(2026, 5, 1, 1), Cost(tokens=4000))],
        Cost(tokens=1001),
        utc(2026, 5, 1, 12),
        utc(2026, 5, 2),
        "quota:tokens/day 4000/5000, resets in 12.0 h",
        id="utc-tokens-day",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 5, 1, 13)),
        Cost(),
        pacific(2026, 5, 1, 23),
        pacific(2026, 5, 2),  # 07:00 UTC in summer time
        "quota:requests/day 3/3, resets in 1.0 h",
        id="pacific-day-resets-at-pacific-midnight",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 5, 1, 13)),
        Cost(),
        utc(2026, 5, 2, 1),  # 18:00 Pacific, still May 1st there
        pacific(2026, 5, 2),
        "quota:requests/day 3/3, resets in 6.0 h",
        id="pacific-day-after-utc-midnight",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 3, 8, 0, 15)),  # spring forward: a 23-hour day
        Cost(),
        pacific(2026, 3, 8, 0, 30),
        pacific(2026, 3, 9),
        "quota:requests/day 3/3, resets in 22.5 h",
        id="pacific-dst-start-23h-day",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 3, 7, 23, 30)),
        Cost(),
        pacific(2026, 3, 8),
        None,
        "",
        id="pacific-dst-start-new-day-fits",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 11, 1, 0, 15)),  # fall back: a 25-hour day
        Cost(),
        pacific(2026, 11, 1, 0, 30),
        pacific(2026, 11, 2),
        "quota:requests/day 3/3, resets in 24.5 h",
        id="pacific-dst-end-25h-day",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, pacific(2026, 10, 31, 23, 59)),
        Cost(),
        pacific(2026, 11, 1),
        None,
        "",
        id="pacific-dst-end-new-day-fits",
    ),
    pytest.param(
        (requests(3, DAY, "us-pacific"),),
        times(3, math.nextafter(pacific(2026, 3, 9), 0)),
        Cost(),
        pacific(2026, 3, 9),
        None,
        "",
        id="pacific-spend-a-hair-before-midnight-is-yesterdays",
    ),
    pytest.param(
        (requests(1, 2 * DAY, "us-pacific"),),
        [(pacific(2026, 3, 8, 1), Cost())],
        Cost(),
        pacific(2026, 3, 8, 12),
        pacific(2026, 3, 10),  # 2-day windows from the epoch's date: Mar 8-9, Mar 10-11
        "quota:requests/172800s 1/1, resets in 36.0 h",
        id="pacific-two-days-end-at-a-pacific-midnight",
    ),
    pytest.param(
        (requests(1, 2 * DAY, "us-pacific"),),
        [(pacific(2026, 3, 8, 1), Cost())],
        Cost(),
        pacific(2026, 3, 9, 12),  # Mar 8 began in PST, Mar 9 in PDT: the same window
        pacific(2026, 3, 10),
        "quota:requests/172800s 1/1, resets in 12.0 h",
        id="pacific-two-days-across-dst-start",
    ),
    pytest.param(
        (requests(1, 2 * DAY, "us-pacific"),),
        [(pacific(2026, 11, 1, 12), Cost())],
        Cost(),
        pacific(2026, 11, 2, 12),
        pacific(2026, 11, 3),
        "quota:requests/172800s 1/1, resets in 12.0 h",
        id="pacific-two-days-across-dst-end",
    ),
    pytest.param(
        (requests(1, 2 * DAY, "utc"),),
        [(utc(2026, 3, 8, 12), Cost())],
        Cost(),
        utc(2026, 3, 9, 12),
        utc(2026, 3, 10),
        "quota:requests/172800s 1/1, resets in 12.0 h",
        id="utc-two-days",
    ),
    pytest.param(
        (requests(2, 60.0, "utc"),),  # shorter than a day: aligned to the epoch
        times(2, T + 10),
        Cost(),
        T + 30,
        T + 60,
        "quota:requests/min 2/2, resets in 30 s",
        id="a-calendar-minute-is-a-fixed-minute",
    ),
    pytest.param(
        (requests(1, 0.5, "utc"),),  # shorter than a slot: every half it overlaps counts it
        [(T + 0.2, Cost())],
        Cost(),
        T + 0.6,
        T + 1,
        "quota:requests/0.5s 1/1, resets in 0.4 s",
        id="a-calendar-window-shorter-than-a-slot-waits-for-the-slot",
    ),
    pytest.param(
        (requests(1, 1 / 64, "utc"),),  # 64 windows in the slot: past them all at once
        [(T + 0.2, Cost())],
        Cost(),
        T + 0.3,
        T + 1,
        "quota:requests/0.015625s 1/1, resets in 0.7 s",
        id="a-tiny-calendar-window-jumps-past-the-slot",
    ),
    pytest.param(
        PER_MIN,
        times(30, T + 10),  # recorded by a clock ahead of the one checking
        Cost(),
        T,
        T + 71,
        "quota:requests/min 30/30, resets in 71 s",
        id="a-spend-recorded-after-now-counts",
    ),
    pytest.param(
        (requests(30, DAY),),  # a rolling day: the spend has aged into an hour slot
        [*times(30, utc(2026, 5, 1, 10, 30)), (utc(2026, 5, 1, 20), Cost(requests=0, tokens=1))],
        Cost(),
        utc(2026, 5, 1, 21),
        utc(2026, 5, 2, 11),  # the hour [10:00, 11:00) counts until a day after its end
        "quota:requests/day 30/30, resets in 14.0 h",
        id="a-rolling-day-judged-on-hour-slots",
    ),
    pytest.param(
        (requests(30, 3 * 3600.0),),  # the hour slot began before the window, ends inside
        [*times(30, utc(2026, 5, 1, 10, 5)), (utc(2026, 5, 1, 13, 6), Cost(requests=0, tokens=1))],
        Cost(),
        utc(2026, 5, 1, 13, 30),
        utc(2026, 5, 1, 14),
        "quota:requests/10800s 30/30, resets in 1800 s",
        id="a-slot-begun-before-the-window-counts-until-its-end-leaves",
    ),
    pytest.param(
        (requests(3, DAY, "utc"),),
        times(3, utc(2026, 5, 2)),  # recorded at the next midnight, by a clock ahead
        Cost(),
        math.nextafter(utc(2026, 5, 2), 0),
        None,
        "",
        id="a-spend-at-midnight-is-the-new-days",
    ),
]


@pytest.mark.parametrize(("limits", "spends", "cost", "now", "until", "reason"), CHECKS)
def test_check(
    limits: tuple[Limit, ...],
    spends: list[tuple[float, Cost]],
    cost: Cost,
    now: float,
    until: float | None,
    reason: str,
) -> None:
    verdict = check(spent(spends), limits, cost, now)
    if until is None:
        assert verdict.ok, verdict
    else:
        assert not verdict.ok
        assert verdict.until == until, (verdict.until - now, until - now)
        assert verdict.reason == reason


def test_a_spend_counts_in_the_second_that_holds_it() -> None:
    quota = spent([(T + 0.25, Cost()), (T + 0.75, Cost(requests=2)), (T + 1.5, Cost(tokens=4))])
    assert quota.spend.slots == (Slot(T, 1.0, 3, 0), Slot(T + 1, 1.0, 1, 4))


def test_a_slot_stops_counting_no_earlier_than_exactly_a_window_after_its_end() -> None:
    # The spend's second ends at 1_700_000_001.0, and 1_700_000_001.0 + 0.05 rounds
    # down to a float a hair short of the exact sum: freeing the slot there would
    # let two spends into 0.05 s.
    limit = tokens(1, 0.05)
    end = 1_700_000_001.0
    assert Fraction(end + 0.05) < Fraction(end) + Fraction(0.05)
    quota = spent([(end - 1, Cost(tokens=1))])
    until = check(quota, (limit,), Cost(tokens=1), end - 1).until
    assert Fraction(until) - Fraction(end) >= Fraction(0.05)
    assert check(quota, (limit,), Cost(tokens=1), until).ok
    assert not check(quota, (limit,), Cost(tokens=1), math.nextafter(until, 0)).ok


def test_a_pacific_day_is_23_or_25_hours_around_a_clock_change() -> None:
    limit = requests(1, DAY, "us-pacific")
    for day, hours in [((2026, 3, 8), 23), ((2026, 11, 1), 25), ((2026, 5, 1), 24)]:
        start = pacific(*day)
        verdict = check(spent([(start, Cost())]), (limit,), Cost(), start)
        assert verdict.until - start == hours * 3600


def test_every_utc_and_pacific_midnight_is_a_whole_hour_so_no_slot_straddles_one() -> None:
    """The log's slots are whole seconds, minutes and hours of Unix time: none
    overlaps two days as long as every midnight is a whole hour, as it has been
    in US Pacific time since 1883 (checked from 1970 to 2100)."""
    day = datetime.date(1970, 1, 1)
    while day.year < 2100:
        assert pacific(day.year, day.month, day.day) % 3600 == 0, day
        assert utc(day.year, day.month, day.day) % 3600 == 0, day
        day += datetime.timedelta(days=1)


def test_an_hour_slot_before_midnight_is_yesterdays_only() -> None:
    """A spend aged into an hour slot still counts in its own day, not the next."""
    limit = requests(3, DAY, "us-pacific")
    quota = spent([*times(3, pacific(2026, 5, 1, 23, 30)), (pacific(2026, 5, 2, 6), Cost(0, 1))])
    assert quota.spend.slots[0] == Slot(pacific(2026, 5, 1, 23), 3600.0, 3, 0)
    assert used(quota, limit, pacific(2026, 5, 1, 23, 59)) == 3
    assert used(quota, limit, pacific(2026, 5, 2)) == 0
    assert check(quota, (limit,), Cost(), pacific(2026, 5, 2)).ok


@pytest.mark.parametrize(
    ("quota", "now", "until", "reason"),
    [
        pytest.param(
            cool_down(Quota(), T + 5),
            T,
            T + 5,
            "rate limited by the provider, retry in 5.0 s",
            id="cooldown-blocks",
        ),
        pytest.param(cool_down(Quota(), T + 5), T + 5, None, "", id="cooldown-ends"),
        pytest.param(
            cool_down(cool_down(Quota(), T + 30), T + 5),
            T,
            T + 30,
            "rate limited by the provider, retry in 30 s",
            id="cooldown-keeps-the-later",
        ),
        pytest.param(
            cool_down(Quota(), T + 3600, exhausted=True),
            T,
            T + 3600,
            "quota exhausted, resets in 1.0 h",
            id="exhausted-blocks",
        ),
        pytest.param(
            cool_down(Quota(), T + 3600, exhausted=True), T + 3600, None, "", id="exhausted-ends"
        ),
        pytest.param(
            cool_down(cool_down(Quota(), T + 60, exhausted=True), T + 10, exhausted=True),
            T,
            T + 60,
            "quota exhausted, resets in 60 s",
            id="exhausted-keeps-the-later",
        ),
        pytest.param(
            cool_down(cool_down(Quota(), T + 30), T + 10, exhausted=True),
            T + 15,
            T + 30,
            "rate limited by the provider, retry in 15 s",
            id="cooldown-after-exhausted-ends",
        ),
        pytest.param(
            cool_down(cool_down(Quota(), T + 30), T + 10, exhausted=True),
            T,
            T + 30,  # not T + 10: the cooldown still holds then
            "rate limited by the provider, retry in 30 s",
            id="cooldown-outlasting-exhausted-decides",
        ),
        pytest.param(
            cool_down(spent(times(30, T)), T + 5),
            T,
            T + 61,  # not T + 5: the window is still full then
            "quota:requests/min 30/30, resets in 61 s",
            id="full-window-outlasting-cooldown-decides",
        ),
        pytest.param(
            learn(
                Quota(),
                [reported("requests", DAY, limit=100, remaining=0, reset_at=T + 90)],
                T,
            ),
            T,
            T + 90,
            "quota:requests/day 0 left (reported), resets in 90 s",
            id="learned-none-left-blocks",
        ),
        pytest.param(
            learn(
                Quota(),
                [reported("requests", DAY, limit=100, remaining=0, reset_at=T + 90)],
                T,
            ),
            T + 90,
            None,
            "",
            id="learned-none-left-ends-at-reset",
        ),
        pytest.param(
            learn(Quota(), [reported("requests", None, remaining=0, reset_at=T + 9)], T),
            T,
            T + 9,
            "quota:requests/reported 0 left (reported), resets in 9.0 s",
            id="learned-window-of-unknown-length",
        ),
        pytest.param(
            learn(Quota(), [reported("requests", 60.0, remaining=0)], T),
            T,
            None,
            "",
            id="learned-none-left-without-a-reset-does-not-block",
        ),
        pytest.param(
            learn(Quota(), [reported("requests", 60.0, remaining=3, reset_at=T + 9)], T),
            T,
            None,
            "",
            id="learned-some-left-does-not-block",
        ),
        pytest.param(
            learn(
                cool_down(Quota(), T + 20),
                [
                    reported("requests", 60.0, remaining=0, reset_at=T + 40),
                    reported("requests", DAY, remaining=0, reset_at=T + 30),
                ],
                T,
            ),
            T,
            T + 40,
            "quota:requests/min 0 left (reported), resets in 40 s",
            id="the-latest-reported-reset-decides",
        ),
    ],
)
def test_cooldowns_and_reports(quota: Quota, now: float, until: float | None, reason: str) -> None:
    verdict = check(quota, PER_MIN, Cost(), now)
    if until is None:
        assert verdict.ok, verdict
    else:
        assert not verdict.ok
        assert verdict.until == until
        assert verdict.reason == reason


def test_a_learned_token_window_does_not_block_a_request_of_no_tokens() -> None:
    quota = learn(Quota(), [reported("tokens", 60.0, remaining=0, reset_at=T + 9)], T)
    assert check(quota, (), Cost(tokens=0), T).ok
    assert not check(quota, (), Cost(tokens=1), T).ok


@pytest.mark.parametrize(
    ("declared", "reports", "expected"),
    [
        pytest.param(
            (requests(30, 60.0),),
            [reported("requests", 60.0, limit=20)],
            (requests(20, 60.0),),
            id="learned-tighter-wins",
        ),
        pytest.param(
            (requests(30, 60.0),),
            [reported("requests", 60.0, limit=50)],
            (requests(30, 60.0),),
            id="declared-tighter-wins",
        ),
        pytest.param(
            (requests(1000, DAY, "us-pacific"),),
            [reported("requests", DAY, limit=250)],
            (requests(250, DAY, "us-pacific"),),
            id="tightened-keeps-its-calendar",
        ),
        pytest.param(
            (requests(30, 60.0),),
            [reported("tokens", 60.0, limit=6000)],
            (requests(30, 60.0), tokens(6000, 60.0)),
            id="learned-window-nothing-declared-covers-is-added",
        ),
        pytest.param(
            (requests(30, 60.0),),
            [reported("requests", 10.0, limit=10)],
            (requests(30, 60.0), requests(10, 10.0)),
            id="same-kind-other-window-is-added",
        ),
        pytest.param(
            (requests(30, 60.0),),
            [
                reported("requests", 60.0),
                reported("tokens", None, limit=5),
                reported("tokens", 60.0, limit=0),
                reported("tokens", 0.0, limit=5),
                reported("tokens", -60.0, limit=5),
            ],
            (requests(30, 60.0),),
            id="reports-without-a-limit-or-a-length-are-ignored",
        ),
        pytest.param(
            (requests(30, 60.0), requests(20, 60.0), requests(40, 60.0)),
            [],
            (requests(20, 60.0),),
            id="the-tightest-of-duplicates",
        ),
    ],
)
def test_effective_limits(
    declared: tuple[Limit, ...], reports: list[ReportedLimit], expected: tuple[Limit, ...]
) -> None:
    assert effective_limits(declared, learn(Quota(), reports, T)) == expected


def test_effective_limits_are_what_check_holds_to() -> None:
    quota = learn(Quota(), [reported("requests", 60.0, limit=2, remaining=1)], T)
    limits = effective_limits(PER_MIN, quota)
    quota = msgspec.structs.replace(spent(times(2, T)), learned=quota.learned)
    verdict = check(quota, limits, Cost(), T)
    assert verdict.reason == "quota:requests/min 2/2, resets in 61 s"
    # and a report of an unknown-length window is kept but is no limit
    assert effective_limits((), learn(Quota(), [reported("tokens", None)], T)) == ()


def test_a_limit_learned_later_counts_what_was_already_spent() -> None:
    """The log is one whatever the limits: a window reported after the spend
    (or declared after a restart, without folding again) judges all of it."""
    quota = spent([*times(5, T), (T + 30, Cost(requests=0, tokens=900))])
    assert check(quota, PER_MIN, Cost(), T + 30).ok
    quota = learn(
        quota, [reported("requests", 60.0, limit=5), reported("tokens", 10.0, limit=1000)], T + 30
    )
    limits = effective_limits(PER_MIN, quota)
    assert limits == (requests(5, 60.0), tokens(1000, 10.0))
    verdict = check(quota, limits, Cost(tokens=200), T + 31)
    assert verdict == QuotaVerdict(False, T + 61, "quota:requests/min 5/5, resets in 30 s")
    verdict = check(quota, limits, Cost(requests=0, tokens=200), T + 35)
    assert verdict == QuotaVerdict(False, T + 41, "quota:tokens/10s 900/1000, resets in 6.0 s")


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        pytest.param(
            [(T, [reported("requests", 60.0, remaining=5)])],
            {"requests/min": 5},
            id="learned",
        ),
        pytest.param(
            [
                (T, [reported("requests", 60.0, remaining=5)]),
                (T + 1, [reported("requests", 60.0, remaining=3)]),
            ],
            {"requests/min": 3},
            id="newer-replaces",
        ),
        pytest.param(
            [
                (T + 1, [reported("requests", 60.0, remaining=3)]),
                (T, [reported("requests", 60.0, remaining=5)]),
            ],
            {"requests/min": 3},
            id="older-never-replaces",
        ),
        pytest.param(
            [
                (
                    T,
                    [
                        reported("requests", 60.0, remaining=5),
                        reported("requests", 60.0, remaining=4),
                    ],
                )
            ],
            {"requests/min": 4},
            id="same-batch-the-later-word",
        ),
        pytest.param(
            [
                (T, [reported("requests", 60.0, remaining=5)]),
                (T, [reported("requests", 60.0, remaining=4)]),
            ],
            {"requests/min": 4},
            id="same-time-the-later-word",
        ),
        pytest.param(
            [
                (
                    T,
                    [
                        reported("requests", DAY, remaining=99),
                        reported("tokens", 60.0, remaining=5000),
                        reported("tokens", None, remaining=7),
                        reported("tokens", 10.0, remaining=8),
                    ],
                ),
                (T + 5, [reported("tokens", 60.0, remaining=4000)]),
            ],
            {"requests/day": 99, "tokens/min": 4000, "tokens/reported": 7, "tokens/10s": 8},
            id="per-key",
        ),
        pytest.param(
            [
                (
                    T,
                    [
                        reported("input_tokens", 60.0, remaining=1),
                        reported("output_tokens", 60.0, remaining=2),
                        reported("images", 60.0, remaining=3),
                        reported("tokens", 60.0, remaining=4),
                    ],
                )
            ],
            {"tokens/min": 4},
            id="only-requests-and-tokens",
        ),
        pytest.param(
            [(math.nan, [reported("tokens", 60.0, remaining=4)])],
            {},
            id="no-time-nothing-learned",
        ),
    ],
)
def test_learn(batches: list[tuple[float, list[ReportedLimit]]], expected: dict[str, int]) -> None:
    quota = Quota()
    for at, batch in batches:
        quota = learn(quota, batch, at)
    assert {key: learned.remaining for key, learned in quota.learned.items()} == expected


def test_learned_keeps_what_was_reported_and_when() -> None:
    quota = learn(
        Quota(),
        [reported("requests", DAY, limit=1000, remaining=10, reset_at=T + 90)],
        T + 3,
    )
    assert quota.learned == {
        "requests/day": Learned(
            kind="requests", window=DAY, limit=1000, remaining=10, reset_at=T + 90, at=T + 3
        )
    }


def test_learned_numbers_that_are_not_finite_are_unknown() -> None:
    """A NaN would make a folded state unequal to itself (``replay --verify``)."""
    quota = learn(
        Quota(),
        [
            reported("requests", math.nan, remaining=0, reset_at=math.inf),
            reported("tokens", math.inf, remaining=0, reset_at=math.nan),
        ],
        T,
    )
    assert quota == copy.deepcopy(quota)
    assert quota.learned == {
        "requests/reported": Learned(kind="requests", window=None, remaining=0, at=T),
        "tokens/reported": Learned(kind="tokens", window=None, remaining=0, at=T),
    }
    assert check(quota, PER_MIN, Cost(tokens=1), T).ok  # no reset known: nothing holds


def test_limits_of() -> None:
    assert limits_of([(30, 60.0), (1000, DAY)], [(6000, 60.0)], "us-pacific") == (
        requests(30, 60.0),
        requests(1000, DAY, "us-pacific"),
        tokens(6000, 60.0),
    )
    assert limits_of([(5, DAY)], []) == (requests(5, DAY),)
    assert [limit.key for limit in limits_of([(1, 1.0), (1, 3600.0), (1, 7.5)], [])] == [
        "requests/s",
        "requests/h",
        "requests/7.5s",
    ]


def test_windows_of_different_lengths_have_different_keys() -> None:
    assert requests(1, 10.0).key != requests(1, 10.0000001).key
    assert requests(1, 2 * DAY).key == "requests/172800s"


#: 500 tokens reserved at T, 300 at T + 10 (a request each).
TWO_SPENDS = spent([(T, Cost(tokens=500)), (T + 10, Cost(tokens=300))])


def token_slots(quota: Quota) -> tuple[tuple[float, int], ...]:
    return tuple((slot.start, slot.tokens) for slot in quota.spend.slots)


@pytest.mark.parametrize(
    ("reserved", "used_", "reserved_at", "expected_slots", "expected_used"),
    [
        pytest.param(
            300, 100, T + 10, ((T, 500), (T + 10, 100)), 600, id="refund-from-its-own-slot"
        ),
        pytest.param(
            300, 100, T + 10.5, ((T, 500), (T + 10, 100)), 600, id="any-moment-of-its-second"
        ),
        pytest.param(300, 0, T + 10, ((T, 500), (T + 10, 0)), 500, id="refund-all-of-it"),
        pytest.param(800, 0, T + 10, ((T, 500), (T + 10, 0)), 500, id="never-from-another-slot"),
        pytest.param(
            500, 0, T + 5, ((T, 500), (T + 10, 300)), 800, id="a-slot-of-nothing-gives-nothing"
        ),
        pytest.param(300, 300, T + 10, ((T, 500), (T + 10, 300)), 800, id="nothing-to-correct"),
        pytest.param(
            300,
            550,
            T + 10,
            ((T, 500), (T + 10, 300), (T + 20, 250)),
            1050,
            id="more-is-spent-when-reported",
        ),
        pytest.param(-5, -1, T + 10, ((T, 500), (T + 10, 300)), 800, id="negatives-are-nothing"),
    ],
)
def test_reconcile(
    reserved: int,
    used_: int,
    reserved_at: float,
    expected_slots: tuple[tuple[float, int], ...],
    expected_used: int,
) -> None:
    quota = reconcile(TWO_SPENDS, reserved=reserved, used=used_, reserved_at=reserved_at, at=T + 20)
    assert token_slots(quota) == expected_slots
    assert used(quota, TPM[0], T + 20) == expected_used
    assert used(quota, PER_MIN[0], T + 20) == 2  # requests are never reconciled


def test_a_refund_after_its_slot_left_the_log_takes_nothing() -> None:
    quota = spent([(T, Cost(tokens=500)), (T + KEPT_FOR + 3600, Cost(tokens=7))])
    assert token_slots(quota) == ((T + KEPT_FOR + 3600, 7),)
    after = reconcile(quota, reserved=500, used=0, reserved_at=T, at=T + KEPT_FOR + 3600)
    assert after == quota


def test_a_refund_of_a_reservation_aged_into_a_minute_comes_from_that_minute() -> None:
    quota = spent([(T + 5, Cost(tokens=500)), (T + 30, Cost(tokens=300))])
    quota = reserve(quota, Cost(requests=0, tokens=1), T + 400)
    assert token_slots(quota) == ((T, 800), (T + 400, 1))  # the minute [T, T + 60)
    quota = reconcile(quota, reserved=500, used=100, reserved_at=T + 5, at=T + 401)
    assert token_slots(quota) == ((T, 400), (T + 400, 1))


def test_a_positive_reconcile_can_overfill_and_then_blocks() -> None:
    quota = reconcile(TWO_SPENDS, reserved=300, used=550, reserved_at=T + 10, at=T + 20)
    verdict = check(quota, TPM, Cost(tokens=1), T + 20)
    assert verdict == check(quota, TPM, Cost(tokens=1), T + 20)
    assert not verdict.ok
    assert verdict.reason == "quota:tokens/min 1050/1000, resets in 41 s"
    assert verdict.until == T + 61  # 51 over: the oldest slot (500) must go
    verdict = check(quota, TPM, Cost(tokens=1000), T + 20)
    assert verdict.until == T + 81  # all three must go, the last ([T + 20, T + 21)) at T + 81


@pytest.mark.parametrize(
    ("reserved", "used_", "expected"),
    [
        pytest.param(500, 400, 400, id="refund"),
        pytest.param(1500, 0, 0, id="never-below-empty"),
        pytest.param(500, 1200, 1200, id="more"),
    ],
)
def test_reconcile_a_calendar_window(reserved: int, used_: int, expected: int) -> None:
    limit = tokens(1000, DAY, "utc")
    quota = spent([(utc(2026, 5, 1, 9), Cost(tokens=500))])
    quota = reconcile(
        quota, reserved=reserved, used=used_, reserved_at=utc(2026, 5, 1, 9), at=utc(2026, 5, 1, 10)
    )
    assert used(quota, limit, utc(2026, 5, 1, 11)) == expected
    assert used(quota, limit, utc(2026, 5, 2)) == 0


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(requests(5, 60.0), id="rolling"),
        pytest.param(requests(5, DAY, "utc"), id="utc"),
        pytest.param(requests(5, DAY, "us-pacific"), id="us-pacific"),
    ],
)
def test_reserve_then_check(limit: Limit) -> None:
    quota = Quota()
    for n in range(5):
        assert used(quota, limit, T) == n
        assert check(quota, (limit,), Cost(requests=5 - n), T).ok
        assert not check(quota, (limit,), Cost(requests=6 - n), T).ok
        quota = reserve(quota, Cost(), T)
    assert used(quota, limit, T) == 5
    assert not check(quota, (limit,), Cost(), T).ok
    assert check(quota, (limit,), Cost(requests=0), T).ok


def test_reserve_leaves_the_provider_word_alone() -> None:
    quota = cool_down(learn(Quota(), [reported("requests", 60.0, remaining=1)], T), T)
    assert reserve(quota, Cost(requests=0, tokens=0), T) == quota  # nothing spent
    assert reserve(quota, Cost(requests=-1, tokens=-5), T) == quota
    after = reserve(quota, Cost(tokens=7), T)
    assert after.learned == quota.learned
    assert after.cooldown_until == T
    assert used(after, PER_MIN[0], T) == 1
    assert used(after, TPM[0], T) == 7


def test_a_spend_folded_late_into_a_past_day_leaves_today_alone() -> None:
    limit = requests(3, DAY, "utc")
    quota = spent([*times(2, utc(2026, 5, 2, 1)), (utc(2026, 5, 1, 23), Cost())])
    assert used(quota, limit, utc(2026, 5, 2, 2)) == 2
    assert used(quota, limit, utc(2026, 5, 1, 23, 30)) == 1


def test_a_spend_folded_late_into_a_rolling_window_counts_from_its_own_time() -> None:
    limit = requests(3, 60.0)
    quota = spent([(T + 30, Cost()), (T, Cost())])
    assert used(quota, limit, T + 30) == 2
    assert used(quota, limit, T + 61) == 1
    assert used(quota, limit, T + 91) == 0


def test_a_quota_survives_json() -> None:
    quota = learn(
        cool_down(spent(times(3, T, Cost(tokens=9))), T + 4),
        [reported("requests", 60.0, limit=30, remaining=27, reset_at=T + 60)],
        T,
    )
    assert msgspec.json.decode(msgspec.json.encode(quota), type=Quota) == quota
    assert msgspec.json.encode(Quota()) == b"{}"
    assert Quota().spend == SpendLog()


# ------------------------------------------------------- usage, as status shows it

#: (declared, quota, now) -> each limit's (key, count, declared, used, left,
#: room_at, resets_at, reported_left), in the order ``effective_limits`` gives.
USAGES = [
    pytest.param(
        PER_MIN,
        Quota(),
        T,
        [("requests/min", 30, 30, 0, 30, None, None, None)],
        id="nothing-spent",
    ),
    pytest.param(
        PER_MIN,
        spent(times(2, T)),
        T + 5,
        [("requests/min", 30, 30, 2, 28, None, T + 61, None)],
        id="a-second-slot-counts-until-a-window-after-its-end",
    ),
    pytest.param(
        (requests(3, 60.0),),
        spent([*times(2, T), (T + 10, Cost())]),
        T + 20,
        [("requests/min", 3, 3, 3, 0, T + 61, T + 71, None)],
        id="full-room-when-the-oldest-goes-empty-when-the-newest-goes",
    ),
    pytest.param(
        (requests(3, 60.0),),
        spent([*times(2, T), (T + 10, Cost())]),
        T + 61,
        [("requests/min", 3, 3, 1, 2, None, T + 71, None)],
        id="the-oldest-slot-stopped-counting",
    ),
    pytest.param(
        (requests(30, 60.0), tokens(1000, 60.0)),
        spent(times(2, T, Cost(requests=1, tokens=300))),
        T,
        [
            ("requests/min", 30, 30, 2, 28, None, T + 61, None),
            ("tokens/min", 1000, 1000, 600, 400, None, T + 61, None),
        ],
        id="requests-and-tokens-from-one-log",
    ),
    pytest.param(
        TPM,
        reconcile(
            spent(times(1, T, Cost(tokens=900))), reserved=900, used=1500, reserved_at=T, at=T
        ),
        T,
        [("tokens/min", 1000, 1000, 1500, 0, T + 61, T + 61, None)],
        id="overfilled-by-a-reconcile-nothing-left",
    ),
    pytest.param(
        (requests(100, DAY, "utc"),),
        spent([(utc(2026, 5, 1, 10), Cost()), (utc(2026, 5, 1, 11), Cost())]),
        utc(2026, 5, 1, 12),
        [("requests/day", 100, 100, 2, 98, None, utc(2026, 5, 2), None)],
        id="a-utc-day-resets-at-midnight",
    ),
    pytest.param(
        (requests(2, DAY, "utc"),),
        spent(times(2, utc(2026, 5, 1, 10))),
        utc(2026, 5, 1, 12),
        [("requests/day", 2, 2, 2, 0, utc(2026, 5, 2), utc(2026, 5, 2), None)],
        id="a-full-utc-day-has-room-at-midnight",
    ),
    pytest.param(
        PER_MIN,
        learn(spent(times(2, T)), [reported("requests", 60.0, limit=20, remaining=18)], T),
        T,
        [("requests/min", 20, 30, 2, 18, None, T + 61, 18)],
        id="tightened-by-the-provider-keeps-the-declared-count-beside",
    ),
    pytest.param(
        PER_MIN,
        learn(
            Quota(),
            [reported("tokens", 60.0, limit=6000, remaining=0, reset_at=T + 9)],
            T,
        ),
        T,
        [
            ("requests/min", 30, 30, 0, 30, None, None, None),
            ("tokens/min", 6000, None, 0, 6000, None, None, 0),
        ],
        id="a-window-only-the-provider-reported-has-no-declared-count",
    ),
    pytest.param(
        (),
        learn(Quota(), [reported("tokens", 60.0, limit=6000, remaining=0, reset_at=T + 9)], T),
        T + 9,
        [("tokens/min", 6000, None, 0, 6000, None, None, None)],
        id="a-report-past-its-reset-is-not-shown",
    ),
    pytest.param(
        (requests(30, 60.0), requests(20, 60.0)),
        Quota(),
        T,
        [("requests/min", 20, 20, 0, 20, None, None, None)],
        id="the-tightest-of-two-declared",
    ),
    pytest.param((), spent(times(2, T)), T, [], id="no-limits-no-usage"),
]


@pytest.mark.parametrize(("declared", "quota", "now", "expected"), USAGES)
def test_limit_usage(
    declared: tuple[Limit, ...],
    quota: Quota,
    now: float,
    expected: list[tuple[str, int, int | None, int, int, float | None, float | None, int | None]],
) -> None:
    usages = limit_usage(quota, declared, now)
    assert [
        (
            u.key,
            u.count,
            u.declared,
            u.used,
            u.left,
            u.room_at,
            u.resets_at,
            u.reported_left,
        )
        for u in usages
    ] == expected


def test_limit_usage_names_the_reported_reset_and_the_window() -> None:
    quota = learn(Quota(), [reported("requests", DAY, limit=50, remaining=3, reset_at=T + 99)], T)
    (usage,) = limit_usage(quota, (requests(1000, DAY, "us-pacific"),), T)
    assert (usage.reported_left, usage.reported_reset_at) == (3, T + 99)
    assert (usage.kind, usage.window, usage.calendar, usage.count) == (
        "requests",
        DAY,
        "us-pacific",
        50,
    )


def test_usage_left_is_what_check_finds_room_for() -> None:
    """The usage of a limit says what the binder's check answers: ``left`` fits,
    one more does not, and at ``room_at`` one fits again."""
    limit = requests(3, 60.0)
    quota = spent([*times(2, T), (T + 10, Cost())])
    for now in (T, T + 30, T + 61, T + 70, T + 71):
        (usage,) = limit_usage(quota, (limit,), now)
        assert check(quota, (limit,), Cost(requests=usage.left), now).ok
        assert not check(quota, (limit,), Cost(requests=usage.left + 1), now).ok
        if usage.room_at is not None:
            assert check(quota, (limit,), Cost(), usage.room_at).ok
            assert not check(quota, (limit,), Cost(), math.nextafter(usage.room_at, 0)).ok
        if usage.resets_at is not None:
            assert used(quota, limit, usage.resets_at) == 0
            assert used(quota, limit, math.nextafter(usage.resets_at, 0)) > 0


# -------------------------------------------------------------- properties

#: Examples per property: 80 in `make test` (the suite's time budget);
#: ``RENQUEUE_PROPERTY_EXAMPLES=2000`` for a thorough run.
PROPERTIES = settings(
    max_examples=int(os.environ.get("RENQUEUE_PROPERTY_EXAMPLES", "80")), deadline=None
)

#: Windows: round ones, and any length (never a whole number of the log's slots).
window_lengths = st.sampled_from([1.0, 10.0, 60.0, 3600.0]) | st.floats(0.05, 600.0)
starts = st.floats(1.7e9, 1.8e9)


@st.composite
def rolling_limits(draw: st.DrawFn) -> tuple[Limit, ...]:
    return tuple(
        draw(
            st.lists(
                st.builds(
                    Limit,
                    kind=st.sampled_from(["requests", "tokens"]),
                    count=st.integers(1, 3) | st.integers(1, 40),  # small ones fill often
                    window=window_lengths,
                ),
                min_size=1,
                max_size=3,
                unique_by=lambda limit: limit.key,
            )
        )
    )


#: A time step: seconds, or ``"until"`` (sleep until the check's ``until``, as a
#: binder would), ``"edge"`` (to the next moment where a rounding could matter) or
#: ``"hair"`` (a hair before it: a spend at the very end of its slot, which only an
#: exact expiry keeps counting long enough).
Step = float | str
#: Steps, each with the cost the client asks for then and, perhaps, what the
#: provider's answer to its oldest unanswered call gives back of its token
#: reservation (negative: it used more than reserved).
Plan = list[tuple[Step, Cost, int | None]]


def plans(
    longest: float,
    costs: st.SearchStrategy[Cost],
    give_backs: st.SearchStrategy[int | None] | None = None,
) -> st.SearchStrategy[Plan]:
    if give_backs is None:
        give_backs = st.none() | st.integers(0, 45)
    step = st.sampled_from(["until", "edge", "hair", 0.0]) | st.floats(0.0, 2 * longest)
    return st.lists(st.tuples(step, costs, give_backs), max_size=60)


def second_edge(limits: Sequence[Limit], now: float) -> float:
    """The next whole second: a spend there starts its slot."""
    return float(math.ceil(now))


def midnight_edge(limits: Sequence[Limit], now: float) -> float:
    """The next midnight of ``limits[0]``'s calendar."""
    return next_midnight(now, limits[0].calendar)


def hair_before(edge: float, now: float) -> float:
    return max(now, math.nextafter(edge, -math.inf))


def run_client(
    limits: tuple[Limit, ...], start: float, plan: Plan
) -> tuple[Quota, list[tuple[float, Cost]], float]:
    """A client that reserves only when ``check`` says ok, and reconciles its calls
    in order. Answers the quota, what it really spent when (a reservation at its
    time, with the tokens reported), and the time it ended."""
    edge = second_edge if limits[0].calendar == "rolling" else midnight_edge
    quota, now = Quota(), start
    history: list[tuple[float, Cost]] = []
    unanswered: deque[int] = deque()
    for step, cost, give_back in plan:
        if step == "until":
            verdict = check(quota, limits, cost, now)
            if not verdict.ok and math.isfinite(verdict.until):
                now = verdict.until
        elif step == "edge":
            now = edge(limits, now)
        elif step == "hair":
            now = hair_before(edge(limits, now), now)
        else:
            assert isinstance(step, float)
            now += step
        if give_back is not None and unanswered:
            index = unanswered.popleft()
            at, spend = history[index]
            reported_ = max(0, spend.tokens - give_back)
            quota = reconcile(quota, reserved=spend.tokens, used=reported_, reserved_at=at, at=now)
            history[index] = (at, Cost(spend.requests, reported_))
            if reported_ > spend.tokens:  # spent at the answer, as the log has it
                history[index] = (at, Cost(spend.requests, spend.tokens))
                history.append((now, Cost(0, reported_ - spend.tokens)))
        if check(quota, limits, cost, now).ok:
            quota = reserve(quota, cost, now)
            history.append((now, cost))
            unanswered.append(len(history) - 1)
        assert len(quota.spend.slots) <= MAX_SLOTS
    return quota, history, now


def most_in_any_window(limit: Limit, history: list[tuple[float, Cost]]) -> int:
    """The most ``limit`` counts in any half-open stretch (t - window, t], exactly:
    a stretch holding the most may end at a spend's time."""
    exact = [(Fraction(at), cost.of(limit.kind)) for at, cost in history]
    window = Fraction(limit.window)
    most = 0
    for end, _ in exact:
        most = max(most, sum(n for at, n in exact if end - window < at <= end))
    return most


costs = st.builds(Cost, requests=st.integers(0, 3), tokens=st.integers(0, 45))


@PROPERTIES
@given(
    rolling_limits().flatmap(
        lambda ls: st.tuples(st.just(ls), starts, plans(max_window(ls), costs))
    )
)
def test_a_client_that_checks_never_spends_more_than_count_in_any_window(
    case: tuple[tuple[Limit, ...], float, Plan],
) -> None:
    limits, start, plan = case
    _, history, _ = run_client(limits, start, plan)
    for limit in limits:
        assert most_in_any_window(limit, history) <= limit.count, limit


def max_window(limits: Sequence[Limit]) -> float:
    return max(limit.window for limit in limits)


@st.composite
def quotas(draw: st.DrawFn) -> tuple[tuple[Limit, ...], Quota, float]:
    """Limits (rolling or calendar), a quota a checking client left them in (its
    calls answered with fewer or more tokens than reserved), and the time it
    ended; perhaps cooled down, exhausted or with windows reported empty."""
    limits, start = draw(
        st.tuples(rolling_limits(), starts) | st.tuples(calendar_limits(), calendar_starts)
    )
    give_backs = st.none() | st.integers(-30, 45)
    quota, _, now = run_client(limits, start, draw(plans(max_window(limits), costs, give_backs)))
    if draw(st.booleans()):
        quota = cool_down(quota, now + draw(st.floats(-10.0, 120.0)))
    if draw(st.booleans()):
        quota = cool_down(quota, now + draw(st.floats(-10.0, 120.0)), exhausted=True)
    reports = draw(
        st.lists(
            st.builds(
                ReportedLimit,
                kind=st.sampled_from(["requests", "tokens", "input_tokens"]),
                window=st.sampled_from([None, 60.0, DAY]),
                remaining=st.integers(0, 2),
                reset_at=st.none() | st.floats(-10.0, 120.0).map(lambda d: now + d),
            ),
            max_size=2,
        )
    )
    return limits, learn(quota, reports, now), now


@PROPERTIES
@given(quotas(), costs, st.floats(0.0, 3 * DAY), st.floats(0.0, 3 * DAY))
def test_check_is_monotone(
    state: tuple[tuple[Limit, ...], Quota, float], cost: Cost, wait: float, more: float
) -> None:
    limits, quota, now = state
    if check(quota, limits, cost, now + wait).ok:
        assert check(quota, limits, cost, now + wait + more).ok


@PROPERTIES
@given(quotas(), costs, st.floats(0.0, 2 * DAY))
def test_a_cost_fits_at_until_and_not_a_moment_before(
    state: tuple[tuple[Limit, ...], Quota, float], cost: Cost, wait: float
) -> None:
    limits, quota, now = state
    now += wait
    verdict = check(quota, limits, cost, now)
    if verdict.ok:
        return
    assert verdict.until > now
    if math.isinf(verdict.until):
        assert any(cost.of(limit.kind) > limit.count for limit in limits)
        assert verdict.reason.endswith("never fits")
        return
    assert check(quota, limits, cost, verdict.until).ok, verdict
    assert not check(quota, limits, cost, math.nextafter(verdict.until, -math.inf)).ok


@PROPERTIES
@given(quotas())
def test_a_quota_survives_json_whatever_it_holds(
    state: tuple[tuple[Limit, ...], Quota, float],
) -> None:
    _, quota, _ = state
    assert msgspec.json.decode(msgspec.json.encode(quota), type=Quota) == quota


#: Pacific midnights from 2025 to 2028, to place a moment in its Pacific day.
PACIFIC_MIDNIGHTS = [
    datetime.datetime.combine(
        datetime.date(2025, 1, 1) + datetime.timedelta(days=n), datetime.time(), PACIFIC
    ).timestamp()
    for n in range(4 * 366)
]


def calendar_day(at: float, calendar: Calendar) -> int:
    """The day holding ``at``, exactly: a UTC day number or a count of Pacific midnights."""
    if calendar == "utc":
        return math.floor(Fraction(at) / 86_400)
    return bisect.bisect_right(PACIFIC_MIDNIGHTS, at)


def next_midnight(at: float, calendar: Calendar) -> float:
    if calendar == "utc":
        return (math.floor(at / DAY) + 1) * DAY
    return PACIFIC_MIDNIGHTS[bisect.bisect_right(PACIFIC_MIDNIGHTS, at)]


#: Around the 2026 clock changes, and an ordinary day.
calendar_starts = st.sampled_from(
    [pacific(2026, 3, 7, 12), pacific(2026, 10, 31, 12), utc(2026, 5, 1, 12)]
).flatmap(lambda at: st.floats(at, at + 2 * DAY))


@st.composite
def calendar_limits(draw: st.DrawFn) -> tuple[Limit, ...]:
    calendar: Calendar = draw(st.sampled_from(["utc", "us-pacific"]))
    return (
        requests(draw(st.integers(1, 5)), DAY, calendar),
        tokens(draw(st.integers(1, 60)), DAY, calendar),
    )[: draw(st.integers(1, 2))]


@PROPERTIES
@given(
    calendar_limits(),
    calendar_starts,
    plans(DAY / 4, st.builds(Cost, requests=st.integers(0, 2), tokens=st.integers(0, 30))),
)
def test_a_client_that_checks_never_spends_more_than_count_in_a_calendar_day(
    limits: tuple[Limit, ...], start: float, plan: Plan
) -> None:
    _, history, _ = run_client(limits, start, plan)
    for limit in limits:
        days: dict[int, int] = {}
        for at, cost in history:
            day = calendar_day(at, limit.calendar)
            days[day] = days.get(day, 0) + cost.of(limit.kind)
        assert max(days.values(), default=0) <= limit.count, (limit, days)


@st.composite
def any_ops(draw: st.DrawFn) -> list[tuple[str, float, int]]:
    """Reserves regardless of check, reconciles either way (of any earlier
    moment), and events folded late, over seconds, minutes and hours."""
    op = st.tuples(
        st.sampled_from(["reserve", "reserve", "reconcile"]),
        st.floats(-5.0, 5.0) | st.floats(0.0, 200.0) | st.floats(-3600.0, 4 * 3600.0),
        st.integers(-100, 100),
    )
    return draw(st.lists(op, max_size=150))


@PROPERTIES
@given(rolling_limits() | calendar_limits(), starts, any_ops())
def test_the_spend_log_stays_small_whatever_is_spent(
    limits: tuple[Limit, ...], start: float, ops: list[tuple[str, float, int]]
) -> None:
    quota, now = Quota(), start
    for name, step, amount in ops:
        now += step
        if name == "reserve":
            quota = reserve(quota, Cost(abs(amount), abs(amount)), now)
        else:
            quota = reconcile(
                quota, reserved=100, used=100 + amount, reserved_at=now - abs(step), at=now
            )
        assert len(quota.spend.slots) <= MAX_SLOTS
        assert all(slot.requests >= 0 and slot.tokens >= 0 for slot in quota.spend.slots)
        assert all(slot.requests or slot.tokens for slot in quota.spend.slots)
        for limit in limits:
            assert used(quota, limit, now) >= 0


@PROPERTIES
@given(
    quotas(),
    costs,
    st.floats(-10.0, 2 * DAY),
    st.integers(-50, 50),
    st.lists(
        st.builds(
            ReportedLimit,
            kind=st.sampled_from(["requests", "tokens", "output_tokens"]),
            window=st.sampled_from([None, 60.0, DAY]),
            limit=st.none() | st.integers(0, 50),
            remaining=st.none() | st.integers(0, 5),
        ),
        max_size=3,
    ),
)
def test_the_functions_are_pure(
    state: tuple[tuple[Limit, ...], Quota, float],
    cost: Cost,
    wait: float,
    correction: int,
    reports: list[ReportedLimit],
) -> None:
    limits, quota, now = state
    at = now + wait
    before = copy.deepcopy((limits, quota, cost, reports))
    calls: list[Callable[[], object]] = [
        lambda: check(quota, limits, cost, at),
        lambda: reserve(quota, cost, at),
        lambda: reconcile(quota, reserved=50, used=50 + correction, reserved_at=now, at=at),
        lambda: cool_down(quota, at),
        lambda: cool_down(quota, at, exhausted=True),
        lambda: learn(quota, reports, at),
        lambda: effective_limits(limits, quota),
        lambda: [used(quota, limit, at) for limit in limits],
    ]
    for call in calls:
        assert call() == call()
        assert (limits, quota, cost, reports) == before


@PROPERTIES
@given(quotas(), st.floats(0.0, 2 * DAY))
def test_limit_usage_counts_as_check_does(
    state: tuple[tuple[Limit, ...], Quota, float], wait: float
) -> None:
    """For any limit and spend: ``left`` is the largest cost ``check`` lets
    through (its spend alone: cooldowns and reports set aside), ``room_at``
    the first moment a cost of one fits once none does, ``resets_at`` the first
    moment nothing counts."""
    declared, quota, now = state
    now += wait
    spend_only = Quota(spend=quota.spend)
    for usage in limit_usage(quota, declared, now):
        limit = Limit(
            kind=usage.kind, count=usage.count, window=usage.window, calendar=usage.calendar
        )

        def cost(n: int, kind: str = usage.kind) -> Cost:
            return Cost(requests=n, tokens=0) if kind == "requests" else Cost(requests=0, tokens=n)

        assert usage.used == used(quota, limit, now)
        assert usage.left == max(0, usage.count - usage.used)
        assert check(spend_only, (limit,), cost(usage.left), now).ok
        assert not check(spend_only, (limit,), cost(usage.left + 1), now).ok
        if usage.left > 0:
            assert usage.room_at is None
        else:
            assert usage.room_at is not None
            assert usage.room_at > now
            assert check(spend_only, (limit,), cost(1), usage.room_at).ok
            assert not check(
                spend_only, (limit,), cost(1), math.nextafter(usage.room_at, -math.inf)
            ).ok
        if usage.used <= 0:
            assert usage.resets_at is None
        else:
            assert usage.resets_at is not None
            assert used(quota, limit, usage.resets_at) == 0
            assert used(quota, limit, math.nextafter(usage.resets_at, -math.inf)) > 0


@pytest.mark.parametrize("far", [1e300, -1e300, 1e15])
def test_a_time_past_the_calendars_range_is_judged_not_raised(far: float) -> None:
    """A forged or broken event can stamp a spend (and so ``newest``) far past
    what ``datetime`` holds: a US Pacific day around it raised OverflowError in
    every binder round (and in ``renqueue status``)."""
    limit = requests(3, DAY, "us-pacific")
    quota = Quota(spend=SpendLog(slots=(Slot(far, 3600.0, 3, 0),), newest=far))
    for now in (far, T):
        verdict = check(quota, [limit], Cost(requests=1), now)
        assert isinstance(verdict, QuotaVerdict)
        assert used(quota, limit, now) >= 0
