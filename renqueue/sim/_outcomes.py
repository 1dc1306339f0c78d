"""What a simulation answers: each request's :class:`Outcome`, in a
:class:`Simulation`. The report (:mod:`renqueue.sim._report`) reads the
recorded run's outcomes in the same shape."""

from __future__ import annotations

from msgspec import Struct

from ._trace import UNFINISHED

__all__ = ["Outcome", "Simulation"]


class Outcome(Struct, frozen=True, kw_only=True):
    """How one request ended, in the log or in a simulation."""

    request_id: str
    tenant: str
    #: The level it was submitted at.
    level: str
    deadline: float | None = None
    #: ``completed``, ``failed``, ``expired``, ``cancelled``, ``rejected`` or ``unfinished``.
    kind: str = UNFINISHED
    at: float | None = None
    #: The backend that completed it (or, failed, the last that failed it).
    backend: str | None = None
    #: US dollars.
    cost: float = 0.0

    @property
    def in_time(self) -> bool:
        """Completed, and before its deadline if it had one."""
        return self.kind == "completed" and (
            self.deadline is None or (self.at is not None and self.at <= self.deadline)
        )


class Simulation(Struct, frozen=True, kw_only=True):
    """What :func:`~renqueue.sim.simulate` found: each request's outcome, in arrival order."""

    outcomes: tuple[Outcome, ...]
    #: Planner rounds and backend runs simulated.
    rounds: int = 0
    runs: int = 0
    #: Backends some run was simulated on with an assumed model (no calls in the log).
    assumed: tuple[str, ...] = ()
    #: Stopped at :data:`~renqueue.sim.MAX_ROUNDS` or the horizon with requests still waiting.
    stopped_early: bool = False
