"""What a backend was sent, over time: the spend log quotas are judged by.

A :class:`SpendLog` records requests and tokens in time slots, finer for
recent spend and coarser for older: one second for the last
:data:`FINE_FOR`, one minute for the last :data:`MEDIUM_FOR`, one hour for the
last :data:`KEPT_FOR` (a day and a day more, for daily quotas whatever the
zone), ages taken from the newest time recorded. So it stays small (at most
:data:`MAX_SLOTS` slots) at any rate, and it needs no configuration: any
window a limit declares, of any length up to :data:`KEPT_FOR`, is read from
the same log, and changing a limit never needs the log folded again.

A slot holds the spend of ``[start, start + length)``; slots are aligned to
whole multiples of their length from the epoch, so the slots holding one
moment nest (a second inside its minute inside its hour), and none straddles
a whole hour: not a UTC midnight, nor a US Pacific one (its offsets from UTC
are whole hours).

Reading is conservative: a slot counts as a whole as long as any part of it
lies in the window, so a spend is counted at least as long as it happened
ago, never shorter. A limit of ``count`` per ``window`` read from this log
is therefore never exceeded in any stretch of ``window`` seconds, whatever
the provider counts by (a token bucket, fixed windows, or a sliding log).
Merging an old slot into a coarser one only makes it count longer.

Every function is pure: times are the caller's (event times when folding).
"""

from __future__ import annotations

import bisect
import math
from typing import Final, Literal

from msgspec import Struct

__all__ = [
    "FINE_FOR",
    "KEPT_FOR",
    "MAX_SLOTS",
    "MEDIUM_FOR",
    "Slot",
    "SpendLog",
    "expiries",
    "record",
    "refund_tokens",
    "spent",
]

#: Spend younger than this (relative to the log's newest) keeps 1-second slots.
FINE_FOR: Final = 180.0
#: Spend younger than this keeps 1-minute slots; older, 1-hour slots.
MEDIUM_FOR: Final = 3 * 3600.0
#: Spend older than this is forgotten: a longer window cannot be judged.
KEPT_FOR: Final = 49 * 3600.0

_HOUR: Final = 3600.0
_RESOLUTIONS: Final = ((FINE_FOR, 1.0), (MEDIUM_FOR, 60.0), (KEPT_FOR, _HOUR))

#: The most slots a log holds (412): a slot of each length ends less than that
#: length's age limit before the newest and starts no later than the newest, so
#: the starts lie in a stretch one slot longer than the age limit: 181 seconds,
#: 181 minutes, 50 hours.
MAX_SLOTS: Final = sum(math.floor((young + length) / length) for young, length in _RESOLUTIONS)


class Slot(Struct, frozen=True, array_like=True):
    """Spend from ``start`` for ``length`` seconds."""

    start: float
    length: float
    requests: int = 0
    tokens: int = 0

    @property
    def end(self) -> float:
        return self.start + self.length

    def of(self, kind: str) -> int:
        """Its requests (``kind == "requests"``) or tokens."""
        return self.requests if kind == "requests" else self.tokens


class SpendLog(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Slots by start, then length (a late spend may land in a finer slot
    inside a coarser one: each counts); ``newest`` is the latest time recorded."""

    slots: tuple[Slot, ...] = ()
    newest: float = 0.0
    #: The ``newest`` time from which a slot may need coarsening or dropping
    #: (0: not known, look now): a record looks over its slots only then, not
    #: at every spend (a log of a busy backend holds ~180 one-second slots).
    ages_at: float = 0.0


def _resolution(age: float) -> float | None:
    for young, length in _RESOLUTIONS:
        if age < young:
            return length
    return None


def _slot_of(at: float, length: float) -> float:
    """The start of the slot of ``length`` holding ``at``: ``start <= at < start + length``,
    whatever the rounding of ``at / length``."""
    index = math.floor(at / length)
    if index * length > at:
        index -= 1
    elif (index + 1) * length <= at:
        index += 1
    return index * length


def _widened(length: float) -> float:
    return 60.0 if length < 60.0 else _HOUR


def record(log: SpendLog, at: float, *, requests: int = 0, tokens: int = 0) -> SpendLog:
    """``log`` with ``requests`` and ``tokens`` spent at ``at`` (older slots coarsened).

    A spend older than :data:`KEPT_FOR` (before the newest) is not kept; a
    negative amount counts as none, and so does a time that is not finite.
    """
    if not math.isfinite(at):
        return log
    newest = max(log.newest, at)
    requests, tokens = max(requests, 0), max(tokens, 0)
    ages_at = log.ages_at
    if newest >= ages_at:
        if any(_ages_out(slot, newest) for slot in log.slots):
            merged: dict[tuple[float, float], list[int]] = {}
            for slot in log.slots:
                _add(
                    merged, slot.start, slot.end, newest, requests=slot.requests, tokens=slot.tokens
                )
            if requests or tokens:
                _add(merged, at, at, newest, requests=requests, tokens=tokens)
            slots = tuple(
                Slot(start, length, r, t) for (start, length), (r, t) in sorted(merged.items())
            )
            return SpendLog(slots=slots, newest=newest, ages_at=_ages_at(slots))
        ages_at = _ages_at(log.slots)  # not known, or earlier than need be (a refund)
    # Every slot stays as it is (the common case): only the new spend's slot changes.
    length = _resolution(newest - at)
    if length is None or not (requests or tokens):
        if newest == log.newest and ages_at == log.ages_at:
            return log
        return SpendLog(slots=log.slots, newest=newest, ages_at=ages_at)
    start = _slot_of(at, length)
    key = (start, length)
    last = _key(log.slots[-1]) if log.slots else None
    # The newest slot, or a new one after it, is the usual one: no search for it.
    if last == key:
        index = len(log.slots) - 1
    elif last is None or last < key:
        index = len(log.slots)
    else:
        index = bisect.bisect_left(log.slots, key, key=_key)
    updated = list(log.slots)
    if index < len(updated) and _key(updated[index]) == key:
        slot = updated[index]
        updated[index] = Slot(start, length, slot.requests + requests, slot.tokens + tokens)
    else:
        slot = Slot(start, length, requests, tokens)
        updated.insert(index, slot)
        ages_at = min(ages_at, _aging(slot)) if ages_at else _aging(slot)
    return SpendLog(slots=tuple(updated), newest=newest, ages_at=ages_at)


def _aging(slot: Slot) -> float:
    """The ``newest`` time from which ``slot`` must be coarsened (or dropped)."""
    for young, length in _RESOLUTIONS:
        if length == slot.length:
            return slot.end + young
    return slot.end  # not a length this log makes: look again at once


def _ages_at(slots: tuple[Slot, ...]) -> float:
    """The earliest :func:`_aging` of ``slots``; 0 (look at any time) for none."""
    return min((_aging(slot) for slot in slots), default=0.0)


def _key(slot: Slot) -> tuple[float, float]:
    return slot.start, slot.length


def _ages_out(slot: Slot, newest: float) -> bool:
    """Whether a slot's age at ``newest`` calls for a coarser slot, or for none."""
    length = _resolution(newest - slot.end)
    return length is None or length > slot.length


def _add(
    merged: dict[tuple[float, float], list[int]],
    start: float,
    end: float,
    newest: float,
    *,
    requests: int,
    tokens: int,
) -> None:
    """Put spend of ``[start, end)`` (a moment: ``start == end``) into the slot its
    age calls for (or forget it).

    Its age is taken from its end, and the slot chosen holds ``start`` and
    reaches ``end``: a coarser slot starts no later and ends no earlier, so
    the spend counts at least as long as before. (Slots are aligned, so an
    hour always holds a minute or a second.)
    """
    length = _resolution(newest - end)
    if length is None:
        return
    slot_start = _slot_of(start, length)
    while slot_start + length < end and length < _HOUR:
        length = _widened(length)  # a coarser slot kept its length as it aged
        slot_start = _slot_of(start, length)
    counts = merged.setdefault((slot_start, length), [0, 0])
    counts[0] += requests
    counts[1] += tokens
    if not (counts[0] or counts[1]):
        del merged[(slot_start, length)]


def refund_tokens(log: SpendLog, tokens: int, reserved_at: float) -> SpendLog:
    """``log`` with ``tokens`` taken back from the slot that holds ``reserved_at``.

    Only from a slot holding that moment, and never below zero: taking them
    from a later slot would stop counting spend that really happened later,
    and from an earlier one, spend of other requests. The slots holding a
    moment nest (a late spend's second inside the minute the reservation
    aged into); they are drawn on finest first. The reservation lies whole in
    one of them, which holds its tokens, so the refund is taken before any
    coarser one is touched, and what a finer one gives back still lies inside
    the reservation's slot: its tokens stay counted there. What cannot be
    taken back (the slot left the log) stays counted (a reservation
    overestimated errs the safe way).
    """
    left = max(tokens, 0)
    if not left or not math.isfinite(reserved_at):
        return log
    holding = sorted(
        (slot.length, index)
        for index, slot in enumerate(log.slots)
        if slot.start <= reserved_at < slot.end and slot.tokens > 0
    )
    if not holding:
        return log
    slots = list(log.slots)
    for _length, index in holding:
        slot = slots[index]
        taken = min(slot.tokens, left)
        slots[index] = Slot(slot.start, slot.length, slot.requests, slot.tokens - taken)
        left -= taken
        if not left:
            break
    return SpendLog(
        # A slot gone only makes ``ages_at`` early: the next record looks and corrects it.
        slots=tuple(s for s in slots if s.requests or s.tokens),
        newest=log.newest,
        ages_at=log.ages_at,
    )


def spent(log: SpendLog, kind: Literal["requests", "tokens"], since: float, now: float) -> int:
    """Requests or tokens spent in slots overlapping ``(since, now]``."""
    return sum(slot.of(kind) for slot in log.slots if slot.end > since and slot.start <= now)


def expiries(
    log: SpendLog, kind: Literal["requests", "tokens"], since: float
) -> list[tuple[float, int]]:
    """``(end, amount)`` of each slot ending after ``since`` with spend of ``kind``,
    earliest end first: when, as the window moves on, each stops counting."""
    return sorted(
        (slot.end, slot.of(kind)) for slot in log.slots if slot.end > since and slot.of(kind) > 0
    )
