"""The whole cluster at one moment, read from the broker, and as Prometheus metric families.

:func:`read_cluster` reads what the projection and the broker know of every
process at once into one :class:`ClusterReading`: the projector's checkpoint
(each backend's health, circuit, quota, calls and spend; each tenant's spend;
each A/B split's arms: the same figures ``renqueue status`` and ``renqueue ab
status`` show), the router and worker consumers (requests waiting at each
level, dispatches at each backend), the oldest request of each level, the
dead-letter stream's size, each stream's and bucket's bytes against its limit
(as ``renqueue status`` reads them), the binder's lease, the requests waiting
to be forwarded to their route (binding split in groups) and how far the
checkpoint lags the log. :func:`cluster_families` turns a reading into the metric families of
:data:`SERIES`, with no I/O of its own.

Labels are names the config or the services chose (backends, levels, tenants,
routes, arms, windows) and fixed words: never a request id or a prompt.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import time
from collections.abc import Iterable, Mapping
from typing import Final, Literal

from msgspec import Struct
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..broker import JetStream
from ..config import Config
from ..errors import NatsNotFoundError
from ..policy import EVERY_TENANT
from ..schema import (
    BINDER_LEASE,
    DLQ_STREAM,
    EVENTS_STREAM,
    FORWARD_CONSUMER,
    REQUESTS_STREAM,
    STATE_BUCKET,
    binder_lease,
)
from ._lease import LeaseHolder, read_lease
from ._split_status import SplitReport, splits_of
from ._status import BackendStatus, StatusReport, out_of_service_here, status_of
from ._verify import read_checkpoint

__all__ = [
    "CIRCUIT_STATES",
    "SERIES",
    "ClusterReading",
    "Series",
    "cluster_families",
    "out_of_service",
    "read_cluster",
]

Kind = Literal["gauge", "counter", "histogram"]

#: The states a circuit breaker can be in (one gauge each, 1 for the current one).
CIRCUIT_STATES: Final = ("closed", "open", "half_open")
#: The states an A/B split can be in.
SPLIT_STATES: Final = ("live", "promoted", "rolled_back")


class Series(Struct, frozen=True):
    """One exported series: its name as scraped (counters end in ``_total``),
    type, labels and meaning."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str


#: Every cluster-wide series, as docs/metrics.md lists them.
SERIES: Final = (
    Series("renqueue_level_waiting_requests", "gauge", ("level",),
           "Requests waiting at the level: its router consumer's not yet delivered, plus held "
           "by the binder"),
    Series("renqueue_level_oldest_wait_seconds", "gauge", ("level",),
           "Age of the oldest request stored at the level (server time; 0 when none)"),
    Series("renqueue_level_aging_bound_seconds", "gauge", ("level",),
           "The level's aging bound (age_after): a request waiting longer competes one level "
           "up; +Inf if it never ages"),
    Series("renqueue_backend_up", "gauge", ("backend",),
           "1 while the binder may bind to the backend (its circuit is not open), 0 when its "
           "circuit is open or it is out of service (its API key missing where the exporter runs)"),
    Series("renqueue_backend_circuit_state", "gauge", ("backend", "state"),
           "1 for the backend's circuit breaker state (closed, open, half_open), 0 for the others"),
    Series("renqueue_backend_slots_in_use", "gauge", ("backend",),
           "Dispatches delivered to the backend's workers and not yet acknowledged (running, "
           "or waiting out a retry's delay)"),
    Series("renqueue_backend_slots_limit", "gauge", ("backend",),
           "The backend's concurrency (its worker consumer's max_ack_pending)"),
    Series("renqueue_backend_waiting_dispatches", "gauge", ("backend",),
           "Dispatches at the backend's worker consumer not yet delivered to a worker"),
    Series("renqueue_backend_quota_used", "gauge", ("backend", "window", "unit"),
           "Requests or tokens spent in the rate-limit window now, as the binder counts"),
    Series("renqueue_backend_quota_limit", "gauge", ("backend", "window", "unit"),
           "The window's limit judged by: the declared one, tightened to what the provider "
           "reported"),
    Series("renqueue_backend_quota_remaining_ratio", "gauge", ("backend", "window", "unit"),
           "What is left of the window's limit, from 0 (spent) to 1 (untouched)"),
    Series("renqueue_backend_quota_reset_timestamp_seconds", "gauge",
           ("backend", "window", "unit"),
           "Unix time the window is whole again (absent while nothing counts in it)"),
    Series("renqueue_backend_learned_limit", "gauge", ("backend", "window", "unit"),
           "A limit the provider reported in its rate-limit headers or 429 bodies"),
    Series("renqueue_backend_calls_total", "counter", ("backend", "outcome"),
           "Backend calls ended, cluster-wide, by outcome (completed; failed: every failed "
           "call, retried or not)"),
    Series("renqueue_backend_faults_total", "counter", ("backend",),
           "Failed calls that blame the backend (what its circuit breaker counts)"),
    Series("renqueue_backend_rate_limited_total", "counter", ("backend",),
           "429s the backend answered"),
    Series("renqueue_backend_spend_dollars_total", "counter", ("backend",),
           "Spend on the backend, in US dollars"),
    Series("renqueue_backend_ttft_seconds", "histogram", ("backend",),
           "Time to first token of completed calls, whichever process ran them (counted since "
           "the exporter started)"),
    Series("renqueue_backend_duration_seconds", "histogram", ("backend",),
           "Duration of completed calls, whichever process ran them (counted since the "
           "exporter started)"),
    Series("renqueue_tenant_spend_today_dollars", "gauge", ("tenant",),
           "The tenant's spend since UTC midnight, in US dollars"),
    Series("renqueue_tenant_budget_dollars", "gauge", ("tenant", "kind"),
           "The tenant's daily budget in US dollars; kind soft (past it only the cheapest "
           "candidates) or hard (past it requests are refused)"),
    Series("renqueue_dlq_messages", "gauge", (),
           "Dead letters in RQ_DLQ"),
    Series("renqueue_store_bytes", "gauge", ("store",),
           "Bytes the stream (a KV bucket's: KV_<bucket>) holds"),
    Series("renqueue_store_limit_bytes", "gauge", ("store",),
           "The stream's byte limit (max_bytes) as the server holds it (absent if it has none)"),
    Series("renqueue_jetstream_used_bytes", "gauge", (),
           "Bytes the JetStream account stores, every stream together"),
    Series("renqueue_jetstream_limit_bytes", "gauge", (),
           "The cap those bytes count against: nats.max_file_store, or the account's own "
           "storage limit if it has one"),
    Series("renqueue_cancels_unsourced_messages", "gauge", (),
           "Clients' cancellations RQ_CANCELS holds that the event log has not sourced "
           "(the services do not know them yet)"),
    Series("renqueue_store_warn_ratio", "gauge", (),
           "The fraction of a limit past which a store is near it (nats.store_warn; "
           "renqueue status says near limit)"),
    Series("renqueue_ab_arm_requests_total", "counter", ("route", "arm"),
           "Requests placed on the A/B split's arm"),
    Series("renqueue_ab_arm_failures_total", "counter", ("route", "arm"),
           "Requests that failed on the arm"),
    Series("renqueue_ab_arm_cost_dollars_total", "counter", ("route", "arm"),
           "Spend of the arm's requests, in US dollars"),
    Series("renqueue_ab_split_state", "gauge", ("route", "state"),
           "1 for the split's state (live, promoted, rolled_back), 0 for the others"),
    Series("renqueue_binder_term", "gauge", (),
           "The binder's lease term (the lease's revision when it was taken; grows with each "
           "take-over); the last one seen while none holds it; 0 when none was ever seen. "
           "Binding split in groups: the first group's (see renqueue_binder_group_term)"),
    Series("renqueue_binder_present", "gauge", (),
           "1 while a router holds the binder's lease, else 0. Binding split in groups: 1 "
           "while every group's lease is held"),
    Series("renqueue_binder_group_term", "gauge", ("group",),
           "Binding split in groups: the group's binder term (its lease's revision when it "
           "was taken); the last one seen while none holds it; 0 when none was ever seen"),
    Series("renqueue_binder_group_present", "gauge", ("group",),
           "Binding split in groups: 1 while a router holds the group's binder lease, else 0"),
    Series("renqueue_forward_waiting_requests", "gauge", (),
           "Binding split in groups: requests sent without their route that the forwarding "
           "consumer (router-forward) has not seen acked: not yet delivered, or delivered and "
           "being forwarded or handed back to be tried again"),
    Series("renqueue_forward_ack_floor", "gauge", (),
           "Binding split in groups: the requests stream's sequence up to which the forwarding "
           "consumer has every request acked (forwarded or refused); still while the oldest "
           "waits, however many others are forwarded"),
    Series("renqueue_projection_lag_events", "gauge", (),
           "Events in the log not yet folded into the projection's checkpoint"),
    Series("renqueue_projection_lag_seconds", "gauge", (),
           "How far the checkpoint is behind the log: the age of the oldest event it has not "
           "folded (0 when caught up)"),
    Series("renqueue_exporter_up", "gauge", (),
           "1 when the exporter's last read of the cluster succeeded; 0 when it failed or timed "
           "out (the other series then hold the last values read)"),
    Series("renqueue_exporter_read_timestamp_seconds", "gauge", (),
           "Unix time of the reading the cluster series show (0: none yet)"),
)  # fmt: skip

_BY_NAME: Final = {series.name: series for series in SERIES}


class ClusterReading(Struct, frozen=True, kw_only=True):
    """The cluster as read at ``at`` (the reader's clock, Unix seconds)."""

    at: float
    status: StatusReport
    splits: tuple[SplitReport, ...]
    #: Messages in the dead-letter stream (``None``: no such stream).
    dlq_messages: int | None
    #: Who holds the binder's lease (``None``: no one now); binding split in
    #: groups, the first group's holder while every group's lease is held.
    binder: LeaseHolder | None
    #: Binding split in groups: each group's name and who holds its lease
    #: (``None``: no one now), in the config's order. Empty when not split.
    groups: tuple[tuple[str, LeaseHolder | None], ...] = ()
    #: Age of the oldest event the checkpoint has not folded; 0 when caught up.
    lag_seconds: float
    #: Binding split in groups: requests at the forwarding consumer not acked
    #: (pending and held); ``None`` when not split, or it has no such consumer.
    forward_waiting: int | None = None
    #: The forwarding consumer's ack floor (its stream sequence), read with
    #: ``forward_waiting``: it moves on as long as requests are forwarded.
    forward_floor: int | None = None


async def read_cluster(
    js: JetStream, config: Config, *, now: float | None = None
) -> ClusterReading:
    """Read the whole cluster at ``now`` (default: ``time.time()``).

    Raises :class:`~renqueue.errors.NatsError` if NATS fails,
    :class:`~renqueue.errors.RenQueueError` if the checkpoint does not decode.
    """
    at = time.time() if now is None else now
    read = await read_checkpoint(await js.key_value(STATE_BUCKET))
    state = None if read is None else read[0]
    status, dlq, (binder, groups), forward = await asyncio.gather(
        status_of(js, config, state, at),
        _dlq_messages(js),
        _binders(js, config),
        _forward_waiting(js, config),
    )
    return ClusterReading(
        at=at,
        status=status,
        splits=tuple(splits_of(config, state, at)),
        dlq_messages=dlq,
        binder=binder,
        groups=groups,
        lag_seconds=await _lag(js, status, at),
        forward_waiting=None if forward is None else forward[0],
        forward_floor=None if forward is None else forward[1],
    )


async def _forward_waiting(js: JetStream, config: Config) -> tuple[int, int] | None:
    """Requests the forwarding consumer holds or has yet to deliver, and its
    ack floor's stream sequence (binding split in groups only: ``None``
    otherwise, or when it is not provisioned)."""
    if not config.sharded():
        return None
    try:
        info = await js.consumer_info(REQUESTS_STREAM, FORWARD_CONSUMER)
    except NatsNotFoundError:
        return None
    floor = 0 if info.ack_floor is None else info.ack_floor.stream_seq or 0
    return (info.num_pending or 0) + (info.num_ack_pending or 0), floor


async def _binders(
    js: JetStream, config: Config
) -> tuple[LeaseHolder | None, tuple[tuple[str, LeaseHolder | None], ...]]:
    """Who holds the binder's lease, and each group's holder when binding is
    split in groups (then the first's stands for all while every lease is held,
    ``None`` while one is not)."""
    if not config.sharded():
        return await read_lease(js, BINDER_LEASE), ()
    names = [group.name for group in config.binding_groups()]
    holders = await asyncio.gather(*(read_lease(js, binder_lease(name)) for name in names))
    groups = tuple(zip(names, holders, strict=True))
    return (None if None in holders else holders[0]), groups


async def _dlq_messages(js: JetStream) -> int | None:
    try:
        info = await js.stream_info(DLQ_STREAM)
    except NatsNotFoundError:
        return None
    return int(info.state.messages)


async def _lag(js: JetStream, status: StatusReport, now: float) -> float:
    """The age of the first event past the checkpoint (0 when there is none)."""
    if status.events_behind <= 0:
        return 0.0
    try:
        first = await js.get_msg(
            EVENTS_STREAM, seq=status.last_seq + 1, subject="rq.evt.>", next=True
        )
    except NatsNotFoundError:
        return 0.0  # folded (or gone) since the stream was read
    stamp = first.time
    if stamp is None:
        return 0.0
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return max(0.0, now - stamp.timestamp())


def out_of_service(config: Config) -> frozenset[str]:
    """The configured backends whose API key cannot be read here (as ``renqueue up``
    takes them out of service)."""
    return frozenset(out_of_service_here(config))


# ---------------------------------------------------------------- the families


class _Families:
    """Metric families by series name, filled as a reading is walked."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}
        for series in SERIES:
            if series.kind == "gauge":
                self.by_name[series.name] = GaugeMetricFamily(
                    series.name, series.help, labels=series.labels
                )
            elif series.kind == "counter":
                self.by_name[series.name] = CounterMetricFamily(
                    series.name, series.help, labels=series.labels
                )

    def add(self, name: str, value: float, *labels: str) -> None:
        family = self.by_name[name]
        assert isinstance(family, GaugeMetricFamily | CounterMetricFamily)
        assert len(labels) == len(_BY_NAME[name].labels), name
        family.add_metric(list(labels), value)


def cluster_families(
    reading: ClusterReading | None,
    config: Config,
    *,
    up: bool,
    term: int,
    out: Iterable[str] = (),
    group_terms: Mapping[str, int] | None = None,
) -> list[Metric]:
    """The gauge and counter families of :data:`SERIES` for ``reading`` (the
    last one read; ``None``: none yet), whether the last read succeeded
    (``up``), and the last binder's term seen (``term``; binding split in
    groups, each group's in ``group_terms``, 0 for one never seen). ``out``:
    backends out of service here. The histograms are the exporter's own. Pure."""
    families = _Families()
    families.add("renqueue_exporter_up", 1.0 if up else 0.0)
    families.add("renqueue_binder_term", float(term))
    if config.sharded():
        seen = group_terms or {}
        for group in config.binding_groups():
            families.add("renqueue_binder_group_term", float(seen.get(group.name, 0)), group.name)
    families.add("renqueue_store_warn_ratio", config.nats.store_warn)
    for level in config.level_policies():
        bound = math.inf if level.age_after is None else level.age_after
        families.add("renqueue_level_aging_bound_seconds", bound, level.name)
    if reading is not None:
        _add_reading(families, reading, config, frozenset(out))
    else:
        families.add("renqueue_exporter_read_timestamp_seconds", 0.0)
    # A family with no samples is still exposed (its HELP and TYPE lines).
    return list(families.by_name.values())


def _add_binding(families: _Families, reading: ClusterReading) -> None:
    """The binders' leases, and what waits to be forwarded (binding split in groups)."""
    families.add("renqueue_binder_present", 0.0 if reading.binder is None else 1.0)
    for group, holder in reading.groups:
        families.add("renqueue_binder_group_present", 0.0 if holder is None else 1.0, group)
    if reading.forward_waiting is not None:
        families.add("renqueue_forward_waiting_requests", float(reading.forward_waiting))
    if reading.forward_floor is not None:
        families.add("renqueue_forward_ack_floor", float(reading.forward_floor))


def _add_reading(
    families: _Families, reading: ClusterReading, config: Config, out: frozenset[str]
) -> None:
    status = reading.status
    families.add("renqueue_exporter_read_timestamp_seconds", reading.at)
    _add_binding(families, reading)
    families.add("renqueue_projection_lag_events", float(status.events_behind))
    families.add("renqueue_projection_lag_seconds", reading.lag_seconds)
    if reading.dlq_messages is not None:
        families.add("renqueue_dlq_messages", float(reading.dlq_messages))
    for store in status.stores:
        families.add("renqueue_store_bytes", float(store.bytes), store.name)
        if store.max_bytes > 0:
            families.add("renqueue_store_limit_bytes", float(store.max_bytes), store.name)
    families.add("renqueue_jetstream_used_bytes", float(status.store_used))
    if status.store_limit > 0:
        families.add("renqueue_jetstream_limit_bytes", float(status.store_limit))
    if status.cancels_unsourced is not None:
        families.add("renqueue_cancels_unsourced_messages", float(status.cancels_unsourced))
    for level in status.levels:
        if level.waiting is not None:
            families.add("renqueue_level_waiting_requests", float(level.waiting), level.name)
        families.add("renqueue_level_oldest_wait_seconds", level.oldest_wait or 0.0, level.name)
    for backend in status.backends:
        _add_backend(families, backend, out)
    _add_tenants(families, status, config)
    for split in reading.splits:
        for state in SPLIT_STATES:
            families.add("renqueue_ab_split_state", float(split.state == state), split.route, state)
        for arm in split.arms:
            labels = (split.route, arm.arm)
            families.add("renqueue_ab_arm_requests_total", float(arm.total.requests), *labels)
            families.add("renqueue_ab_arm_failures_total", float(arm.total.failed), *labels)
            families.add("renqueue_ab_arm_cost_dollars_total", arm.total.cost, *labels)


def _add_backend(families: _Families, b: BackendStatus, out: frozenset[str]) -> None:
    name = b.name
    families.add("renqueue_backend_up", float(b.healthy and name not in out), name)
    for state in CIRCUIT_STATES:
        families.add("renqueue_backend_circuit_state", float(b.circuit == state), name, state)
    families.add(
        "renqueue_backend_slots_in_use",
        float(b.in_flight if b.running is None else b.running),
        name,
    )
    if b.concurrency is not None:
        families.add("renqueue_backend_slots_limit", float(b.concurrency), name)
    if b.waiting is not None:
        families.add("renqueue_backend_waiting_dispatches", float(b.waiting), name)
    families.add("renqueue_backend_calls_total", float(b.calls_completed), name, "completed")
    families.add("renqueue_backend_calls_total", float(b.calls_failed), name, "failed")
    families.add("renqueue_backend_faults_total", float(b.faults), name)
    families.add("renqueue_backend_rate_limited_total", float(b.rate_limited), name)
    families.add("renqueue_backend_spend_dollars_total", b.spend, name)
    seen: set[tuple[str, str]] = set()
    for usage in b.limits:
        window = _window(usage.key)
        if (window, usage.kind) in seen:
            continue  # one series per window and unit: the first (the tightest) stands
        seen.add((window, usage.kind))
        labels = (name, window, usage.kind)
        families.add("renqueue_backend_quota_used", float(usage.used), *labels)
        families.add("renqueue_backend_quota_limit", float(usage.count), *labels)
        if usage.count > 0:
            ratio = min(1.0, max(0.0, usage.left / usage.count))
            families.add("renqueue_backend_quota_remaining_ratio", ratio, *labels)
        reset = usage.resets_at if usage.resets_at is not None else usage.reported_reset_at
        if reset is not None and math.isfinite(reset):
            families.add("renqueue_backend_quota_reset_timestamp_seconds", reset, *labels)
    for key, learned in sorted(b.learned.items()):
        if learned.limit is not None:
            families.add(
                "renqueue_backend_learned_limit", float(learned.limit), name, _window(key),
                learned.kind,
            )  # fmt: skip


def _add_tenants(families: _Families, status: StatusReport, config: Config) -> None:
    budgets = config.budgets()
    shown = {tenant.name for tenant in status.tenants}
    for tenant in status.tenants:
        families.add("renqueue_tenant_spend_today_dollars", tenant.spend_today, tenant.name)
        if tenant.budget is not None:
            families.add(
                "renqueue_tenant_budget_dollars", tenant.budget.daily, tenant.name,
                tenant.budget.mode,
            )  # fmt: skip
    # Tenants the config names that spent nothing yet: their budget, and 0 today.
    for name, budget in sorted(budgets.items()):
        if name in shown or name == EVERY_TENANT:
            continue
        families.add("renqueue_tenant_spend_today_dollars", 0.0, name)
        if budget is not None:
            families.add("renqueue_tenant_budget_dollars", budget.daily, name, budget.mode)


def _window(key: str) -> str:
    """A limit's window as a label: ``requests/min`` -> ``min``, ``tokens/10s`` -> ``10s``."""
    return key.partition("/")[2] or key
