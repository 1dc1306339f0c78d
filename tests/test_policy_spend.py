"""The spend log (renqueue.policy._spend): slots by age, coarsening, refunds and
reads, then properties over any sequence of spends (late ones too) against the
raw history: every spend counts at least as long as its true age, merging
never shortens a slot, and the log stays small."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.policy._spend import (
    FINE_FOR,
    KEPT_FOR,
    MAX_SLOTS,
    MEDIUM_FOR,
    Slot,
    SpendLog,
    expiries,
    record,
    refund_tokens,
    spent,
)

#: A whole hour (so a whole minute and second too).
T = 1_780_000_000.0 - 1_780_000_000.0 % 3600
MINUTE = 60.0
HOUR = 3600.0


def log_of(*spends: tuple[float, int, int]) -> SpendLog:
    """A log after ``(at, requests, tokens)`` recorded in order."""
    log = SpendLog()
    for at, requests, tokens in spends:
        log = record(log, at, requests=requests, tokens=tokens)
    return log


# ------------------------------------------------------------------ record


def test_a_spend_lands_in_the_second_that_holds_it() -> None:
    log = log_of((T + 0.25, 1, 10), (T + 0.75, 2, 0), (T + 1.0, 0, 5))
    assert log.slots == (Slot(T, 1.0, 3, 10), Slot(T + 1, 1.0, 0, 5))
    assert log.newest == T + 1.0


@pytest.mark.parametrize(
    ("later", "expected"),
    [
        pytest.param(FINE_FOR - 1.0, Slot(T + 5, 1.0, 1, 7), id="still-a-second"),
        pytest.param(FINE_FOR + 6.0, Slot(T, MINUTE, 1, 7), id="a-minute-once-older-than-180-s"),
        pytest.param(MEDIUM_FOR + 6.0, Slot(T, HOUR, 1, 7), id="an-hour-once-older-than-3-h"),
        pytest.param(KEPT_FOR - 1.0, Slot(T, HOUR, 1, 7), id="an-hour-until-49-h"),
        pytest.param(KEPT_FOR + HOUR, None, id="forgotten-after-49-h"),
    ],
)
def test_a_spend_is_coarsened_as_it_ages(later: float, expected: Slot | None) -> None:
    log = log_of((T + 5.5, 1, 7), (T + 5.5 + later, 0, 1))
    assert log.slots[:-1] == ((expected,) if expected else ())
    assert log.slots[-1] == Slot(math.floor(T + 5.5 + later), 1.0, 0, 1)


def test_coarsening_merges_the_slots_of_one_minute_or_hour() -> None:
    log = log_of((T + 1, 1, 0), (T + 30, 1, 0), (T + 61, 1, 0), (T + 400, 0, 1))
    assert log.slots == (Slot(T, MINUTE, 2, 0), Slot(T + 60, MINUTE, 1, 0), Slot(T + 400, 1, 0, 1))
    log = record(log, T + 4 * HOUR, requests=1)
    assert log.slots == (Slot(T, HOUR, 3, 1), Slot(T + 4 * HOUR, 1.0, 1, 0))


def test_nothing_recorded_ages_the_log_but_adds_no_slot() -> None:
    log = record(log_of((T, 1, 0)), T + 500)
    assert (log.slots, log.newest) == ((Slot(T, MINUTE, 1, 0),), T + 500)


@pytest.mark.parametrize(
    ("at", "requests", "tokens"),
    [
        pytest.param(math.nan, 1, 1, id="nan"),
        pytest.param(math.inf, 1, 1, id="inf"),
        pytest.param(-math.inf, 1, 1, id="minus-inf"),
        pytest.param(T + 9, -1, -5, id="negative-amounts"),
    ],
)
def test_what_is_no_spend_changes_nothing(at: float, requests: int, tokens: int) -> None:
    log = log_of((T + 9, 2, 3))
    assert record(log, at, requests=requests, tokens=tokens) == log


# -------------------------------------------------------------- late events


def test_a_late_spend_lands_in_the_slot_its_age_calls_for() -> None:
    log = log_of((T + HOUR * 5, 1, 0))
    log = record(log, T + HOUR * 5 - 10.5, requests=1)  # 10 s late: a second
    log = record(log, T + HOUR * 5 - 600, requests=1)  # 10 min late: a minute
    log = record(log, T + 30, requests=1)  # 5 h late: an hour
    assert log.slots == (
        Slot(T, HOUR, 1, 0),
        Slot(T + HOUR * 5 - 600, MINUTE, 1, 0),
        Slot(T + HOUR * 5 - 11, 1.0, 1, 0),
        Slot(T + HOUR * 5, 1.0, 1, 0),
    )
    assert log.newest == T + HOUR * 5  # a late spend is not the newest


def test_a_late_second_inside_an_aged_minute_counts_beside_it_until_it_ages_too() -> None:
    log = log_of((T + 10, 1, 0), (T + 60 + FINE_FOR - 30, 0, 0), (T + 60 + FINE_FOR - 30, 1, 0))
    assert log.slots[0] == Slot(T, MINUTE, 1, 0)  # [T + 10, T + 11) aged into its minute
    log = record(log, T + 50, requests=1)  # 160 s late: still a second
    assert log.slots[:2] == (Slot(T, MINUTE, 1, 0), Slot(T + 50, 1.0, 1, 0))
    assert spent(log, "requests", T + 49, T + 50) == 2
    log = record(log, T + 400, requests=1)
    assert log.slots[0] == Slot(T, MINUTE, 2, 0)


def test_a_late_spend_older_than_kept_is_forgotten() -> None:
    log = log_of((T + KEPT_FOR + 10, 1, 0))
    assert record(log, T + 5, requests=1, tokens=1) == log


# ------------------------------------------------------------------ refunds

#: 500 tokens at T + 2, 300 at T + 10, a request each.
TWO = log_of((T + 2, 1, 500), (T + 10, 1, 300))


@pytest.mark.parametrize(
    ("tokens", "reserved_at", "expected"),
    [
        pytest.param(100, T + 10, ((T + 2, 500), (T + 10, 200)), id="from-its-slot"),
        pytest.param(100, T + 10.9, ((T + 2, 500), (T + 10, 200)), id="any-moment-of-it"),
        pytest.param(300, T + 10, ((T + 2, 500), (T + 10, 0)), id="all-of-it"),
        pytest.param(900, T + 10, ((T + 2, 500), (T + 10, 0)), id="never-below-zero"),
        pytest.param(100, T + 11, ((T + 2, 500), (T + 10, 300)), id="never-from-the-next"),
        pytest.param(100, T + 9.99, ((T + 2, 500), (T + 10, 300)), id="never-from-the-one-before"),
        pytest.param(0, T + 10, ((T + 2, 500), (T + 10, 300)), id="nothing"),
        pytest.param(-100, T + 10, ((T + 2, 500), (T + 10, 300)), id="negative-is-nothing"),
        pytest.param(100, math.nan, ((T + 2, 500), (T + 10, 300)), id="no-time"),
    ],
)
def test_refund_tokens(tokens: int, reserved_at: float, expected: tuple[tuple[float, int]]) -> None:
    log = refund_tokens(TWO, tokens, reserved_at)
    assert tuple((slot.start, slot.tokens) for slot in log.slots) == expected
    assert [slot.requests for slot in log.slots] == [1, 1]  # requests are never refunded
    assert log.newest == TWO.newest


def test_a_refund_that_empties_a_slot_drops_it() -> None:
    log = refund_tokens(log_of((T, 0, 50), (T + 1, 0, 5)), 50, T + 0.5)
    assert log.slots == (Slot(T + 1, 1.0, 0, 5),)


def test_a_refund_of_a_slot_that_left_the_log_is_nothing() -> None:
    log = log_of((T, 0, 50), (T + KEPT_FOR + HOUR, 0, 5))
    assert refund_tokens(log, 50, T) == log


def test_a_refund_draws_on_the_finest_slot_holding_the_moment_first() -> None:
    """A reservation folded late into a minute, whose moment's second still holds
    another spend: both slots hold the moment. What the second gives back lies
    inside the minute, where the reservation's tokens stay counted; taking from
    the minute first could uncount the second's own spend."""
    log = log_of((T + 10.9, 0, 40), (T + 190.6, 0, 0))  # [T + 10, T + 11) is 179.6 s old
    log = record(log, T + 10.5, tokens=500)  # 180.1 s old: a minute
    assert log.slots == (Slot(T, MINUTE, 0, 500), Slot(T + 10, 1.0, 0, 40))
    after = refund_tokens(log, 100, T + 10.5)
    assert after.slots == (Slot(T, MINUTE, 0, 440),)  # 40 from the second, 60 from the minute


# ------------------------------------------------------------------ reading


@pytest.mark.parametrize(
    ("kind", "since", "now", "expected"),
    [
        pytest.param("requests", T, T + 20, 2, id="both"),
        pytest.param("tokens", T, T + 20, 800, id="tokens"),
        pytest.param("tokens", T + 2.5, T + 20, 800, id="a-slot-partly-in-counts-whole"),
        pytest.param("tokens", T + 3, T + 20, 300, id="a-slot-ended-at-since-is-out"),
        pytest.param("tokens", T, T + 9.99, 500, id="a-slot-not-begun-is-out"),
        pytest.param("tokens", T, T + 10, 800, id="a-slot-begun-at-now-is-in"),
        pytest.param("tokens", T + 11, T + 50, 0, id="after-both"),
    ],
)
def test_spent_counts_slots_overlapping_since_to_now(
    kind: str, since: float, now: float, expected: int
) -> None:
    assert spent(TWO, kind, since, now) == expected  # type: ignore[arg-type]


def test_expiries_are_slot_ends_earliest_first() -> None:
    log = log_of((T + 10, 1, 0), (T + 2, 1, 500), (T + 5, 0, 7))
    assert expiries(log, "tokens", T) == [(T + 3, 500), (T + 6, 7)]
    assert expiries(log, "requests", T) == [(T + 3, 1), (T + 11, 1)]
    assert expiries(log, "requests", T + 3) == [(T + 11, 1)]


def test_a_log_survives_json() -> None:
    log = log_of((T, 1, 2), (T + 4000, 3, 4))
    assert msgspec.json.decode(msgspec.json.encode(log), type=SpendLog) == log
    assert msgspec.json.encode(SpendLog()) == b"{}"


def test_the_log_never_holds_more_than_max_slots_even_spending_in_every_slot() -> None:
    """A spend in every hour for two days, then every minute, then every second:
    the worst case fills every slot the log may keep, and no more."""
    log, now, most = SpendLog(), T, 0
    for step, count in [(HOUR, 60), (MINUTE, 200), (1.0, 200)]:
        for _ in range(count):
            now += step
            log = record(log, now, requests=1)
            most = max(most, len(log.slots))
    assert most <= MAX_SLOTS == 412
    assert most >= 400  # (and the bound is close)


# -------------------------------------------------------------- properties

PROPERTIES = settings(
    max_examples=int(os.environ.get("RENQUEUE_PROPERTY_EXAMPLES", "80")), deadline=None
)

starts = st.floats(1.7e9, 1.8e9)
#: Steps of every scale, and back (a spend folded late).
steps = (
    st.floats(0.0, 3.0)
    | st.floats(0.0, 400.0)
    | st.floats(0.0, 4 * HOUR)
    | st.floats(-FINE_FOR, 0.0)
    | st.floats(-KEPT_FOR - HOUR, 0.0)
    | st.sampled_from([1.0, MINUTE, HOUR, -1.0])
)
spends = st.lists(st.tuples(steps, st.integers(0, 3), st.integers(0, 50)), min_size=1, max_size=40)


def replay(
    start: float, plan: list[tuple[float, int, int]]
) -> list[tuple[SpendLog, float, int, int]]:
    """Each log after each spend, with the spend: ``(log, at, requests, tokens)``."""
    out, log, at = [], SpendLog(), start
    for step, requests, tokens in plan:
        at += step
        log = record(log, at, requests=requests, tokens=tokens)
        out.append((log, at, requests, tokens))
    return out


def well_formed(log: SpendLog) -> None:
    keys = [(slot.start, slot.length) for slot in log.slots]
    assert keys == sorted(set(keys))
    for slot in log.slots:
        assert slot.length in {1.0, MINUTE, HOUR}
        assert slot.start % slot.length == 0
        assert slot.requests >= 0
        assert slot.tokens >= 0
        assert slot.requests or slot.tokens
        assert slot.start <= log.newest


@PROPERTIES
@given(st.floats(-1e12, 1e12) | starts, st.sampled_from([1.0, MINUTE, HOUR]))
def test_a_slot_holds_the_moment_it_was_spent(at: float, length: float) -> None:
    for moment in (at, math.nextafter(at, 0), math.floor(at / length) * length):
        log = record(SpendLog(newest=moment), moment, tokens=1)
        (slot,) = log.slots
        assert slot.start <= moment < slot.end


@PROPERTIES
@given(starts, spends)
def test_every_spend_counts_at_least_as_long_as_its_true_age(
    start: float, plan: list[tuple[float, int, int]]
) -> None:
    """Against the raw history: any stretch (since, now] holding a spend that is
    not yet older than KEPT_FOR reads at least that spend; nothing is invented."""
    history = replay(start, plan)
    log = history[-1][0]
    well_formed(log)
    truth = [(at, r, t) for _, at, r, t in history]
    kept = [(at, r, t) for at, r, t in truth if log.newest - at < KEPT_FOR]
    for kind, column in (("requests", 1), ("tokens", 2)):
        total = sum(slot.of(kind) for slot in log.slots)
        assert sum(s[column] for s in kept) <= total <= sum(s[column] for s in truth)
    moments = sorted({at for at, _, _ in kept})
    for i, first in enumerate(moments):
        since = math.nextafter(first, -math.inf)
        for now in moments[i:]:
            inside = [s for s in kept if Fraction(since) < Fraction(s[0]) <= Fraction(now)]
            assert spent(log, "requests", since, now) >= sum(s[1] for s in inside)
            assert spent(log, "tokens", since, now) >= sum(s[2] for s in inside)


def resolution(age: float) -> float | None:
    """Seconds, minutes, hours, or forgotten, by age (the model of the log)."""
    for young, length in ((FINE_FOR, 1.0), (MEDIUM_FOR, MINUTE), (KEPT_FOR, HOUR)):
        if age < young:
            return length
    return None


def rebuilt(log: SpendLog, at: float, requests: int, tokens: int) -> SpendLog:
    """A model of ``record``: every slot placed again, from scratch, in the slot its
    end's age calls for that covers it (or none), and then the spend."""
    newest = max(log.newest, at)
    merged: dict[tuple[float, float], list[int]] = {}
    parts = [(slot.start, slot.end, slot.requests, slot.tokens) for slot in log.slots]
    for start, end, r, t in [*parts, (at, at, max(requests, 0), max(tokens, 0))]:
        length = resolution(newest - end)
        if length is None or not (r or t):
            continue
        while math.floor(start / length) * length + length < end:
            length = MINUTE if length == 1.0 else HOUR
        counts = merged.setdefault((math.floor(start / length) * length, length), [0, 0])
        counts[0] += r
        counts[1] += t
    slots = tuple(Slot(s, length, r, t) for (s, length), (r, t) in sorted(merged.items()))
    return SpendLog(slots=slots, newest=newest)


def aging(slot: Slot) -> float:
    """When ``slot`` must be coarsened or dropped: its end plus its length's age limit."""
    young = {1.0: FINE_FOR, MINUTE: MEDIUM_FOR, HOUR: KEPT_FOR}[slot.length]
    return slot.end + young


@PROPERTIES
@given(starts, spends)
def test_record_is_the_log_placed_again_from_scratch(
    start: float, plan: list[tuple[float, int, int]]
) -> None:
    log, at = SpendLog(), start
    for step, requests, tokens in plan:
        at += step
        expected = rebuilt(log, at, requests, tokens)
        log = record(log, at, requests=requests, tokens=tokens)
        assert (log.slots, log.newest) == (expected.slots, expected.newest)
        # The log looks over its slots again no later than the first must age.
        assert not log.slots or 0 < log.ages_at <= min(aging(slot) for slot in log.slots)


@PROPERTIES
@given(starts, spends)
def test_merging_never_shortens_a_slot(start: float, plan: list[tuple[float, int, int]]) -> None:
    """Each slot a record leaves (unless forgotten) lies inside a slot of the new log,
    which holds at least its spend."""
    previous = SpendLog()
    for log, _at, _r, _t in replay(start, plan):
        for old in previous.slots:
            if log.newest - old.end >= KEPT_FOR:
                continue  # forgotten: every spend in it is older than KEPT_FOR
            covering = [s for s in log.slots if s.start <= old.start and s.end >= old.end]
            assert covering, (old, log)
            assert sum(s.requests for s in covering) >= old.requests
            assert sum(s.tokens for s in covering) >= old.tokens
        previous = log


@PROPERTIES
@given(
    starts,
    st.lists(
        st.tuples(steps, st.integers(0, 3), st.integers(0, 300), st.integers(-20, 400)),
        max_size=150,
    ),
)
def test_the_log_stays_small_whatever_is_spent_or_refunded(
    start: float, plan: list[tuple[float, int, int, int]]
) -> None:
    log, at = SpendLog(), start
    for step, requests, tokens, refund in plan:
        at += step
        log = record(log, at, requests=requests, tokens=tokens)
        log = refund_tokens(log, refund, at - abs(step) / 2)
        assert len(log.slots) <= MAX_SLOTS
        well_formed(log)


@PROPERTIES
@given(starts, spends, st.integers(0, 200), st.integers(0, 39))
def test_a_refund_never_uncounts_a_spend_it_does_not_hold(
    start: float, plan: list[tuple[float, int, int]], tokens: int, which: int
) -> None:
    """Refunding a reservation's tokens (a spend of the history, its time as
    reserved_at) keeps every other spend counted: a stretch holding spends reads
    at least their tokens, the reservation's own less what was taken back."""
    history = replay(start, plan)
    log = history[-1][0]
    truth = [(at, t) for _, at, _r, t in history if log.newest - at < KEPT_FOR]
    if not truth:
        return
    index = which % len(truth)
    reserved_at, reserved = truth[index]
    refund = min(tokens, reserved)  # a refund is never more than was reserved
    after = refund_tokens(log, refund, reserved_at)
    assert sum(s.tokens for s in log.slots) - sum(s.tokens for s in after.slots) <= refund
    truth[index] = (reserved_at, reserved - refund)
    moments = sorted({at for at, _ in truth})
    for i, first in enumerate(moments):
        since = math.nextafter(first, -math.inf)
        for now in moments[i:]:
            inside = sum(t for at, t in truth if since < at <= now)
            assert spent(after, "tokens", since, now) >= inside
