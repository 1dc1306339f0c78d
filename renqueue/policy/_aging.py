"""Aging and pick order: a waiting request's effective priority, as plain functions.

A request waits at the level it was submitted with. Each level may say how long
a request waits there before it is *promoted* (``age_after``) and to which
level (``promote_to``, default the next more urgent one); promotion repeats
from the new level with that level's ``age_after``. Waiting time is measured
from when the broker stored the request (server time, the time its
``submitted`` event records; never the ``submitted_at`` a client wrote into
the payload, nor when a router happened to see it), so the bound holds across
router restarts and a tenant cannot backdate its way up.

With every level aging towards the top, a request submitted at level L is
treated as the most urgent level after at most the sum of the ``age_after``
on its path, and from then on it competes oldest-first with everything else
at the top: sustained urgent traffic can delay it by at most that bound plus
the time for one slot to free (:func:`aging_bound`).
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct


class LevelPolicy(Struct, frozen=True, kw_only=True):
    """How one priority level behaves; ``rank`` 0 is the most urgent."""

    name: str
    rank: int
    #: Seconds of waiting at this level before promotion; ``None`` = never.
    age_after: float | None = None
    #: Rank promoted to; ``None`` = the next more urgent level.
    promote_to: int | None = None
    #: Running requests at this level may be preempted by urgent ones.
    preemptible: bool = False
    #: Requests at this level may preempt preemptible ones.
    preempts: bool = False
    #: Seconds a request at this level with no deadline may wait for a free or
    #: cheaper backend rather than pay now (its choice is made as if it had a
    #: deadline this long after its submit; it never expires for it); ``None``:
    #: the cheapest that can start now.
    patience: float | None = None


def promotions(
    rank: int, waited: float, policies: Sequence[LevelPolicy]
) -> list[tuple[int, float]]:
    """The promotions a request of ``rank`` has earned after ``waited`` seconds.

    Returns ``(new_rank, after_seconds)`` pairs in order; the last one (if any)
    is the request's effective rank. Pure: no clock, no I/O.
    """
    steps: list[tuple[int, float]] = []
    elapsed = 0.0
    current = rank
    seen = {current}
    while True:
        policy = policies[current]
        if policy.age_after is None or current == 0:
            return steps
        elapsed += policy.age_after
        if waited < elapsed:
            return steps
        target = current - 1 if policy.promote_to is None else policy.promote_to
        if target in seen or not 0 <= target < current:
            return steps  # a misconfigured cycle or demotion: stop where we are
        seen.add(target)
        current = target
        steps.append((current, elapsed))


def effective_rank(rank: int, waited: float, policies: Sequence[LevelPolicy]) -> int:
    """The rank a request of ``rank`` competes at after waiting ``waited`` seconds."""
    steps = promotions(rank, waited, policies)
    return steps[-1][0] if steps else rank


def pick_key(
    rank: int,
    submitted_at: float,
    now: float,
    policies: Sequence[LevelPolicy],
    *,
    parent: tuple[int, float] | None = None,
    boost: tuple[int, float] | None = None,
) -> tuple[int, float]:
    """Sort key for waiting requests: most urgent effective rank first, then oldest.

    ``parent`` is the (rank, submitted_at) of the request's parent: a child
    never competes below its parent's effective rank (priority inheritance).
    ``boost`` is the most urgent (rank, submitted_at) among the requests that
    coalesced onto this one: the shared call competes at its most urgent
    waiter's effective rank. Neither changes the age the request is ordered by.
    """
    own = effective_rank(rank, max(0.0, now - submitted_at), policies)
    if parent is not None:
        own = min(own, effective_rank(parent[0], max(0.0, now - parent[1]), policies))
    if boost is not None:
        own = min(own, effective_rank(boost[0], max(0.0, now - boost[1]), policies))
    return (own, submitted_at)


def aging_bound(rank: int, policies: Sequence[LevelPolicy]) -> float | None:
    """Seconds after which a request of ``rank`` competes at the top level.

    ``None`` when its path never reaches the top (a level with no aging).
    """
    steps = promotions(rank, float("inf"), policies)
    if rank == 0:
        return 0.0
    if not steps or steps[-1][0] != 0:
        return None
    return steps[-1][1]
