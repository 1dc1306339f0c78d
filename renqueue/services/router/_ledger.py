"""What the binder has reserved of each backend's quota that the projection may not show yet.

The projection (:mod:`renqueue.state`) folds every ``routed`` decision into
its backend's quota, a moment after the decision is stored. Between the two,
the binder counts its own reservations here, as :class:`Capacity` counts its
own dispatches: a reservation is counted from the moment it is decided until
the projection has folded the event that logged it (its stream sequence is at
or below the projection's ``last_seq``), or until it is dropped (its decision
was not logged). So a round always sees every reservation exactly once, and
a new binder, whose ledger starts empty, sees them all in the projection.

It also holds the binder's own word that a backend is out (:meth:`Ledger.pause`):
a request put back because its provider's quota is spent says so in the log
(a ``retrying`` event with ``requeued``), and the binder reads that event when
it fetches the request again. From then until the time it names, the backend
is judged out (:func:`renqueue.policy.cool_down`, ``exhausted``) whatever the
projection says: no projector running, or one that lags, never sends a
request back to a backend whose provider just said its quota is spent.
"""

from __future__ import annotations

import heapq
import itertools
import math

from ...config import Config
from ...coordination import LiveState
from ...policy import Cost, Limit, Quota, cool_down, effective_limits, reserve, says_anything

__all__ = ["Ledger", "Reserved"]


class Reserved:
    """One decided reservation, counted until the projection folds it or it is dropped."""

    __slots__ = ("_ledger", "at", "backend", "cost", "seq")

    def __init__(self, ledger: Ledger, backend: str, cost: Cost, at: float) -> None:
        self._ledger = ledger
        self.backend = backend
        self.cost = cost
        self.at = at
        #: The ``routed`` event's stream sequence, once stored.
        self.seq: int | None = None

    def logged(self, backend: str, seq: int) -> None:
        """Its decision was stored at ``seq`` (naming ``backend``)."""
        self._ledger.discard(self)
        self.backend = backend
        self.seq = seq
        self._ledger.add(self)

    def dropped(self) -> None:
        """Its decision was not logged: it reserves nothing."""
        self._ledger.discard(self)


class Ledger:
    """Per-backend quota as the binder decides by: the projection's, plus its own since.

    Reservations are kept per backend (a round reads only those of the
    backends it judges) and, once logged, also in a heap by stream sequence,
    so forgetting what the projection has folded costs only what it forgets:
    the projection may lag the log by seconds under load, and the binder
    decides many times a second.
    """

    def __init__(self, config: Config) -> None:
        self._declared: dict[str, tuple[Limit, ...]] = {
            name: backend.limits.declared() for name, backend in config.backends.items()
        }
        #: Per backend, the reservations counted (insertion-ordered, as a set).
        self._pending: dict[str, dict[Reserved, None]] = {}
        #: (seq, tie-breaker, reservation) of the logged ones, smallest seq first.
        self._logged: list[tuple[int, int, Reserved]] = []
        self._ties = itertools.count()
        #: Per backend, until when (Unix time) its provider's quota is spent,
        #: as this binder read it from the log (dropped once passed).
        #: Backend -> (until when, whether its quota is spent rather than a 429 pause).
        self._paused: dict[str, tuple[float, bool]] = {}

    def __len__(self) -> int:
        return sum(len(pending) for pending in self._pending.values())

    def reserving(self, backend: str, cost: Cost, at: float) -> Reserved:
        reserved = Reserved(self, backend, cost, at)
        self.add(reserved)
        return reserved

    def add(self, reserved: Reserved) -> None:
        self._pending.setdefault(reserved.backend, {})[reserved] = None
        if reserved.seq is not None:
            heapq.heappush(self._logged, (reserved.seq, next(self._ties), reserved))

    def discard(self, reserved: Reserved) -> None:
        """Stop counting ``reserved`` (its heap entry, if any, is skipped when popped)."""
        pending = self._pending.get(reserved.backend)
        if pending is not None:
            pending.pop(reserved, None)

    def prune(self, state: LiveState | None) -> None:
        """Forget reservations the projection has folded (once per round)."""
        folded = 0 if state is None else state.last_seq
        while self._logged and self._logged[0][0] <= folded:
            seq, _, reserved = heapq.heappop(self._logged)
            if reserved.seq == seq:
                self.discard(reserved)

    def pause(self, backend: str, until: float, exhausted: bool = True) -> None:
        """``backend``'s provider said its quota is spent (``exhausted``), or
        answered 429, until ``until`` (Unix time): bind nothing there before
        then (the later of this and any earlier pause), whatever the
        projection says."""
        if math.isfinite(until):
            earlier, was = self._paused.get(backend, (until, exhausted))
            self._paused[backend] = (max(until, earlier), was or exhausted)

    def paused_until(self, backend: str, now: float) -> float | None:
        """Until when ``backend`` is paused by :meth:`pause` (``None``: not, or passed)."""
        paused = self._paused.get(backend)
        if paused is not None and paused[0] <= now:
            del self._paused[backend]
            return None
        return None if paused is None else paused[0]

    def quota(
        self, backend: str, state: LiveState | None, *, now: float
    ) -> tuple[Quota | None, tuple[Limit, ...]]:
        """``backend``'s quota and the limits it is judged by, as of ``state``
        and this binder's own pause of it (:meth:`pause`) at ``now``.

        ``(None, ())`` for a backend with nothing to judge: no declared limit,
        nothing its provider said (no learned window, no pause) and no pause
        of this binder's.
        """
        projected = None if state is None else state.backend(backend).quota
        declared = self._declared.get(backend, ())
        paused = self.paused_until(backend, now)
        if not declared and paused is None and (projected is None or not says_anything(projected)):
            return None, ()
        quota = projected or Quota()
        if paused is not None:
            quota = cool_down(quota, paused, exhausted=self._paused[backend][1])
        for reserved in self._pending.get(backend, ()):
            quota = reserve(quota, reserved.cost, reserved.at)
        return quota, effective_limits(declared, quota)
