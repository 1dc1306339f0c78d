"""State the services share, kept in the broker and rebuilt from it.

- The projection: :func:`fold` (``_fold``) turns the event log into
  :class:`ProjectionState`, a pure function of the events; :class:`Projector`
  (``_projector``) keeps it in the ``rq-state`` KV bucket (the checkpoint, and
  one view per backend and per A/B split); :class:`StateView` (``_view``) is a
  reader's live copy of the views. The A/B part of the fold (``_splits``):
  each split's :class:`SplitState` and what each arm did.
- Checking and showing it: :func:`diff_states` (``_diff``) names every field
  two projections disagree on; :func:`verify` (``_verify``) compares the
  checkpoint and the views with a rebuild from the log (``renqueue replay
  --verify``); :func:`read_status` and :func:`render_status` (``_status``)
  report each backend, priority level and tenant (``renqueue status``);
  :func:`read_splits`, :func:`render_splits` and :func:`move_split`
  (``_split_status``) report and move A/B splits (``renqueue ab``).
- The binder's lease (``_lease``): :class:`Lease`, at most one holder at a
  time, judged by the server's clock.
- Coalescing groups (``_coalescing``): :class:`Coalescer`, identical requests
  sharing one backend call, groups changed only by compare-and-set.
- The cancellation watch (``_cancellation``): :class:`CancelWatch`, which
  requests must not run or must stop.
"""

from ._cancellation import CANCELS, CancelWatch, cancel_of
from ._coalescing import Coalescer, Group, coalesce_key
from ._diff import Difference, diff_states, diff_values
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
from ._split_status import (
    ArmFigures,
    ArmReport,
    SplitReport,
    move_split,
    read_splits,
    render_splits,
)
from ._splits import STALE_ASSIGNED, ArmRequest, Splits, SplitState
from ._status import (
    BackendStatus,
    LevelStatus,
    StatusReport,
    TenantStatus,
    backend_status,
    read_status,
    render_status,
)
from ._verify import Verification, read_checkpoint, verify
from ._view import (
    PROGRESS_KEY,
    VIEW_KEYS,
    BackendView,
    LiveState,
    Progress,
    SplitView,
    StateView,
    TenantSpend,
    TenantView,
    backend_view_key,
    decode_backend_view,
    decode_progress,
    decode_split_view,
    decode_tenant_view,
    encode_view,
    split_view_key,
    tenant_view_key,
)

__all__ = [
    "BACKEND_FAULTS",
    "CANCELS",
    "LEASE_MARGIN",
    "PROGRESS_KEY",
    "STALE_ASSIGNED",
    "STALE_IN_FLIGHT",
    "STATE_KEY",
    "STATE_VERSION",
    "TENANT_WRITTEN_KINDS",
    "VIEW_KEYS",
    "ArmFigures",
    "ArmReport",
    "ArmRequest",
    "BackendState",
    "BackendStatus",
    "BackendView",
    "CancelWatch",
    "Coalescer",
    "Difference",
    "Group",
    "InFlight",
    "Lease",
    "LevelStatus",
    "LiveState",
    "Progress",
    "ProjectionState",
    "Projector",
    "SplitReport",
    "SplitState",
    "SplitView",
    "Splits",
    "StateView",
    "StatusReport",
    "TenantSpend",
    "TenantState",
    "TenantStatus",
    "TenantView",
    "Verification",
    "backend_status",
    "backend_view_key",
    "cancel_of",
    "coalesce_key",
    "decode_backend_view",
    "decode_progress",
    "decode_split_view",
    "decode_state",
    "decode_tenant_view",
    "diff_states",
    "diff_values",
    "encode_state",
    "encode_view",
    "fold",
    "fold_many",
    "move_split",
    "read_checkpoint",
    "read_splits",
    "read_status",
    "rebuild",
    "render_splits",
    "render_status",
    "split_view_key",
    "tenant_view_key",
    "utc_day",
    "verify",
]
