"""The binder's A/B splits: each request's arm, and the automatic rollback.

The binder is the one place that binds, so it is the one place that places a
request of a split route on an arm and the one place that rolls a split back
(:mod:`renqueue.policy._ab` holds the rules). :class:`Splitter`:

- :meth:`Splitter.place`, when a request is read (before its tier is
  estimated, so the arm's own complexity rules apply): a request of a split
  route goes to its arm (``route`` becomes the arm's, ``split`` the route it
  named); one already on an arm (put back to routing) keeps it; either goes
  to where the split's traffic was moved if it was rolled back or promoted.
  Held requests are placed again each round, so a rollback moves those
  waiting too.
- :meth:`Splitter.judge`, each round, at most once a second per split: a
  live split whose arm breaches its rollback rules, judged on the arms'
  figures as the projection folded them, is rolled back to its control. The
  change is logged as an ``ab`` event (``rq.evt._system.<route>.ab``); this
  binder's own word stands until its view of the projection shows it, or
  shows an operator's newer one.
"""

from __future__ import annotations

from typing import Final

from ... import metrics
from ...config import Config
from ...coordination import LiveState
from ...logs import get_logger
from ...policy import SplitFacts, SplitStatus, judge, moved_to, on_arm
from ...schema import InferenceRequest, SplitChanged, split_changed

__all__ = ["JUDGE_EVERY", "Splitter"]

log = get_logger("router")

#: Seconds between two judgements of one split's arms.
JUDGE_EVERY: Final = 1.0


class Splitter:
    """Every A/B split of the config, as this binder applies it (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._splits = {
            name: route.ab.policy(name)
            for name, route in config.routes.items()
            if route.ab is not None
        }
        #: Rollbacks this binder logged, until its view of the projection shows them.
        self._mine: dict[str, SplitStatus] = {}
        #: When each split was last judged (this binder's clock).
        self._judged: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self._splits)

    def status(self, route: str, live: LiveState | None) -> SplitFacts | None:
        """Where route ``route``'s split sends its traffic now: as this binder
        last decided, until the projection shows it (or an operator's later move)."""
        folded = None if live is None else live.splits.get(route)
        mine = self._mine.get(route)
        if mine is not None:
            if folded is None or (folded.state == "live" and folded.since < mine.since):
                return mine
            del self._mine[route]  # the log caught up, or an operator moved it since
        return folded

    def place(self, request: InferenceRequest, live: LiveState | None) -> InferenceRequest:
        """``request`` on the arm it goes to now (unchanged when it is on it
        already, or its route has no split)."""
        if not self._splits:
            return request  # (no A/B split configured: every request stays put)
        placed = on_arm(
            self._splits,
            lambda name: self.status(name, live),
            request,
            lambda route: self._config.serves(request, route),
        )
        if placed is not request and placed.split is not None:
            metrics.AB_PLACED.labels(placed.split, placed.route).inc()
        return placed

    def moved(self, request: InferenceRequest, live: LiveState | None) -> bool:
        """Whether ``request``, on an arm, must move: its split now sends it elsewhere."""
        split = None if request.split is None else self._splits.get(request.split)
        if split is None:
            return False
        target = moved_to(split, self.status(split.route, live))
        return target is not None and target != request.route

    def judge(
        self, live: LiveState | None, now: float, *, router: str, term: int
    ) -> list[SplitChanged]:
        """The rollbacks to log at ``now``: each live split (judged once per
        :data:`JUDGE_EVERY`) one of whose arms breaches its rules."""
        changes: list[SplitChanged] = []
        for route, split in self._splits.items():
            if split.rollback is None or now - self._judged.get(route, -JUDGE_EVERY) < JUDGE_EVERY:
                continue
            self._judged[route] = now
            folded = None if live is None else live.splits.get(route)
            if folded is None or moved_to(split, self.status(route, live)) is not None:
                continue
            try:
                found = judge(split, folded.arms, now)
            except (ArithmeticError, ValueError) as exc:
                # A damaged view must not fail the round for every route.
                log.warning("A/B split not judged", route=route, error=repr(exc))
                continue
            if found is None:
                continue
            arm, why = found
            reason = f"arm {arm} breached its rollback thresholds: {why}"
            self._mine[route] = SplitStatus(state="rolled_back", arm=split.control, since=now)
            metrics.AB_ROLLBACKS.labels(route).inc()
            log.warning("A/B split rolled back", route=route, arm=arm, reason=reason)
            changes.append(
                split_changed(
                    route,
                    at=now,
                    state="rolled_back",
                    arm=split.control,
                    previous=folded.state,
                    reason=reason,
                    router=router,
                    term=term,
                )
            )
        return changes

    def retract(self, event: SplitChanged) -> None:
        """Drop this binder's rollback (its event could not be logged): the
        next judgement decides it again, and logs it."""
        mine = self._mine.get(event.route)
        if mine is not None and mine.since == event.at:
            del self._mine[event.route]
            self._judged.pop(event.route, None)

    def forget(self) -> None:
        """Drop this binder's own word (a term ended: the next starts from the log)."""
        self._mine.clear()
        self._judged.clear()
