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
- Cluster-wide metrics: :func:`read_cluster` (``_cluster``) reads the whole
  cluster at one moment (the checkpoint, the consumers, the DLQ, the binder's
  lease, the projection's lag) and :func:`cluster_families` turns it into the
  Prometheus families of :data:`CLUSTER_SERIES`; :class:`ClusterMetrics` (a
  Prometheus collector), :class:`Exporter` (what feeds it on a connection,
  with a tail of completed calls) and :func:`run_exporter` (``renqueue
  exporter``) are in ``_exporter``.
- The binder's lease (``_lease``): :class:`Lease`, at most one holder at a
  time, judged by the server's clock; :func:`read_lease`, who holds it now.
- Coalescing groups (``_coalescing``): :class:`Coalescer`, identical requests
  sharing one backend call, groups changed only by compare-and-set.
- The cancellation watch (``_cancellation``): :class:`CancelWatch`, which
  requests must not run or must stop.
"""

from ._cancellation import CANCELS, CancelWatch, cancel_of
from ._cluster import SERIES as CLUSTER_SERIES
from ._cluster import ClusterReading, Series, cluster_families, out_of_service, read_cluster
from ._coalescing import Coalescer, Group, coalesce_key
from ._exporter import ClusterMetrics, Exporter, run_exporter
from ._lease import LEASE_MARGIN, Lease, LeaseHolder, read_lease
from ._projector import Projector, rebuild
from ._split_status import (
    ArmFigures,
    ArmReport,
    SplitReport,
    move_split,
    planned_move,
    read_splits,
    render_splits,
    splits_of,
)
from ._status import (
    NEAR_LIMIT,
    BackendStatus,
    LevelStatus,
    StatusReport,
    StatusSection,
    StoreStatus,
    TenantStatus,
    backend_status,
    health_of,
    read_status,
    render_status,
    status_heading,
    status_of,
    status_sections,
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
    "CLUSTER_SERIES",
    "LEASE_MARGIN",
    "NEAR_LIMIT",
    "PROGRESS_KEY",
    "VIEW_KEYS",
    "ArmFigures",
    "ArmReport",
    "BackendStatus",
    "BackendView",
    "CancelWatch",
    "ClusterMetrics",
    "ClusterReading",
    "Coalescer",
    "Exporter",
    "Group",
    "Lease",
    "LeaseHolder",
    "LevelStatus",
    "LiveState",
    "Progress",
    "Projector",
    "Replayed",
    "Series",
    "SplitReport",
    "SplitView",
    "StateView",
    "StatusReport",
    "StatusSection",
    "StoreStatus",
    "TenantSpend",
    "TenantStatus",
    "TenantView",
    "Verification",
    "backend_status",
    "backend_view_key",
    "cancel_of",
    "cluster_families",
    "coalesce_key",
    "decode_backend_view",
    "decode_progress",
    "decode_split_view",
    "decode_tenant_view",
    "encode_view",
    "health_of",
    "move_split",
    "out_of_service",
    "planned_move",
    "read_checkpoint",
    "read_cluster",
    "read_events",
    "read_lease",
    "read_splits",
    "read_status",
    "read_trace",
    "rebuild",
    "render_splits",
    "render_status",
    "replay_log",
    "run_exporter",
    "split_view_key",
    "splits_of",
    "status_heading",
    "status_of",
    "status_sections",
    "tenant_view_key",
    "verify",
]
