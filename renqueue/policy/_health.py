"""Backend health: the circuit breaker, and the older streak rule, as plain functions.

A backend's **circuit** is ``closed`` (calls go through), ``open`` (no call is
bound there) or ``half_open`` (one call at a time, the probe, decides). The
facts it is judged from are folded from the event log by
:func:`renqueue.state.fold` (:class:`CircuitFacts`: the streak of backend
faults, the outcomes of recent calls, the latest active health probe, and the
circuit's own state as last logged); the rules are the backend's
``[backends.<name>.circuit]`` (:class:`CircuitRules`). :func:`next_circuit` is
the one transition function, applied by the binder (the one place that binds,
so the one place that decides), which logs every change as a ``circuit``
event; the fold then starts a closed circuit's count afresh.

The transitions, at ``now``:

- ``closed`` -> ``open``: ``failures`` backend faults in a row; or at least
  ``error_rate`` of at least ``min_calls`` calls in the last ``window``
  seconds ended in a backend fault; or the active probe (if one is
  configured) failed since the circuit closed.
- ``open`` -> ``closed``: the active probe succeeded since it opened (a local
  server that came back is used again at once).
- ``open`` -> ``half_open``: ``cooloff`` seconds after it opened, unless the
  active probe still fails (then the probe decides).
- ``half_open`` -> ``closed``: a call completed since it became half-open.
- ``half_open`` -> ``open``: a backend fault since it became half-open, or a
  failed active probe.

"Since" is in log order (the fold counts completions, faults and probe
answers logged after the latest ``circuit`` event), never a comparison of one
process's clock with another's; and a circuit is judged on those counts only
once the log shows the binder's latest change (until then they belong to the
circuit before it).

Faults are the classes that blame the backend (refused or dropped
connections, timeouts, 5xx, overloaded, malformed answers, broken streams, a
backend that cannot serve); a 429, a bad request, a context too long or a
content filter say nothing of its health.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, Protocol

from msgspec import Struct

#: Consecutive backend-fault failures after which a backend is unhealthy.
DEFAULT_FAILURE_THRESHOLD: Final = 3
#: Seconds (event time) after the last fault at which an unhealthy backend is
#: tried again: one more fault re-arms the cooldown, a completion clears it.
DEFAULT_COOLDOWN: Final = 30.0

#: Seconds per bucket of :attr:`CircuitFacts.outcomes`.
OUTCOME_BUCKET: Final = 10
#: Seconds of outcomes the fold keeps (the longest ``window`` a config may set).
OUTCOME_HORIZON: Final = 600

CircuitState = Literal["closed", "open", "half_open"]


class FaultRecord(Protocol):
    """What the streak rule reads of a backend's folded state
    (:class:`renqueue.state.BackendState` has it)."""

    @property
    def consecutive_failures(self) -> int: ...

    @property
    def last_fault_at(self) -> float | None: ...


class CircuitFacts(FaultRecord, Protocol):
    """What the circuit breaker reads of a backend's folded state
    (:class:`renqueue.state.BackendState` has it). The counts "since the
    circuit" are of events logged after its latest ``circuit`` event, in log
    order: no clock is compared with another."""

    @property
    def outcomes(self) -> Sequence[tuple[int, int, int]]:
        """``(bucket start, calls completed, backend faults)`` per
        :data:`OUTCOME_BUCKET` seconds, oldest first, since the circuit last closed."""
        ...

    @property
    def probe_ok(self) -> bool | None:
        """The latest answer of the active probe (``None``: none)."""
        ...

    @property
    def circuit(self) -> str:
        """The circuit's state as last logged."""
        ...

    @property
    def ok_since_circuit(self) -> int: ...

    @property
    def faults_since_circuit(self) -> int: ...

    @property
    def probe_since_circuit(self) -> bool | None:
        """The latest probe answer logged after the latest ``circuit`` event."""
        ...


class CircuitRules(Struct, frozen=True, kw_only=True):
    """When a backend's circuit opens and closes (``[backends.<name>.circuit]``).

    ``failures`` is 5 by default, not 3: failures come back faster than
    answers (a 503 at once, a stream cut early), so with a few calls in
    flight a streak of 3 in log order is common on a backend failing one call
    in twenty; the error rate over a window catches a steadier decline.
    """

    failures: int = 5
    error_rate: float = 0.5
    min_calls: int = 10
    window: float = 60.0
    cooloff: float = DEFAULT_COOLDOWN
    #: An active health probe is configured (``[backends.<name>.probe]``).
    probed: bool = False


class Circuit(Struct, frozen=True, kw_only=True):
    """A backend's circuit: its state, since when (Unix time), and why."""

    state: CircuitState = "closed"
    since: float = 0.0
    reason: str = ""


CLOSED: Final = Circuit()


def next_circuit(current: Circuit, facts: CircuitFacts, rules: CircuitRules, now: float) -> Circuit:
    """The circuit at ``now``: ``current`` or the one it moves to (see the module docstring).

    Pure: a new :class:`Circuit` (``since = now``) when the state changes, else
    ``current``. Facts are judged only once the log shows ``current``'s state
    (``facts.circuit``): until the binder's own change is folded, the counts
    it would read belong to the circuit before it. Only the cool-off, on the
    binder's own clock, runs meanwhile.
    """
    if facts.circuit != current.state:
        return _cooled_off(current, facts, rules, now) if current.state == "open" else current
    if current.state == "closed":
        reason = _trip(facts, rules, now, closed_for=now - current.since)
    elif current.state == "open":
        if rules.probed and facts.probe_since_circuit is True:
            return Circuit(state="closed", since=now, reason="the health probe succeeded")
        return _cooled_off(current, facts, rules, now)
    elif rules.probed and facts.probe_since_circuit is False:
        reason = "the health probe failed"
    elif facts.faults_since_circuit > 0:
        reason = "the probe call failed"
    elif facts.ok_since_circuit > 0:
        return Circuit(state="closed", since=now, reason="the probe call completed")
    else:
        reason = None
    return current if reason is None else Circuit(state="open", since=now, reason=reason)


def _trip(facts: CircuitFacts, rules: CircuitRules, now: float, *, closed_for: float) -> str | None:
    """Why a closed circuit opens now (closed for ``closed_for`` seconds), or ``None``."""
    if rules.probed and facts.probe_ok is False:
        return "the health probe failed"
    if facts.consecutive_failures >= rules.failures:
        return f"{facts.consecutive_failures} backend faults in a row"
    calls, faults = _recent(facts.outcomes, now - rules.window)
    # Failures come back faster than answers: just after a close (the counts
    # start afresh) the first outcomes are mostly the failures of calls that
    # started with the successes still running. The rate is judged once the
    # circuit has been closed for half the window.
    settled = closed_for >= rules.window / 2
    if settled and calls >= rules.min_calls and faults >= rules.error_rate * calls:
        return f"{faults} of {calls} calls failed in the last {rules.window:g} s"
    return None


def _cooled_off(current: Circuit, facts: CircuitFacts, rules: CircuitRules, now: float) -> Circuit:
    """An open circuit half-open ``cooloff`` after it opened, unless the active
    probe still fails (then the probe decides)."""
    if now - current.since >= rules.cooloff and not (rules.probed and facts.probe_ok is False):
        return Circuit(
            state="half_open",
            since=now,
            reason=f"{rules.cooloff:g} s after it opened: one call decides",
        )
    return current


def _recent(outcomes: Sequence[tuple[int, int, int]], since: float) -> tuple[int, int]:
    """Calls and faults in the buckets that end after ``since``."""
    calls = faults = 0
    for start, ok, bad in outcomes:
        if start + OUTCOME_BUCKET > since:
            calls += ok + bad
            faults += bad
    return calls, faults


def is_healthy(
    backend: FaultRecord,
    now: float,
    *,
    threshold: int = DEFAULT_FAILURE_THRESHOLD,
    cooldown: float = DEFAULT_COOLDOWN,
) -> bool:
    """The streak rule (before circuits; kept for the projection's own verdict):
    unhealthy after ``threshold`` consecutive backend faults, until a
    completion or until ``cooldown`` seconds after the latest fault.

    ``now`` is a Unix time on the events' scale (``time.time()`` for a live
    router; a log time for an audit).
    """
    if backend.consecutive_failures < threshold or backend.last_fault_at is None:
        return True
    return now - backend.last_fault_at >= cooldown
