"""What ``renqueue status`` shows: each backend, priority level and tenant, now.

:func:`read_status` reads it all into one :class:`StatusReport` (the JSON of
``renqueue status --json``); :func:`status_sections` turns a report into the
sections a person reads (the command draws them as tables, :func:`render_status`
as aligned text lines), with no I/O of its own.

Where each figure comes from:

- per backend, from the config and the projector's checkpoint (the key
  ``projection`` in ``rq-state``): health (its circuit breaker as the binder
  last logged it, and its active probe's latest answer; ``out: no API key``
  when its key cannot be read where the status is read, as ``renqueue up``
  takes such a backend out of service there), requests in flight,
  the provider's cooldown and exhausted quota, and for each limit it is judged
  by (declared, tightened by what the provider reported:
  :func:`renqueue.policy.limit_usage`) what is used and left and when it
  resets, counted as the binder counts; ``held`` is
  the binder's reason to pass the backend over for the smallest request now.
  Its queue is its worker consumer's (``worker-<backend>`` on
  ``RQ_DISPATCH``), in two counts: ``waiting``, dispatches not yet delivered
  to a worker, and ``running``, those delivered and not yet acknowledged
  (being run, or waiting out a retry's delay). A backend whose name cannot
  name a consumer (only a forged or damaged checkpoint holds one) has neither.
- per priority level: the requests waiting (its router consumer
  ``router-<level>`` on ``RQ_REQUESTS``: not yet delivered plus held by the
  binder) and how long the oldest one still stored has waited (its stream
  timestamp, the server's clock; a request put back by the services counts
  from when it was put back).
- per tenant, from the checkpoint: spend today (the UTC day of the reader's
  clock), total spend, requests submitted and ended by kind.
- per store (each stream, and each KV bucket's stream ``KV_<bucket>``), from
  its stream info: bytes and messages against its ``max_bytes`` as the server
  holds it, and what it does when full (``discard``); and the account's
  stored bytes against ``nats.max_file_store`` (the server's own cap is not
  readable over NATS; an account limit, where there is one, is used
  instead). A store at ``nats.store_warn`` (80 %) of its limit or more is
  named in ``near_limit`` and gets a ``near limit`` line.

The checkpoint lags the log by up to a flush (100 ms) when the projector keeps
up (``events_behind`` says by how much), and it does not hold the reservations
the binder made since the last event it folded.

The report holds what the checkpoint holds, names and times as they are; the
text (:func:`render_status`) shows every name with its non-printable
characters escaped (:func:`printable`: an escape sequence in a backend's or a
tenant's name is shown, never sent to the terminal) and a time too far out for
a calendar as ``far future``.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import time
from collections.abc import Sequence
from typing import Final

from msgspec import Struct

from ..broker import STORES, JetStream, JetStreamApi
from ..config import Config
from ..errors import ConfigError, NatsApiError, NatsNotFoundError
from ..policy import (
    Budget,
    Cost,
    Learned,
    LimitUsage,
    Perf,
    Quota,
    budget_of,
    check,
    effective_limits,
    limit_usage,
)
from ..schema import (
    CANCELS_STREAM,
    DISPATCH_STREAM,
    EVENTS_STREAM,
    REQUESTS_STREAM,
    STATE_BUCKET,
    requests_of_level,
    router_consumer,
    worker_consumer,
)
from ..state import BackendState, ProjectionState, utc_day
from ..text import clock, printable, shorten
from ._cancellation import read_cancel_source
from ._verify import read_checkpoint

__all__ = [
    "NEAR_LIMIT",
    "BackendStatus",
    "LevelStatus",
    "StatusReport",
    "StatusSection",
    "StoreStatus",
    "TenantStatus",
    "backend_status",
    "health_of",
    "out_of_service_here",
    "read_status",
    "render_status",
    "status_heading",
    "status_of",
    "status_sections",
]

#: The smallest request: what ``held`` asks the binder's check about.
_SMALLEST: Final = Cost(requests=1, tokens=1)
_EMPTY: Final = BackendState()
#: The longest ``held`` reason shown in the text (the binder's words, which
#: hold a duration: a forged time far ahead would make it run on).
_HELD_WIDTH: Final = 100
#: Durations from this on are shown as ``far future`` (about 27 years).
_FAR: Final = 10_000 * 86400.0


class BackendStatus(Struct, frozen=True, kw_only=True):
    """One backend now. Times are absolute (Unix seconds)."""

    name: str
    #: Whether the config names it (a backend only the log names has no limits here).
    configured: bool
    #: Whether the binder may bind to it: its circuit is not open, and it is
    #: not out of service (``out``).
    healthy: bool
    consecutive_failures: int
    last_error_type: str | None
    #: Requests whose latest start was here and that have not ended (the projection's).
    in_flight: int
    #: Dispatches at its worker consumer not yet delivered to a worker
    #: (``num_pending``); ``None`` when it has no consumer.
    waiting: int | None
    #: Dispatches delivered to a worker and not yet acknowledged
    #: (``num_ack_pending``): being run, or waiting out a retry's delay;
    #: ``None`` when it has no consumer.
    running: int | None
    #: Its declared concurrency (the worker consumer's ``max_ack_pending``).
    concurrency: int | None
    #: No call before this (a 429's ``retry-after``), if in the future.
    cooldown_until: float | None
    #: The provider's quota is spent until this, if in the future.
    exhausted_until: float | None
    #: Why the binder would pass it over for the smallest request now; "" if it would not.
    held: str
    limits: tuple[LimitUsage, ...]
    #: Its circuit breaker as last logged: ``closed``, ``open`` or ``half_open``,
    #: since when and why (``circuit`` events, written by the binder).
    circuit: str = "closed"
    circuit_since: float = 0.0
    circuit_reason: str = ""
    #: The latest answer of its active health probe (``None``: none configured or none yet).
    probe_ok: bool | None = None
    calls_completed: int
    calls_failed: int
    rate_limited: int
    spend: float
    #: Its speed and reliability as learned from the log (``None``: nothing yet).
    perf: Perf | None = None
    #: Failures that blamed the backend, ever (``calls_failed`` counts every failure).
    faults: int = 0
    #: The windows its provider reported (limit, remaining, reset), by limit key.
    learned: dict[str, Learned] = {}
    #: Why it is out of service where the status was read ("" if it is not):
    #: its API key cannot be read there (``renqueue up`` takes it out of every
    #: route and runs no worker for it).
    out: str = ""


class LevelStatus(Struct, frozen=True, kw_only=True):
    """One priority level now."""

    name: str
    #: Requests at its router consumer: not yet delivered plus held by the
    #: binder; ``None`` when it has no consumer.
    waiting: int | None
    #: When the oldest request still stored at this level was stored (server time).
    oldest_at: float | None
    #: How long it has waited, by the reader's clock.
    oldest_wait: float | None


class TenantStatus(Struct, frozen=True, kw_only=True):
    """One tenant: spend (USD) today and in all, requests submitted and ended."""

    name: str
    spend_today: float
    spend: float
    submitted: int
    terminal: dict[str, int]
    #: Its daily budget (USD) and mode (``soft``, ``hard``), if it has one.
    budget: Budget | None = None


class StoreStatus(Struct, frozen=True, kw_only=True):
    """One stream (a KV bucket's too: ``KV_<bucket>``) against its byte limit."""

    name: str
    bytes: int
    messages: int
    #: Its ``max_bytes`` as the server holds it; -1: none of its own.
    max_bytes: int
    #: ``new``: when full, a write is refused (nothing is dropped); ``old``:
    #: the oldest messages make room.
    discard: str
    #: At least ``nats.store_warn`` of its limit is used.
    near_limit: bool


class StatusReport(Struct, frozen=True, kw_only=True):
    """Everything ``renqueue status`` shows, as of ``at`` (the reader's clock)."""

    at: float
    #: Whether a projector has stored a checkpoint (if not, every count is 0).
    projected: bool
    #: The stream sequence the checkpoint reflects, and its log time.
    last_seq: int
    log_time: float
    #: Events stored in the log past the checkpoint.
    events_behind: int
    in_flight: int
    backends: tuple[BackendStatus, ...]
    levels: tuple[LevelStatus, ...]
    tenants: tuple[TenantStatus, ...]
    #: Each stream and bucket against its ``max_bytes``.
    stores: tuple[StoreStatus, ...] = ()
    #: Bytes the JetStream account stores, in all, and the cap they count
    #: against (``nats.max_file_store``, or the account's own limit if it has one).
    store_used: int = 0
    store_limit: int = -1
    #: The fraction of a limit past which a store is near it (``nats.store_warn``).
    store_warn: float = 0.8
    #: What is near its limit: stream names, and ``store`` for the whole store.
    #: Empty when nothing is.
    near_limit: tuple[str, ...] = ()
    #: Clients' cancellations ``RQ_CANCELS`` holds that the event log has not
    #: taken in (its source is behind: the log is full, the source is being set
    #: up again, or missing); ``None`` when ``RQ_CANCELS`` is not there. A
    #: moment's worth is normal; more means cancellations wait, unknown to the
    #: services.
    cancels_unsourced: int | None = None


# -------------------------------------------------------------------- reading


async def read_status(js: JetStream, config: Config, *, now: float | None = None) -> StatusReport:
    """Read the checkpoint, the consumers and the oldest requests into a report.

    ``now`` (default: ``time.time()``) is the clock health, quota windows and
    waits are judged at. Raises :class:`~renqueue.errors.NatsError` if NATS
    fails, :class:`~renqueue.errors.RenQueueError` if the stored checkpoint
    does not decode.
    """
    at = time.time() if now is None else now
    read = await read_checkpoint(await js.key_value(STATE_BUCKET))
    return await status_of(js, config, None if read is None else read[0], at)


async def status_of(
    js: JetStream, config: Config, checkpoint: ProjectionState | None, at: float
) -> StatusReport:
    """:func:`read_status` of a checkpoint already read (``None``: none stored):
    the consumers and the oldest requests are read here."""
    state = ProjectionState() if checkpoint is None else checkpoint
    names = [*config.backends, *sorted(set(state.backends) - set(config.backends))]
    out = out_of_service_here(config)
    stream, queues, levels, (stores, used, cap), unsourced = await asyncio.gather(
        js.stream_info(EVENTS_STREAM),
        asyncio.gather(*(_pending(js, DISPATCH_STREAM, worker_consumer(n)) for n in names)),
        asyncio.gather(*(_level(js, level, at, _groups(config)) for level in config.priorities)),
        _stores(js, config),
        cancels_unsourced(js),
    )
    backends = tuple(
        backend_status(
            name,
            state.backend(name),
            config,
            at,
            waiting=None if queue is None else queue[0],
            running=None if queue is None else queue[1],
            out=out.get(name, ""),
        )
        for name, queue in zip(names, queues, strict=True)
    )
    today = utc_day(at)
    budgets = config.budgets()
    tenants = tuple(
        TenantStatus(
            name=name,
            spend_today=tenant.spend_on(today),
            spend=tenant.spend,
            submitted=tenant.submitted,
            terminal=dict(tenant.terminal),
            budget=budget_of(name, budgets),
        )
        for name, tenant in sorted(state.tenants.items())
    )
    return StatusReport(
        at=at,
        projected=checkpoint is not None,
        last_seq=state.last_seq,
        log_time=state.log_time,
        events_behind=max(0, int(stream.state.last_seq) - state.last_seq),
        in_flight=state.in_flight_count,
        backends=backends,
        levels=tuple(levels),
        tenants=tenants,
        stores=stores,
        store_used=used,
        store_limit=cap,
        store_warn=config.nats.store_warn,
        near_limit=(
            *(s.name for s in stores if s.near_limit),
            *(("store",) if _near(used, cap, config.nats.store_warn) else ()),
        ),
        cancels_unsourced=unsourced,
    )


async def cancels_unsourced(js: JetStream) -> int | None:
    """How many of ``RQ_CANCELS``'s messages the event log has not sourced
    (:attr:`StatusReport.cancels_unsourced`); ``None`` without ``RQ_CANCELS``."""
    source = await read_cancel_source(js)
    return None if source is None else source.unsourced


async def _stores(js: JetStream, config: Config) -> tuple[tuple[StoreStatus, ...], int, int]:
    """Every provisioned stream against its limit; the account's stored bytes, and its cap."""
    warn = config.nats.store_warn

    async def one(name: str) -> StoreStatus | None:
        try:
            info = await js.stream_info(name)
        except NatsNotFoundError:
            return None
        limit = int(info.config.max_bytes or -1)
        used = int(info.state.bytes or 0)
        discard = info.config.discard
        return StoreStatus(
            name=name,
            bytes=used,
            messages=int(info.state.messages or 0),
            max_bytes=limit,
            discard=str(getattr(discard, "value", discard) or "old"),
            near_limit=_near(used, limit, warn),
        )

    found, account = await asyncio.gather(
        asyncio.gather(*(one(name) for name in STORES)), JetStreamApi(js).call("INFO")
    )
    used = int(account.get("storage", 0)) if isinstance(account, dict) else 0
    limits = account.get("limits", {}) if isinstance(account, dict) else {}
    cap = int(limits.get("max_storage", -1) or -1)
    if cap <= 0:
        cap = config.nats.store_bytes
    return tuple(s for s in found if s is not None), used, cap


def _near(used: int, limit: int, warn: float) -> bool:
    return limit > 0 and used >= warn * limit


def backend_status(
    name: str,
    state: BackendState,
    config: Config,
    now: float,
    *,
    waiting: int | None = None,
    running: int | None = None,
    out: str = "",
) -> BackendStatus:
    """One backend's status from its folded state and its config, at ``now``. Pure.

    ``waiting`` and ``running``: its worker consumer's counts (``None``: no consumer).
    ``out``: why it is out of service here ("" if it is not: :func:`out_of_service_here`).
    A quota whose times no calendar holds (a damaged or forged checkpoint) is
    not judged: ``held`` says so and no limit is listed.
    """
    backend = config.backends.get(name)
    declared = () if backend is None else backend.limits.declared()
    quota = state.quota or Quota()
    limits: tuple[LimitUsage, ...] = ()
    try:
        verdict = check(quota, effective_limits(declared, quota), _SMALLEST, now)
        limits = limit_usage(quota, declared, now)
    except (OverflowError, ValueError, OSError) as exc:
        held = f"cannot judge its quota: {exc}"
    else:
        held = "" if verdict.ok else verdict.reason
    return BackendStatus(
        name=name,
        configured=backend is not None,
        healthy=state.circuit != "open" and not out,
        consecutive_failures=state.consecutive_failures,
        last_error_type=state.last_error_type,
        in_flight=state.in_flight,
        waiting=waiting,
        running=running,
        concurrency=None if backend is None else backend.limits.concurrency,
        cooldown_until=_ahead(quota.cooldown_until, now),
        exhausted_until=_ahead(quota.exhausted_until, now),
        held=held,
        limits=limits,
        circuit=state.circuit,
        circuit_since=state.circuit_at,
        circuit_reason=state.circuit_reason,
        probe_ok=state.probe_ok,
        calls_completed=state.calls_completed,
        calls_failed=state.calls_failed,
        rate_limited=state.rate_limited,
        spend=state.spend,
        perf=state.perf,
        faults=state.faults,
        learned=dict(quota.learned),
        out=out,
    )


def out_of_service_here(config: Config) -> dict[str, str]:
    """The configured backends whose API key cannot be read here, each with why
    (``no API key: ...``): ``renqueue up`` takes them out of service."""
    out = {}
    for name, backend in config.backends.items():
        try:
            backend.api_key(path=f"$.backends.{name}")
        except ConfigError as exc:
            out[name] = f"no API key: {exc}"
    return out


def _ahead(until: float | None, now: float) -> float | None:
    return until if until is not None and until > now else None


async def _pending(js: JetStream, stream: str, consumer: str) -> tuple[int, int] | None:
    """A consumer's messages not yet delivered, and delivered and not acked;
    ``None`` when there is no such consumer.

    A name that cannot be a consumer's (a backend named ``a.b`` or ``*`` in a
    damaged or forged checkpoint: nats-py refuses it with ``ValueError``, the
    server with an API error) names no consumer either.
    """
    try:
        info = await js.consumer_info(stream, consumer)
    except (ValueError, NatsNotFoundError, NatsApiError):
        return None
    return info.num_pending or 0, info.num_ack_pending or 0


def _groups(config: Config) -> list[str | None]:
    """The binding groups whose router consumers count a level's waiting requests
    (``[None]``: binding not split, one consumer a level)."""
    return [g.name for g in config.binding_groups()] if config.sharded() else [None]


async def _level(js: JetStream, level: str, now: float, groups: list[str | None]) -> LevelStatus:
    """A level's waiting requests: its router consumers' (one per binding group)
    pending and held; with binding split, not those still to be forwarded."""
    found = [await _pending(js, REQUESTS_STREAM, router_consumer(level, g)) for g in groups]
    counts = [c for c in found if c is not None]
    waiting = None if not counts else sum(sum(c) for c in counts)
    try:
        oldest = await js.get_msg(
            REQUESTS_STREAM, seq=1, subject=requests_of_level(level), next=True
        )
    except NatsNotFoundError:
        oldest_at = None
    else:
        stamp = oldest.time
        if stamp is not None and stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.UTC)
        oldest_at = None if stamp is None else stamp.timestamp()
    return LevelStatus(
        name=level,
        waiting=waiting,
        oldest_at=oldest_at,
        oldest_wait=None if oldest_at is None else max(0.0, now - oldest_at),
    )


# ------------------------------------------------------------------ rendering


class StatusSection(Struct, frozen=True, kw_only=True):
    """One section of the status for a person: a table (``columns`` and
    ``rows`` of text cells, names escaped) or, without ``columns``, notes
    (``rows`` of ``(name, what)``). The text (:func:`render_status`) and the
    command line's tables draw the same sections."""

    title: str
    #: Column headings; empty for notes.
    columns: tuple[str, ...] = ()
    #: Which columns hold numbers (aligned right).
    numeric: tuple[bool, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()


def health_of(backend: BackendStatus) -> str:
    """A backend's health in words a person reads: ``ok`` (its circuit closed),
    ``ok, probe down``, ``open``, ``half-open`` (one trial call), ``out: no API
    key``; then how many faults in a row, when there are some. ``--json`` keeps
    the fields this is made of: ``circuit``, ``probe_ok``, ``out``, ``healthy``."""
    if backend.out:
        return "out: no API key"
    word = {"closed": "ok", "half_open": "half-open"}.get(backend.circuit, backend.circuit)
    word = printable(word)
    if backend.probe_ok is False and backend.circuit == "closed":
        word += ", probe down"
    if backend.consecutive_failures:
        word += f" ({backend.consecutive_failures})"
    return word


def status_sections(report: StatusReport) -> list[StatusSection]:
    """The report as sections for a person (no I/O). Names are shown
    :func:`printable`; times too far out for a calendar as ``far future``. A
    section with nothing to say (no pause, no open circuit, nothing learned,
    no limit) is left out."""
    now = report.at
    found = [
        _backend_section(report.backends),
        _notes(
            "Out of service here (set the key and restart: renqueue up runs no worker for it)",
            [(b.name, b.out) for b in report.backends if b.out],
        ),
        _notes(
            "Held back (why the binder would pass it over for the smallest request now)",
            [(b.name, shorten(printable(b.held), _HELD_WIDTH)) for b in report.backends if b.held],
        ),
        _notes(
            "Paused by the provider",
            [(b.name, "; ".join(_pauses(b, now))) for b in report.backends if _pauses(b, now)],
        ),
        _notes(
            "Circuit breakers not closed (the binder moves them; circuit events)",
            [
                (b.name, _circuit_text(b))
                for b in report.backends
                if b.circuit != "closed" or b.probe_ok is False
            ],
        ),
        _learned_section(report.backends),
        _limit_section(report.backends, now),
        _level_section(report.levels),
        _tenant_section(report.tenants),
        *_store_sections(report),
        _notes(
            "Cancellations not in the log (routers and workers do not know them yet)",
            [(CANCELS_STREAM, f"{report.cancels_unsourced} waiting to be sourced")]
            if report.cancels_unsourced
            else [],
        ),
    ]
    return [section for section in found if section is not None]


def status_heading(report: StatusReport) -> list[str]:
    """The status's first lines: when, and how far the projection is behind."""
    return [
        f"Ren-Queue status at {clock(report.at)}",
        (
            f"  projection at seq {report.last_seq} ({report.events_behind} events behind the"
            f" log), log time {clock(report.log_time) if report.log_time else '-'};"
            f" {report.in_flight} in flight"
            if report.projected
            else "  no projection stored yet: no projector has run (counts below are 0)"
        ),
    ]


def render_status(report: StatusReport) -> list[str]:
    """The report as aligned text lines (no trailing newlines). Pure: the
    sections of :func:`status_sections`, each a heading and its rows."""
    lines = status_heading(report)
    for section in status_sections(report):
        lines += ["", section.title]
        if not section.columns:
            lines += [f"  {name}: {what}" for name, what in section.rows]
            continue
        if not section.rows:
            lines.append("  none yet")
            continue
        table = [section.columns, *section.rows]
        widths = [max(len(row[n]) for row in table) for n in range(len(section.columns))]
        for row in table:
            cells = [
                cell.rjust(width) if right else cell.ljust(width)
                for cell, width, right in zip(row[:-1], widths, section.numeric, strict=False)
            ]
            lines.append("  " + " ".join([*cells, row[-1]]).rstrip())
    return lines


def _notes(title: str, notes: Sequence[tuple[str, str]]) -> StatusSection | None:
    if not notes:
        return None
    return StatusSection(title=title, rows=tuple((printable(n), what) for n, what in notes))


def _circuit_text(b: BackendStatus) -> str:
    return (
        f"{b.circuit.replace('_', '-')} since"
        f" {clock(b.circuit_since)}: {shorten(printable(b.circuit_reason), _HELD_WIDTH)}"
        + ("" if b.probe_ok is None else f" (probe: {'up' if b.probe_ok else 'down'})")
    )


def _backend_section(backends: Sequence[BackendStatus]) -> StatusSection:
    return StatusSection(
        title="Backends",
        columns=(
            *("backend", "health", "in flight", "waiting", "running", "slots", "done"),
            *("failed", "429s", "spend $"),
        ),
        numeric=(False, False, *([True] * 8)),
        rows=tuple(
            (
                printable(b.name),
                health_of(b),
                str(b.in_flight),
                _opt(b.waiting),
                _opt(b.running),
                _opt(b.concurrency),
                str(b.calls_completed),
                str(b.calls_failed),
                str(b.rate_limited),
                f"{b.spend:.6f}",
            )
            for b in backends
        ),
    )


def _learned_section(backends: Sequence[BackendStatus]) -> StatusSection | None:
    learned = [(b.name, b.perf) for b in backends if b.perf is not None and b.perf.samples]
    if not learned:
        return None
    return StatusSection(
        title="Learned from the log (mean +- spread; what the binder predicts finish times by)",
        columns=("backend", "calls", "first token s", "tokens/s", "output tok", "faults", "429s"),
        numeric=(False, *([True] * 6)),
        rows=tuple(
            (
                printable(name),
                str(perf.samples),
                _spread(perf.ttft, perf.ttft_sd, 2),
                _spread(perf.rate, perf.rate_sd, 0),
                _spread(perf.output, perf.output_sd, 0),
                f"{perf.fault_p:.0%}",
                f"{perf.limited_p:.0%}",
            )
            for name, perf in learned
        ),
    )


def _limit_section(backends: Sequence[BackendStatus], now: float) -> StatusSection | None:
    limited = [(b.name, u) for b in backends for u in b.limits]
    if not limited:
        return None
    return StatusSection(
        title="Rate limits (the limit judged by: the declared one, "
        "or less if the provider said so)",
        columns=("backend", "window", "used", "limit", "left", "declared", "resets in"),
        numeric=(False, False, True, True, True, True, False),
        rows=tuple(
            (
                printable(name),
                _limit_name(u),
                str(u.used),
                str(u.count),
                str(u.left),
                _opt(u.declared),
                _resets(u, now),
            )
            for name, u in limited
        ),
    )


def _level_section(levels: Sequence[LevelStatus]) -> StatusSection:
    return StatusSection(
        title="Priority levels",
        columns=("level", "waiting", "oldest wait"),
        numeric=(False, True, False),
        rows=tuple(
            (
                printable(level.name),
                _opt(level.waiting),
                "-" if level.oldest_wait is None else _duration(level.oldest_wait),
            )
            for level in levels
        ),
    )


def _tenant_section(tenants: Sequence[TenantStatus]) -> StatusSection:
    return StatusSection(
        title="Tenants",
        columns=("tenant", "spend today $", "budget/day $", "spend $", "submitted", "ended"),
        numeric=(False, True, True, True, True, False),
        rows=tuple(
            (
                printable(t.name),
                f"{t.spend_today:.6f}",
                "-" if t.budget is None else f"{t.budget.daily:.6f} {t.budget.mode}",
                f"{t.spend:.6f}",
                str(t.submitted),
                " ".join(f"{printable(k)}={n}" for k, n in sorted(t.terminal.items())) or "-",
            )
            for t in tenants
        ),
    )


def _pauses(backend: BackendStatus, now: float) -> list[str]:
    """What the provider said holds the backend back, now: one line.

    An exhausted quota is named as such, until the later of its end and any
    cooldown (a worker that finds a quota spent also pauses the backend
    until then: one pause). A cooldown alone is a 429's pause: its
    ``retry-after``, or ``worker.quota_hold`` for an out-of-credit 429 that
    does not say until when (``insufficient_quota``), which the projection
    folds as a cooldown: it cannot be told from a rate limit there.
    """
    exhausted, cooldown = backend.exhausted_until, backend.cooldown_until
    if exhausted is not None and exhausted > now:
        end = exhausted if cooldown is None else max(exhausted, cooldown)
        return [f"quota exhausted until {_until(end, now)}"]
    if cooldown is not None and cooldown > now:
        return [f"429 from the provider: no call until {_until(cooldown, now)}"]
    return []


def _until(at: float, now: float) -> str:
    if at - now >= _FAR:
        return "far future"
    return f"{clock(at)} (in {_duration(at - now)})"


def _limit_name(usage: LimitUsage) -> str:
    key = printable(usage.key)
    return key if usage.calendar == "rolling" else f"{key} ({usage.calendar})"


def _resets(usage: LimitUsage, now: float) -> str:
    parts = []
    if usage.resets_at is not None:
        parts.append(_duration(usage.resets_at - now))
    if usage.room_at is not None:
        parts.append(f"room for one more in {_duration(usage.room_at - now)}")
    if usage.reported_left is not None:
        reset = (
            ""
            if usage.reported_reset_at is None
            else f", resets in {_duration(usage.reported_reset_at - now)}"
        )
        parts.append(f"provider says {usage.reported_left} left{reset}")
    return "; ".join(parts) or "-"


def _spread(mean: float, sd: float, digits: int) -> str:
    return f"{mean:.{digits}f} +- {sd:.{digits}f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    seconds = max(0.0, seconds)
    if seconds >= _FAR:
        return "far future"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{round(seconds)} s"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


#: The title of the status's warnings (the command line shows it in yellow).
NEAR_LIMIT: Final = "Near limit (what to do: docs/operations.md#storage)"


def _store_sections(report: StatusReport) -> list[StatusSection]:
    """Each store's bytes against its limit; then, for each store past
    ``store_warn`` of its limit (and the server's store as a whole), a
    ``near limit`` note."""
    if not report.stores:
        return []
    whole = (
        f"{_size(report.store_used)} of {_size(report.store_limit)}"
        f" ({_share(report.store_used, report.store_limit)})"
    )
    sections = [
        StatusSection(
            title=f"Storage ({whole} of the server's store used)",
            columns=("stream", "bytes", "limit", "full", "messages", "when full"),
            numeric=(False, True, True, True, True, False),
            rows=tuple(
                (
                    printable(s.name),
                    _size(s.bytes),
                    _size(s.max_bytes),
                    _share(s.bytes, s.max_bytes),
                    str(s.messages),
                    "refuses new" if s.discard == "new" else "drops oldest",
                )
                for s in report.stores
            ),
        )
    ]
    warn = f"{report.store_warn:.0%}"
    near = [
        (s.name, f"{_share(s.bytes, s.max_bytes)} full (over {warn})")
        for s in report.stores
        if s.near_limit
    ]
    if "store" in report.near_limit:
        whole_share = _share(report.store_used, report.store_limit)
        near.append(("the server's store", f"{whole_share} full (over {warn})"))
    note = _notes(NEAR_LIMIT, near)
    return sections if note is None else [*sections, note]


def _size(count: int) -> str:
    """Bytes for a person: ``-`` for no limit, else B, KiB, MiB, GiB or TiB."""
    if count < 0:
        return "-"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _share(used: int, limit: int) -> str:
    return "-" if limit <= 0 else f"{used / limit:.0%}"
