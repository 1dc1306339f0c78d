"""The health rule: whether a backend may be called, from the facts the log folded.

The facts (a backend's streak of backend faults and the time of the latest)
are folded from the event log by :func:`renqueue.state.fold`; the verdict
is this plain function of them and a caller-supplied ``now``, so the state
stays clock-free and a router applies the cooldown with its own clock.
"""

from __future__ import annotations

from typing import Final, Protocol

#: Consecutive backend-fault failures after which a backend is unhealthy.
DEFAULT_FAILURE_THRESHOLD: Final = 3
#: Seconds (event time) after the last fault at which an unhealthy backend is
#: tried again: one more fault re-arms the cooldown, a completion clears it.
DEFAULT_COOLDOWN: Final = 30.0


class FaultRecord(Protocol):
    """What the health rule reads of a backend's folded state
    (:class:`renqueue.state.BackendState` has it)."""

    @property
    def consecutive_failures(self) -> int: ...

    @property
    def last_fault_at(self) -> float | None: ...


def is_healthy(
    backend: FaultRecord,
    now: float,
    *,
    threshold: int = DEFAULT_FAILURE_THRESHOLD,
    cooldown: float = DEFAULT_COOLDOWN,
) -> bool:
    """The health rule: unhealthy after ``threshold`` consecutive backend faults,
    until a completion or until ``cooldown`` seconds after the latest fault.

    ``now`` is a Unix time on the events' scale (``time.time()`` for a live
    router; a log time for an audit). After the cooldown the backend is tried
    again; one more fault makes it unhealthy for another cooldown.
    """
    if backend.consecutive_failures < threshold or backend.last_fault_at is None:
        return True
    return now - backend.last_fault_at >= cooldown
