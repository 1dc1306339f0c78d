"""The binder's circuit breakers: each backend's circuit, judged every round, changes logged.

The binder is the one place that binds, so it is the one place that moves a
circuit: each round it applies :func:`renqueue.policy.next_circuit` to each
backend's facts as the projection folded them, from the circuit as last
logged (``circuit`` events, folded) or, newer, as this binder last decided
(its own change may not be folded yet). A change is logged as a ``circuit``
event (``rq.evt._system.<backend>.circuit``); a binder taking over starts
from what the log says.

An open backend is left out of the round (it is not healthy); a half-open one
has one slot, for its probe call (``Dispatch.probe``), and once that call is
bound no other until its outcome moves the circuit (or ``cooloff`` passes
without one).
"""

from __future__ import annotations

from ...config import Config, parse_duration
from ...logs import get_logger
from ...policy import CLOSED, Circuit, CircuitRules, CircuitState, next_circuit
from ...schema import CircuitChanged, circuit_changed
from ...state import BackendState

__all__ = ["Circuits", "change_event", "rules_of"]

log = get_logger("router")

_NO_FACTS = BackendState()


def rules_of(config: Config, name: str) -> CircuitRules:
    """Backend ``name``'s circuit rules: its ``[circuit]``, and whether it has a ``[probe]``."""
    backend = config.backends[name]
    circuit = backend.circuit
    return CircuitRules(
        failures=circuit.failures,
        error_rate=circuit.error_rate,
        min_calls=circuit.min_calls,
        window=parse_duration(circuit.window),
        cooloff=parse_duration(circuit.cooloff),
        probed=backend.probe is not None,
    )


class Circuits:
    """Every backend's circuit as this binder sees it (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self._rules = {name: rules_of(config, name) for name in config.backends}
        #: Changes this binder decided, until the projection shows them (or newer).
        self._mine: dict[str, Circuit] = {}
        #: When this binder bound the probe call of a half-open circuit, by backend.
        self._probes: dict[str, float] = {}

    def judge(
        self, name: str, facts: BackendState | None, now: float, *, term: int = 0
    ) -> tuple[Circuit, Circuit | None]:
        """Backend ``name``'s circuit at ``now`` for the binder of lease ``term``,
        and the one it was before if it changed (the change to log), else ``None``.

        This binder's own word stands until the log shows it, or a newer term's."""
        rules = self._rules.get(name)
        if rules is None:
            return CLOSED, None
        known = facts or _NO_FACTS
        folded = (
            CLOSED
            if facts is None
            else Circuit(
                state=_state(facts.circuit), since=facts.circuit_at, reason=facts.circuit_reason
            )
        )
        mine = self._mine.get(name)
        logged_term = 0 if facts is None else facts.circuit_term
        ours = mine is not None and (
            logged_term < term or (logged_term == term and mine.since >= folded.since)
        )
        current = mine if mine is not None and ours else folded
        if mine is not None and current is folded:
            del self._mine[name]  # the log caught up with (or passed) this binder's word
        moved = next_circuit(current, known, rules, now)
        if moved is current:
            return current, None
        self._mine[name] = moved
        self._probes.pop(name, None)
        log.warning(
            "circuit breaker changed",
            backend=name,
            state=moved.state,
            previous=current.state,
            reason=moved.reason,
        )
        return moved, current

    def probe_bound(self, name: str, now: float) -> None:
        """The probe call of ``name``'s half-open circuit was bound at ``now``."""
        self._probes[name] = now

    def probe_pending(self, name: str, now: float) -> bool:
        """Whether ``name``'s half-open circuit has its probe call out: one call
        decides, so no other is bound until its outcome moves the circuit, or
        until ``cooloff`` has passed without one (the probe request may have
        been cancelled or expired before it ran)."""
        at = self._probes.get(name)
        rules = self._rules.get(name)
        if at is None or rules is None:
            return False
        if now - at >= rules.cooloff:
            del self._probes[name]
            return False
        return True

    def retract(self, name: str, circuit: Circuit) -> None:
        """Drop this binder's change to ``circuit`` (its event could not be
        logged): the next round decides it again, and logs it."""
        if self._mine.get(name) == circuit:
            del self._mine[name]

    def forget(self) -> None:
        """Drop this binder's own word (a term ended: the next starts from the log)."""
        self._mine.clear()
        self._probes.clear()


def change_event(
    name: str, moved: Circuit, previous: Circuit, *, router: str, term: int
) -> CircuitChanged:
    """The ``circuit`` event of a change of backend ``name``'s circuit."""
    return circuit_changed(
        name,
        at=moved.since,
        state=moved.state,
        previous=previous.state,
        reason=moved.reason,
        router=router,
        term=term,
    )


def _state(text: str) -> CircuitState:
    """A logged state as a :data:`CircuitState` (anything else reads as closed)."""
    if text == "open":
        return "open"
    return "half_open" if text == "half_open" else "closed"
