"""The routing decision for one request, and the checks before it, as plain functions.

:func:`validate` judges a decoded request against the subject it came on and
the config; :func:`choose_backend` picks, among a route's candidates in cascade
order, the first that is healthy, of a tier the request needs and has a free
slot; :func:`hopeless` tells early that no candidate can finish before the
deadline. A :class:`BackendView` is what such a decision knows of one backend
at one moment. The round planner (:func:`renqueue.policy.plan`) applies them to
everything a router holds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from ..errors import MalformedRequestError, NoCapableBackendError, UnknownRouteError
from ..wire._messages import InferenceRequest
from ..wire._subjects import msg_id
from ._quota import Cost, Limit, Quota, QuotaVerdict, check

if TYPE_CHECKING:  # config builds the level policies from this package: no cycle at run time
    from ..config import Config


_NO_SPEND = Quota()


class NoRoom(enum.Enum):
    """Why no backend was chosen."""

    FULL = "every capable candidate is at capacity"
    NONE_CAPABLE = "no candidate is healthy and capable"


class BackendView(msgspec.Struct, frozen=True, kw_only=True):
    """What a routing decision knows about one backend at one moment."""

    name: str
    capacity: int
    in_flight: int
    healthy: bool = True
    tier: int = 1
    #: What a call here is expected to take (seconds); ``None``: not known yet.
    expected_duration: float | None = None
    #: What its rate limits leave (``None``: nothing spent or reported yet),
    #: judged against ``limits`` (declared, tightened by what was learned).
    quota: Quota | None = None
    limits: tuple[Limit, ...] = ()

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.in_flight)


def validate(
    request: InferenceRequest,
    *,
    level: str,
    tenant: str,
    config: Config,
    message_id: str | None = None,
    requeue: bool = False,
) -> None:
    """Check a decoded request against where it was published and the config.

    The subject is authoritative: a payload naming another tenant or level is
    rejected (a tenant must not be able to speak for another). ``message_id``
    is the publish's ``Nats-Msg-Id``: it must be ``<tenant>:<id>`` (a requeue
    by the services: ``<tenant>:<id>:requeue:...``, see
    :func:`renqueue.wire.publish_stored`), so that deduplication is scoped
    by tenant. ``None`` skips that check (a request not read from the stream).
    ``requeue``: it was read from the services' requeue subject (which no
    tenant may publish to); only such a request may carry ``requeues`` (a
    tenant setting it ran one id many times at once, billed once).
    """
    if requeue != (request.requeues > 0):
        raise MalformedRequestError(
            "requeues is set by the services only, on rq.req.<priority>.<tenant>.requeue"
            if request.requeues > 0
            else "a request on the requeue subject must carry requeues > 0",
            request_id=request.id,
        )
    if message_id is not None and not (
        message_id == msg_id(tenant, request.id)
        or (requeue and message_id.startswith(msg_id(tenant, request.id, "requeue")))
    ):
        raise MalformedRequestError(
            f"the Nats-Msg-Id header must be {msg_id(tenant, request.id)!r} "
            f"(<tenant>:<request id>), got {message_id[:200]!r}",
            request_id=request.id,
        )
    if request.tenant != tenant:
        raise MalformedRequestError(
            f"tenant {request.tenant!r} does not match subject tenant {tenant!r}",
            request_id=request.id,
        )
    if request.priority != level:
        raise MalformedRequestError(
            f"priority {request.priority!r} does not match subject level {level!r}",
            request_id=request.id,
        )
    if request.route not in config.routes:
        raise UnknownRouteError(request.route, request_id=request.id)
    if request.complexity is not None:
        # Held, a request no backend can ever serve would wait forever and,
        # many of them, fill the level's hold for every tenant.
        tiers = [
            config.backends[name].tier
            for name in config.routes[request.route].backends
            if name in config.backends
        ]
        best = max(tiers, default=0)
        if request.complexity > best:
            raise NoCapableBackendError(
                request.route, request.complexity, best, request_id=request.id
            )


def capable(
    request: InferenceRequest, candidates: Sequence[str], views: Mapping[str, BackendView]
) -> list[BackendView]:
    """The candidates (cascade order) that are healthy and of a tier the request needs."""
    return [
        views[name]
        for name in candidates
        if name in views
        and views[name].healthy
        and (request.complexity is None or views[name].tier >= request.complexity)
    ]


def choose_backend(
    request: InferenceRequest, candidates: Sequence[str], views: Mapping[str, BackendView]
) -> str | NoRoom:
    """The first healthy, capable candidate (cascade order) with a free slot."""
    return choose(request, candidates, views, None, 0.0)[0]


def choose(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    cost: Cost | None,
    now: float,
) -> tuple[str | NoRoom, list[tuple[str, QuotaVerdict]]]:
    """The first capable candidate with a free slot and, unless ``cost`` is
    ``None``, room in its quota for ``cost`` at ``now``; and the candidates
    with a free slot passed over for their quota (cascade order)."""
    able = capable(request, candidates, views)
    if not able:
        return NoRoom.NONE_CAPABLE, []
    passed: list[tuple[str, QuotaVerdict]] = []
    for view in able:
        if view.free <= 0:
            continue
        # Judged where there are limits, or a provider's cooldown.
        if cost is not None and (view.limits or view.quota is not None):
            verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
            if not verdict.ok:
                passed.append((view.name, verdict))
                continue
        return view.name, passed
    return NoRoom.FULL, passed


def hopeless(deadline: float, now: float, expected: Sequence[float | None]) -> float | None:
    """Whether no candidate can finish before ``deadline``.

    ``expected`` holds each candidate's expected call duration (``None``:
    unknown, which is never hopeless). Returns the best estimate of when the
    request could finish when that is past the deadline, else ``None``.
    """
    if not expected or any(duration is None for duration in expected):
        return None
    best = now + min(duration for duration in expected if duration is not None)
    return best if best > deadline else None
