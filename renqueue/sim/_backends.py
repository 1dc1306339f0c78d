"""One backend as a simulated round sees it: a :class:`~renqueue.policy.BackendView`
built from the config and the projection, as the router builds its own.

The router's round (``renqueue/services/router/_router.py``, ``_views``) reads
each backend's slots and tier from the config, its in-flight count from the
broker, its quota from the projection (judged against its declared limits,
tightened by what its provider reported: :func:`~renqueue.policy.effective_limits`,
and left unjudged when there is nothing to judge), its learned speed
(:class:`~renqueue.policy.Perf`) and mean call duration from the projection
(the mean only from 5 completions on). :func:`backend_view` does the same
from a simulation's own in-flight count and projection. Every backend is
healthy: circuits are not simulated (docs/what-if.md).
"""

from __future__ import annotations

from typing import Final

from ..config import BaseBackendConfig
from ..policy import MIN_SAMPLES, BackendView, Limit, Quota, effective_limits, says_anything
from ..state import BackendState

__all__ = ["backend_view"]

_NOTHING: Final = BackendState()


def backend_view(
    name: str, backend: BaseBackendConfig, *, in_flight: int, state: BackendState | None
) -> BackendView:
    """What a round knows of backend ``name`` with ``in_flight`` calls bound to
    it and ``state`` (its projection; ``None``: the log never named it)."""
    state = state or _NOTHING
    declared = backend.limits.declared()
    quota: Quota | None = state.quota
    limits: tuple[Limit, ...] = ()
    if not declared and (quota is None or not says_anything(quota)):
        quota = None
    else:
        quota = quota or Quota()
        limits = effective_limits(declared, quota)
    return BackendView(
        name=name,
        capacity=backend.limits.concurrency,
        in_flight=in_flight,
        tier=backend.tier,
        context_window=backend.context_window,
        cost_input_per_mtok=backend.cost_input_per_mtok,
        cost_output_per_mtok=backend.cost_output_per_mtok,
        features=backend.supports,
        expected_duration=state.duration_ewma if state.calls_completed >= MIN_SAMPLES else None,
        perf=state.perf,
        quota=quota,
        limits=limits,
    )
