"""NATS subjects and stream names: the one place that spells them.

Subjects carry the tenant, so NATS permissions alone can confine a tenant to
publishing its own requests and reading its own tokens and events::

    rq.req.<priority>.<tenant>             requests, one subject per priority level
    rq.req.<priority>.<tenant>.requeue     services only: a request put back (preempted, ...)
    rq.req.<priority>.<tenant>.<route>[.requeue]
                                           the same, naming the route: binding split in
                                           groups (docs/scaling.md); the route is checked
                                           against the payload's (the subject is the authority)
    rq.dispatch.<backend>                  routing decisions, one subject per backend
    rq.evt.<tenant>.<request_id>.<kind>    the event log
    rq.evt._system.<backend>.<kind>        the event log: a backend's circuit and probes
    rq.cancel.<tenant>.<request_id>        a client's cancellation (RQ_CANCELS, at most
                                           MAX_CANCEL_BYTES a message), which the event
                                           log sources as rq.evt.<tenant>.<id>.cancel_requested
    rq.tok.<tenant>.<request_id>           streamed token chunks
    rq.dlq.<stage>                         dead letters (stage: requests, dispatch)
    rq.capacity.<backend>                  core NATS: a worker freed a slot (not stored)
    rq.preempt.<backend>.ask               core NATS: an urgent request asks all workers for offers
    rq.preempt.<backend>.<worker token>    core NATS request: the chosen worker, told to preempt
    rq.boost.<tenant>                      core NATS: lift a coalescing leader to a follower's level
    $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>
                                           the server: a message ran out of deliveries
                                           (captured in RQ_ADVISORIES)

A tenant's permissions (``nats/auth.conf``): publish ``rq.req.*.<tenant>``,
``rq.req.*.<tenant>.*`` (a route; ``requeue`` is refused by admission, not by
the permission) and ``rq.cancel.<tenant>.*``; subscribe ``rq.tok.<tenant>.>``; and
JetStream API subjects that carry the tenant: named single-filter consumers
and last-by-subject direct gets under ``rq.evt.<tenant>.`` / ``rq.tok.<tenant>.``.

A tenant may not publish to any other subject, but it can make the server
*deliver* to any subject: a push consumer's ``deliver_subject`` is in the
request body, which no permission checks. What arrives that way keeps the
subject it was stored under (one of the tenant's own ``rq.evt.<tenant>.…``
or ``rq.tok.<tenant>.…``), with a payload the services wrote or, on
``cancel_requested`` (sourced from its ``rq.cancel.<tenant>.<request_id>``),
the tenant wrote; idle heartbeats and flow-control
messages of such a consumer arrive with the deliver subject itself and an
empty body. So every receiver of a core subscription checks that
``msg.subject`` is one it subscribed for (:func:`subject_matches`) and drops
(logs and counts, :func:`renqueue.logs.misdirected`) anything else.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ADVISORIES_CONSUMER",
    "ADVISORIES_STREAM",
    "BINDER_LEASE",
    "CANCELS_STREAM",
    "CANCEL_SOURCE",
    "DISPATCH_STREAM",
    "DLQ_STREAM",
    "EVENTS_STREAM",
    "FETCH_TIMEOUT",
    "FORWARD_CONSUMER",
    "LEASE_BUCKET",
    "PREEMPT_ASK",
    "REQUESTS_STREAM",
    "REQUEUE_SUFFIX",
    "ROUTER_DELIVERY_BACKSTOP",
    "SHUTDOWN_NAK_DELAY",
    "STATE_BUCKET",
    "SYSTEM_TENANT",
    "TERMINAL_BUCKET",
    "TOKENS_STREAM",
    "binder_lease",
    "boost_subject",
    "cancel_subject",
    "capacity_subject",
    "dispatch_subject",
    "dlq_subject",
    "event_subject",
    "events_of_request",
    "forwarded_subjects",
    "is_requeue_subject",
    "max_deliveries_advisory",
    "msg_id",
    "preempt_subject",
    "preempt_subjects",
    "request_subject",
    "requests_of_level",
    "requests_of_route",
    "route_of_subject",
    "router_consumer",
    "router_max_deliveries",
    "run_claim_key",
    "subject_matches",
    "terminal_key",
    "token_subject",
    "worker_consumer",
]

REQUESTS_STREAM: Final = "RQ_REQUESTS"
DISPATCH_STREAM: Final = "RQ_DISPATCH"
EVENTS_STREAM: Final = "RQ_EVENTS"
TOKENS_STREAM: Final = "RQ_TOKENS"
DLQ_STREAM: Final = "RQ_DLQ"
ADVISORIES_STREAM: Final = "RQ_ADVISORIES"
#: Clients' cancellations, each at most ``MAX_CANCEL_BYTES`` (its
#: ``max_msg_size``): the event log sources them (:data:`CANCEL_SOURCE`), so a
#: tenant never writes to the log itself and an oversized cancellation is
#: refused by the broker before anything is stored.
CANCELS_STREAM: Final = "RQ_CANCELS"
#: How ``RQ_EVENTS`` takes in ``RQ_CANCELS`` (its ``sources`` entry, in NATS's
#: stream config schema): ``rq.cancel.<tenant>.<request_id>`` becomes
#: ``rq.evt.<tenant>.<request_id>.cancel_requested``.
CANCEL_SOURCE: Final = {
    "name": CANCELS_STREAM,
    "subject_transforms": [
        {
            "src": "rq.cancel.*.*",
            "dest": "rq.evt.{{wildcard(1)}}.{{wildcard(2)}}.cancel_requested",
        }
    ],
}
STATE_BUCKET: Final = "rq-state"
#: Claims only services can write: a request's one terminal outcome, a pool run.
TERMINAL_BUCKET: Final = "rq-terminal"
#: Leases (renqueue.coordination._lease): entries expire router.lease_ttl after their last write.
LEASE_BUCKET: Final = "rq-leases"
#: The key of the binder's lease: the one router that binds requests to backends.
BINDER_LEASE: Final = "binder"
#: With binding split in groups: the consumer of requests published without
#: their route (``rq.req.<level>.<tenant>[.requeue]``), which every router
#: reads to re-publish each under its route, for its group's binder.
FORWARD_CONSUMER: Final = "router-forward"


def binder_lease(group: str | None = None) -> str:
    """The key of a binder's lease: :data:`BINDER_LEASE`, or ``binder.<group>``
    when binding is split in groups (one lease, one binder, per group)."""
    return BINDER_LEASE if group is None else f"{BINDER_LEASE}.{group}"


#: The durable consumer on RQ_ADVISORIES that ends requests out of deliveries.
ADVISORIES_CONSUMER: Final = "advisories"


#: Seconds a pull (fetch) waits at the server. Kept short: a waiting pull whose
#: client went away still receives messages until it expires (DESIGN.md).
FETCH_TIMEOUT: Final = 1.0

#: Delay of the naks given at shutdown: past the expiry of any pull the
#: stopping process left at the server, so the message is not redelivered into
#: it (where it would sit out a whole ack_wait).
SHUTDOWN_NAK_DELAY: Final = FETCH_TIMEOUT + 0.5

#: The router consumers' ``max_deliver`` is ``router.max_deliver`` times this.
#: ``router.max_deliver`` counts *failed dispatches* of a request; deliveries
#: also go up with every hand-back (a router's graceful stop naks what it
#: holds), so the broker's own limit is only a backstop, far above it.
ROUTER_DELIVERY_BACKSTOP: Final = 20

#: The last token of the subject preemption asks are published to.
PREEMPT_ASK: Final = "ask"


def router_max_deliveries(max_deliver: int) -> int:
    """The router consumers' ``max_deliver`` for a ``router.max_deliver`` of ``max_deliver``."""
    return max_deliver * ROUTER_DELIVERY_BACKSTOP


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one that ``pattern`` (NATS wildcards: ``*`` one
    token, ``>`` one or more at the end) subscribes to."""
    want = pattern.split(".")
    have = subject.split(".")
    tokens = len(have)
    for index, part in enumerate(want):
        if part == ">":
            return tokens > index
        if index >= tokens or part not in ("*", have[index]):
            return False
    return tokens == len(want)


#: Last token of the services' requeue subject, ``rq.req.<priority>.<tenant>.requeue``.
REQUEUE_SUFFIX = "requeue"


def request_subject(
    priority: str, tenant: str, *, requeue: bool = False, route: str | None = None
) -> str:
    """Where a request waits; ``requeue``: the services' own subject for putting
    one back (a preemption, a coalesced follower left to run alone), which no
    tenant may publish to, so only a request read there may carry ``requeues``.
    ``route``: the subject naming the request's route, which binding split in
    groups filters by (``rq.req.<priority>.<tenant>.<route>[.requeue]``)."""
    subject = f"rq.req.{priority}.{tenant}"
    if route is not None:
        subject = f"{subject}.{route}"
    return f"{subject}.{REQUEUE_SUFFIX}" if requeue else subject


def is_requeue_subject(subject: str) -> bool:
    """True for ``rq.req.<priority>.<tenant>[.<route>].requeue`` (services only)."""
    parts = subject.split(".")
    return len(parts) in (5, 6) and parts[-1] == REQUEUE_SUFFIX


def route_of_subject(subject: str) -> str | None:
    """The route a request subject names (``rq.req.<p>.<t>.<route>[.requeue]``), if any."""
    parts = subject.split(".")
    if len(parts) == 6 or (len(parts) == 5 and parts[4] != REQUEUE_SUFFIX):
        return parts[4]
    return None


def requests_of_level(priority: str) -> str:
    return f"rq.req.{priority}.>"


def requests_of_route(priority: str, route: str) -> list[str]:
    """The subjects of ``route``'s requests at one level (its group's consumer's filters)."""
    return [f"rq.req.{priority}.*.{route}", f"rq.req.{priority}.*.{route}.{REQUEUE_SUFFIX}"]


def forwarded_subjects(priority: str) -> list[str]:
    """The request subjects without a route at one level (:data:`FORWARD_CONSUMER`'s)."""
    return [f"rq.req.{priority}.*", f"rq.req.{priority}.*.{REQUEUE_SUFFIX}"]


def dispatch_subject(backend: str) -> str:
    return f"rq.dispatch.{backend}"


def capacity_subject(backend: str) -> str:
    """Core NATS (not stored): a worker freed a slot of ``backend``."""
    return f"rq.capacity.{backend}"


def boost_subject(tenant: str) -> str:
    """Core NATS: a coalesced follower lifts its leader to its level, if more urgent."""
    return f"rq.boost.{tenant}"


def preempt_subject(backend: str, worker: str = PREEMPT_ASK) -> str:
    """Core NATS: a router asks every worker of ``backend`` for a preemption offer
    (``worker`` left out), or tells the one worker whose token is ``worker`` to
    preempt (see :mod:`renqueue.schema._offers`)."""
    return f"rq.preempt.{backend}.{worker}"


def preempt_subjects(backend: str) -> str:
    """What a worker of ``backend`` subscribes to: the asks and its own confirms."""
    return f"rq.preempt.{backend}.*"


#: The tenant token of events about a backend rather than a request
#: (``rq.evt._system.<backend>.<kind>``: ``circuit``, ``probed``), written
#: by the services only. No tenant may have this name.
SYSTEM_TENANT: Final = "_system"


def event_subject(tenant: str, request_id: str, kind: str) -> str:
    return f"rq.evt.{tenant}.{request_id}.{kind}"


def cancel_subject(tenant: str, request_id: str) -> str:
    """Where a client asks for ``request_id`` to be cancelled (``RQ_CANCELS``);
    the log has it as ``event_subject(tenant, request_id, "cancel_requested")``."""
    return f"rq.cancel.{tenant}.{request_id}"


def events_of_request(tenant: str, request_id: str) -> str:
    return f"rq.evt.{tenant}.{request_id}.*"


def token_subject(tenant: str, request_id: str) -> str:
    return f"rq.tok.{tenant}.{request_id}"


def dlq_subject(stage: str) -> str:
    return f"rq.dlq.{stage}"


def msg_id(tenant: str, request_id: str, *parts: object) -> str:
    """A JetStream message id (``Nats-Msg-Id``) for something about one request.

    Deduplication is per stream, across every tenant, so each id starts with
    the tenant: ``<tenant>:<request_id>[:<part>...]``. Tenant and request id
    cannot contain ``:``, so ids of different tenants never collide. A client
    submits with ``msg_id(tenant, request_id)``.
    """
    if not parts:  # the common case, without the join
        return f"{tenant}:{request_id}"
    return ":".join((tenant, request_id, *map(str, parts)))


def terminal_key(tenant: str, request_id: str) -> str:
    """Key of a request's terminal claim in the ``rq-terminal`` bucket."""
    return f"{tenant}.{request_id}"


def run_claim_key(tenant: str, request_id: str, attempt: int, run: int) -> str:
    """Key of the claim on one run of a pooled request (``rq-terminal`` bucket):
    when a dispatch is stolen while its sibling's worker takes it too, the
    worker that creates the key runs it."""
    return f"{tenant}.{request_id}.run.{attempt}.{run}"


def max_deliveries_advisory(stream: str, consumer: str = "*") -> str:
    """The server's advisory that a message of ``stream`` ran out of deliveries."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def router_consumer(priority: str, group: str | None = None) -> str:
    """The router consumer of one level (of one binding group's routes, when split)."""
    return f"router-{priority}" if group is None else f"router-{group}-{priority}"


def worker_consumer(backend: str) -> str:
    return f"worker-{backend}"
