"""State the services share, kept in the broker and rebuilt from it.

- The projection: :func:`fold` (``_fold``) turns the event log into
  :class:`ProjectionState`, a pure function of the events; :class:`Projector`
  (``_projector``) keeps it in the ``rq-state`` KV bucket (the checkpoint, and
  one view per backend); :class:`StateView` (``_view``) is a reader's live copy
  of the views.
- The binder's lease (``_lease``): :class:`Lease`, at most one holder at a
  time, judged by the server's clock.
- Coalescing groups (``_coalescing``): :class:`Coalescer`, identical requests
  sharing one backend call, groups changed only by compare-and-set.
- The cancellation watch (``_cancellation``): :class:`CancelWatch`, which
  requests must not run or must stop.
"""

from ._cancellation import CANCELS, CancelWatch, cancel_of
from ._coalescing import Coalescer, Group, coalesce_key
from ._fold import (
    BACKEND_FAULTS,
    STALE_IN_FLIGHT,
    STATE_KEY,
    STATE_VERSION,
    TENANT_WRITTEN_KINDS,
    BackendState,
    InFlight,
    ProjectionState,
    TenantState,
    decode_state,
    encode_state,
    fold,
    fold_many,
    utc_day,
)
from ._lease import LEASE_MARGIN, Lease
from ._projector import Projector, rebuild
from ._view import (
    PROGRESS_KEY,
    VIEW_KEYS,
    BackendView,
    LiveState,
    Progress,
    StateView,
    backend_view_key,
    decode_backend_view,
    decode_progress,
    encode_view,
)

__all__ = [
    "BACKEND_FAULTS",
    "CANCELS",
    "LEASE_MARGIN",
    "PROGRESS_KEY",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "VIEW_KEYS",
    "BackendState",
    "BackendView",
    "CancelWatch",
    "Coalescer",
    "Group",
    "InFlight",
    "Lease",
    "LiveState",
    "Progress",
    "ProjectionState",
    "Projector",
    "StateView",
    "TenantState",
    "backend_view_key",
    "cancel_of",
    "coalesce_key",
    "decode_backend_view",
    "decode_progress",
    "decode_state",
    "encode_state",
    "encode_view",
    "fold",
    "fold_many",
    "rebuild",
    "utc_day",
]
