"""State the services share, kept in the broker and rebuilt from it. I/O.

The pure half (the fold, its diffs, the A/B fold) is :mod:`renqueue.state`;
this package keeps it in NATS and coordinates over it.

- The projection: :class:`Projector` (``_projector``) folds the event log into
  the ``rq-state`` KV bucket (the checkpoint, and one view per backend, tenant
  and A/B split, written by ``_view_publisher``); :class:`StateView`
  (``_view``) is a reader's live copy of the views.
- Checking and showing it: :func:`verify` (``_verify``) compares the
  checkpoint and the views with a rebuild from the log (``renqueue replay
  --verify``); :func:`read_status` and :func:`render_status` (``_status``)
  report each backend, priority level and tenant (``renqueue status``);
  :func:`read_splits`, :func:`render_splits` and :func:`move_split`
  (``_split_status``) report and move A/B splits (``renqueue ab``);
  :func:`read_trace` (``_trace_reader``) reads a stretch of the log as a
  what-if :class:`renqueue.sim.Trace`.
- The binder's lease (``_lease``): :class:`Lease`, at most one holder at a
  time, judged by the server's clock.
- Coalescing groups (``_coalescing``): :class:`Coalescer`, identical requests
  sharing one backend call, groups changed only by compare-and-set.
- The cancellation watch (``_cancellation``): :class:`CancelWatch`, which
  requests must not run or must stop.
"""

from ._cancellation import CANCELS, CancelWatch, cancel_of
from ._coalescing import Coalescer, Group, coalesce_key
from ._lease import LEASE_MARGIN, Lease
from ._projector import Projector, rebuild
from ._split_status import (
    ArmFigures,
    ArmReport,
    SplitReport,
    move_split,
    planned_move,
    read_splits,
    render_splits,
)
from ._status import (
    BackendStatus,
    LevelStatus,
    StatusReport,
    TenantStatus,
    backend_status,
    read_status,
    render_status,
)
from ._trace_reader import read_events, read_trace
from ._verify import Replayed, Verification, read_checkpoint, replay_log, verify
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
    "CANCELS",
    "LEASE_MARGIN",
    "PROGRESS_KEY",
    "VIEW_KEYS",
    "ArmFigures",
    "ArmReport",
    "BackendStatus",
    "BackendView",
    "CancelWatch",
    "Coalescer",
    "Group",
    "Lease",
    "LevelStatus",
    "LiveState",
    "Progress",
    "Projector",
    "Replayed",
    "SplitReport",
    "SplitView",
    "StateView",
    "StatusReport",
    "TenantSpend",
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
    "decode_tenant_view",
    "encode_view",
    "move_split",
    "planned_move",
    "read_checkpoint",
    "read_events",
    "read_splits",
    "read_status",
    "read_trace",
    "rebuild",
    "render_splits",
    "render_status",
    "replay_log",
    "split_view_key",
    "tenant_view_key",
    "verify",
]
