"""The projection's pure half: the event log folded into state. No I/O.

- :func:`fold` (``_fold``) turns the event log into :class:`ProjectionState`, a
  pure function of the events. The A/B part of the fold (``_splits``): each
  split's :class:`SplitState` and what each arm did.
- :func:`diff_states` (``_diff``) names every field two projections disagree on.
- Which failures blame the backend (``_faults``).

Keeping it in NATS (the projector, views, leases) is :mod:`renqueue.coordination`.
"""

from ._diff import Difference, diff_states, diff_values
from ._fold import (
    BACKEND_FAULTS,
    EMPTY_BACKEND,
    STALE_IN_FLIGHT,
    STATE_KEY,
    STATE_VERSION,
    TENANT_WRITTEN_KINDS,
    UNROUTED_KEPT,
    UPGRADED_IN_PLACE,
    BackendState,
    Ended,
    Folding,
    InFlight,
    ProjectionState,
    TenantState,
    decode_state,
    encode_state,
    fold,
    fold_many,
    is_backend_fault,
    utc_day,
)
from ._splits import STALE_ASSIGNED, ArmEnd, ArmRequest, Splits, SplitState

__all__ = [
    "BACKEND_FAULTS",
    "EMPTY_BACKEND",
    "STALE_ASSIGNED",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "UNROUTED_KEPT",
    "UPGRADED_IN_PLACE",
    "ArmEnd",
    "ArmRequest",
    "BackendState",
    "Difference",
    "Ended",
    "Folding",
    "InFlight",
    "ProjectionState",
    "SplitState",
    "Splits",
    "TenantState",
    "decode_state",
    "diff_states",
    "diff_values",
    "encode_state",
    "fold",
    "fold_many",
    "is_backend_fault",
    "utc_day",
]
