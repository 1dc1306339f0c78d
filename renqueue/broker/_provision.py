"""Apply the stream and consumer definitions in ``streams/`` to a NATS server, idempotently.

The definitions are JSON in NATS's own config schema (what ``nats stream add
--config`` takes), so an operator can read them, diff them and apply them with
the ``nats`` CLI. :func:`provision` sends them to the JetStream API directly
(``$JS.API.STREAM.*`` / ``$JS.API.CONSUMER.*`` requests) rather than through
nats-py's typed wrappers: those drop fields they do not know and re-serialise
the rest, so what reaches the server would not be what the file says.

For each stream and consumer it reads the live config, compares the fields the
definition names, and then:

- creates it when missing;
- updates it when only fields NATS can change in place differ (limits,
  subjects, ack wait, max ack pending, ...);
- refuses with :class:`ProvisionError`, naming each differing field with its
  old and new value, when NATS cannot apply the change in place (storage;
  retention to or from workqueue; a consumer's deliver, ack or replay policy)
  or when the server rejects the update. Such a change needs a migration, never
  a silent delete-and-recreate of a queue that may hold requests.

Fields the definition does not name are left as they are on the server, so a
limit an operator set by hand survives a re-provision.

While JetStream cannot answer (no reply in time, no responders, or a "not now"
error: a cluster with no quorum or no leader yet, a stream between leaders, a
node still joining), each stream and consumer is retried after a capped,
jittered backoff, with one warning logged per attempt, until the cluster
answers or ``nats.startup_wait`` runs out ("0s", the default: forever).
:func:`until_jetstream_answers` does that, for any start-up step. Errors that
waiting cannot fix fail at once: a bad definition, a change NATS refuses, a
NATS permissions violation.

Values from the config override the files at provision time (see
``streams/README.md``): ``num_replicas`` from ``nats.replicas``; ``max_age``
from ``nats.<stream>``; ``max_bytes`` of every stream and bucket from
``nats.<store>.max_bytes``, else its share of ``nats.max_file_store``
(:meth:`renqueue.config.NatsConfig.max_bytes`); ``duplicate_window`` from
``nats.duplicate_window`` on the requests, dispatch and events streams;
``max_msg_size`` of ``RQ_CANCELS`` from :data:`renqueue.schema.MAX_CANCEL_BYTES`
(and the event log's ``sources`` must be :data:`renqueue.schema.CANCEL_SOURCE`); the
request subjects from ``priorities``; the consumers from ``priorities``,
``backends``, ``router`` and ``worker``.

Two KV buckets are provisioned from code (the KV protocol fixes their stream's
shape): ``rq-state`` (the projection, coalescing groups) and ``rq-terminal``
(terminal claims, see :mod:`renqueue.broker._eventlog`), whose entries live as long as
the events they guard (``nats.events.max_age``).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.resources
import json
import os
import random
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import msgspec

from ..config import LEASE_BYTES, Config, parse_duration
from ..errors import ConnectionFailedError, NatsClosedError, NatsUnavailableError, ProvisionError
from ..logs import get_logger
from ..schema import (
    ADVISORIES_CONSUMER,
    ADVISORIES_STREAM,
    CANCEL_SOURCE,
    CANCELS_STREAM,
    DISPATCH_STREAM,
    DLQ_STREAM,
    EVENTS_STREAM,
    FORWARD_CONSUMER,
    LEASE_BUCKET,
    MAX_CANCEL_BYTES,
    REQUESTS_STREAM,
    STATE_BUCKET,
    TERMINAL_BUCKET,
    TOKENS_STREAM,
    cancel_subject,
    dispatch_subject,
    forwarded_subjects,
    max_deliveries_advisory,
    requests_of_level,
    requests_of_route,
    router_consumer,
    router_max_deliveries,
    worker_consumer,
)
from ._nats import (
    CONSUMER_EXISTS,
    CONSUMER_NOT_FOUND,
    STREAM_NAME_IN_USE,
    STREAM_NOT_FOUND,
    Connection,
    JetStream,
    JetStreamApi,
    reply_error,
)

__all__ = [
    "STORES",
    "STREAMS_DIR_ENV",
    "Action",
    "ProvisionItem",
    "ProvisionReport",
    "ensure_router_consumers",
    "find_streams_dir",
    "provision",
    "renew_router_consumers",
    "router_consumer_configs",
    "until_jetstream_answers",
]

log = get_logger("provision")

#: Environment variable naming the directory of stream definitions.
STREAMS_DIR_ENV: Final = "RENQUEUE_STREAMS_DIR"


# Backoff between attempts while JetStream is unavailable: base * 2**n, capped.
_RETRY_BASE: Final = 0.2
_RETRY_CAP: Final = 3.0

_T = TypeVar("_T")

_NS_PER_SECOND: Final = 1_000_000_000
_DURATION_FIELDS: Final = frozenset({"max_age", "duplicate_window", "ack_wait", "idle_heartbeat"})

# Fields NATS cannot change on a live consumer; checked before asking, so the
# error names the field instead of relaying a server message.
_CONSUMER_FIXED: Final = (
    "deliver_policy",
    "opt_start_seq",
    "opt_start_time",
    "ack_policy",
    "replay_policy",
    "deliver_subject",
)

# The KV bucket's backing stream, in the shape nats-py's create_key_value
# builds (the KV protocol fixes the stream name and subjects), with history 1.
_KV_STREAM: Final = f"KV_{STATE_BUCKET}"
_TERMINAL_STREAM: Final = f"KV_{TERMINAL_BUCKET}"
_LEASE_STREAM: Final = f"KV_{LEASE_BUCKET}"

_PLACEHOLDER_RE: Final = re.compile(r"\{([A-Za-z_.]+)\}")


class Action(enum.Enum):
    """What provisioning did to one stream or consumer."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


class ProvisionItem(msgspec.Struct, frozen=True, kw_only=True):
    """One stream, consumer or KV bucket, and what was done to it.

    ``name`` is the stream name, ``<stream>/<consumer>`` for a consumer, or
    the bucket name. ``changes`` lists ``field: old -> new`` for an update.
    """

    kind: Literal["stream", "consumer", "kv"]
    name: str
    action: Action
    changes: tuple[str, ...] = ()


class ProvisionReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything :func:`provision` touched, in the order it was applied."""

    items: tuple[ProvisionItem, ...]

    def get(self, name: str) -> ProvisionItem:
        """The item for a stream, ``<stream>/<consumer>`` or bucket name."""
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(name)

    def names(self, action: Action) -> list[str]:
        return [item.name for item in self.items if item.action is action]

    @property
    def created(self) -> list[str]:
        return self.names(Action.CREATED)

    @property
    def updated(self) -> list[str]:
        return self.names(Action.UPDATED)

    @property
    def unchanged(self) -> list[str]:
        return self.names(Action.UNCHANGED)

    def __str__(self) -> str:
        lines = []
        for item in self.items:
            line = f"{item.kind} {item.name}: {item.action.value}"
            if item.changes:
                line += " (" + "; ".join(item.changes) + ")"
            lines.append(line)
        return "\n".join(lines)


class _StreamSpec(msgspec.Struct, frozen=True):
    file: str
    name: str
    #: Attribute of NatsConfig holding this stream's RetentionConfig, if any.
    retention: str | None
    #: Whether nats.duplicate_window applies (streams written with Nats-Msg-Id).
    dedupe: bool
    #: Its key in ``STORE_SHARES``: where its ``max_bytes`` comes from.
    store: str


_STREAMS: Final = (
    _StreamSpec("requests.json", REQUESTS_STREAM, "requests", dedupe=True, store="requests"),
    _StreamSpec("dispatch.json", DISPATCH_STREAM, "dispatch", dedupe=True, store="dispatch"),
    # Before the event log, which sources it.
    _StreamSpec("cancels.json", CANCELS_STREAM, "cancels", dedupe=False, store="cancels"),
    _StreamSpec("events.json", EVENTS_STREAM, "events", dedupe=True, store="events"),
    _StreamSpec("tokens.json", TOKENS_STREAM, "tokens", dedupe=False, store="tokens"),
    _StreamSpec("dlq.json", DLQ_STREAM, "dlq", dedupe=False, store="dlq"),
    _StreamSpec("advisories.json", ADVISORIES_STREAM, None, dedupe=False, store="advisories"),
)

#: The streams of every stream and bucket provisioned, each with a ``max_bytes``.
STORES: Final = (
    *(spec.name for spec in _STREAMS),
    _TERMINAL_STREAM,
    _KV_STREAM,
    _LEASE_STREAM,
)


def find_streams_dir(streams_dir: Path | None = None) -> Path:
    """The stream definitions, in this order of precedence.

    1. ``streams_dir``, else ``$RENQUEUE_STREAMS_DIR`` (an error if it is not
       a directory: a path given explicitly is never silently replaced);
    2. the checkout's ``streams/``: the directory next to the ``renqueue``
       package when a ``pyproject.toml`` sits beside it (a clone, or an
       editable install of one), so edits there take effect;
    3. the copy packaged into the wheel as ``renqueue/_streams`` (an installed
       ``renqueue``, e.g. ``pip install renqueue`` or a container image).
    """
    env = os.environ.get(STREAMS_DIR_ENV)
    if streams_dir is not None or env:
        if streams_dir is not None:
            candidate, origin = Path(streams_dir), "streams_dir argument"
        else:
            candidate, origin = Path(str(env)), f"${STREAMS_DIR_ENV}"
        if not candidate.is_dir():
            raise ProvisionError(f"stream definitions directory {candidate} ({origin}) not found")
        return candidate
    checkout = Path(__file__).resolve().parents[2]  # renqueue/broker/_provision.py
    if (checkout / "streams").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout / "streams"
    packaged = importlib.resources.files("renqueue") / "_streams"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    raise ProvisionError(
        f"no stream definitions: neither {checkout / 'streams'} (a checkout) nor the "
        f"packaged copy {packaged} exists; pass streams_dir or set ${STREAMS_DIR_ENV} "
        "to a copy of the repository's streams/ directory"
    )


async def provision(
    js_or_nc: Connection | JetStream,
    config: Config,
    *,
    streams_dir: Path | None = None,
) -> ProvisionReport:
    """Create or update every stream, consumer and the state KV bucket; idempotent.

    ``js_or_nc`` is a connection or a JetStream context from one
    (whose API prefix, and so its JetStream domain, is used). Raises
    :class:`ProvisionError` for a bad definition file or a change NATS cannot
    apply. While JetStream cannot answer it waits (see
    :func:`until_jetstream_answers`), up to ``nats.startup_wait``, then raises
    :class:`ConnectionFailedError`, as it does at once for a permissions
    violation. All definitions are read and checked before anything is sent.
    """
    directory = find_streams_dir(streams_dir)
    streams = [(spec, _stream_config(directory, spec, config)) for spec in _STREAMS]
    consumers = _consumer_configs(directory, config)
    api = JetStreamApi(js_or_nc, patience=parse_duration(config.nats.startup_wait))

    items: list[ProvisionItem] = []
    for spec, desired in streams:
        items.append(await _ensure_stream(api, desired, source=str(directory / spec.file)))
    # Both wait while JetStream cannot answer, as every other step does (a
    # service started while a node is down must wait for it, not exit).
    if config.sharded() or await _answered(
        api, "the forwarding consumer", lambda: _has_group_consumers(api)
    ):
        keep = frozenset(d["durable_name"] for s, d, _ in consumers if s == REQUESTS_STREAM)
        await _answered(
            api, "the router consumers", lambda: _drop_other_router_consumers(api, keep)
        )
    for stream, desired, source in consumers:
        items.append(await _ensure_consumer(api, stream, desired, source=source))
    kv = await _ensure_stream(api, _kv_stream_config(config), source="renqueue.broker.provision")
    items.append(msgspec.structs.replace(kv, kind="kv", name=STATE_BUCKET))
    claims = await _ensure_stream(
        api, _terminal_stream_config(config), source="renqueue.broker.provision"
    )
    items.append(msgspec.structs.replace(claims, kind="kv", name=TERMINAL_BUCKET))
    leases = await _ensure_stream(
        api, _lease_stream_config(config), source="renqueue.broker.provision"
    )
    items.append(msgspec.structs.replace(leases, kind="kv", name=LEASE_BUCKET))

    report = ProvisionReport(items=tuple(items))
    log.info(
        "provisioned",
        created=report.created,
        updated=report.updated,
        unchanged=len(report.unchanged),
    )
    return report


def router_consumer_configs(
    config: Config, *, streams_dir: Path | None = None, group: str | None = None
) -> list[dict[str, Any]]:
    """The router consumers' configs (one per level), rendered from ``streams/``;
    ``group``: binding group ``group``'s (binding split in groups), or
    :data:`~renqueue.schema.FORWARD_CONSUMER`'s alone for ``FORWARD_CONSUMER``."""
    directory = find_streams_dir(streams_dir)
    if group is None:
        names = {router_consumer(level) for level in config.priorities}
    elif group == FORWARD_CONSUMER:
        names = {FORWARD_CONSUMER}
    else:
        names = {router_consumer(level, group) for level in config.priorities}
    return [
        desired
        for stream, desired, _source in _consumer_configs(directory, config)
        if stream == REQUESTS_STREAM and desired["durable_name"] in names
    ]


async def renew_router_consumers(
    js_or_nc: Connection | JetStream, configs: Sequence[dict[str, Any]]
) -> None:
    """Delete and re-create the router consumers: a new binder's first act.

    Deleting a work-queue consumer keeps its messages in the stream; the new
    consumer delivers every one not yet acked at once, including those a dead
    binder held (which would otherwise wait out ``router.ack_wait``). An ack
    from a binder that lost its lease still acks its message by stream
    sequence: it sends one only after the request's dispatch was stored.
    """
    api = JetStreamApi(js_or_nc)

    async def renew(desired: dict[str, Any]) -> None:
        durable = desired["durable_name"]
        reply = await api.call(f"CONSUMER.DELETE.{REQUESTS_STREAM}.{durable}")
        error = reply_error(reply)
        if error is not None and error[0] != CONSUMER_NOT_FOUND:
            raise ConnectionFailedError(
                f"cannot delete consumer {REQUESTS_STREAM}/{durable}: {error[1]}"
            )
        await _ensure_consumer_now(api, REQUESTS_STREAM, desired, source="the binder")

    # Concurrently: on a cluster each is a replicated change (~100 ms).
    await asyncio.gather(*(renew(desired) for desired in configs))


async def ensure_router_consumers(
    js_or_nc: Connection | JetStream, configs: Sequence[dict[str, Any]]
) -> None:
    """Create the router consumers ``configs`` that do not exist (update those that differ)."""
    api = JetStreamApi(js_or_nc)
    for desired in configs:
        await _ensure_consumer_now(api, REQUESTS_STREAM, desired, source="the router")


# -- waiting for JetStream ---------------------------------------------------


async def until_jetstream_answers(
    step: str,
    attempt: Callable[[], Awaitable[_T]],
    *,
    nc: Connection,
    patience: float = 0.0,
) -> _T:
    """``await attempt()`` until JetStream answers it, and return its result.

    While JetStream cannot answer (nats-py's timeout or no-responders errors, a
    503 or "not now" API error: no quorum or leader yet, a stream or consumer
    between leaders, a node still joining), logs one warning per attempt and
    tries again after ``min(3 s, 0.2 s * 2**n)`` with jitter: a service started
    during a cluster election waits for the cluster, as a pod waits for its
    dependency. ``attempt`` must be safe to repeat. After ``patience`` seconds
    (0: never) it gives up with :class:`ConnectionFailedError`; so it does at
    once when ``nc`` saw a NATS permissions violation on the JetStream API or
    its reply inbox (the server drops the request, so it looks like a timeout,
    but waiting cannot fix it). Any other error is raised at once.
    """
    loop = asyncio.get_running_loop()
    began = loop.time()
    failures = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if not _unavailable(exc):
                raise
            if (denied := _permission_denied(nc)) is not None:
                raise ConnectionFailedError(
                    f"{step}: JetStream did not answer: the NATS server refused this user "
                    f"({denied}); it needs to publish to $JS.API.> and to subscribe to its "
                    "reply inbox (nats.inbox_prefix)"
                ) from exc
            waited = loop.time() - began
            if patience and waited >= patience:
                raise ConnectionFailedError(
                    f"{step}: JetStream did not answer within nats.startup_wait "
                    f"({patience:g}s): {exc}"
                ) from exc
            failures += 1
            delay = min(_RETRY_CAP, _RETRY_BASE * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)
            log.warning(
                "jetstream unavailable; retrying",
                step=step,
                attempt=failures,
                waited=round(waited, 1),
                retry_in=round(delay, 2),
                error=str(exc) or type(exc).__name__,
            )
        # nats-py's requests use asyncio.wait_for, which can swallow a
        # cancellation (see renqueue.tasks): never start another wait after one.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        await asyncio.sleep(delay)


def _unavailable(exc: Exception) -> bool:
    """Whether ``exc`` means JetStream cannot answer *yet* (worth waiting for):
    a closed connection will not answer later."""
    return isinstance(exc, NatsUnavailableError) and not isinstance(exc, NatsClosedError)


def _permission_denied(nc: Connection) -> str | None:
    """The server's permissions violation on the JetStream API or a reply inbox, if any."""
    error = nc.last_error
    text = "" if error is None else str(error).lower()  # nats-py lowercases -ERR text
    if "permissions violation" in text and ("$js." in text or "subscription" in text):
        return text
    return None


# -- definitions -------------------------------------------------------------


def _load_json(path: Path) -> dict[str, Any]:
    """Read one definition file; any problem is a ProvisionError naming the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ProvisionError(f"{path}: definition file not found") from exc
    except OSError as exc:
        raise ProvisionError(f"{path}: cannot read: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProvisionError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProvisionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ns(duration: str) -> int:
    return round(parse_duration(duration) * _NS_PER_SECOND)


def _stream_config(directory: Path, spec: _StreamSpec, config: Config) -> dict[str, Any]:
    path = directory / spec.file
    desired = _load_json(path)
    if desired.get("name") != spec.name:
        raise ProvisionError(
            f"{path}: name is {desired.get('name')!r}, expected {spec.name!r} (renqueue.schema)"
        )
    subjects = desired.get("subjects")
    if not isinstance(subjects, list) or not all(isinstance(s, str) for s in subjects):
        raise ProvisionError(f"{path}: subjects must be a list of strings")
    desired["subjects"] = _expand_subjects(subjects, config.priorities)
    nats_config = config.nats
    desired["num_replicas"] = nats_config.replicas
    if spec.retention is not None:
        retention = getattr(nats_config, spec.retention)
        desired["max_age"] = _ns(retention.max_age)
    desired["max_bytes"] = nats_config.max_bytes(spec.store)
    if spec.dedupe:
        desired["duplicate_window"] = _ns(nats_config.duplicate_window)
        max_age = desired.get("max_age", 0)
        if isinstance(max_age, int) and 0 < max_age < desired["duplicate_window"]:
            raise ProvisionError(
                f"stream {spec.name}: nats.duplicate_window ({nats_config.duplicate_window}) "
                f"exceeds nats.{spec.retention}.max_age; NATS requires it to be at most max_age"
            )
    if spec.name == CANCELS_STREAM:
        _check_layout(path, desired["subjects"], [cancel_subject("*", "*")])
        # The broker refuses a bigger cancellation before anything is stored
        # (the services would ignore it: renqueue.coordination._cancellation).
        desired["max_msg_size"] = MAX_CANCEL_BYTES
    if spec.name == EVENTS_STREAM and desired.get("sources") != [CANCEL_SOURCE]:
        raise ProvisionError(
            f"{path}: sources are {desired.get('sources')!r}, but renqueue.schema expects "
            f"[{CANCEL_SOURCE!r}]: clients' cancellations would never reach the log"
        )
    if spec.name == REQUESTS_STREAM:
        _check_layout(path, desired["subjects"], [requests_of_level(p) for p in config.priorities])
        if config.sharded():
            # Binding split in groups: only subjects a consumer reads are
            # stored (a route no group has would wait unread for ever).
            desired["subjects"] = [
                subject
                for level in config.priorities
                for subject in [
                    *forwarded_subjects(level),
                    *(s for route in config.routes for s in requests_of_route(level, route)),
                ]
            ]
        # router.tenant_backlog: a tenant's requests waiting at one level (its
        # own subject), refused by the broker past it; 0 (-1 here): no cap.
        backlog = config.router.tenant_backlog
        desired["max_msgs_per_subject"] = backlog if backlog > 0 else -1
        desired["discard_new_per_subject"] = backlog > 0
    return desired


def _expand_subjects(subjects: list[str], priorities: Sequence[str]) -> list[str]:
    """``rq.req.{priority}.>`` -> one subject per priority level, in config order."""
    expanded: list[str] = []
    for subject in subjects:
        if "{priority}" in subject:
            expanded.extend(subject.replace("{priority}", level) for level in priorities)
        else:
            expanded.append(subject)
    return expanded


def _check_layout(path: Path, got: Sequence[str], expected: Sequence[str]) -> None:
    """A template that disagrees with renqueue.schema would strand messages: refuse it."""
    if list(got) != list(expected):
        raise ProvisionError(
            f"{path}: renders {list(got)}, but renqueue.schema expects {list(expected)}"
        )


def _consumer_configs(directory: Path, config: Config) -> list[tuple[str, dict[str, Any], str]]:
    """(stream, consumer config, source) for every router and worker consumer."""
    router_path = directory / "consumers" / "router.json"
    worker_path = directory / "consumers" / "worker.json"
    advisories_path = directory / "consumers" / "advisories.json"
    router_template = _load_json(router_path)
    worker_template = _load_json(worker_path)
    common = {
        "router.ack_wait": _ns(config.router.ack_wait),
        "router.max_deliver": config.router.max_deliver,
        # The router consumers' backstop (router.max_deliver counts failed
        # dispatches; every hand-back is a delivery too): see renqueue.services.router._router.
        "router.max_deliveries": router_max_deliveries(config.router.max_deliver),
        "worker.ack_wait": _ns(config.worker.ack_wait),
        "worker.max_deliver": config.worker.max_deliver,
        "worker.delivery_limit": config.worker.deliveries,
    }
    result: list[tuple[str, dict[str, Any], str]] = []
    for level in config.priorities:
        values = {**common, "priority": level}
        rendered = _render(router_template, values, router_path)
        _check_consumer(router_path, rendered, router_consumer(level), requests_of_level(level))
        if not config.sharded():
            result.append((REQUESTS_STREAM, rendered, str(router_path)))
    if config.sharded():
        result.extend(
            (REQUESTS_STREAM, desired, str(router_path))
            for desired in _group_consumers(router_template, common, router_path, config)
        )
    for name, backend in config.backends.items():
        values = {**common, "backend": name, "backend.concurrency": backend.limits.concurrency}
        rendered = _render(worker_template, values, worker_path)
        _check_consumer(worker_path, rendered, worker_consumer(name), dispatch_subject(name))
        result.append((DISPATCH_STREAM, rendered, str(worker_path)))
    advisories = _render(_load_json(advisories_path), common, advisories_path)
    expected = [max_deliveries_advisory(s) for s in (REQUESTS_STREAM, DISPATCH_STREAM)]
    if (
        advisories.get("durable_name") != ADVISORIES_CONSUMER
        or advisories.get("filter_subjects") != expected
    ):
        raise ProvisionError(
            f"{advisories_path}: renders durable_name={advisories.get('durable_name')!r}, "
            f"filter_subjects={advisories.get('filter_subjects')!r}; renqueue.schema expects "
            f"{ADVISORIES_CONSUMER!r}, {expected!r}"
        )
    result.append((ADVISORIES_STREAM, advisories, str(advisories_path)))
    return result


#: The forwarding consumer's ack wait at most (ns): see :func:`_group_consumers`.
_FORWARD_ACK_WAIT_NS: Final = 5_000_000_000


def _group_consumers(
    template: Any, common: Mapping[str, Any], path: Path, config: Config
) -> list[dict[str, Any]]:
    """Binding split in groups (docs/scaling.md): the router template rendered
    once per group and level, filtering that group's routes' subjects, and the
    forwarding consumer of requests published without their route. Their
    filters never overlap (a route may not be named ``requeue``)."""
    consumers: list[dict[str, Any]] = []
    for group in config.binding_groups():
        for level in config.priorities:
            rendered = _render(template, {**common, "priority": level}, path)
            del rendered["filter_subject"]
            rendered["durable_name"] = router_consumer(level, group.name)
            rendered["description"] = (
                f"Binder of group {group.name} pulls priority level {level} from RQ_REQUESTS"
            )
            rendered["filter_subjects"] = [
                subject for route in group.routes for subject in requests_of_route(level, route)
            ]
            consumers.append(rendered)
    forward = _render(template, {**common, "priority": config.priorities[0]}, path)
    del forward["filter_subject"]
    forward["durable_name"] = FORWARD_CONSUMER
    forward["description"] = "Routers re-publish requests sent without their route under it"
    # No lease, no successor re-creating it: what a killed router had fetched
    # comes back only after ack_wait. Forwarding a batch takes milliseconds
    # (a copy sent again after a slow ack is dropped by its id), so a short one.
    forward["ack_wait"] = min(forward["ack_wait"], _FORWARD_ACK_WAIT_NS)
    forward["filter_subjects"] = [
        subject for level in config.priorities for subject in forwarded_subjects(level)
    ]
    consumers.append(forward)
    return consumers


async def _answered(api: JetStreamApi, step: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
    """``attempt()`` once JetStream answers it (:func:`until_jetstream_answers`,
    with ``api``'s connection and patience): every provisioning step waits so."""
    return await until_jetstream_answers(step, attempt, nc=api.nc, patience=api.patience)


async def _has_group_consumers(api: JetStreamApi) -> bool:
    """Whether RQ_REQUESTS has the forwarding consumer of binding split in groups."""
    return (
        reply_error(await api.call(f"CONSUMER.INFO.{REQUESTS_STREAM}.{FORWARD_CONSUMER}")) is None
    )


async def _drop_other_router_consumers(api: JetStreamApi, keep: Iterable[str]) -> None:
    """Delete router consumers of RQ_REQUESTS this config does not have (binding
    split in groups, or no longer): their filters would overlap the new ones,
    which a work-queue stream refuses. Their messages stay in the stream."""
    wanted = set(keep)
    reply = await api.call(f"CONSUMER.NAMES.{REQUESTS_STREAM}", {"offset": 0})
    error = reply_error(reply)
    if error is not None:
        raise ProvisionError(f"cannot list the consumers of {REQUESTS_STREAM}: {error[1]}")
    for name in reply.get("consumers") or []:
        if str(name).startswith("router-") and name not in wanted:
            dropped = reply_error(await api.call(f"CONSUMER.DELETE.{REQUESTS_STREAM}.{name}"))
            if dropped is not None and dropped[0] != CONSUMER_NOT_FOUND:
                raise ProvisionError(f"cannot delete consumer {REQUESTS_STREAM}/{name}")
            log.info("consumer deleted", consumer=f"{REQUESTS_STREAM}/{name}")


def _render(template: Any, values: Mapping[str, Any], path: Path) -> Any:
    """Fill placeholders: a string that is exactly ``"{x}"`` becomes the typed value of x;
    ``{x}`` inside a longer string is substituted as text."""
    if isinstance(template, dict):
        return {key: _render(value, values, path) for key, value in template.items()}
    if isinstance(template, list):
        return [_render(value, values, path) for value in template]
    if not isinstance(template, str):
        return template

    def lookup(name: str) -> Any:
        if name not in values:
            known = ", ".join(sorted(values))
            raise ProvisionError(f"{path}: unknown placeholder {{{name}}} (known here: {known})")
        return values[name]

    whole = _PLACEHOLDER_RE.fullmatch(template)
    if whole is not None:
        return lookup(whole.group(1))
    return _PLACEHOLDER_RE.sub(lambda match: str(lookup(match.group(1))), template)


def _check_consumer(path: Path, rendered: dict[str, Any], durable: str, subject: str) -> None:
    if rendered.get("durable_name") != durable or rendered.get("filter_subject") != subject:
        raise ProvisionError(
            f"{path}: renders durable_name={rendered.get('durable_name')!r}, "
            f"filter_subject={rendered.get('filter_subject')!r}; renqueue.schema expects "
            f"{durable!r}, {subject!r}"
        )


def _kv_stream_config(config: Config) -> dict[str, Any]:
    return {
        "name": _KV_STREAM,
        "description": "Ren-Queue projection state (KV bucket rq-state)",
        "subjects": [f"$KV.{STATE_BUCKET}.>"],
        "retention": "limits",
        "storage": "file",
        "discard": "new",
        "max_msgs_per_subject": 1,
        "allow_direct": True,
        "allow_rollup_hdrs": True,
        # Coalescing groups expire (router.coalesce_ttl): a Nats-TTL on each write.
        "allow_msg_ttl": True,
        "deny_delete": True,
        "duplicate_window": 120 * _NS_PER_SECOND,
        "num_replicas": config.nats.replicas,
        "max_bytes": config.nats.max_bytes("state"),
    }


def _terminal_stream_config(config: Config) -> dict[str, Any]:
    """The terminal claims' bucket: one entry per request, kept as long as its events."""
    return {
        "name": _TERMINAL_STREAM,
        "description": (
            f"Ren-Queue terminal claims (KV bucket {TERMINAL_BUCKET}): one per request, "
            "created before its terminal event"
        ),
        "subjects": [f"$KV.{TERMINAL_BUCKET}.>"],
        "retention": "limits",
        "storage": "file",
        "discard": "new",
        "max_msgs_per_subject": 1,
        "max_age": _ns(config.nats.events.max_age),
        "allow_direct": True,
        "allow_rollup_hdrs": True,
        "deny_delete": True,
        "deny_purge": False,
        "duplicate_window": min(120 * _NS_PER_SECOND, _ns(config.nats.events.max_age))
        or 120 * _NS_PER_SECOND,
        "num_replicas": config.nats.replicas,
        "max_bytes": config.nats.max_bytes("claims"),
    }


def _lease_stream_config(config: Config) -> dict[str, Any]:
    """The leases' bucket: an entry lives ``router.lease_ttl`` past its last write."""
    ttl = _ns(config.router.lease_ttl)
    return {
        "name": _LEASE_STREAM,
        "description": (
            f"Ren-Queue leases (KV bucket {LEASE_BUCKET}): the binder's, renewed while it lives"
        ),
        "subjects": [f"$KV.{LEASE_BUCKET}.>"],
        "retention": "limits",
        "storage": "file",
        "discard": "new",
        "max_msgs_per_subject": 1,
        "max_age": ttl,
        "allow_direct": True,
        "allow_rollup_hdrs": True,
        "deny_delete": True,
        "duplicate_window": ttl,
        "num_replicas": config.nats.replicas,
        "max_bytes": LEASE_BYTES,
    }


# -- applying ----------------------------------------------------------------


def _show(field: str, value: Any) -> str:
    if field in _DURATION_FIELDS and isinstance(value, int) and value > 0:
        return f"{value} ({value / _NS_PER_SECOND:g}s)"
    return json.dumps(value)


def _equal(old: Any, new: Any) -> bool:
    # The server omits zero values (Go's omitempty): missing == false/0/""/[]/{}.
    if old is None:
        return new in (None, False, 0, "", [], {})
    return bool(old == new)


def _diff(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """``field: old -> new`` for each field the definition names that differs."""
    return [
        f"{field}: {_show(field, existing.get(field))} -> {_show(field, value)}"
        for field, value in desired.items()
        if not _equal(existing.get(field), value)
    ]


async def _ensure_stream(
    api: JetStreamApi, desired: dict[str, Any], *, source: str
) -> ProvisionItem:
    """Create or update one stream, waiting while JetStream cannot answer."""
    return await _answered(
        api,
        f"stream {desired['name']}",
        lambda: _ensure_stream_now(api, desired, source=source),
    )


async def _ensure_stream_now(
    api: JetStreamApi, desired: dict[str, Any], *, source: str
) -> ProvisionItem:
    name = desired["name"]
    for _attempt in range(2):  # a second pass only after losing a create race
        info = await api.call(f"STREAM.INFO.{name}")
        error = reply_error(info)
        if error is not None and error[0] == STREAM_NOT_FOUND:
            created = await api.call(f"STREAM.CREATE.{name}", desired)
            error = reply_error(created)
            if error is None:
                log.info("stream created", stream=name)
                return ProvisionItem(kind="stream", name=name, action=Action.CREATED)
            if error[0] == STREAM_NAME_IN_USE:
                continue
            raise ProvisionError(
                f"stream {name} ({source}): NATS refused to create it: {error[1]}"
                + _no_room_hint(error[0], desired)
            )
        if error is not None:
            raise ProvisionError(f"stream {name}: cannot read its config: {error[1]}")
        return await _update_stream(api, info["config"], desired, source=source)
    raise ProvisionError(f"stream {name}: created and deleted concurrently; try again")


async def _update_stream(
    api: JetStreamApi, existing: dict[str, Any], desired: dict[str, Any], *, source: str
) -> ProvisionItem:
    name = desired["name"]
    if name == _LEASE_STREAM:
        desired = _never_shorter(existing, desired)
    changes = _diff(existing, desired)
    if not changes:
        return ProvisionItem(kind="stream", name=name, action=Action.UNCHANGED)
    fixed = [c for c in changes if c.startswith("storage:")]
    old_retention, new_retention = existing.get("retention"), desired.get("retention")
    if old_retention != new_retention and "workqueue" in (old_retention, new_retention):
        fixed += [c for c in changes if c.startswith("retention:")]
    if fixed:
        raise ProvisionError(
            f"stream {name} ({source}): NATS cannot change {'; '.join(fixed)} on a live "
            "stream; create a new stream and migrate, or delete this one if it is empty"
        )
    reply = await api.call(f"STREAM.UPDATE.{name}", {**existing, **desired})
    _raise_refused(reply, f"stream {name} ({source})", changes)
    log.info("stream updated", stream=name, changes=changes)
    return ProvisionItem(kind="stream", name=name, action=Action.UPDATED, changes=tuple(changes))


def _never_shorter(existing: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The lease bucket's config, but never with a shorter ``max_age`` than it has.

    A running binder judges its lease valid for ``0.75 x`` the ``max_age`` it
    read; shortening it under a live binder would let the server expire the
    lease between that binder's renewals, and a second router would bind
    beside it. A longer ttl is safe (a binder renewing for the shorter one
    keeps renewing in time) and slows a take-over only. To shorten it, stop
    every router and delete the stream ``KV_rq-leases``; the next provision
    creates it with the configured ttl.
    """
    # 0 is "never expires": the longest of all.
    have = existing.get("max_age") or 0
    want = desired.get("max_age") or 0
    if have != 0 and (want == 0 or have <= want):
        return desired
    log.warning(
        "the lease bucket's ttl is not shortened in place: a running binder judges "
        "its lease by the longer one; stop every router and delete the stream to shorten it",
        stream=desired["name"],
        ttl=have / _NS_PER_SECOND if have else "never expires",
        configured=want / _NS_PER_SECOND,
    )
    return {**desired, "max_age": have, "duplicate_window": existing.get("duplicate_window", have)}


async def _ensure_consumer(
    api: JetStreamApi, stream: str, desired: dict[str, Any], *, source: str
) -> ProvisionItem:
    """Create or update one consumer, waiting while JetStream cannot answer."""
    return await _answered(
        api,
        f"consumer {stream}/{desired['durable_name']}",
        lambda: _ensure_consumer_now(api, stream, desired, source=source),
    )


async def _ensure_consumer_now(
    api: JetStreamApi, stream: str, desired: dict[str, Any], *, source: str
) -> ProvisionItem:
    durable = desired["durable_name"]
    label = f"{stream}/{durable}"
    for _attempt in range(2):  # a second pass only after losing a create race
        info = await api.call(f"CONSUMER.INFO.{stream}.{durable}")
        error = reply_error(info)
        if error is not None and error[0] == CONSUMER_NOT_FOUND:
            request = {"stream_name": stream, "config": desired, "action": "create"}
            created = await api.call(f"CONSUMER.CREATE.{stream}.{durable}", request)
            error = reply_error(created)
            if error is None:
                log.info("consumer created", consumer=label)
                return ProvisionItem(kind="consumer", name=label, action=Action.CREATED)
            if error[0] == CONSUMER_EXISTS:
                continue
            raise ProvisionError(
                f"consumer {label} ({source}): NATS refused to create it: {error[1]}"
            )
        if error is not None:
            raise ProvisionError(f"consumer {label}: cannot read its config: {error[1]}")
        return await _update_consumer(api, stream, info["config"], desired, source=source)
    raise ProvisionError(f"consumer {label}: created and deleted concurrently; try again")


async def _update_consumer(
    api: JetStreamApi,
    stream: str,
    existing: dict[str, Any],
    desired: dict[str, Any],
    *,
    source: str,
) -> ProvisionItem:
    durable = desired["durable_name"]
    label = f"{stream}/{durable}"
    changes = _diff(existing, desired)
    if not changes:
        return ProvisionItem(kind="consumer", name=label, action=Action.UNCHANGED)
    fixed = [c for c in changes if c.partition(":")[0] in _CONSUMER_FIXED]
    if fixed:
        raise ProvisionError(
            f"consumer {label} ({source}): NATS cannot change {'; '.join(fixed)} on a live "
            "consumer; delete it (its pending messages stay in the stream) and provision again"
        )
    request = {"stream_name": stream, "config": {**existing, **desired}, "action": "update"}
    reply = await api.call(f"CONSUMER.CREATE.{stream}.{durable}", request)
    _raise_refused(reply, f"consumer {label} ({source})", changes)
    log.info("consumer updated", consumer=label, changes=changes)
    return ProvisionItem(kind="consumer", name=label, action=Action.UPDATED, changes=tuple(changes))


def _raise_refused(reply: Any, what: str, changes: Sequence[str]) -> None:
    error = reply_error(reply)
    if error is not None:
        raise ProvisionError(
            f"{what}: NATS refused the update ({error[1]}); differing fields: {'; '.join(changes)}"
        )


#: nats-server's "insufficient storage resources available" (a stream's
#: max_bytes over what the server's or account's JetStream store has left).
_NO_ROOM: Final = frozenset({10047, 10023})


def _no_room_hint(err_code: int | None, desired: dict[str, Any]) -> str:
    """What to do when the server has no room for a stream's ``max_bytes``:
    they are shares of ``[nats] max_file_store`` (16 GiB by default), which a
    server of one's own with a smaller JetStream store cannot reserve."""
    if err_code not in _NO_ROOM:
        return ""
    return (
        f" (it asks max_bytes {desired.get('max_bytes')}, a share of [nats] max_file_store: "
        "set max_file_store to at most the server's jetstream max_file_store, less what "
        "other streams on it reserve; docs/operations.md#storage)"
    )
